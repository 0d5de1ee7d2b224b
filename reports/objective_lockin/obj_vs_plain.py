"""The objective's predictions against the realised steps and against plain steps measured in the same process
(the 6 held-out prompts of ../catch_up/common.py, plain and objective interleaved per prompt).
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/objective_lockin/obj_vs_plain.py PLAN NEW [PASSES]"""
import sys, statistics as st, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "catch_up"))
from common import objective_setup
from yggtree.shapes import SamplingParams
from yggtree.runtime.policy import FixedPolicy, StepChoice
eng, pol, prompts = objective_setup(sys.argv[1])
new = int(sys.argv[2]); passes = int(sys.argv[3]) if len(sys.argv) > 3 else 2
params = SamplingParams(max_new_tokens=new)
plainp = FixedPolicy(StepChoice(0, 1), 1)
P, O, PS = [], [], {}  # plain steps (ms excl. resync), objective steps (pred, rec)
tok_ms = {"plain": [], "obj": []}
for rep in range(passes):
    for ids in prompts:
        recs = []
        r = eng.generate(ids, params, policy=plainp, on_step=recs.append)
        tok_ms["plain"].append((r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1))
        P += [sum(v for k, v in x.stage_ms.items()) for x in recs]
        for x in recs:
            for k, v in x.stage_ms.items(): PS[k] = PS.get(k, 0) + v
        recs = []; n0 = len(pol.log)
        r = eng.generate(ids, params, policy=pol, on_step=recs.append)
        tok_ms["obj"].append((r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1))
        O += list(zip(pol.log[n0:], recs))
ratio = [p / o for p, o in zip(tok_ms["plain"], tok_ms["obj"])]
print(f"ms/token plain {st.median(tok_ms['plain']):.3f} objective {st.median(tok_ms['obj']):.3f}; speed-up median {st.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}]")
print(f"plain steps (plain system): {len(P)}, mean {st.mean(P):.3f} ms, median {st.median(P):.3f}")
op = [(p, r) for p, r in O if p.draft_depth == 0]
od = [(p, r) for p, r in O if p.draft_depth > 0]
if op:
    print(f"objective plain steps {len(op)}: measured mean {st.mean(sum(r.stage_ms.values()) for p, r in op):.3f} ms; plain_ms_online mean {st.mean(p.plain_ms_online for p, r in op):.3f}")
print("  plain system stages/step:", {k: round(v / len(P), 3) for k, v in PS.items()})
if op:
    S = {}
    for p, r in op:
        for k, v in r.stage_ms.items(): S[k] = S.get(k, 0) + v / len(op)
    print("  objective plain step stages:", {k: round(v, 3) for k, v in S.items()})
if od:
    ex = lambda r: sum(v for k, v in r.stage_ms.items() if k != "resync")
    a_p = st.mean(p.aal_online for p, r in od); a_r = st.mean(1 + r.n_accepted for p, r in od)
    t_p = st.mean(p.step_ms_online for p, r in od); t_r = st.mean(ex(r) for p, r in od)
    pl = st.mean(p.plain_ms_online for p, r in od); rs = sum(r.stage_ms.get("resync", 0) for p, r in od)
    print(f"objective drafted steps {len(od)}: AAL pred {a_p:.3f} real {a_r:.3f}; step ms pred {t_p:.3f} real {t_r:.3f}; plain_ms_online {pl:.3f} vs plain system {st.mean(P):.3f}")
    print(f"  speed-up predicted {a_p*pl/t_p:.3f}; realised vs plain system (excl. resync) {a_r*st.mean(P)/t_r:.3f}; resync total {rs:.1f} ms = {rs/len(od):.3f} ms/drafted step")
    stages = {}
    for p, r in od:
        for k, v in r.stage_ms.items(): stages[k] = stages.get(k, 0) + v / len(od)
    print("  drafted step stages:", {k: round(v, 3) for k, v in stages.items()})
fb = pol.feedback
print("feedback: scales", {d: round(fb.global_scale_at(d), 3) for d in range(1, 5)}, "spec_extra", round(fb.spec_extra, 3), "machine", round(fb.machine, 3), "plan_ratio", round(getattr(fb, "plan_ratio", lambda: float("nan"))(), 3))
