"""The parts of one plain (W = 1) step of the w4a8 plan's plain engine outside its block packages
(tree mask, prologue, row window, norm, head) and one block package with warm weights, in us
(issue #20). OMP_NUM_THREADS=2 python reports/plain_loop/outer.py PLAN"""
import sys, time, statistics, torch

from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
from yggtree.runtime import steps
from yggtree.runtime.model import rows_path, row_window
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
m = eng.target
L = torch.tensor(150); zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool); tokv = torch.tensor([42])
C = eng.graphs.bucket(151)
def t(f, n=300):
    for _ in range(30): f()
    ts = []
    for _ in range(7):
        a = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - a) / n * 1e6)
    return statistics.median(ts)
mask = steps.tree_mask(L, anc, C)
ids = torch.stack([tokv, zero, zero])
def pro():
    tokens, depth, node = ids
    pos = (L + depth)[None]; slots = (L + node)[None]
    cs = m.rope[pos]
    cos, sin = cs[..., 0].unsqueeze(2).contiguous(), cs[..., 1].unsqueeze(2).contiguous()
    x = m.embed_tokens(tokens[None])
    window, mk = row_window(mask[None])
    sl = torch.cat([slots[..., None], window], -1)
    return x, cos, sin, sl, mk
x, cos, sin, sl, mk = pro()
h = torch.randn(1, 1, m.cfg.hidden_size)
with torch.no_grad():
    r = {"tree_mask": t(lambda: steps.tree_mask(L, anc, C)), "stack": t(lambda: torch.stack([tokv, zero, zero])),
         "prologue": t(pro), "row_window": t(lambda: row_window(mask[None])), "one block": t(lambda: m.layers[0](x, cos, sin, sl, mk)),
         "norm": t(lambda: m.norm(h)), "head": t(lambda: m.logits(h[0]), 100), "argmax": t(lambda: torch.randn(1, 49152).argmax(-1), 100),
         "full step": t(lambda: eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C), 100)}
print({k: round(v, 1) for k, v in r.items()}, "us")
