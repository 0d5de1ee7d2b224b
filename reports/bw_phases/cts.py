"""Where a 2-thread w4a8 product's time goes, per product: rdtsc in a copy of the shipped kernel (w4a8_ts.patch; with
VFLAGS=-DRAW_OMP its region is a bare `omp parallel` instead of at::parallel_for), the 120 layer products called back
to back from C++ through the copy's C shim, 4 rounds, the 256 MiB huge-page sum probed before each."""
import ctypes, sys, statistics, tempfile, time, torch
from pathlib import Path
from torch.utils import cpp_extension
from torch.utils.cpp_extension import load_inline
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "w4a8_stream"))
from common import arena_model, SHAPES
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
torch.set_num_threads(2); load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_ts_"))
v = build / "v.cpp"
import subprocess
here = Path(__file__).parent
subprocess.run(["patch", "-s", "-o", str(build / "ts.cpp"), str(here.parents[1] / "yggtree/runtime/csrc/w4a8.cpp"), str(here / "w4a8_ts.patch")], check=True)
v.write_text((build / "ts.cpp").read_text().replace("(yggtree, ", "(ygg_b, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_b"))
cpp_extension.load(name="ygg_ts", sources=[str(v)], extra_cflags=list(CFLAGS) + [f for f in __import__("os").environ.get("VFLAGS", "").split(";") if f], extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
lib = ctypes.CDLL(str(build / "ygg_ts.so"), mode=ctypes.RTLD_GLOBAL)
m = load_inline("cloop", cpp_sources=open(str(__import__("pathlib").Path(__file__).with_name("cloop_src.cpp"))).read(), functions=["loop"], extra_cflags=["-O2"], extra_ldflags=["-ldl"])
GHZ = 2.596
from probe import sum_gbps
L, nbytes = arena_model(torch.Generator().manual_seed(1), SHAPES[:-1], pack=lambda b: (pack_blocks(b),))
xs = {K: torch.randn(1, K) for K in (576, 1536)}
buf = (ctypes.c_double * 8)()
for rnd in range(4):
    bw = sum_gbps()
    lib.w4a8_stats(buf)
    for K, p in L: pass
    t = m.loop([xs[K] for K, _ in L], [p for _, p in L], 20, "aoti_torch_cpu_w4a8_mm_b", 0.0)
    lib.w4a8_stats(buf); s = [x for x in buf]; n = s[6]
    us = lambda i: s[i] / n / GHZ / 1e3
    print(f"sum {bw:.0f} GB/s | {t/len(L)*1e6:.2f} us a product | call {us(7):.2f} | worker starts {us(0):.2f}, main {us(1):.2f} after the region's call | work main {us(2):.2f} worker {us(3):.2f} | ends apart {us(4):.2f} | last end -> return {us(5):.2f}", flush=True)
