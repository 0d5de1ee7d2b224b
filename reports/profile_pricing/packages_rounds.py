"""The w4a8 plan's verify steps on its compiled packages, timed as `yggtree profile --compiled`
times them (model_calls' thunks, time_rounds over every width of the plan with settle=1) and each
width on its own (repeated calls), at one context (issue #20).
    OMP_NUM_THREADS=2 python reports/profile_pricing/packages_rounds.py profiles/epyc-2core-w4a8.yaml 2 224"""
import statistics
import sys

import torch

from yggtree.offline.profile import model_calls
from yggtree.offline.timing import time_rounds
from yggtree.plan import artifact_dir, load_plan
from yggtree.runtime.build import build_plan_engine

threads, ctx = int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
plan = load_plan(sys.argv[1])
engine, _ = build_plan_engine(plan, artifact_dir(plan), threads=threads)
widths = sorted({1, *plan.verify_widths})
calls = [c for c in model_calls(engine, plan, widths, [ctx], set()) if c[0] == "verify"]
with torch.no_grad(), engine.graphs.frozen():
    rounds = time_rounds({c[1]: c[-1] for c in calls}, 3, 9, settle=1)
    alone = {c[1]: statistics.median(time_rounds({0: c[-1]}, 3, 9)[0]) for c in calls}
for w in widths:
    print(f"W={w:2d}: in rounds {statistics.median(rounds[w]):6.2f} ms, alone {alone[w]:6.2f} ms", flush=True)
