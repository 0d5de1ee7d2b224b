"""At each plain step of the objective (3 held-out prompts x 256 tokens): the best tree's predicted speed-up and the feedback's scales.
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/catch_up/obj_why.py profiles/epyc-2core-w4a8.yaml"""
import sys, torch, collections, statistics
from yggtree.shapes import SamplingParams
from common import objective_setup
eng, pol, prompts = objective_setup(sys.argv[1])
params = SamplingParams(max_new_tokens=256)
orig = pol.choose_draft
seen = []
def choose_draft(h, committed):
    c = orig(h, committed)
    if c.draft_depth == 0:
        best, s = pol.plan_choice(committed, allow_plain=False)
        seen.append((s, pol._behind, pol._remaining, pol.catch_up_ms(), pol._plain_run))
    return c
pol.choose_draft = choose_draft
for ids in prompts[:3]:
    eng.generate(ids, params, policy=pol)
ss = [x[0] for x in seen] or [float("nan")]  # a run may take no plain step
print("plain steps", len(seen), "best tree speed-up predicted at them: median", round(statistics.median(ss), 3), "max", round(max(ss), 3), "share > 1:", round(sum(s > 1 for s in ss) / len(ss), 3))
gated = [x for x in seen if x[0] > 1]
if gated: print("of those > 1: catch-up ms median", round(statistics.median(x[3] for x in gated), 1), "behind median", statistics.median(x[1] for x in gated), "remaining median", statistics.median(x[2] for x in gated))
fb = pol.feedback
print("feedback: scales d1..4", [round(fb.accept_scale_at(d), 3) for d in range(1, 5)], "spec_extra", round(fb.spec_extra, 3), "machine", round(fb.machine, 3), "widths", {k: round(v, 3) for k, v in fb._width.items()})
