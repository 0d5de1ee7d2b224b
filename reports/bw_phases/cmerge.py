"""Per-product overhead: the 120 layer products back to back (C++, C shim) against the same bytes as 4 merged products
(all qkv, all o, all gate_up, all down weights each as one product), cold, alternated, with the sum probe."""
import sys, statistics, time, torch
from torch.utils.cpp_extension import load_inline
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "w4a8_stream"))
from common import arena_model, blocks, SHAPES
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
T = int(sys.argv[1]); torch.set_num_threads(T); load_kernel()
m = load_inline("cloop", cpp_sources=open(str(__import__("pathlib").Path(__file__).with_name("cloop_src.cpp"))).read(), functions=["loop"], extra_cflags=["-O2"], extra_ldflags=["-ldl"])
g = torch.Generator().manual_seed(1)
L, nbytes = arena_model(g, SHAPES[:-1], pack=lambda b: (pack_blocks(b),))
merged, _ = arena_model(g, [(960 * 30, 576, 4), (576 * 30, 576, 4), (3072 * 30, 576, 4), (576 * 30, 1536, 4)], pack=lambda b: (pack_blocks(b),))
xs = {K: torch.randn(1, K) for K in (576, 1536)}
from probe import sum_gbps
S = "aoti_torch_cpu_w4a8_mm"
for rnd in range(int(__import__("os").environ.get("ROUNDS", "8"))):
    bw = sum_gbps()
    a = m.loop([xs[K] for K, _ in L], [p for _, p in L], 10, S, 0.0)
    b = m.loop([xs[K] for K, _ in merged], [p for _, p in merged], 10, S, 0.0)
    print(f"T{T} sum {bw:.0f} GB/s | 120 products {a*1e3:.3f} ms {nbytes/a/1e9:.1f} GB/s | 4 merged {b*1e3:.3f} ms {nbytes/b/1e9:.1f} GB/s | {a/b:.2f}x", flush=True)
