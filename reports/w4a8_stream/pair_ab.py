"""A/B (run at 8c0930a, whose op took codes, d, m): the shipped w4a8 kernel against two columns per byte (w4a8_pair.cpp: git show 8c0930a:yggtree/runtime/csrc/w4a8.cpp, then patch with w4a8_pair.patch), bitwise, then time."""
import sys, statistics, tempfile, torch
import torch.nn.functional as F
from pathlib import Path
from torch.utils import cpp_extension
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import blocks, arena_model, SHAPES
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
from yggtree.offline.timing import time_rounds
T = int(sys.argv[1]); Ms = [int(x) for x in sys.argv[2:]]
torch.set_num_threads(T); load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_pair_"))
v = build / "v.cpp"
v.write_text(Path(__file__).with_name("w4a8_pair.cpp").read_text().replace("(yggtree, ", "(ygg_b, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_b"))
cpp_extension.load(name="ygg_pair", sources=[str(v)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
def pack_pair(b):
    if b.bits == 8:
        return pack_blocks(b)
    n, k = b.u.shape
    pad = -n % 32
    u, d, m = (F.pad(t, (0, 0, 0, pad)) for t in (b.u, b.d, b.m))
    p, nb = (n + pad) // 32, k // 32
    t = u.view(p, 2, 16, nb, 8, 4).permute(0, 1, 3, 4, 2, 5)  # [P, half, B, g, lane, i]
    codes = (t[:, 0] | (t[:, 1] << 4)).reshape(p, nb, 512).contiguous()
    per = lambda s: s.view(p, 32, nb).permute(0, 2, 1).contiguous()
    return codes, per(d), per(m)
A, B_ = torch.ops.yggtree.w4a8_mm, torch.ops.ygg_b.w4a8_mm
g = torch.Generator().manual_seed(0)
for bits in (4, 8):
    for N in (16, 32, 48, 576, 960):
        for K in (32, 576, 1536):
            bl = blocks(g, N, K, bits); x = torch.randn(17, K, generator=g)
            pa, pb = pack_blocks(bl), pack_pair(bl)
            for M in range(1, 18):
                ya, yb = A(x[:M], *pa), B_(x[:M], *pb)
                assert torch.equal(ya[:, :N], yb[:, :N]), (bits, N, K, M)
print("bitwise equal")
if not Ms: sys.exit()
LA, nbytes = arena_model(torch.Generator().manual_seed(1))
LB, nb2 = arena_model(torch.Generator().manual_seed(1), pack=pack_pair)
fns = {}
for M in Ms:
    xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
    fns[("A", M)] = (lambda xs: lambda: [A(xs[K], c, d, m) for K, c, d, m in LA[:-1]])(xs)
    fns[("B", M)] = (lambda xs: lambda: [B_(xs[K], c, d, m) for K, c, d, m in LB[:-1]])(xs)
tr = time_rounds(fns, 3, 21)
for M in Ms:
    a, b = statistics.median(tr[("A", M)]), statistics.median(tr[("B", M)])
    print(f"T{T} M{M:2d} layers A {a:6.3f} ms  B {b:6.3f} ms  A/B {a/b:.3f}", flush=True)
