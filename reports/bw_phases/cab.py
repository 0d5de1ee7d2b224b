"""A/B from C++: the shipped w4a8 kernel (A) against a variant (B: source argv[1] built with ;-separated flags argv[2]),
the default model's 121 products called back to back through each library's C shim, rounds alternated, each round
with the 256 MiB huge-page sum probed before it (host phase). usage: cab.py SRC FLAGS THREADS [ROUNDS]"""
import os, sys, statistics, tempfile, time, torch
from pathlib import Path
from torch.utils import cpp_extension
from torch.utils.cpp_extension import load_inline
sys.path.insert(0, str(Path(__file__).parents[1] / "w4a8_stream"))
from common import arena_model, blocks
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
srcf, flags, T = sys.argv[1], [f for f in sys.argv[2].split(";") if f], int(sys.argv[3])
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 12
torch.set_num_threads(T); load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_cab_"))
v = build / "v.cpp"
v.write_text(Path(srcf).read_text().replace("(yggtree, ", "(ygg_b, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_b"))
cpp_extension.load(name="ygg_cab", sources=[str(v)], extra_cflags=list(CFLAGS) + flags, extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
import ctypes; ctypes.CDLL(str(build / "ygg_cab.so"), mode=ctypes.RTLD_GLOBAL)
m = load_inline("cloop", cpp_sources=open(str(Path(__file__).with_name("cloop_src.cpp"))).read(), functions=["loop"], extra_cflags=["-O2"], extra_ldflags=["-ldl"])
A, B_ = torch.ops.yggtree.w4a8_mm, torch.ops.ygg_b.w4a8_mm
g = torch.Generator().manual_seed(0)
for bits in (4, 8):
    for N in (16, 48, 576, 960):
        p = pack_blocks(blocks(g, N, 576, bits)); x = torch.randn(9, 576, generator=g)
        for M in range(1, 10):
            assert torch.equal(A(x[:M], p), B_(x[:M], p)), (bits, N, M)
print("bitwise equal", flush=True)
L, nbytes = arena_model(torch.Generator().manual_seed(1), pack=lambda b: (pack_blocks(b),))
xs = {K: torch.randn(1, K, generator=g) for K in (576, 1536)}
X, W = [xs[K] for K, _ in L], [p for _, p in L]
from probe import sum_gbps
GAP = float(os.environ.get("GAP_US", "0"))
res = []
for rnd in range(ROUNDS):
    bw = sum_gbps()
    order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
    t = {}
    for k in order:
        t[k] = m.loop(X, W, 10, "aoti_torch_cpu_w4a8_mm" + ("" if k == "A" else "_b"), GAP)
    res.append((bw, t["A"], t["B"]))
    print(f"T{T} {' '.join(flags)} gap {GAP:.0f}: sum {bw:4.0f} GB/s | A {t['A']*1e3:.3f} ms {nbytes/t['A']/1e9:5.1f} GB/s | B {t['B']*1e3:.3f} ms {nbytes/t['B']/1e9:5.1f} GB/s | A/B {t['A']/t['B']:.3f}", flush=True)
for name, sel in (("fast (sum > 48)", [r for r in res if r[0] > 48]), ("slow", [r for r in res if r[0] <= 48])):
    if sel:
        print(f"{name}: {len(sel)} rounds, median A/B {statistics.median(a / b for _, a, b in sel):.3f}, A {statistics.median(a for _, a, _ in sel)*1e3:.3f} ms, B {statistics.median(b for _, _, b in sel)*1e3:.3f} ms")
