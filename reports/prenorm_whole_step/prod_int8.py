"""Scratch: the int8 tiled products by shape, hot in cache, 1 vs 2 threads."""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.quant import Int8Linear
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
lins = [mod for mod in eng.target.modules() if isinstance(mod, Int8Linear)]
print(len(lins), "int8 layers", getattr(lins[0], "kernel", None), lins[0].qweight.shape)
shapes = {}
for l in lins:
    shapes.setdefault(tuple(l.qweight.shape), l)
def t_call(x, w, s, n):
    op = torch.ops.yggtree.tiled_mm
    for _ in range(10): op(x, w, s)
    ts = []
    for rep in range(7):
        t = time.perf_counter()
        for _ in range(n): op(x, w, s)
        ts.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(ts)
for threads in (1, 2):
    torch.set_num_threads(threads)
    for shp, l in shapes.items():
        x = torch.randn(1, l.qweight.shape[1])
        nb = l.qweight.numel()
        us = t_call(x, l.qweight, l.scales, 300 if nb < 5e6 else 10)
        print(f"threads {threads} w {shp}: {us:.1f} us ({nb/us/1e3:.1f} GB/s hot)", flush=True)
