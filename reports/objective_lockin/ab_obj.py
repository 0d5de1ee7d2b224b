"""Objective variants beside plain steps and the fixed tree d3w1v4 in one process, systems interleaved per prompt (order
alternating), the 6 held-out prompts of ../catch_up/common.py, PASSES passes (each variant a fresh policy kept across
them). A variant is the feedback's per-request prior in pseudo-tokens, or "none" (no per-request learning).
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/objective_lockin/ab_obj.py PLAN NEW PASSES VARIANT..."""
import sys, statistics as st
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "catch_up"))
from common import objective_setup
from yggtree.shapes import SamplingParams
from yggtree.runtime.policy import FixedPolicy, StepChoice
from yggtree.runtime.build import fixed_policy
eng, pol, prompts = objective_setup(sys.argv[1])
new, passes, modes = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
systems = {"plain": FixedPolicy(StepChoice(0, 1), 1)}
for m in modes:
    systems[f"obj-rpt{m}"] = pol.fresh()
    systems[f"obj-rpt{m}"].feedback.request_prior_tokens = None if m == "none" else float(m)
systems["d3w1v4"] = FixedPolicy(StepChoice(3, 1), 4)
params = SamplingParams(max_new_tokens=new)
res = {k: [] for k in systems}
for rep in range(passes):
    for i, ids in enumerate(prompts):
        names = list(systems) if (i + rep) % 2 == 0 else list(reversed(systems))
        for name in names:
            r = eng.generate(ids, params, policy=systems[name])
            res[name].append(((r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1), r.token_ids, rep))
base = res["plain"]
for name, v in res.items():
    ratios = [b[0] / x[0] for b, x in zip(base, v)]
    same = sum(b[1] == x[1] for b, x in zip(base, v))
    last = [b[0] / x[0] for b, x in zip(base, v) if x[2] == passes - 1]
    print(f"{name:12s} {st.median(x[0] for x in v):6.3f} ms/token  x plain median {st.median(ratios):.3f} (last pass {st.median(last):.3f}; all passes sum "
          f"{sum(b[0] for b in base) / sum(x[0] for x in v):.3f})  same {same}/{len(v)}")
import collections
for name, p in systems.items():
    if hasattr(p, "log") and p.log:
        c = collections.Counter((x.draft_depth, x.verify_width) for x in p.log)
        fb = p.feedback
        print(f"{name}: steps by (D, W_v) {dict(c.most_common(6))}; plan_ratio {fb.plan_ratio():.3f} "
              f"scales {[round(fb.global_scale_at(d), 3) for d in range(1, 5)]}")
