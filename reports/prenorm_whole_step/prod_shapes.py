"""Scratch: the w4a8 products by shape, hot in cache, 1 vs 2 threads: us per call and GB/s; and the
fixed cost of a call (a 16-column slice)."""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.w4a8 import W4A8Linear
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
lins = [mod for mod in eng.target.modules() if isinstance(mod, W4A8Linear)]
shapes = {}
for l in lins:
    shapes.setdefault((l.out_features, l.in_features, l.bits), l)
def t_call(x, c, d, m, n=300):
    op = torch.ops.yggtree.w4a8_mm
    for _ in range(20): op(x, c, d, m)
    ts = []
    for rep in range(7):
        t = time.perf_counter()
        for _ in range(n): op(x, c, d, m)
        ts.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(ts)
for threads in (1, 2):
    torch.set_num_threads(threads)
    for (N, K, bits), l in shapes.items():
        x = torch.randn(1, K)
        nb = l.codes.numel() + 2 * l.d.numel() + 2 * l.m.numel()
        us = t_call(x, l.codes, l.d, l.m, 300 if nb < 5e6 else 20)
        us1 = t_call(x, l.codes[:1].contiguous(), l.d[:1].contiguous(), l.m[:1].contiguous())
        print(f"threads {threads} N {N} K {K} bits {bits}: {us:.1f} us ({nb/us/1e3:.1f} GB/s hot), one tile {us1:.2f} us", flush=True)
