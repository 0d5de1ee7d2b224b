"""The default model's 121 one-row products per format, on random weights in huge-page arenas, with COPIES
copies of the model rotated so every pass reads weights the last pass did not (the decode's case: the weights
stream once a token, more than the cache holds); GB/s of the weights, medians over rounds, distances swept.
Also a float32 sum over the same bytes (the stream limit the bench's probe measures).
usage: cold_products.py THREADS ROUNDS COPIES"""
import statistics, sys, time, torch
sys.path.insert(0, "/work/main/reports/w4a8_stream")
from common import arena_model
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import load_library, prefetch
from yggtree.runtime.w4a8 import pack_blocks
threads, rounds, copies = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
load_library()
H, I, V, L = 576, 1536, 49152, 30
shapes = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L + [(V, H)]  # (N, K)
g = torch.Generator().manual_seed(0)
def arena(tensors):
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    a = huge_empty(total); off = 0; out = []
    for t in tensors:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out, total
def int8_model():
    ts = []
    for N, K in shapes:
        ts += [torch.randint(-127, 128, (N // 16, K, 16), generator=g, dtype=torch.int8), torch.rand(N // 16, 16, generator=g)]
    a, nb = arena(ts)
    return [(a[2 * i], a[2 * i + 1]) for i in range(len(shapes))], nb
def q4_model():
    ts = []
    for N, K in shapes:
        ts += [torch.randint(0, 256, (N // 16, K // 2, 16), generator=g, dtype=torch.uint8),
               torch.rand(N // 16, K // 32, 16, generator=g), torch.rand(N // 16, K // 32, 16, generator=g)]
    a, nb = arena(ts)
    return [tuple(a[3 * i: 3 * i + 3]) for i in range(len(shapes))], nb
xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
systems = {}
for name, make, call in (
        ("int8", int8_model, lambda p: torch.ops.yggtree.tiled_mm(xs[p[0].size(1)], p[0], p[1])),
        ("q4", q4_model, lambda p: torch.ops.yggtree.tiled_q4_mm(xs[2 * p[0].size(1)], *p)),
        ("w4a8", lambda: arena_model(g, pack=lambda b: (pack_blocks(b),)), lambda p: torch.ops.yggtree.w4a8_mm(xs[p[0]], p[1]))):
    models = [make() for _ in range(copies)]
    systems[name] = ([m for m, _ in models], models[0][1], call)
sums = [huge_empty(systems["int8"][1] // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)]
DIST = ((16384, 0), (2048, 8192))
res = {}
for rnd in range(rounds):
    for name, (models, nb, call) in systems.items():
        for d in DIST:
            with prefetch(d):
                for c, m in enumerate(models):
                    t = time.perf_counter()
                    for p in m:
                        call(p)
                    res.setdefault((name, d), []).append((time.perf_counter() - t, nb))
    for s in sums:
        t = time.perf_counter(); s.sum(); res.setdefault(("sum", 0), []).append((time.perf_counter() - t, s.numel() * 4))
for (name, d), v in res.items():
    ms = statistics.median(t for t, _ in v) * 1e3
    print(f"{name:5s} {str(d):14s} {v[0][1]/1e6:6.0f} MB {ms:7.3f} ms {v[0][1]/ms/1e6:5.1f} GB/s", flush=True)
