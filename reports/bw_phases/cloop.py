"""The default model's 121 w4a8 products called back to back from C++ through the op's C shim (as AOTInductor
calls it): GB/s of the layers and of the LM head, against a 256 MiB huge-page sum probed around each round.
(the LM head alone is called 30 times in a row: its 32 MB then sit partly in the 32 MiB L3, so its rate is not a
cold one; "all" is). usage: cloop.py THREADS (GAP_US: serial microseconds after each product; ROUNDS)"""
import ctypes, os, sys, statistics, time, torch
from pathlib import Path
from torch.utils.cpp_extension import load_inline
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "w4a8_stream"))
from common import arena_model
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
T = int(sys.argv[1]); torch.set_num_threads(T); load_kernel()
src = Path(__file__).with_name("cloop_src.cpp").read_text()
m = load_inline("cloop", cpp_sources=src, functions=["loop"], extra_cflags=["-O2"], extra_ldflags=["-ldl"])
L, nbytes = arena_model(torch.Generator().manual_seed(1), pack=lambda b: (pack_blocks(b),))
g = torch.Generator().manual_seed(0)
xs = {K: torch.randn(1, K, generator=g) for K in (576, 1536)}
lay = L[:-1]; head = L[-1:]
lb = sum(p.numel() for _, p in lay); hb = head[0][1].numel()
from probe import sum_gbps
GAP = float(os.environ.get("GAP_US", "0"))
for rnd in range(int(os.environ.get("ROUNDS", "6"))):
    b0 = sum_gbps()
    tl = m.loop([xs[K] for K, _ in lay], [p for _, p in lay], 10, "aoti_torch_cpu_w4a8_mm", GAP)
    th = m.loop([xs[K] for K, _ in head], [p for _, p in head], 30, "aoti_torch_cpu_w4a8_mm", 0.0)
    tall = m.loop([xs[K] for K, _ in L], [p for _, p in L], 10, "aoti_torch_cpu_w4a8_mm", GAP)
    b1 = sum_gbps()
    print(f"T{T} sum {b0:.0f}/{b1:.0f} GB/s | layers {tl*1e3:.3f} ms {lb/tl/1e9:.1f} GB/s | head {th*1e3:.3f} ms {hb/th/1e9:.1f} GB/s | all {tall*1e3:.3f} ms {nbytes/tall/1e9:.1f} GB/s", flush=True)
