"""The library's 4-bit tiled product (16-bit activations, vpdpwssd; 885289d) against the byte-product variant
(bytes_q4_tiled_mm.cpp), the default model's 120 block products with float16 scales, 2 copies rotated, 9 rounds."""
import statistics, sys, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library, prefetch
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime import quant as q_cur
torch.set_num_threads(2); load_library()
import os
os.makedirs('/tmp/ygg2_build', exist_ok=True)
cpp_extension.load(name='ygg2', sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)), 'bytes_q4_tiled_mm.cpp')],
                   extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory='/tmp/ygg2_build', is_python_module=False, verbose=False)
def q4_bytes(q):  # the variant's layout: per 32 inputs, byte (h, l, i) = q[l][4h+i] | q[l][16+4h+i] << 4
    n, k = q.shape
    b = q.view(n // 16, 16, k // 32, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n // 16, k // 8, 64).contiguous()
ns = {"q4_tiles": q4_bytes}
H, I, L = 576, 1536, 30
blocks = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L
g = torch.Generator().manual_seed(0)
def arena(tensors):
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    a = huge_empty(total); off = 0; out = []
    for t in tensors:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out, total
def tiles(v): return v.view(v.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()
def model(new):
    ts = []
    for N, K in blocks:
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        ts += [(ns["q4_tiles"] if new else q_cur.q4_tiles)(q), tiles((torch.rand(N, K // 32, generator=g) / 64).half()), tiles((torch.randn(N, K // 32, generator=g) / 64).half())]
    a, nb = arena(ts)
    return [a[3 * i: 3 * i + 3] for i in range(len(blocks))], nb
xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
ms = {new: [model(new) for _ in range(2)] for new in (False, True)}
nb = ms[True][0][1]
sums = [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(2)]
res = {}
with prefetch((1024, 16384)):
    for rnd in range(9):
        for new in (False, True):
            op = torch.ops.ygg2.tiled_q4_mm if new else torch.ops.yggtree.tiled_q4_mm
            for m, _ in ms[new]:
                t = time.perf_counter()
                for c, s, mm in m: op(xs[8 * c.size(1)], c, s, mm)
                res.setdefault(new, []).append(time.perf_counter() - t)
        for s in sums:
            t = time.perf_counter(); s.sum(); res.setdefault("sum", []).append(time.perf_counter() - t)
sm = statistics.median(res["sum"])
for k, v in res.items():
    t = statistics.median(v)
    print(f"{('byte products (vpdpbusd)' if k is True else 'word products (vpdpwssd)' if k is False else 'sum'):26s} {nb/1e6:.1f} MB {t*1e3:.3f} ms {nb/t/1e9:.1f} GB/s {sm/t*100:.1f}% of the sum")
