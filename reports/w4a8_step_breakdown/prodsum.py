import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.w4a8 import W4A8Linear
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
lins = [m for m in eng.target.modules() if isinstance(m, W4A8Linear)]
print(len(lins), "products", sum(l.codes.numel() + 2 * l.d.numel() + 2 * l.m.numel() for l in lins) / 1e6, "MB")
op = torch.ops.yggtree.w4a8_mm
xs = [torch.randn(1, l.in_features) for l in lins]
args = [(x, l.codes, l.d, l.m) for x, l in zip(xs, lins)]
one = [(x, l.codes[:1].contiguous(), l.d[:1].contiguous(), l.m[:1].contiguous()) for x, l in zip(xs, lins)]
def loop(a, n=50):
    for _ in range(5):
        for t in a: op(*t)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        for t in a: op(*t)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for rep in range(3):
    print("all products ms", round(loop(args), 3), "one-tile calls ms", round(loop(one), 3), "no-head", round(loop(args[:-1]), 3))
