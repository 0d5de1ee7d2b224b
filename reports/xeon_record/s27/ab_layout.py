# Ran at 0c2718d (the library then had quant.q4_tiles and the three-stream yggtree::tiled_q4_mm(x, codes, s, m));
# check that commit out to rerun it.
"""A/B: the tiled 4-bit product in three streams (library: codes, s, m) against one stream per tile (proto q4b),
and w4a8 (one stream, int8 activations) on the same blocks; the default model's 120 block products, 1 row,
COPIES copies rotated. usage: ab_layout.py THREADS ROUNDS COPIES NEAR FAR"""
import os, statistics, sys, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library, prefetch
from yggtree.runtime.quant import q4_tiles
from yggtree.runtime.w4a8 import Blocks, pack_blocks
threads, rounds, copies, near, far = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(threads); load_library()
os.makedirs("/tmp/proto27", exist_ok=True)
cpp_extension.load(name="proto27", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "proto_q4.cpp")], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                   build_directory="/tmp/proto27", is_python_module=False, verbose=False)
H, I, L = 576, 1536, 30
shapes = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L
g = torch.Generator().manual_seed(0)
def arena(tensors):
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    a = huge_empty(total); off = 0; out = []
    for t in tensors:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out, total
def tiles(v): return v.view(v.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()
def q4b(q, s, m):  # [T, B, G*8 + 64]
    n, k = q.shape; t, b = n // 16, k // 32
    c = q4_tiles(q).view(t, b, 256)
    return torch.cat([c, tiles(s).view(torch.uint8), tiles(m).view(torch.uint8)], 2).contiguous()
raw = []
for N, K in shapes:
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s, m = (torch.rand(N, K // 32, generator=g) / 64).half(), (torch.randn(N, K // 32, generator=g) / 64).half()
    raw.append((q, s, m))
def build(kind):
    ts, per = [], 0
    for q, s, m in raw:
        if kind == "three": ts += [q4_tiles(q), tiles(s), tiles(m)]; per = 3
        elif kind == "one": ts += [q4b(q, s, m)]; per = 1
        elif kind == "bytes": ts += [pack_blocks(Blocks(q, s, m, 4))]; per = 1
        else: ts += [pack_blocks(Blocks(q, s, m, 4))]; per = 1
    a, nb = arena(ts)
    return [a[per * i: per * i + per] for i in range(len(raw))], nb
ops = {"three": torch.ops.yggtree.tiled_q4_mm, "one": torch.ops.proto27.q4b_mm, "bytes": torch.ops.proto27.q4c_mm, "w4a8": torch.ops.yggtree.w4a8_mm}
systems = {k: [build(k) for _ in range(copies)] for k in ops}
xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
# exactness of the prototype against the library
three, one = systems["three"][0][0], systems["one"][0][0]
for i in range(4):
    K = raw[i][0].shape[1]
    for M in (1, 2, 3, 4, 7):
        x = torch.randn(M, K, generator=g)
        assert torch.equal(ops["three"](x, *three[i]), ops["one"](x, *one[i])), (i, M)
        assert torch.equal(ops["three"](x, *three[i]), ops["bytes"](x, *systems["bytes"][0][0][i])), (i, M)
print("one stream = three streams, bitwise (4 shapes x M 1,2,3,4,7)")
nb = systems["one"][0][1]
sums = [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)]
res = {}
with prefetch((near, far)):
    for rnd in range(rounds):
        for k, op in ops.items():
            for m, _ in systems[k]:
                t = time.perf_counter()
                for i, p in enumerate(m): op(xs[shapes[i][1]], *p)
                res.setdefault(k, []).append(time.perf_counter() - t)
        for s in sums:
            t = time.perf_counter(); s.sum(); res.setdefault("sum", []).append(time.perf_counter() - t)
sm = statistics.median(res["sum"])
print(f"{threads} thread(s), {rounds} rounds x {copies} copies, prefetch ({near}, {far}); medians; {nb/1e6:.1f} MB")
for k, v in res.items():
    t = statistics.median(v)
    print(f"{k:8s} {systems[k][0][1]/1e6 if k in systems else nb/1e6:6.1f} MB {t*1e3:7.3f} ms  {sm/t*100:5.1f}% of the sum")
