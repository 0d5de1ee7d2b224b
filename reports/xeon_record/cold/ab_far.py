"""The second-level prefetch in the shipped integration: one compiled plain plan (its engine as `yggtree run --plan PLAN
--no-speculate` builds it, the setting from its manifest), its decoding at a first-level-only setting (A: NEAR bytes
ahead, no far; the last session's measured distance) against the manifest's setting (B) in one process, paired by
prompt (reports/ab.py: 8 chat prompts of our own, ROUNDS rounds alternating A and B), tokens compared in every pair.
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/xeon_record/cold/ab_far.py COMPILE_ROOT ROUNDS NEW_TOKENS PLAN:NEAR..."""
import sys, pathlib, torch
from dataclasses import replace
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[1]))
from ab import chat_prompts, decoder, paired
from yggtree.bench import plan_runner
root, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
for arg in sys.argv[4:]:
    plan_path, near = arg.rsplit(":", 1)
    eng, tok, _ = plan_runner(plan_path, compile_root=root)[2](False)
    base = eng.cfg
    dec = decoder(eng, n)

    def at(setting):
        def run(ids):
            eng.cfg = replace(base, prefetch=setting)
            return dec(ids)
        return run

    r = paired(at((int(near), 0)), at(base.prefetch), chat_prompts(tok), rounds)
    print(f"{pathlib.Path(plan_path).stem}: ({near}, 0) {r['a_ms']:.3f} ms/token, measured {base.prefetch}: {r['b_ms']:.3f}, "
          f"speed-up {1 / r['speedup']:.3f} [{1 / r['max']:.3f}, {1 / r['min']:.3f}], same tokens {r['same']}/{r['pairs']}",
          flush=True)
    del eng
