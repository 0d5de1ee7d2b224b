"""A compiled plan's whole-step package against the same step over its block packages, bitwise,
on a real cache (a chat prompt and 8 generated tokens), for 12 next tokens spread over the
vocabulary: ``python reports/step_packages/whole_vs_blocks.py PLAN_YAML`` from the checkout. Run
at 3af3c3f on packages whose whole step fused the final norm (results.txt: 3-5 of 12 differ);
since 7354d19 the whole step ends before the norm, and a float32 speculative plan compiles it too."""
import sys

import torch

from yggtree.plan import load_plan, artifact_dir
from yggtree.runtime.aoti import step_packages
from yggtree.runtime.build import build_plan_engine
from yggtree.runtime.engine import SamplingParams
plan = load_plan(sys.argv[1])
engine, tok = build_plan_engine(plan, artifact_dir(plan), speculate=False)
ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a hash table works."}], add_generation_prompt=True, return_dict=False)
r = engine.generate(ids, SamplingParams(max_new_tokens=8))
n = len(ids) + len(r.token_ids) - 1
model, graphs = engine.target, engine.graphs
whole = step_packages(model)
print("step packages", whole is not None, "committed", n)
one = torch.ones(1, 1, dtype=torch.bool); zero = torch.zeros(1, dtype=torch.int64); committed = torch.tensor(n)
before = model.kv.kv.clone() if hasattr(model, "kv") else None
diffs = 0
for t in range(100, 49152, 4096):
    outs, caches = [], []
    for path in (whole, None):
        model.kv.kv.copy_(before); model.step_packages = path
        with torch.no_grad():
            outs.append(graphs.tree_step(torch.tensor([t]), zero, zero, one, committed, (), graphs.bucket(n + 1)))
        caches.append(model.kv.kv.clone())
    (la, ha, _), (lb, hb, _) = outs
    same = torch.equal(la, lb) and torch.equal(ha, hb) and torch.equal(*caches)
    diffs += not same
    if not same: print("token", t, "logits", torch.equal(la, lb), "h", torch.equal(ha, hb), "cache", torch.equal(*caches), (la - lb).abs().max().item())
print(sys.argv[1], "differing", diffs, "of", len(range(100, 49152, 4096)))
