"""In one process, the same compiled plan (PLAN: no OpenMP region of its own, e.g. reports/serial_small_kernels/chunk.yaml)
with the kernel library's loops on OpenMP at 2 threads (A) against the spinning pool of 2 threads, OpenMP at 1 (B); the
variant library (make_variant.py) serves both (its loops switch at run time), paired by prompt (reports/ab.py).
usage: ab_pool.py PLAN [ROUNDS] [NEW_TOKENS]"""
import ctypes, os, sys, pathlib, torch
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[0])); sys.path.insert(0, str(here.parents[0] / "bw_phases"))
from torch.utils.cpp_extension import load_inline
from make_variant import build
lib = ctypes.CDLL(str(build()), mode=os.RTLD_GLOBAL)
from ab import chat_prompts, decoder, paired
from yggtree.bench import plan_runner
plan_path = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3; n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
torch.set_num_threads(2)
eng, tok, _ = plan_runner(plan_path)[2](False)
torch.ops.yggtree.w4a8_mm = torch.ops.yggpool.w4a8_mm  # the eager LM head on the variant too
pp_text = (here.parents[0] / "bw_phases/pingpong.py").read_text()
pp = load_inline("pingpong", cpp_sources=pp_text.split("r'''")[1].split("'''")[0], functions=["pingpong"], extra_cflags=["-O2"], extra_ldflags=["-lpthread"])
dec = decoder(eng, n)
def omp(ids):
    lib.ygg_pool_enable(0); eng.plan_threads = lambda plan: 2
    return dec(ids)
def pool(ids):
    lib.ygg_pool_enable(1); eng.plan_threads = lambda plan: 1
    try:
        return dec(ids)
    finally:
        lib.ygg_pool_enable(0)
p0 = pp.pingpong(20000)
r = paired(omp, pool, chat_prompts(tok), rounds)
p1 = pp.pingpong(20000)
print(f"omp {r['a_ms']:.3f} ms/token  pool {r['b_ms']:.3f}  pool speed-up {1/r['speedup']:.3f} [{1/r['max']:.3f}, {1/r['min']:.3f}]"
      f"  same {r['same']}/{r['pairs']}  pingpong {p0:.0f} {p1:.0f} ns", flush=True)
