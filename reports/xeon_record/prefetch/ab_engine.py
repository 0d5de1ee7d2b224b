"""The measured prefetch distance in the shipped integration: one compiled plain plan (its engine as `yggtree run --plan
PLAN --no-speculate` builds it, the distance from its manifest), its decoding at the library's default distance (A,
1024) against the measured one (B) in one process, paired by prompt (reports/ab.py: 8 chat prompts of our own, ROUNDS
rounds alternating A and B), tokens compared in every pair.
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/xeon_record/prefetch/ab_engine.py COMPILE_ROOT ROUNDS NEW_TOKENS PLAN..."""
import sys, pathlib, torch
from dataclasses import replace
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[1]))
from ab import chat_prompts, decoder, paired
from yggtree.bench import plan_runner
root, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
for plan_path in sys.argv[4:]:
    eng, tok, _ = plan_runner(plan_path, compile_root=root)[2](False)
    base = eng.cfg
    dec = decoder(eng, n)

    def at(distance):
        def run(ids):
            eng.cfg = replace(base, prefetch=distance)
            return dec(ids)
        return run

    r = paired(at(1024), at(base.prefetch), chat_prompts(tok), rounds)
    print(f"{pathlib.Path(plan_path).stem}: 1024 {r['a_ms']:.3f} ms/token, measured {base.prefetch}: {r['b_ms']:.3f}, "
          f"speed-up {1 / r['speedup']:.3f} [{1 / r['max']:.3f}, {1 / r['min']:.3f}], same tokens {r['same']}/{r['pairs']}",
          flush=True)
    del eng
