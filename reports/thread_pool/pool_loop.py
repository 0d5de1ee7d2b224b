"""The 120 layer products (+ optionally 4 merged ones) back to back from C++: at::parallel_for (libgomp) against a minimal
spinning pool, same tile code (copied from csrc/w4a8.cpp), cold weights in one huge-page arena, rounds alternated, with the
host-phase probes (sum GB/s, ping-pong ns). usage: pool_loop.py THREADS ROUNDS SPIN_US"""
import os, sys, pathlib, torch
from torch.utils.cpp_extension import load_inline
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[0] / "w4a8_stream")); sys.path.insert(0, str(here.parents[0] / "bw_phases"))
from common import arena_model, SHAPES
from yggtree.runtime.w4a8 import pack_blocks
from yggtree.runtime.kernels import CFLAGS
T, ROUNDS, SPIN = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(T)
kern = (here.parents[1] / "yggtree/runtime/csrc/w4a8.cpp").read_text()
head = kern[: kern.index("template <int BITS>\nvoid run(")]
head = "\n".join(l for l in head.splitlines() if "aoti_torch" not in l and "torch/library.h" not in l)
src = "#include <torch/extension.h>\n" + head + "\n}  // namespace\n" + (here / "pool_src.cpp").read_text()
m = load_inline("pool_exp", cpp_sources=src, functions=["loop", "one", "pool_start", "pool_stop"],
                extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"])
from probe import sum_gbps
pp_text = (here.parents[0] / "bw_phases/pingpong.py").read_text()
pp = load_inline("pingpong", cpp_sources=pp_text.split("r'''")[1].split("'''")[0], functions=["pingpong"], extra_cflags=["-O2"], extra_ldflags=["-lpthread"])
g = torch.Generator().manual_seed(1)
L, nbytes = arena_model(g, SHAPES[:-1], pack=lambda b: (pack_blocks(b),))
merged, _ = arena_model(g, [(960 * 30, 576, 4), (576 * 30, 576, 4), (3072 * 30, 576, 4), (576 * 30, 1536, 4)], pack=lambda b: (pack_blocks(b),))
xs = {K: torch.randn(1, K) for K in (576, 1536)}
m.pool_start(T, SPIN)
for K, w in L[:4]:
    assert torch.equal(m.one(xs[K], w, True), m.one(xs[K], w, False))
for rnd in range(ROUNDS):
    import time; time.sleep(float(os.environ.get('PAUSE', '0')))
    bw = sum_gbps(); ns = pp.pingpong(20000)
    torch.set_num_threads(T); a = m.loop([xs[K] for K, _ in L], [w for _, w in L], 10, False)
    c = m.loop([xs[K] for K, _ in merged], [w for _, w in merged], 10, False)
    if os.environ.get("OMP1"): torch.set_num_threads(1); import time; time.sleep(0.05)
    b = m.loop([xs[K] for K, _ in L], [w for _, w in L], 10, True)
    print(f"T{T} sum {bw:.0f} GB/s pp {ns:.0f} ns | 120 omp {a*1e3:.3f} ms {nbytes/a/1e9:.1f} GB/s | 120 pool {b*1e3:.3f} ms {nbytes/b/1e9:.1f} GB/s"
          f" | 4 merged omp {c*1e3:.3f} ms {nbytes/c/1e9:.1f} | pool/omp {a/b:.3f}x", flush=True)
m.pool_stop()
