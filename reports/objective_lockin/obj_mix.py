"""The objective's choices on held-out prompts (passes x prompts x NEW): per (D, W_d, W_v) the steps, realised AAL,
measured ms, the speed-up planned before drafting and realised (vs the online plain time).
usage: [RPT=N|none] LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/objective_lockin/obj_mix.py PLAN NEW [PASSES]"""
import sys, collections, statistics as st
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "catch_up"))
from common import objective_setup
from yggtree.shapes import SamplingParams
eng, pol, prompts = objective_setup(sys.argv[1])
import os
if os.environ.get("RPT"):  # the feedback's per-request prior (pseudo-tokens; "none": no per-request learning)
    pol.feedback.request_prior_tokens = None if os.environ["RPT"] == "none" else float(os.environ["RPT"])
new = int(sys.argv[2]); passes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
planned = []
orig = pol.choose_draft
why = []
def cd(h, c):
    ch = orig(h, c); planned.append(getattr(pol, "_planned", 0.0))
    if ch.draft_depth == 0:
        b, s = pol.plan_choice(c, allow_plain=False)
        why.append((s, pol._behind, pol._remaining, pol.catch_up_ms(), pol.feedback.plan_ratio(), c, b))
    return ch
pol.choose_draft = cd
rows = collections.defaultdict(list)
for rep in range(passes):
    for ids in prompts:
        recs = []; n0 = len(pol.log); m0 = len(planned)
        eng.generate(ids, SamplingParams(max_new_tokens=new), policy=pol, on_step=recs.append)
        for p, rec, pl in zip(pol.log[n0:], recs, planned[m0:]):
            k = (rec.choice.draft_depth, rec.choice.draft_width if rec.choice.draft_depth else 0, rec.verify_width)
            ms = sum(v for kk, v in rec.stage_ms.items() if kk != "resync")
            rows[k].append((1 + rec.n_accepted, ms, pl, p.plain_ms_online, rec.stage_ms.get("resync", 0.0), p.aal_online, p.step_ms_online))
tot_tok = sum(r[0] for v in rows.values() for r in v); tot_ms = sum(r[1] + r[4] for v in rows.values() for r in v)
print(f"{tot_tok} tokens, {tot_ms / tot_tok:.3f} ms/token")
for k, v in sorted(rows.items(), key=lambda kv: -len(kv[1])):
    a = st.mean(r[0] for r in v); ms = st.mean(r[1] for r in v); pl = st.mean(r[3] for r in v)
    plan = [r[2] for r in v if r[2] > 0]
    print(f"D{k[0]} Wd{k[1]} Wv{k[2]}: {len(v):4d} steps AAL {a:.2f} (pred {st.mean(r[5] for r in v):.2f}) ms {ms:6.2f} (pred {st.mean(r[6] for r in v):6.2f}) "
          f"plain' {pl:.2f} realised x{a * pl / ms:.3f} planned x{st.mean(plan) if plan else float('nan'):.3f} resync {sum(r[4] for r in v):.0f} ms")
fb = pol.feedback
print("feedback: scales", {d: round(fb.global_scale_at(d), 3) for d in range(1, 7)}, "spec_extra", round(fb.spec_extra, 3), "machine", round(fb.machine, 3), "plan_ratio", round(fb.plan_ratio(), 3), "widths", {k: round(v, 3) for k, v in fb._width.items()})

if why:
    ss = [w[0] for w in why]
    print(f"at plain steps: best tree priced median x{st.median(ss):.3f}, >1 in {sum(x > 1 for x in ss)}/{len(ss)}; "
          f"of those >1: behind median {st.median([w[1] for w in why if w[0] > 1] or [0])}, catch-up ms median {st.median([w[3] for w in why if w[0] > 1] or [0]):.1f}")
    import collections as C
    print("priced x by decile of the step index:", [round(st.median(ss[i * len(ss) // 10:(i + 1) * len(ss) // 10] or [0]), 3) for i in range(10)])

    print("first 40 plain-step records (s, behind, remaining, catch-up ms, plan_ratio, ctx, best):")
    for w in why[:40]: print("  ", tuple(round(x, 3) if isinstance(x, float) else x for x in w))
