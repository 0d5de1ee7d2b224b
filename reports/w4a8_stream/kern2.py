"""The default model's 121 w4a8 products at M rows in a huge-page arena (all, LM head, layers) against a 256 MiB sum (run at 8c0930a: codes, d, m)."""
import sys, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import arena_model, SHAPES
from yggtree.runtime.w4a8 import load_kernel
from yggtree.offline.timing import time_rounds
from yggtree.runtime.hugepages import huge_zeros
T = int(sys.argv[1]); Ms = [int(x) for x in sys.argv[2:]]
torch.set_num_threads(T); load_kernel()
g = torch.Generator().manual_seed(0)
L, nbytes = arena_model(g)
x = huge_zeros((256 * 2**20 // 4,), torch.float32).fill_(1.0)
fns = {"sum": lambda: x.sum()}
op = torch.ops.yggtree.w4a8_mm
for M in Ms:
    xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
    fns[M] = (lambda xs: lambda: [op(xs[e[0]], *e[1:]) for e in L])(xs)
    fns[("head", M)] = (lambda xs: lambda: op(xs[576], *L[-1][1:]))(xs)
    fns[("layers", M)] = (lambda xs: lambda: [op(xs[K], c, d, m) for K, c, d, m in L[:-1]])(xs)
tr = time_rounds(fns, 3, 15)
s = statistics.median(tr["sum"]); bw = 256*2**20/s/1e6; print(f"T{T} weights {nbytes/1e6:.1f} MB; huge sum {bw:.1f} GB/s")
hb = sum(t.numel() * t.element_size() for t in L[-1][1:])
for M in Ms:
    t = statistics.median(tr[M]); th = statistics.median(tr[("head", M)]); tl = statistics.median(tr[("layers", M)])
    print(f"T{T} M{M:3d} all {t:6.3f} ms {nbytes/t/1e6:5.1f} GB/s ({100*nbytes/t/1e6/bw:.0f}%) | head {th:6.3f} ms {hb/th/1e6:5.1f} GB/s | layers {tl:6.3f} ms {(nbytes-hb)/tl/1e6:5.1f} GB/s")
