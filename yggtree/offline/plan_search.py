"""The plan search: each execution plan's step latency per tree shape, predicted
from a profile's stage forms (:mod:`yggtree.offline.profile_stages`), and the best plan.

Candidates: ``sequential@T`` and ``ahead@T`` for every T the profile measured, ``overlap@T+D`` for
every overlapped split it measured (a profile without ``stage_forms`` has no candidates: the
plan keeps its own ``stages``). For a shape (D, W_d, W_v), with the times of split T::

    sequential@T   head + c(D) draft(W_d) + verify(W_v) + other stages
    ahead@T        c(D) draft(W_d) + verify(W_v) + ahead(W_v) + other stages   (head picked up)
    overlap@T+D    max(verify', job'(D)) + sync + other stages + (1 - h) (head + c(D) draft(W_d))

``c(D)`` is D or D - 1 drafter steps (``feeds_leaves``); ``verify'`` and ``job'`` are the pair's
times measured overlapped (contention included), the job scaled from D_max to D by its calls;
``sync`` is the pair's wall time beyond its slower side; ``h`` the chance that the worker's guess
is the accepted path (then the next step's head and draft are already done). ``h`` comes from
the pair's calibration (:func:`hit_rate`); without one it is 0 and an overlap plan never wins.
Times are the profile's at its stage-forms context; the other stages' are the cost model's.
Everything here is a pure function of its arguments.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.schedule import split_name


def candidates(forms: dict | None) -> list[str]:
    """The plan labels ``forms`` has data for (empty without stage forms)."""
    if not isinstance(forms, dict) or not isinstance(forms.get("splits"), dict):
        return []
    out = []
    for split, rec in forms["splits"].items():
        if "+" in split and "pair" in rec and str(rec["threads"]) in forms["splits"]:
            out.append(f"overlap@{split}")
        elif "+" not in split:
            out += [f"sequential@{split}"] + ([f"ahead@{split}"] if "ahead_ms" in rec else [])
    return out


def calls(d: int, feeds_leaves: bool) -> int:
    return d if feeds_leaves else d - 1


def hit_rate(aal: dict | None, verify_widths, d: int, wd: int, wv: int) -> float:
    """A crude chance that the guessed path is the accepted one, from a calibration's measured
    AAL table (``aal[W_d][D - 1][column of W_v]``): P(accepted length >= D) = AAL(D) - AAL(D - 1)
    times P(the drafter's top-1 is the bonus) ~ AAL of a one-deep chain verifying 2 nodes - 1.
    0 without a table."""
    try:
        col = list(verify_widths).index(wv)
        rows = aal[str(wd)]
        upto = rows[d - 1][col] - (rows[d - 2][col] if d > 1 else 1.0)
        first = aal[str(min(int(k) for k in aal))][0]
        top1 = first[list(verify_widths).index(min(w for w in verify_widths if w > 1))] - 1.0
    except (KeyError, ValueError, IndexError, TypeError):
        return 0.0
    return float(min(max(upto, 0.0), 1.0) * min(max(top1, 0.0), 1.0))


def predict_ms(label: str, forms: dict, shape: tuple[int, int, int], other_ms: float, hit: float,
               feeds_leaves: bool) -> float:
    """Predicted wall time of one step of ``shape`` (D, W_d, W_v) under plan ``label``."""
    name, t, dt = split_name(label)
    d, wd, wv = shape
    seq = forms["splits"][str(t)]
    c = calls(d, feeds_leaves)
    drafting = seq["head_ms"] + c * seq["draft_ms"][str(wd)]
    if name == "sequential":
        return drafting + seq["verify_ms"][str(wv)] + other_ms
    if name == "ahead":
        return c * seq["draft_ms"][str(wd)] + seq["verify_ms"][str(wv)] + seq["ahead_ms"][str(wv)] + other_ms
    pair = forms["splits"][f"{t}+{dt}"]["pair"][f"{wv},{wd}"]
    d_max = int(forms["d_max"])
    job = pair["spec_ms"] * (2 + c) / (2 + calls(d_max, feeds_leaves))
    sync = max(pair["wall_ms"] - max(pair["verify_ms"], pair["spec_ms"]), 0.0)
    return max(pair["verify_ms"], job) + sync + other_ms + (1.0 - hit) * drafting


def search(forms: dict | None, shapes: list[tuple[int, int, int]], other_ms, hit, feeds_leaves: bool
           ) -> dict | None:
    """Every candidate's predicted step latency per shape, the best per shape and the plan with the
    lowest mean over ``shapes`` (``other_ms(shape)``, ``hit(shape)``: the other stages' ms and the
    guess's hit rate). None when ``forms`` has no candidates."""
    labels = candidates(forms)
    if not labels or not shapes:
        return None
    rows = []
    for shape in shapes:
        pred = {lab: round(predict_ms(lab, forms, shape, other_ms(shape), hit(shape), feeds_leaves), 4)
                for lab in labels}
        rows.append({"shape": list(shape), "hit_rate": round(hit(shape), 4), "predicted_ms": pred,
                     "best": min(labels, key=pred.__getitem__)})
    mean = {lab: round(sum(r["predicted_ms"][lab] for r in rows) / len(rows), 4) for lab in labels}
    return {"candidates": labels, "chosen": min(labels, key=mean.__getitem__), "mean_ms": mean,
            "per_shape": rows, "context": forms.get("context")}


def plan_shapes(plan) -> list[tuple[int, int, int]]:
    """The tree shapes (D, W_d, W_v) ``plan`` compiles: every D <= D_max, W_d and W_v that fits."""
    return [(d, wd, wv) for d in range(1, plan.d_max + 1) for wd in plan.draft_widths
            for wv in plan.verify_widths if wv <= 1 + d * wd]


def search_plan(plan) -> dict | None:
    """:func:`search` over ``plan``'s shapes from its profile's stage forms and its calibration's
    AAL table (None: no profile, no drafter, or a profile without stage forms, such as one made
    before they existed). The profile's device is not checked here: a run checks it."""
    if plan.profile is None or not plan.speculative:
        return None
    import json
    from dataclasses import replace

    from ..runtime.prepare import drafter_feeds_leaves
    from ..runtime.calibration import Calibration
    from ..runtime.cost import CostModel

    try:
        prof = json.loads(Path(plan.profile).read_text())
    except (OSError, ValueError):
        return None
    forms = prof.get("stage_forms") if isinstance(prof, dict) else None
    if not candidates(forms):
        return None
    cost = replace(CostModel.from_profile_dict(prof, f"profile {plan.profile}"),
                   feeds_leaves=drafter_feeds_leaves(plan))
    calib = Calibration.load(plan.calibration, plan) if plan.calibration else None
    aal, cols = (calib.aal, calib.verify_widths) if calib is not None else (None, ())
    return search(forms, plan_shapes(plan), lambda s: cost.overhead_ms(*s),
                  lambda s: hit_rate(aal, cols, *s), cost.feeds_leaves)
