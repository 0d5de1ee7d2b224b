"""Reports of a ``yggtree tune`` study: rows per trial, the Pareto front, a rich table of the
best trials and optuna's matplotlib plots (optimisation history, parameter importances, Pareto
front) written as PNGs next to the tuned plan."""

from __future__ import annotations

import warnings
from pathlib import Path

from ..files import atomic_path


def trial_rows(study) -> list[dict]:
    """One plain dict per finished trial (complete or pruned): number, state, the plan fields,
    predicted and measured tokens/s, graphs (compiled, else estimated), compile seconds and
    artifact bytes."""
    from optuna.trial import TrialState

    rows = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        a = t.user_attrs
        rows.append({
            "number": t.number,
            "state": t.state.name.lower(),
            "fields": a.get("fields"),
            "predicted_tps": a.get("predicted_tps"),
            "measured_tps": t.value if t.state == TrialState.COMPLETE else a.get("measured_tps"),
            "shapes": a.get("shapes"),  # estimated before compiling
            "graphs": a.get("graphs", a.get("shapes")),  # compiled when the trial was compiled
            "compile_s": a.get("compile_s"),
            "size_bytes": a.get("size_bytes"),
            "aal": a.get("aal"),
            "infeasible": bool(a.get("infeasible")),
            "unpriced": a.get("unpriced"),  # no prediction: the profile did not measure its weights
            "why": a.get("infeasible") or a.get("duplicate_of") and f"same plan as #{a['duplicate_of']}"
            or a.get("pruned_at"),
            "seconds": (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start else None,
        })
    return rows


def pareto_front(points: list[tuple[float, float, int]]) -> list[int]:
    """Ids of the points ``(speed, cost, id)`` no other point beats (speed higher or equal and
    cost lower or equal, one strictly), by ascending cost."""
    front = []
    for s, c, i in points:
        dominated = any((s2 >= s and c2 <= c) and (s2 > s or c2 < c) for s2, c2, _ in points)
        if not dominated:
            front.append((c, -s, i))
    return [i for _, _, i in sorted(front)]


def complete_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["state"] == "complete" and r["measured_tps"] is not None]


def fields_text(f: dict | None) -> str:
    if not f:
        return "?"
    text = (f"W_d {f['draft_widths']} W_v {f['verify_widths']} D {f['d_max']} k {f['top_k']} "
            f"lookup {f['lookup']} chunk {f['prefill_chunk']}")
    extra = [f.get("stages"), f.get("weights")]  # absent in trials of studies made before
    return " ".join([text, *(v for v in extra if v)])


def best_table(rows: list[dict], n: int = 8, title: str = "best trials", confirmed: dict | None = None):
    """A rich table of the ``n`` best completed trials: the confirmed candidates first (fastest
    confirmed first, ``confirmed``: trial number -> :func:`confirm_summary` candidate), then
    the others by measured tokens/s."""
    from rich.table import Table

    confirmed = confirmed or {}
    t = Table(title=title)
    for name in ("trial", "confirmed tok/s", "vs base (95% CI)", "measured tok/s", "predicted tok/s",
                 "AAL", "plan", "graphs", "compile s", "MB"):
        t.add_column(name, justify="left" if name == "plan" else "right")
    first = sorted((r for r in rows if r["number"] in confirmed),
                   key=lambda r: -confirmed[r["number"]]["confirmed_tps"])
    rest = sorted((r for r in complete_rows(rows) if r["number"] not in confirmed),
                  key=lambda r: -r["measured_tps"])
    for r in (first + rest)[:max(n, len(first))]:
        c = confirmed.get(r["number"], {})
        vs = (f"{c['ratio_to_base']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
              if c and not c["base"] else "base" if c else "")
        t.add_row(str(r["number"]), _num(c.get("confirmed_tps")), vs, _num(r["measured_tps"]),
                  _num(r["predicted_tps"]), _num(r["aal"], 2), fields_text(r["fields"]),
                  str(r["graphs"] or ""), _num(r["compile_s"]), _num((r["size_bytes"] or 0) / 1e6, 1))
    return t


def confirm_candidates(rows: list[dict], base: dict | None, top: int) -> list[dict]:
    """The trials the confirmation measures again: the ``top`` completed trials by measured
    tokens/s, then the base plan's (plan fields ``base``; a completed trial of them first, else
    a pruned one) when it is not among them. Pure."""
    out = sorted(complete_rows(rows), key=lambda r: (-r["measured_tps"], r["number"]))[:top]
    if base is not None and not any(r["fields"] == base for r in out):
        mine = sorted((r for r in rows if r["fields"] == base and not r["infeasible"]),
                      key=lambda r: (r["state"] != "complete", r["number"]))
        out += mine[:1]
    return out


