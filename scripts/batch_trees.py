#!/usr/bin/env python
"""Where batch-aware trees switch toward plain steps: the joint choice of a plan's objective for
B identical requests at a context (runtime/batch_objective.py), from the plan's profile and
calibration, no model loaded.

For every B of ``--batches`` and context of ``--contexts`` it prints the tree every request gets
((D, W_d, W_v); all requests alike get one choice here up to ties), the verify call's rows and
the predicted tokens per ms against all-plain steps. The last line is JSON.

    python scripts/batch_trees.py --plan profiles/epyc-2core.yaml --batches 1,2,4,8 --contexts 256,768
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from yggtree.errors import YggError, run_reporting


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="a plan with a profile and a calibration")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="256,768")
    ap.add_argument("--any-device", action="store_true",
                    help="read the plan's profile even where it was measured on another machine (its curves, "
                         "not this machine's: an analysis of that machine)")
    return ap.parse_args()


def objective(plan_path: str, any_device: bool):
    """The plan's :class:`BatchObjective` (its profile checked against this machine unless ``any_device``)."""
    from dataclasses import replace

    from yggtree.plan import load_plan
    from yggtree.runtime.artifacts import read_artifact
    from yggtree.runtime.batch_objective import BatchObjective
    from yggtree.runtime.calibration import Calibration
    from yggtree.runtime.cost import PROFILE_KIND, CostModel
    from yggtree.runtime.objective import plan_policy
    from yggtree.runtime.prepare import drafter_feeds_leaves

    plan = load_plan(plan_path)
    if plan.profile is None or plan.calibration is None:
        raise YggError(f"plan {plan_path} names no profile and calibration: nothing to choose")
    if not any_device:
        return BatchObjective.of(plan_policy(plan, feedback=False))
    cost = CostModel.from_profile_dict(read_artifact(plan.profile, "profile", PROFILE_KIND), str(plan.profile))
    cost = replace(cost, feeds_leaves=drafter_feeds_leaves(plan))
    return BatchObjective(cost, Calibration.load(plan.calibration, plan), tuple(plan.draft_widths),
                          tuple(plan.verify_widths), plan.d_max)


def verify_ms(cost, ctx: int, rows: int) -> float:
    return cost.t_verify(rows, ctx)


def run(args: argparse.Namespace) -> int:
    from yggtree.runtime.batch import batch_bucket
    from yggtree.runtime.batch_objective import joint_choice, plain_menu, rate

    try:
        batches = [int(b) for b in args.batches.split(",")]
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise YggError("--batches and --contexts take comma-separated integers") from None
    obj = objective(args.plan, args.any_device)
    rows = []
    for ctx in contexts:
        for b in batches:
            menu = obj.menu(ctx)
            n_rows = batch_bucket(b, max(batches))
            verify = functools.partial(verify_ms, obj.cost, ctx)
            picks, best = joint_choice([menu] * b, verify, n_rows)
            plain = rate([plain_menu(menu.own_ms[0])] * b, [0] * b, verify, n_rows)
            choices = [menu.choices[p] for p in picks]
            rows.append({"context": ctx, "batch": b, "choices": choices,
                         "verify_rows": n_rows * max(c[2] for c in choices),
                         "tokens_per_ms": round(best, 4), "vs_plain": round(best / plain, 3)})
            print(f"ctx {ctx:5}  B={b:2}  trees {sorted(set(choices))}  verify rows {rows[-1]['verify_rows']:4}  "
                  f"{best:.4f} tok/ms  x{best / plain:.3f} vs plain", flush=True)
    print(json.dumps({"plan": args.plan, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(run_reporting("batch_trees", run, parse_args()))
