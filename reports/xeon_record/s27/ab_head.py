"""The default model's Q8_0 head (49152 x 576, blocks of 32), 1 row: the tiled int8 kernel with a scale per
block (two streams: pairs, scales) against w4a8's 8-bit blocks (one stream, int8 activations), COPIES rotated."""
import statistics, sys, time, torch
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import load_library, prefetch
from yggtree.runtime.quant import int8_pairs
from yggtree.runtime.w4a8 import Blocks, pack_blocks
threads, rounds, copies = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads); load_library()
V, H = 49152, 576
g = torch.Generator().manual_seed(0)
def arena(tensors):
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    a = huge_empty(total); off = 0; out = []
    for t in tensors:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out, total
def tiles(v): return v.view(v.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()
q = torch.randint(-127, 128, (V, H), generator=g, dtype=torch.int8)
d = (torch.rand(V, H // 32, generator=g) / 64).half()
sys_ = {"tiled int8/32": [], "w4a8 8-bit": []}
for _ in range(copies):
    sys_["tiled int8/32"].append(arena([int8_pairs(q), tiles(d.float())]))
    sys_["w4a8 8-bit"].append(arena([pack_blocks(Blocks((q.int() + 128).to(torch.uint8), d, (-128 * d.float()).half(), 8))]))
ops = {"tiled int8/32": torch.ops.yggtree.tiled_mm, "w4a8 8-bit": torch.ops.yggtree.w4a8_mm}
x = torch.randn(1, H, generator=g)
nb = sys_["tiled int8/32"][0][1]
sums = [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)]
res = {}
with prefetch((2048, 32768)):
    for rnd in range(rounds):
        for k, op in ops.items():
            for ts, _ in sys_[k]:
                t = time.perf_counter(); op(x, *ts); res.setdefault(k, []).append(time.perf_counter() - t)
        for s in sums:
            t = time.perf_counter(); s.sum(); res.setdefault("sum", []).append(time.perf_counter() - t)
sm = statistics.median(res["sum"])
for k, v in res.items():
    t = statistics.median(v); b = sys_[k][0][1] if k in sys_ else nb
    print(f"{k:14s} {b/1e6:6.1f} MB {t*1e3:7.3f} ms {b/t/1e9:5.1f} GB/s  {nb/t/(nb/sm)*100:5.1f}% of the sum's time")
