"""Why `yggtree profile` priced steps ~2x too high: a one-row verify step timed in rounds over a
few shapes, over the profile's whole grid (14 widths x 3 context buckets of one step function),
and over the whole grid with each timed call right after an untimed one of its own shape
(time_rounds settle=1, what the profile does now).

    OMP_NUM_THREADS=2 python reports/profile_pricing/grid_rounds.py profiles/epyc-2core-w4a8.yaml 2
"""
import statistics
import sys

import torch

from yggtree.offline.profile import grid_contexts, grid_widths, model_calls
from yggtree.offline.timing import time_rounds
from yggtree.plan import load_plan
from yggtree.runtime.build import EngineSpec, build_engine, plan_slots
from yggtree.runtime.graphs import context_buckets, inductor_cache

threads = int(sys.argv[2])
torch.set_num_threads(threads)
plan = load_plan(sys.argv[1])
widths = grid_widths(plan, 128)
contexts = grid_contexts(context_buckets(plan_slots(plan)), plan.max_context, max(widths))
with inductor_cache("compile/_inductor-profile"):  # the profile's graph cache
    engine, _ = build_engine(EngineSpec.from_plan(plan, "performance", min_rows=1))
    engine.graphs.warm_up(widths, engine.drafter.target_layers)


def timed(ws, cs, settle):
    calls = [c for c in model_calls(engine, plan, ws, cs, set()) if c[0] == "verify"]
    with torch.no_grad(), engine.graphs.frozen():
        times = time_rounds({i: c[-1] for i, c in enumerate(calls)}, 2, 9, settle=settle)
    return {(w, ctx): statistics.median(times[i]) for i, (_, w, ctx, _, _) in enumerate(calls)}


for label, ws, cs, settle in (("3 shapes", [1, 4, 8], contexts[:1], 0),
                              (f"grid of {len(widths) * len(contexts)} shapes", widths, contexts, 0),
                              ("grid, settle=1", widths, contexts, 1)):
    t = timed(ws, cs, settle)
    print(f"{label:24s}" + "  ".join(f"W={w}: {t[w, contexts[0]]:6.2f} ms" for w in (1, 4, 8)), flush=True)
