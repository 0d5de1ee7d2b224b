import torch
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams, TreeParams
from yggtree.runtime.model import set_invariant_rows
from yggtree.data import load_prompts
torch.set_num_threads(2)
tree = TreeParams(draft_width=8, draft_depth=6, verify_width=32, top_k=8)
plain, tok = build_engine(EngineSpec(model="default", dtype="bfloat16", mode="reference", min_rows=4))
spec, _ = build_engine(EngineSpec(model="default", drafter="default", dtype="bfloat16", mode="reference", min_rows=4, tree=tree))
for e in (plain, spec): set_invariant_rows(e.target, 63)
prompts = load_prompts(4, 0, tok)
for pid, ids in prompts:
    L = len(ids)
    a = plain.generate(ids, SamplingParams(max_new_tokens=1, temperature=0.0))
    ka = [c.k[0, :L].clone() for c in plain.target.caches()]
    b = spec.generate(ids, SamplingParams(max_new_tokens=1, temperature=0.0))
    kb = [c.k[0, :L].clone() for c in spec.target.caches()]
    diff = [i for i, (x, y) in enumerate(zip(ka, kb)) if not torch.equal(x, y)]
    print(pid, "L", L, "first token", a.token_ids, b.token_ids, "layers whose prompt K differ:", diff[:5], len(diff), flush=True)
    a = plain.generate(ids, SamplingParams(max_new_tokens=64, temperature=0.0)).token_ids
    b = spec.generate(ids, SamplingParams(max_new_tokens=64, temperature=0.0)).token_ids
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(pid, "first divergence at", i, flush=True)