def confirm_summary(per_prompt: list[dict], keys: list, ref) -> dict:
    """Candidates ``keys`` measured side by side (``per_prompt``: one row per prompt, key ->
    ``{"new_tokens", "decode_s"}``) against the reference ``ref`` (the base plan's trial):
    per key the decode tokens/s over all prompts, the paired ratio to ``ref`` with its 95%
    bootstrap interval over prompts (``yggtree.bench.paired_ratio``); the winner (highest
    tokens/s) and the keys faster than ``ref`` beyond the interval. Pure."""
    from ..bench import paired_ratio

    out = {}
    for k in keys:
        n = sum(max(r[k]["new_tokens"] - 1, 0) for r in per_prompt if r[k]["decode_s"] > 0)
        t = sum(r[k]["decode_s"] for r in per_prompt)
        c = {"confirmed_tps": n / t if t else 0.0, "base": k == ref,
             "ratio_to_base": 1.0, "ci95": [1.0, 1.0], "faster_share": None}
        if k != ref:
            p = paired_ratio(per_prompt, k, ref)
            c |= {"ratio_to_base": p["ratio"], "ci95": p["ci95"], "faster_share": p["a_faster_share"]}
        out[k] = c
    winner = max(keys, key=lambda k: out[k]["confirmed_tps"])
    return {"candidates": out, "winner": winner,
            "beat_base": [k for k in keys if k != ref and out[k]["ci95"][0] > 1.0]}


def _num(v, digits: int = 1) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _save(fig_or_ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = fig_or_ax.figure if hasattr(fig_or_ax, "figure") and not hasattr(fig_or_ax, "savefig") else fig_or_ax
    if hasattr(fig_or_ax, "flat"):  # an array of axes
        fig = fig_or_ax.flat[0].figure
    fig.set_size_inches(8, 5)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def write_plots(study, rows: list[dict], stem: Path) -> dict[str, str | None]:
    """``<stem>.history.png``, ``<stem>.importances.png`` and ``<stem>.pareto.png``; a plot
    that cannot be drawn yet (too few trials) is skipped (None, with the reason in the dict's
    ``notes``)."""
    import matplotlib

    matplotlib.use("Agg")
    import optuna
    from optuna.visualization import matplotlib as ovm

    out: dict = {"notes": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
        done = complete_rows(rows)
        try:
            out["history"] = str(_save(ovm.plot_optimization_history(study), stem.with_suffix(".history.png")))
        except (ValueError, RuntimeError) as e:
            out["history"], out["notes"]["history"] = None, str(e)
        predicted = _derived_study(rows, ("predicted_tps",), ("maximize",))
        try:  # importances of the predicted objective: every feasible trial has it
            ax = ovm.plot_param_importances(predicted)
            ax.set_title("parameter importances for predicted tokens/s (all feasible trials)", loc="left")
            out["importances"] = str(_save(ax, stem.with_suffix(".importances.png")))
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            out["importances"], out["notes"]["importances"] = None, str(e) or type(e).__name__
        front = _derived_study(done, ("measured_tps", "graphs"), ("maximize", "minimize"))
        try:
            ax = ovm.plot_pareto_front(front, target_names=["measured decode tokens/s",
                                                            "decoder-block graphs to compile"])
            out["pareto"] = str(_save(ax, stem.with_suffix(".pareto.png")))
        except (ValueError, RuntimeError) as e:
            out["pareto"], out["notes"]["pareto"] = None, str(e)
    del optuna
    return out


def _derived_study(rows: list[dict], keys: tuple[str, ...], directions: tuple[str, ...]):
    """An in-memory study of ``rows`` with ``keys`` as objective values (rows lacking one are
    left out) and the plan fields as parameters, for optuna's plots."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    study = optuna.create_study(directions=list(directions))
    trials = []
    for r in rows:
        vals = [r.get(k) for k in keys]
        if any(v is None for v in vals) or not r.get("fields"):
            continue
        params = {k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in r["fields"].items()}
        trials.append((vals, params, r["number"]))
    choices = {}
    for _, params, _ in trials:
        for k, v in params.items():
            choices.setdefault(k, [])
            if v not in choices[k]:
                choices[k].append(v)
    fixed = {k for k, v in choices.items() if len(v) == 1}  # not searched: no importance
    for vals, params, number in trials:
        params = {k: v for k, v in params.items() if k not in fixed}
        dists = {k: CategoricalDistribution(choices[k]) for k in params}
        study.add_trial(optuna.trial.create_trial(values=vals, params=params, distributions=dists,
                                                  user_attrs={"tune_trial": number}))
    return study
