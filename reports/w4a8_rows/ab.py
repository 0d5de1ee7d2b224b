"""A/B: the shipped w4a8 kernel (yggtree::w4a8_mm) against another version of its source (built
with its op renamed ygg_b::w4a8_mm and its C shim aoti_torch_cpu_w4a8_mm_b), outputs bitwise equal
for 1-17 rows, over the default model's 121 products (random uncached weights), interleaved
rounds, medians:
    git show e6c663e:yggtree/runtime/csrc/w4a8.cpp > /tmp/groups_41.cpp
    OMP_NUM_THREADS=2 python reports/w4a8_rows/ab.py /tmp/groups_41.cpp 2 1 2 3 4 8 16 32
The recorded run (docs/results.md) ran the other way round: at e6c663e (row groups of 4 and 1)
against the kernel of 5153b30 (groups of 8, 4, 2, 1), so its B/A is this command's A/B."""
import os, sys, statistics, tempfile, torch
from pathlib import Path
from torch.utils import cpp_extension

from yggtree.runtime.w4a8 import load_kernel, pack_blocks, Blocks, CFLAGS, LDFLAGS
from yggtree.offline.timing import time_rounds
src, T = sys.argv[1], int(sys.argv[2]); Ms = [int(x) for x in sys.argv[3:]]
torch.set_num_threads(T)
load_kernel()
build = Path(tempfile.mkdtemp(prefix="ygg_kernel_ab_"))
variant = build / "variant.cpp"
variant.write_text(Path(src).read_text().replace("(yggtree, ", "(ygg_b, ").replace("aoti_torch_cpu_w4a8_mm", "aoti_torch_cpu_w4a8_mm_b"))
cpp_extension.load(name="ygg_kernel_ab", sources=[str(variant)], extra_cflags=list(CFLAGS),
                   extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False, verbose=False)
g = torch.Generator().manual_seed(0)
def blocks(N, K, bits):
    return Blocks(torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8), (torch.rand(N, K//32, generator=g)/64).half(), (torch.rand(N, K//32, generator=g)/64).half(), bits)
# exactness: every row count 1..17, 4- and 8-bit
for bits in (4, 8):
    c, d, m = pack_blocks(blocks(64, 1536, bits))
    for M in range(1, 18):
        x = torch.randn(M, 1536, generator=g)
        assert torch.equal(torch.ops.yggtree.w4a8_mm(x, c, d, m), torch.ops.ygg_b.w4a8_mm(x, c, d, m)), (bits, M)
print("bitwise equal, M 1..17, 4 and 8 bits")
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
L = [(K, *pack_blocks(blocks(N, K, 8 if i == len(shapes) - 1 else 4))) for i, (N, K) in enumerate(shapes)]
for M in Ms:
    xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
    fns = {"A": lambda: [torch.ops.yggtree.w4a8_mm(xs[K], c, d, m) for K, c, d, m in L],
           "B": lambda: [torch.ops.ygg_b.w4a8_mm(xs[K], c, d, m) for K, c, d, m in L]}
    tr = time_rounds(fns, 3, 15)
    a, b = statistics.median(tr["A"]), statistics.median(tr["B"])
    print(f"T{T} M{M:3d}  A {a:7.2f} ms  B {b:7.2f} ms  B/A {b/a:.3f}", flush=True)
