"""Predicted (online) vs realised AAL and step time of the objective's drafted steps, held-out prompts (2 passes x 64).
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/catch_up/obj_bias.py profiles/epyc-2core-w4a8.yaml"""
import sys, torch, statistics
from yggtree.shapes import SamplingParams
from common import objective_setup
eng, pol, prompts = objective_setup(sys.argv[1])
params = SamplingParams(max_new_tokens=64)
rows, plain = [], []
for rep in range(2):
    for ids in prompts:
        recs = []; n0 = len(pol.log)
        eng.generate(ids, params, policy=pol, on_step=recs.append)
        for p, rec in zip(pol.log[n0:], recs):
            if not p.draft_depth:
                plain.append((p.plain_ms_online, sum(v for k, v in rec.stage_ms.items() if k != "resync")))
            if p.draft_depth:
                st = {k: v for k, v in rec.stage_ms.items() if k != "resync"}
                rows.append((p.aal_online, 1 + rec.n_accepted, p.step_ms_online, sum(st.values()), p.plain_ms_online, p.aal, rec.choice.draft_depth, rec.verify_width))
print("drafted steps", len(rows))
if rows:
    m = lambda i: statistics.mean(r[i] for r in rows)
    print(f"AAL predicted online {m(0):.3f} (offline {m(5):.3f}) realised {m(1):.3f}; step ms predicted {m(2):.2f} measured {m(3):.2f}; plain predicted {m(4):.2f}")
    print(f"predicted speed-up (mean of a*plain/t) {statistics.mean(r[0]*r[4]/r[2] for r in rows):.3f}; realised {m(1)*m(4)/m(3):.3f}")
    if plain:
        print(f"plain steps {len(plain)}: predicted {statistics.mean(x[0] for x in plain):.2f} ms, measured {statistics.mean(x[1] for x in plain):.2f} (median {statistics.median(x[1] for x in plain):.2f})")
        print(f"realised speed-up against the measured plain steps {m(1)*statistics.mean(x[1] for x in plain)/m(3):.3f}")
    fb = pol.feedback
    print("feedback: accept scale by depth", {d: round(fb.global_scale_at(d), 3) for d in range(1, 5)}, "spec_extra", round(fb.spec_extra, 3), "machine", round(fb.machine, 3), "catch_up", fb.catch_up)
