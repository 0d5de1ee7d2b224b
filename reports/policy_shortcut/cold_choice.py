"""A plain step's choice (``ObjectivePolicy.choose_draft``) with and without the cached best tree
rate, hot (called back to back) and cold (after a 16 MB matrix product at 2 threads, as after a
verify), for a plan whose trees the feedback has priced out (its drafted steps' extra work taken
as 4x the profile's, so every step is plain). Median microseconds of 300 calls.

    python reports/policy_shortcut/cold_choice.py profiles/epyc-2core-w4a8.yaml
"""
import statistics
import sys
import time

import torch

from yggtree.plan import load_plan
from yggtree.runtime.objective import plan_policy

torch.set_num_threads(2)
fast = plan_policy(load_plan(sys.argv[1]))
full = plan_policy(load_plan(sys.argv[1]))
full._surely_plain = lambda ctx: False  # price every tree each step, as before the shortcut
for pol in (fast, full):
    pol.feedback.spec_extra = 4.0
a, b = torch.randn(2048, 2048), torch.randn(2048, 64)


def run(pol, cold: bool) -> float:
    xs = []
    for _ in range(300):
        if cold:
            a @ b
        t0 = time.perf_counter()
        pol.choose_draft(None, 224)
        xs.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(xs)


assert fast.plan_choice(224)[0].draft_depth == 0
for cold in (False, True):
    print(f"{'cold' if cold else 'hot '}: shortcut {run(fast, cold):6.1f} us, full pricing {run(full, cold):6.1f} us")
