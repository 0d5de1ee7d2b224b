"""A/B of w4a8 kernel variants over the default model's 121 products (random uncached weights):
the shipped op (yggtree::w4a8_mm) against scratch.cpp (the kernel as shipped since 0b3468b: built
with OpenMP, scratch buffers) and inter.cpp (the same with d and m inline after each block's codes),
outputs checked bitwise equal. Run from the repository root at 0b3468b~1 (whose shipped kernel was
built without OpenMP) to get the A/B of docs/results.md:
    OMP_NUM_THREADS=T python reports/formats_w4a8_omp/kernel_ab/ab.py T 1"""
import os, tempfile
import sys, statistics, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.w4a8 import load_kernel, pack_blocks, Blocks, CFLAGS
from yggtree.offline.timing import time_rounds
T, M = int(sys.argv[1]), int(sys.argv[2]); torch.set_num_threads(T)
load_kernel()
here = os.path.dirname(os.path.abspath(__file__))
for name in ("scratch", "inter"):
    build = os.path.join(tempfile.gettempdir(), f"ygg_kernel_ab_{name}")
    os.makedirs(build, exist_ok=True)
    cpp_extension.load(name=f"ygg_{name}", sources=[os.path.join(here, f"{name}.cpp")],
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
    t_, nb = c.shape[:2]
    inter = torch.cat([c, d.view(torch.uint8).view(t_, nb, 32), m.view(torch.uint8).view(t_, nb, 32)], 2).contiguous()
    L.append((K, c, d, m, inter))
xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
ops = {"main": lambda K, c, d, m, i: torch.ops.yggtree.w4a8_mm(xs[K], c, d, m),
       "scratch": lambda K, c, d, m, i: torch.ops.ygg_s6.w4a8_mm(xs[K], c, d, m),
       "inter": lambda K, c, d, m, i: torch.ops.ygg_s6i.w4a8_mm(xs[K], i, d, m)}
for l in L[:5] + L[-1:]:
    ref = ops["main"](*l)
    for k in ("scratch", "inter"):
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
