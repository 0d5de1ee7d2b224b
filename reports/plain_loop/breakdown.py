"""Where a plain decode step's time goes on a compiled plan's packages (issue #20).

    OMP_NUM_THREADS=2 python reports/plain_loop/breakdown.py profiles/epyc-2core-w4a8.yaml [threads]

Builds the plan's plain engine (``yggtree run --plan P --no-speculate``), decodes one prompt, then
times, over 200 plain steps at the same context: the whole ``generate`` per token, one
``tree_step`` (the model call with its mask), the 30 package runs alone (``runner.run`` with the
same inputs), and the block calls as the model makes them (``PackagedForward``). Medians in ms.
"""

import statistics
import sys
import time

import torch

from yggtree.plan import artifact_dir, load_plan
from yggtree.runtime import aoti
from yggtree.runtime.build import build_plan_engine
from yggtree.runtime.engine import SamplingParams

plan = load_plan(sys.argv[1])
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(threads)
eng, tok = build_plan_engine(plan, artifact_dir(plan), speculate=False)
ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a hash table works."}],
                              add_generation_prompt=True, return_dict=False)


def med(f, n=200, warm=10):
    for _ in range(warm):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


sp = SamplingParams(max_new_tokens=64)
eng.generate(ids, sp)
per_tok = []
for _ in range(3):
    st = eng.generate(ids, sp).stats
    per_tok.append((st["total_ms"] - st["ttft_ms"]) / (st["new_tokens"] - 1))
print(f"generate: {statistics.median(per_tok):.3f} ms/token (plain, {len(ids)}-token prompt, 64 new)")

L = torch.tensor(len(ids) + 32)
root, zero, anc = torch.tensor([7]), torch.zeros(1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool)
bucket = eng.graphs.bucket(int(L) + 1)
with torch.no_grad():
    t_step = med(lambda: eng.graphs.tree_step(root, zero, zero, anc, L, (), bucket))
    blocks = eng.target.layers
    # the activations one block call receives at this shape, recorded once
    seen = {}
    fwd0 = blocks[0].forward

    def rec(x, cos, sin, slots, mask):
        seen["a"] = (x, cos, sin, slots, mask)
        return fwd0(x, cos, sin, slots, mask)

    blocks[0].forward = rec
    eng.graphs.tree_step(root, zero, zero, anc, L, (), bucket)
    blocks[0].forward = fwd0
    x, cos, sin, slots, mask = seen["a"]
    runner = fwd0.runners[(x.shape[1], mask.shape[-1])]
    caches = [b.self_attn.cache.kv for b in blocks]
    weights = [b.forward.weights for b in blocks]
    acts = [x.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous(), mask.contiguous()]
    t_runs = med(lambda: [runner.run([*acts, kv, *w]) for kv, w in zip(caches, weights)])
    t_calls = med(lambda: [b.forward(x, cos, sin, slots, mask) for b in blocks])
    lm = eng.target
    h = torch.randn(1, lm.cfg.hidden_size)
    t_head = med(lambda: lm.logits(lm.norm(h)))
    t_argmax = med(lambda: int(torch.randn(lm.cfg.vocab_size).argmax()))
print(f"tree_step (W=1, context {int(L)}, bucket {bucket}): {t_step:.3f} ms")
print(f"  {len(blocks)} package runs alone: {t_runs:.3f} ms; as block calls: {t_calls:.3f} ms")
print(f"  final norm + LM head: {t_head:.3f} ms")
print(f"  the rest of tree_step (mask, embedding, rope, glue): {t_step - t_calls - t_head:.3f} ms")
print(f"generate minus tree_step: {statistics.median(per_tok) - t_step:.3f} ms per token")
