"""The tiled int8 kernel's one-row loop (hint_src.cpp) on COPIES rotated copies of the default model's 121 products
(random weights, huge-page arenas): GB/s by prefetch hint and distance, per-product parallel regions against one
region over all; a float32 sum over the same bytes. usage: hint.py THREADS ROUNDS COPIES"""
import statistics, sys, time, torch
from pathlib import Path
from torch.utils.cpp_extension import load_inline
from yggtree.runtime.hugepages import huge_empty
threads, rounds, copies = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
m = load_inline("cold_hint", cpp_sources=Path(__file__).with_name("hint_src.cpp").read_text(), functions=["bench", "bench_one_region", "bench_v"],
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
H, I, V, L = 576, 1536, 49152, 30
shapes = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L + [(V, H)]
g = torch.Generator().manual_seed(0)
def model():
    ts = []
    for N, K in shapes:
        ts += [torch.randint(-127, 128, (N // 16, K, 16), generator=g, dtype=torch.int8), torch.rand(N // 16, 16, generator=g)]
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in ts)
    a = huge_empty(total); off = 0; out = []
    for t in ts:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out[0::2], out[1::2], total
models = [model() for _ in range(copies)]
xs = [torch.randn(K, generator=g) for N, K in shapes]
nb = models[0][2]
sums = [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)]
cases = [("T0", 3, 16384)]
variants = [("T2 far+T0 near", 1, (f << 16) | n) for f in (4096, 8192, 16384, 32768) for n in (0, 512, 1024, 2048)] + \
           [("T1 far+T0 near", 4, (f << 16) | n) for f in (8192, 16384) for n in (1024,)]
res = {}
for _ in range(rounds):
    for name, hint, d in cases:
        for ws, ss, _n in models:
            res.setdefault(f"{name}@{d}", []).append(m.bench(ws, ss, xs, hint, d))
    for name, v, d in variants:
        for ws, ss, _n in models:
            res.setdefault(f"{name}@{d >> 16}/{d & 0xFFFF}", []).append(m.bench_v(ws, ss, xs, v, d))
    for s in sums:
        t = time.perf_counter(); s.sum(); res.setdefault("sum", []).append(time.perf_counter() - t)
for k, v in res.items():
    t = statistics.median(v)
    print(f"{k:22s} {t*1e3:7.3f} ms {nb/t/1e9:5.1f} GB/s", flush=True)
