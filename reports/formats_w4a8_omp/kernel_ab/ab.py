"""A/B of the shipped w4a8 kernel (yggtree::w4a8_mm, as this checkout builds it) against the same
source built with OpenMP under another op name (ygg_s6::w4a8_mm), over the default model's 121
products (random uncached weights), outputs checked bitwise equal. Run from the repository root at
0b3468b~1 (whose kernel was built without OpenMP) for the A/B of docs/results.md:
    OMP_NUM_THREADS=T python reports/formats_w4a8_omp/kernel_ab/ab.py T 1
(The interleaved-layout variant also timed there is in git history, commit dee2993: reports/formats_w4a8_omp/kernel_ab/inter.cpp.)"""
import os, tempfile
import sys, statistics, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.w4a8 import load_kernel, pack_blocks, Blocks, CFLAGS
from yggtree.offline.timing import time_rounds
T, M = int(sys.argv[1]), int(sys.argv[2]); torch.set_num_threads(T)
load_kernel()
src = open("yggtree/runtime/csrc/w4a8.cpp").read().replace("(yggtree, ", "(ygg_s6, ")
build = os.path.join(tempfile.gettempdir(), "ygg_kernel_ab_omp")
os.makedirs(build, exist_ok=True)
with open(os.path.join(build, "w4a8_omp.cpp"), "w") as f:
    f.write(src)
cpp_extension.load(name="ygg_omp", sources=[os.path.join(build, "w4a8_omp.cpp")],
                   extra_cflags=[f for f in CFLAGS if f != "-fopenmp"] + ["-fopenmp"], extra_ldflags=["-fopenmp"],
                   build_directory=build, is_python_module=False, verbose=False)
g = torch.Generator().manual_seed(0)
def blocks(N, K, bits):
    return Blocks(torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8), (torch.rand(N, K//32, generator=g)/64).half(), (torch.rand(N, K//32, generator=g)/64).half(), bits)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
L = []
for i, (N, K) in enumerate(shapes):
    b = blocks(N, K, 8 if i == len(shapes) - 1 else 4)
    c, d, m = pack_blocks(b)
    L.append((K, c, d, m))
xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
ops = {"main": lambda K, c, d, m: torch.ops.yggtree.w4a8_mm(xs[K], c, d, m),
       "openmp": lambda K, c, d, m: torch.ops.ygg_s6.w4a8_mm(xs[K], c, d, m)}
for l in L[:5] + L[-1:]:
    ref = ops["main"](*l)
    for k in ("openmp",):
        assert torch.equal(ref, ops[k](*l)), k
def body(op, ls): 
    return lambda: [op(*l) for l in ls]
fns = {}
for k, op in ops.items():
    fns[(k, "all")] = body(op, L)
    fns[(k, "head")] = body(op, L[-1:])
    fns[(k, "layers")] = body(op, L[:-1])
tr = time_rounds(fns, 3, 21)
mb_all = sum(l[1].numel() + l[2].numel()*4 for l in L) / 1e6
mb_head = L[-1][1].numel() / 1e6 + L[-1][2].numel() * 4 / 1e6
for key, v in tr.items():
    ms = statistics.median(v)
    mb = {"all": mb_all, "head": mb_head, "layers": mb_all - mb_head}[key[1]]
    print(f"T{T} M{M} {key[0]:8s} {key[1]:7s} {ms:7.2f} ms  {mb/ms:6.1f} GB/s")
