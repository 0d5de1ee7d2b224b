"""A/B: the shipped w4a8 kernel (A) against w4a8_next.patch (B: the op takes the next product's weights too; each
thread, after its tiles, with MODE=0 prefetches the first PF_NEXT bytes of its share of them, with MODE=1 (default)
reads them line by line while the region's other thread still works; C: the same op with no next). The 121 products of the
default model in a huge-page arena, called in model order from Python (the dispatcher's few us between calls stand
in for the step's serial work), optionally with GAP_US of extra serial work between calls.
usage: next_ab.py FLAGS(;-separated) THREADS M..."""
import os, sys, statistics, tempfile, time, torch
from pathlib import Path
from torch.utils import cpp_extension
sys.path.insert(0, str(Path(__file__).parents[1] / "w4a8_stream"))
from common import blocks, arena_model
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
from yggtree.offline.timing import time_rounds
flags, T = [f for f in sys.argv[1].split(";") if f], int(sys.argv[2]); Ms = [int(x) for x in sys.argv[3:]]
GAP = float(os.environ.get("GAP_US", "0")) * 1e-6
torch.set_num_threads(T); load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_next_"))
v = build / "v.cpp"
import subprocess
here = Path(__file__).parent
subprocess.run(["patch", "-s", "-o", str(build / "next.cpp"), str(here.parents[1] / "yggtree/runtime/csrc/w4a8.cpp"), str(here / "w4a8_next.patch")], check=True)
v.write_text((build / "next.cpp").read_text().replace("(yggtree, ", "(ygg_b, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_b"))
cpp_extension.load(name="ygg_next", sources=[str(v)], extra_cflags=list(CFLAGS) + flags, extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
A, B_ = torch.ops.yggtree.w4a8_mm, torch.ops.ygg_b.w4a8_mm
none = torch.empty(0, dtype=torch.uint8)
g = torch.Generator().manual_seed(0)
for bits in (4, 8):
    for N in (16, 48, 576, 960):
        bl = blocks(g, N, 576, bits); x = torch.randn(9, 576, generator=g); p = pack_blocks(bl)
        for M in range(1, 10):
            assert torch.equal(A(x[:M], p), B_(x[:M], p, p)), (bits, N, M)
print("bitwise equal", flush=True)
L, nbytes = arena_model(torch.Generator().manual_seed(1), pack=lambda b: (pack_blocks(b),))
nxt = [L[(i + 1) % len(L)][1] for i in range(len(L))]
def gap():
    if GAP:
        t = time.perf_counter()
        while time.perf_counter() - t < GAP: pass
fns = {}
for M in Ms:
    xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
    def a(xs=xs):
        for K, p in L: A(xs[K], p); gap()
    def b(xs=xs):
        for (K, p), n in zip(L, nxt): B_(xs[K], p, n); gap()
    def c(xs=xs):
        for K, p in L: B_(xs[K], p, none); gap()
    fns[("A", M)], fns[("B", M)], fns[("C", M)] = a, b, c
tr = time_rounds(fns, 3, 21)
for M in Ms:
    a, b, c = (statistics.median(tr[(k, M)]) for k in "ABC")
    print(f"T{T} M{M:2d} gap {GAP*1e6:.0f}us {' '.join(flags)}: A {a:6.3f} ms  B(next) {b:6.3f}  C(no next) {c:6.3f}  A/B {a/b:.3f}  C/B {c/b:.3f}", flush=True)
