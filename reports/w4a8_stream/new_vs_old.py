"""The shipped w4a8 kernel (one interleaved stream per tile: codes, d, m) against the one before it (8c0930a: three
streams; read with git show), built as ygg_old::w4a8_mm: outputs bitwise equal for 1-17 rows, then the default model's 121 products timed in
interleaved rounds, weights in one huge-page arena in model order (cold: 98 MB > L3). OMP_NUM_THREADS=2 python new_vs_old.py 2 1 2 4 8"""
import sys, statistics, tempfile, torch
from pathlib import Path
from torch.utils import cpp_extension
sys.path.insert(0, str(Path(__file__).parent))
from common import blocks, arena_model
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
from yggtree.offline.timing import time_rounds
T = int(sys.argv[1]); Ms = [int(x) for x in sys.argv[2:]]
torch.set_num_threads(T); load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_old_"))
v = build / "v.cpp"
import subprocess
v.write_text(subprocess.run(["git", "show", "8c0930a:yggtree/runtime/csrc/w4a8.cpp"], capture_output=True, text=True, check=True).stdout.replace("(yggtree, ", "(ygg_old, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_old"))
cpp_extension.load(name="ygg_old", sources=[str(v)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
NEW, OLD = torch.ops.yggtree.w4a8_mm, torch.ops.ygg_old.w4a8_mm
def split(p):  # new packed -> old (codes, d, m)
    c = p.shape[2] - 64
    return p[..., :c].contiguous(), p[..., c:c+32].contiguous().view(torch.float16), p[..., c+32:].contiguous().view(torch.float16)
g = torch.Generator().manual_seed(0)
for bits in (4, 8):
    for N in (16, 48, 100, 576, 960):
        for K in (32, 576, 1536):
            p = pack_blocks(blocks(g, N, K, bits)); x = torch.randn(17, K, generator=g)
            for M in range(1, 18):
                assert torch.equal(NEW(x[:M], p), OLD(x[:M], *split(p))), (bits, N, K, M)
print("bitwise equal: new layout = HEAD's kernel, 4 and 8 bits, M 1..17")
if not Ms: sys.exit()
LN, _ = arena_model(torch.Generator().manual_seed(1), pack=lambda b: (pack_blocks(b),))
LO, _ = arena_model(torch.Generator().manual_seed(1), pack=lambda b: split(pack_blocks(b)))
fns = {}
for M in Ms:
    xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
    fns[("old", M)] = (lambda xs: lambda: [OLD(xs[e[0]], *e[1:]) for e in LO])(xs)
    fns[("new", M)] = (lambda xs: lambda: [NEW(xs[e[0]], *e[1:]) for e in LN])(xs)
tr = time_rounds(fns, 3, 21)
for M in Ms:
    a, b = statistics.median(tr[("old", M)]), statistics.median(tr[("new", M)])
    print(f"T{T} M{M:2d} 121 products: HEAD {a:6.3f} ms  new {b:6.3f} ms  speed-up {a/b:.3f}", flush=True)
