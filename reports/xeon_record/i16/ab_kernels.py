"""Same-process A/B of the tiled kernel's quantized products: the library's (16-bit integer activations, VNNI;
4-bit scales in float16) against its own code at e6b6765 (old_tiled_mm.cpp: float32 activations, float32 4-bit
scales), on the default model's 121 one-row products with random weights, COPIES copies rotated so every pass
reads weights the last did not (a decode's case), in rounds; a float32 sum over the same bytes as the stream
limit. Systems: int8 (every product int8 per column) and gguf-native (blocks 4-bit in groups of 32, the head an
int8 stream with a scale per block of 32, as the default GGUF runs).
usage: ab_kernels.py THREADS ROUNDS COPIES NEAR FAR [LAYERS]"""
import statistics, sys, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library, prefetch
from yggtree.runtime.quant import int8_pairs, q4_tiles
import os
threads, rounds, copies, near, far = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(threads)
load_library()
here = os.path.dirname(os.path.abspath(__file__))
os.makedirs("/tmp/yggold_build", exist_ok=True)
cpp_extension.load(name="yggold", sources=[f"{here}/old_tiled_mm.cpp"], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                   build_directory="/tmp/yggold_build", is_python_module=False, verbose=False)
H, I, V = 576, 1536, 49152
L = int(sys.argv[6]) if len(sys.argv) > 6 else 30  # decoder layers (30: the default model)
blocks = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L
g = torch.Generator().manual_seed(0)

def arena(tensors):
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    a = huge_empty(total); off = 0; out = []
    for t in tensors:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out, total

def tiles(v):  # [N, X] -> [T, X, 16]
    return v.view(v.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()

def int8_model(new):
    ts, calls = [], []
    for N, K in blocks + [(V, H)]:
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        ts += [int8_pairs(q) if new else tiles(q), torch.rand(N // 16, 16, generator=g) / 64]
    a, nb = arena(ts)
    op = torch.ops.yggtree.tiled_mm if new else torch.ops.yggold.tiled_mm
    return [(op, a[2 * i], a[2 * i + 1]) for i in range(len(ts) // 2)], nb

def gguf_model(new):
    ts, kinds = [], []
    for N, K in blocks:
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        s, m = ((torch.rand(N, K // 32, generator=g) / 64).half(), (torch.randn(N, K // 32, generator=g) / 64).half())
        if new:
            ts += [q4_tiles(q), tiles(s), tiles(m)]
        else:
            pairs = q.view(N // 16, 16, K // 2, 2)
            ts += [(pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1).contiguous(), tiles(s.float()), tiles(m.float())]
        kinds.append("q4")
    q = torch.randint(-127, 128, (V, H), generator=g, dtype=torch.int8)
    ts += [int8_pairs(q) if new else tiles(q), tiles(torch.rand(V, H // 32, generator=g) / 64)]
    a, nb = arena(ts)
    ns = torch.ops.yggtree if new else torch.ops.yggold
    out = [(ns.tiled_q4_mm, *a[3 * i: 3 * i + 3]) for i in range(len(blocks))]
    return out + [(ns.tiled_mm, a[-2], a[-1])], nb

xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
def width(p):
    op, w = p[0], p[1]
    if w.dtype == torch.int8:
        return 2 * w.size(1) if w.size(2) == 32 else w.size(1)
    return 8 * w.size(1) if w.size(2) == 64 else 2 * w.size(1)

systems = {}
for name, make in (("int8", int8_model), ("gguf-native", gguf_model)):
    for new in (False, True):
        ms = [make(new) for _ in range(copies)]
        systems[f"{name} {'new' if new else 'old'}"] = ([m for m, _ in ms], ms[0][1])
nbytes = {k: nb for k, (_, nb) in systems.items()}
sums = {k: [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)] for k, nb in nbytes.items() if k.endswith("new")}
res = {}
with prefetch((near, far)):
    for rnd in range(rounds):
        for key, (models, nb) in systems.items():
            for m in models:
                t = time.perf_counter()
                for p in m:
                    p[0](xs[width(p)], *p[1:])
                res.setdefault(key, []).append(time.perf_counter() - t)
        for key, ss in sums.items():
            for s in ss:
                t = time.perf_counter(); s.sum(); res.setdefault("sum " + key.split()[0], []).append(time.perf_counter() - t)
print(f"{threads} thread(s), {rounds} rounds x {copies} copies, prefetch ({near}, {far}); medians")
for key, v in res.items():
    fmt = key.split()[1] if key.startswith("sum") else key.split()[0]
    nb = nbytes.get(key, nbytes[f"{fmt} new"])  # a sum reads the new system's bytes
    rate = nb / statistics.median(v)
    sum_rate = nbytes[f"{fmt} new"] / statistics.median(res[f"sum {fmt}"])
    print(f"{key:18s} {nb / 1e6:6.1f} MB {statistics.median(v) * 1e3:7.3f} ms {rate / 1e9:5.1f} GB/s  "
          f"{rate / sum_rate * 100:5.1f}% of the sum's rate")
for fmt in ("int8", "gguf-native"):
    print(f"{fmt}: new / old time {statistics.median(res[f'{fmt} new']) / statistics.median(res[f'{fmt} old']):.3f}")
