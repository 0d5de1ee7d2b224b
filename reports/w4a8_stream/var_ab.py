"""A/B (run at 8c0930a, whose op took codes, d, m): the shipped w4a8 kernel against a variant source argv[1] of the same layout built with extra flags argv[2] (w4a8_dyn.cpp: the kernel of 8c0930a patched with w4a8_dyn.patch); layers + head in a huge-page arena."""
import sys, statistics, tempfile, torch
from pathlib import Path
from torch.utils import cpp_extension
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import blocks, arena_model
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
from yggtree.offline.timing import time_rounds
srcf, flags, T = sys.argv[1], [f for f in sys.argv[2].split(";") if f], int(sys.argv[3]); Ms = [int(x) for x in sys.argv[4:]]
torch.set_num_threads(T); load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_var_"))
v = build / "v.cpp"
v.write_text(Path(srcf).read_text().replace("(yggtree, ", "(ygg_b, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_b"))
cpp_extension.load(name="ygg_var", sources=[str(v)], extra_cflags=list(CFLAGS) + flags, extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
A, B_ = torch.ops.yggtree.w4a8_mm, torch.ops.ygg_b.w4a8_mm
g = torch.Generator().manual_seed(0)
for bits in (4, 8):
    for N in (16, 48, 576, 960, 3072):
        bl = blocks(g, N, 576, bits); x = torch.randn(9, 576, generator=g); p = pack_blocks(bl)
        for M in range(1, 10):
            assert torch.equal(A(x[:M], *p), B_(x[:M], *p)), (bits, N, M)
print("bitwise equal")
L, nbytes = arena_model(torch.Generator().manual_seed(1))
fns = {}
for M in Ms:
    xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
    for name, op in (("A", A), ("B", B_)):
        fns[(name, M)] = (lambda xs, op: lambda: [op(xs[K], c, d, m) for K, c, d, m in L])(xs, op)
tr = time_rounds(fns, 3, 21)
for M in Ms:
    a, b = statistics.median(tr[("A", M)]), statistics.median(tr[("B", M)])
    print(f"T{T} M{M:2d} model A {a:6.3f} ms  B {b:6.3f} ms  A/B {a/b:.3f}", flush=True)
