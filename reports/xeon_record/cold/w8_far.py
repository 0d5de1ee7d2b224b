"""The w4a8 kernel's 8-bit blocks (the default model's Q8_0 head, 49152 x 576) one row at a time, COPIES copies rotated:
no second-level prefetch (far 0) against far 8192 / 16384 / 32768 (8-bit blocks take no first-level prefetch).
usage: w8_far.py ROUNDS COPIES"""
import statistics, sys, time, torch
sys.path.insert(0, "/work/main/reports/w4a8_stream")
from common import blocks
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import load_library, prefetch
from yggtree.runtime.w4a8 import pack_blocks
rounds, copies = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(2)
load_library()
g = torch.Generator().manual_seed(0)
def huge(t):
    r = huge_empty(t.numel()).view(t.shape); r.copy_(t); return r
heads = [huge(pack_blocks(blocks(g, 49152, 576, 8))) for _ in range(copies)]
x = torch.randn(1, 576, generator=g)
res = {}
for _ in range(rounds):
    for far in (0, 8192, 16384, 32768):
        with prefetch((1024, far)):
            for h in heads:
                t = time.perf_counter(); torch.ops.yggtree.w4a8_mm(x, h); res.setdefault(far, []).append(time.perf_counter() - t)
nb = heads[0].numel()
for far, v in res.items():
    print(f"far {far}: {statistics.median(v) * 1e3:.3f} ms, {nb / statistics.median(v) / 1e9:.1f} GB/s", flush=True)
