"""The w4a8 speculative plan's held-out decodes (reports/spec_packages/stages.py's prompts and counting) with the kernel
loops on OpenMP and on the library's pool in one process: plain steps, the objective (a fresh policy per mode: its
feedback learns each mode's times) and fixed trees, systems interleaved per prompt, the second of two passes counted.
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/thread_pool/stages_ab.py PLAN N_PROMPTS NEW D,WD,WV..."""
import sys, torch
from dataclasses import replace
from yggtree.bench import plan_runner
from yggtree.runtime.build import fixed_policy
from yggtree.runtime.policy import FixedPolicy, StepChoice
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt

plan_path, n_prompts, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
trees = [tuple(int(x) for x in t.split(",")) for t in sys.argv[4:]]
torch.set_num_threads(2)
plan, info, make = plan_runner(plan_path)
eng, tok, pol = make()
base = eng.cfg
prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(30 + n_prompts, seed=7)[30:]]
params = SamplingParams(max_new_tokens=new)
systems = {}
for mode in ("openmp", "pool"):
    systems[f"plain/{mode}"] = (mode, FixedPolicy(StepChoice(0, 1), 1))
    systems[f"objective/{mode}"] = (mode, pol.fresh())
    for d, wd, wv in trees:
        systems[f"d{d}w{wd}v{wv}/{mode}"] = (mode, fixed_policy(eng, plan, draft_width=wd, verify_width=wv, draft_depth=d))
rows = {k: [] for k in systems}
for rep in range(2):
    for i, ids in enumerate(prompts):
        names = list(systems) if (i + rep) % 2 == 0 else list(reversed(list(systems)))
        for name in names:
            mode, p = systems[name]
            eng.cfg = replace(base, loop_pool=mode == "pool")
            r = eng.generate(ids, params, policy=p)
            if rep == 1:
                rows[name].append(r)
eng.cfg = base
plain_texts = [r.token_ids for r in rows["plain/openmp"]]
ms = {}
for name, rs in rows.items():
    ms[name] = (sum(r.stats["tpot_ms"] * (r.stats["new_tokens"] - 1) for r in rs) / sum(r.stats["new_tokens"] - 1 for r in rs),
                sum(r.stats["total_ms"] for r in rs) / sum(r.stats["new_tokens"] for r in rs))
    same = sum(r.token_ids == t for r, t in zip(rs, plain_texts))
    steps = sum(r.stats["verify_calls"] for r in rs)
    aal = sum(r.stats.get("accepted_tokens", 0) + r.stats["verify_calls"] for r in rs) / steps
    print(f"{name:18s} {ms[name][0]:.2f} ms/token (prefill included {ms[name][1]:.2f})  AAL {aal:.2f}  = plain/openmp {same}/{len(rs)}")
b = ms["plain/openmp"]
for name in rows:
    if name.endswith("/pool"):
        o = name.replace("/pool", "/openmp")
        print(f"{name:18s} x its OpenMP run {ms[o][0] / ms[name][0]:.3f}  x plain/openmp {b[0] / ms[name][0]:.3f} "
              f"(prefill included {b[1] / ms[name][1]:.3f})")
