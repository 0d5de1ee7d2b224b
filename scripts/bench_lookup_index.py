#!/usr/bin/env python
"""Per-step cost of the lookup source (issue 22): one emitted token added to the index plus one
proposal (``--budget`` nodes, chains ``--depth`` deep), at several context lengths, on real text
(calibration corpus chunks tokenized with the embedded model's tokenizer, joined to the length).

Median and p90 over ``--steps`` consecutive steps per context, next to one plain decode step of
the target: the plan's profile (``CostModel.plain_ms``, measured on the profiled machine; contexts
past the profile's largest bucket use its largest) and, with ``--measure-plain``, a plain step
timed here (width 1 through the engine's graph at that context).

    OMP_NUM_THREADS=1 python scripts/bench_lookup_index.py --plan PLAN.yaml
"""

from __future__ import annotations

import argparse
import json
import time


def text_tokens(tok, n: int) -> list[int]:
    from yggtree.data import calibration_corpus

    ids: list[int] = []
    for chunk in calibration_corpus(None, 0).chunks:
        ids += tok.encode(chunk.text if hasattr(chunk, "text") else str(chunk))
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the calibration corpus has fewer than {n} tokens")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True, help="a plan tuned for this machine (profiles/*.yaml)")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    args = ap.parse_args(argv)

    import numpy as np

    from yggtree.plan import load_plan
    from yggtree.runtime.loading import load_tokenizer, resolve_model
    from yggtree.runtime.lookup import LookupCalibration, LookupIndex, propose
    from yggtree.runtime.cost import CostModel

    plan = load_plan(args.plan)
    cost = CostModel.from_profile(plan.profile, plan) if plan.profile else None
    tok = load_tokenizer(resolve_model(plan.target))
    ctxs = [int(x) for x in args.contexts.split(",")]
    ids = text_tokens(tok, max(ctxs) + args.steps)
    calib = LookupCalibration.load()
    out = []
    for ctx in ctxs:
        idx = LookupIndex()
        t = time.perf_counter()
        idx.extend(ids[:ctx])
        build_ms = (time.perf_counter() - t) * 1e3
        times, found = [], 0
        for i in range(ctx, ctx + args.steps):
            t = time.perf_counter()
            idx.extend(ids[i : i + 1])
            prop = propose(idx, calib, args.budget, args.depth)
            times.append((time.perf_counter() - t) * 1e3)
            found += len(prop) > 0
        med, p90 = float(np.median(times)), float(np.percentile(times, 90))
        plain = cost.plain_ms(ctx) if cost is not None else float("nan")
        row = {"context": ctx, "median_ms": round(med, 4), "p90_ms": round(p90, 4),
               "plain_step_ms_profile": round(plain, 2), "median_share": round(med / plain, 5),
               "p90_share": round(p90 / plain, 5), "steps_with_candidates": found / args.steps,
               "prompt_index_build_ms": round(build_ms, 2)}
        out.append(row)
        print(f"context {ctx:5d}: per step median {med * 1e3:.0f} us, p90 {p90 * 1e3:.0f} us = "
              f"{100 * med / plain:.2f}% / {100 * p90 / plain:.2f}% of a plain step ({plain:.1f} ms, profile); "
              f"candidates at {100 * found / args.steps:.0f}% of steps; indexing the prompt {build_ms:.1f} ms")
    print(json.dumps({"command": "bench_lookup_index", "budget": args.budget, "depth": args.depth,
                      "steps": args.steps, "rows": out}))
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("bench_lookup_index", lambda _: main(), None))
