"""The default model's vocabulary projection (its GGUF's Q8_0 token embedding, 49152 x 576, tied) one row at a time:
as gguf-native runs it on the tiled kernel today (two 4-bit planes, each with float32 scales and offsets, summed) against
one int8 tile stream with a float32 scale per output column (the int8 format's layout: the bytes and the arithmetic a
group-scaled 8-bit layout would have, less its per-group scale), COPIES copies rotated, at the machine's best setting.
usage: head_planes.py ROUNDS COPIES NEAR FAR"""
import statistics, sys, time, torch
from yggtree.runtime.kernels import load_library, prefetch
from yggtree.runtime.hugepages import huge_empty
rounds, copies, near, far = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(2)
load_library()
N, K, G = 49152, 576, 32
g = torch.Generator().manual_seed(0)
def huge(t):
    r = huge_empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape); r.copy_(t); return r
planes = [[(huge(torch.randint(0, 256, (N // 16, K // 2, 16), generator=g, dtype=torch.uint8)),
            huge(torch.rand(N // 16, K // G, 16, generator=g)), huge(torch.rand(N // 16, K // G, 16, generator=g)))
           for _ in range(2)] for _ in range(copies)]
int8 = [(huge(torch.randint(-127, 128, (N // 16, K, 16), generator=g, dtype=torch.int8)), huge(torch.rand(N // 16, 16, generator=g)))
        for _ in range(copies)]
x = torch.randn(1, K, generator=g)
def two_planes(c):
    y = None
    for p in planes[c]:
        yp = torch.ops.yggtree.tiled_q4_mm(x, *p)
        y = yp if y is None else y + yp
def one_int8(c):
    torch.ops.yggtree.tiled_mm(x, *int8[c])
res = {"two 4-bit planes": [], "one int8 stream": []}
with prefetch((near, far)):
    for _ in range(rounds):
        for c in range(copies):
            for name, f in (("two 4-bit planes", two_planes), ("one int8 stream", one_int8)):
                t = time.perf_counter(); f(c); res[name].append(time.perf_counter() - t)
nb = {"two 4-bit planes": sum(t.numel() * t.element_size() for p in planes[0] for t in p),
      "one int8 stream": sum(t.numel() * t.element_size() for t in int8[0])}
for k, v in res.items():
    print(f"{k}: {statistics.median(v) * 1e3:.3f} ms, {nb[k] / 1e6:.1f} MB", flush=True)
