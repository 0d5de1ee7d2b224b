"""accept.argmax (numpy on the CPU) against ATen's argmax over the default model's vocabulary
(49152), 1 and 4 rows, at 1 and 2 threads: us per call, median of 7 timings of 2000 calls."""
import statistics, time, torch
from yggtree.runtime.accept import argmax
def t(fn, n=2000):
    for _ in range(100): fn()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(ts)
for threads in (1, 2):
    torch.set_num_threads(threads)
    for rows in (1, 4):
        x = torch.randn(rows, 49152)[0 if rows == 1 else slice(None)]
        print(f"threads {threads} rows {rows}: ATen {t(lambda: x.argmax(dim=-1)):.1f} us, accept.argmax {t(lambda: argmax(x)):.1f} us", flush=True)
