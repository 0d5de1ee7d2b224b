"""The objective on held-out prompts: each step's choice, prediction (online) and measurement.
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/catch_up/obj_trace.py profiles/epyc-2core-w4a8.yaml"""
import sys, torch, statistics
from yggtree.shapes import SamplingParams
from common import objective_setup
eng, pol, prompts = objective_setup(sys.argv[1])
params = SamplingParams(max_new_tokens=64)
recs = []
def on_step(rec): recs.append(rec)
for ids in prompts[:4]:
    n0 = len(pol.log); recs.clear()
    r = eng.generate(ids, params, policy=pol, on_step=on_step)
    log = pol.log[n0:]
    fb = pol.feedback
    print(f"--- prompt {len(ids)} tok: {r.stats['tpot_ms']:.2f} ms/token, AAL {(r.stats.get('accepted_tokens',0)+r.stats['verify_calls'])/r.stats['verify_calls']:.2f}; feedback machine {fb.machine:.2f} spec_extra {fb.spec_extra:.2f} width {{{', '.join(f'{k}: {v:.2f}' for k, v in sorted(fb._width.items()))}}} accept-scale d1..4 {[round(fb.accept_scale_at(d), 2) for d in range(1, 5)]}")
    line = []
    for p, rec in zip(log, recs):
        meas = sum(rec.stage_ms.values())
        line.append(f"D{p.draft_depth}w{p.verify_width} pred {p.aal_online:.2f}/{p.step_ms_online:.1f}ms(plain {p.plain_ms_online:.1f}) got {1+rec.n_accepted}/{meas:.1f}ms")
    print("\n".join(line[:40]))
