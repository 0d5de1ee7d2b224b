"""The plan's whole W=1 step vs its 121 products alone (same weights, 1 row), paired, 2 threads."""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.w4a8 import W4A8Linear
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
m = eng.target
lins = [mod for mod in m.modules() if isinstance(mod, W4A8Linear)]
nbytes = sum(l.codes.numel() + 2 * l.d.numel() + 2 * l.m.numel() for l in lins)
xs = [torch.randn(1, l.in_features) for l in lins]
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool); tokv = torch.tensor([42])
L = torch.tensor(60); C = eng.graphs.bucket(61)
def step():
    with torch.no_grad():
        for _ in range(30): eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C)
def prods():
    for _ in range(30):
        for l, x in zip(lins, xs): torch.ops.yggtree.w4a8_mm(x, l.codes, l.d, l.m)
x = torch.ones(256 * 2**20 // 4)
def bw():
    for _ in range(3): x.sum()
step(); prods()
ta, tb, tc = [], [], []
for rep in range(9):
    t = time.perf_counter(); step(); ta.append((time.perf_counter() - t) / 30 * 1e3)
    t = time.perf_counter(); prods(); tb.append((time.perf_counter() - t) / 30 * 1e3)
    t = time.perf_counter(); bw(); tc.append(3 * x.numel() * 4 / (time.perf_counter() - t) / 1e9)
a, b, c = statistics.median(ta), statistics.median(tb), statistics.median(tc)
print(f"{len(lins)} products, {nbytes/1e6:.1f} MB; step {a:.3f} ms; products {b:.3f} ms ({nbytes/b/1e6:.1f} GB/s); rest {a-b:.3f} ms; sum bandwidth {c:.1f} GB/s -> limit {nbytes/c/1e6:.3f} ms")
