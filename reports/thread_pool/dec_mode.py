"""Plain w4a8 decoding of 8 chat prompts x 64 in one of three modes, for process-alternated A/B (README.txt):
  omp    PLAN at 2 OpenMP threads (the shipped way)
  pool   PLAN (compiled with no OpenMP region of its own) at 1 OpenMP thread, the kernel library's loops on a spinning pool
         of YGG_POOL_THREADS (the variant library, make_variant.py, loaded before the real one; the eager LM head too)
usage: dec_mode.py MODE PLAN [ROUNDS]   -> ms/token (median over prompts and rounds), tokens' hash, phase probes"""
import ctypes, hashlib, os, statistics, sys, pathlib, time, torch
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[0])); sys.path.insert(0, str(here.parents[0] / "bw_phases"))
from torch.utils.cpp_extension import load_inline
mode, plan_path = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
if mode == "pool":
    from make_variant import build
    ctypes.CDLL(str(build()), mode=os.RTLD_GLOBAL)
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)
from ab import chat_prompts, decoder
from yggtree.bench import plan_runner
eng, tok, _ = plan_runner(plan_path)[2](False)
if mode == "pool":
    torch.ops.yggtree.w4a8_mm = torch.ops.yggpool.w4a8_mm  # the eager LM head's calls
pp_text = (here.parents[0] / "bw_phases/pingpong.py").read_text()
pp = load_inline("pingpong", cpp_sources=pp_text.split("r'''")[1].split("'''")[0], functions=["pingpong"], extra_cflags=["-O2"], extra_ldflags=["-lpthread"])
run = decoder(eng, 64)
prompts = chat_prompts(tok)
run(prompts[0])
ms, toks, phases = [], [], [pp.pingpong(20000)]
for r in range(rounds):
    for ids in prompts:
        t, ids_out = run(ids); ms.append(t); toks.append(ids_out)
    phases.append(pp.pingpong(20000))
h = hashlib.sha1(str(toks).encode()).hexdigest()[:10]
print(f"{mode} {statistics.median(ms):.3f} ms/token tokens {h} pingpong {' '.join(f'{p:.0f}' for p in phases)} ns", flush=True)
