"""The w4a8 plan's objective on the 6 held-out prompts of stages.py: the (D, W_v) of every step of
each prompt (second pass) and the feedback state after it.

    OMP_NUM_THREADS=2 python reports/attention_spec/objective_choices.py profiles/epyc-2core-w4a8.yaml
"""
import sys, collections, statistics, torch
from yggtree.bench import plan_runner
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make()
prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(36, seed=7)[30:]]
params = SamplingParams(max_new_tokens=64)
for rep in range(2):
    for ids in prompts:
        n0 = len(pol.log)
        recs = []
        r = eng.generate(ids, params, policy=pol, on_step=recs.append)
        if rep == 1:
            log = pol.log[n0:]
            kinds = collections.Counter((p.draft_depth, p.verify_width) for p in log)
            fb = pol.feedback
            print(len(r.token_ids), dict(kinds), "spec_extra %.2f machine %.2f w1 %.2f w4 %.2f scales %s" % (
                fb.spec_extra, fb.machine, fb.width_factor(1), fb.width_factor(4),
                [round(fb.accept_scale_at(d), 2) for d in (1, 2, 3)]), "probe_gap", pol._probe_gap, "probe_cost", pol._probe_cost, flush=True)
