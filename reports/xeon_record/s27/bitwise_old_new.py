"""The library's 4-bit tiled product (6a34e3e: one stream, byte products) against its own code at 0c2718d (three
streams, vpdpwssd): bitwise on the default model's shapes, 1-9 rows, float16 and float32 scales, groups 32-256."""
import torch
from torch.utils import cpp_extension
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library
from yggtree.runtime.quant import q4_blocks
load_library()
cpp_extension.load(name="yggold27", sources=["/tmp/oldk/old27.cpp"], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                   build_directory="/tmp/oldk", is_python_module=False, verbose=False)
def q4_tiles(q):  # 0c2718d's layout
    n, k = q.shape
    t, c = n // 16, k // 8
    z = q.view(t, 16, c, 4, 2).permute(0, 2, 3, 1, 4).reshape(t, c, 4, 32)
    i = torch.arange(64)
    j, word = (i % 16 >= 8).long(), 8 * (i // 16) + i % 8
    return (z[:, :, j, word] | (z[:, :, j + 2, word] << 4)).contiguous()
def tiles(v): return v.view(v.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()
g = torch.Generator().manual_seed(7)
n = 0
for threads in (1, 2):
    torch.set_num_threads(threads)
    for N, K in [(960, 576), (576, 576), (3072, 576), (576, 1536), (64, 256)]:
        for G in (32, 64, 128, 256):
            if K % G: continue
            for half in (True, False):
                q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
                s = torch.rand(N, K // G, generator=g) / 64; m = torch.randn(N, K // G, generator=g) / 64
                if half: s, m = s.half(), m.half()
                for M in (1, 2, 3, 4, 5, 9):
                    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10
                    new = torch.ops.yggtree.tiled_q4_mm(x, q4_blocks(q, s, m))
                    old = torch.ops.yggold27.tiled_q4_mm(x, q4_tiles(q), tiles(s), tiles(m))
                    assert torch.equal(new, old), (N, K, G, half, M, (new - old).abs().max())
                    n += 1
print(f"bitwise equal on {n} cases (2 thread counts x 5 shapes x groups 32-256 x float16/float32 scales x 1-9 rows)")
