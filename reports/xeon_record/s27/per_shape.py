"""Per-shape time of the one-stream 4-bit product, cold (30 copies rotated) and warm (one copy repeated),
and an empty-ish call (T=4, K=32); 1 row. usage: per_shape.py THREADS"""
import os, statistics, sys, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library, prefetch
torch.set_num_threads(int(sys.argv[1])); load_library()
cpp_extension.load(name="proto27", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "proto_q4.cpp")], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                   build_directory="/tmp/proto27", is_python_module=False, verbose=False)
op = torch.ops.proto27.q4b_mm
g = torch.Generator().manual_seed(0)
def blocks(N, K, n):
    S = 320; a = huge_empty(n * (N // 16) * (K // 32) * S)
    a.copy_(torch.randint(0, 256, a.shape, generator=g, dtype=torch.uint8))
    v = a.view(n, N // 16, K // 32, S)
    v[..., 256:] = torch.tensor([0x00, 0x20], dtype=torch.uint8).repeat(32)  # float16 1/512-ish scales
    return [v[i] for i in range(n)]
import contextlib
from yggtree.runtime.kernels import loop_pool
with prefetch((1024, 16384)), (loop_pool(2) if len(sys.argv) > 2 else contextlib.nullcontext()):
    for N, K in [(64, 32), (960, 576), (576, 576), (3072, 576), (576, 1536)]:
        x = torch.randn(1, K)
        cold, warm = blocks(N, K, 40), None
        for _ in range(3):
            for b in cold: op(x, b)
        tc, tw = [], []
        for rnd in range(15):
            t = time.perf_counter()
            for b in cold: op(x, b)
            tc.append((time.perf_counter() - t) / len(cold))
            t = time.perf_counter()
            for _ in range(len(cold)): op(x, cold[0])
            tw.append((time.perf_counter() - t) / len(cold))
        mb = cold[0].numel() / 1e6
        c, w = statistics.median(tc) * 1e6, statistics.median(tw) * 1e6
        print(f"N {N:5d} K {K:5d}  {mb:6.3f} MB  cold {c:7.1f} us ({mb*1e3/c:5.1f} GB/s)  warm {w:7.1f} us")
