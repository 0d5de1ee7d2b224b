# shapes.py: per-call time of one product shape (60 uncached copies) at 1 and 2 threads
import sys, statistics, time, torch
from yggtree.runtime.w4a8 import load_kernel, pack_blocks, Blocks
from yggtree.offline.timing import time_rounds
load_kernel()
g = torch.Generator().manual_seed(0)
def blocks(N, K, bits):
    return Blocks(torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8), (torch.rand(N, K//32, generator=g)/64).half(), (torch.rand(N, K//32, generator=g)/64).half(), bits)
res = {}
for N, K in [(960, 576), (576, 576), (3072, 576), (576, 1536), (16, 576)]:
    L = [pack_blocks(blocks(N, K, 4)) for _ in range(60)]
    x = torch.randn(1, K, generator=g)
    mb = sum(c.numel() + d.numel() * 4 for c, d, m in L) / 1e6
    for T in (1, 2):
        torch.set_num_threads(T)
        f = lambda: [torch.ops.yggtree.w4a8_mm(x, c, d, m) for c, d, m in L]
        ms = statistics.median(time_rounds({0: f}, 3, 15)[0])
        print(f"{N}x{K} T{T}: {ms/60*1e3:7.1f} us/call  {mb/ms:5.1f} GB/s")
