"""The shipped integration: one compiled plan (PLAN, compiled by `yggtree compile` at this commit: packages with serial
inductor loops, the manifest's `loops` measured), its plain decoding with the kernel loops on OpenMP (A) against the
library's pool (B) in one process, paired by prompt (reports/ab.py: 8 chat prompts of our own), with the phase probe.
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/thread_pool/ab_engine.py PLAN [ROUNDS] [NEW_TOKENS] [COMPILE_ROOT]"""
import sys, pathlib, torch
from dataclasses import replace
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[0]))
from torch.utils.cpp_extension import load_inline
from ab import chat_prompts, decoder, paired
from yggtree.bench import plan_runner
plan_path = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3; n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
root = sys.argv[4] if len(sys.argv) > 4 else "compile"
torch.set_num_threads(2)
eng, tok, _ = plan_runner(plan_path, compile_root=root)[2](False)
base = eng.cfg
pp_text = (here.parents[0] / "bw_phases/pingpong.py").read_text()
pp = load_inline("pingpong", cpp_sources=pp_text.split("r'''")[1].split("'''")[0], functions=["pingpong"], extra_cflags=["-O2"], extra_ldflags=["-lpthread"])
dec = decoder(eng, n)
def on(pool):
    def run(ids):
        eng.cfg = replace(base, loop_pool=pool)
        return dec(ids)
    return run
p0 = pp.pingpong(20000)
r = paired(on(False), on(True), chat_prompts(tok), rounds)
p1 = pp.pingpong(20000)
print(f"manifest loop_pool {base.loop_pool} | openmp {r['a_ms']:.3f} ms/token  pool {r['b_ms']:.3f}  pool speed-up "
      f"{1 / r['speedup']:.3f} [{1 / r['max']:.3f}, {1 / r['min']:.3f}]  same {r['same']}/{r['pairs']}  pingpong {p0:.0f} {p1:.0f} ns", flush=True)
