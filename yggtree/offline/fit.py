"""Fits behind the latency objective: latency curves (from a profile) and acceptance calibration.

- :func:`fit_curve`: per context bucket, an isotonic (monotone non-decreasing) piecewise-linear
  fit of milliseconds against width (scikit-learn ``IsotonicRegression``), exported as knots the
  runtime interpolates (:class:`yggtree.runtime.cost.Curve`); :func:`loo_errors` reports the
  relative error on held-out grid widths (leave-one-out, interior widths).
- ``yggtree calibrate``: run the plan's pair on calibration prompts (never evaluation prompts),
  verify every drafted node, and fit the monotone map from the drafter's probability of a token to
  the rate at which the target accepts it; also the measured mean accepted length of every
  (W_d, D, W_v). Saved as JSON with a per-depth acceptance plot next to the pair's artifacts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import YggError, module_main
from ..files import save_figure, write_text_atomic
from ..plan import default_plan, load_plan
from ..progress import stderr_progress

# ----------------------------------------------------------------------------- latency curves


def isotonic_knots(x, y) -> tuple[list[float], list[float]]:
    """Monotone non-decreasing least-squares fit of y(x); returns its knots (x ascending)."""
    from sklearn.isotonic import IsotonicRegression

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) == 1:
        return [float(x[0])], [float(y[0])]
    iso = IsotonicRegression(increasing=True, out_of_bounds="clip").fit(x, y)
    xs = np.unique(x)
    return [float(v) for v in xs], [float(v) for v in iso.predict(xs)]


def fit_curve(points: list[tuple[int, int, float]]) -> dict:
    """points (width, bucket, ms) -> Curve JSON (one isotonic fit in width per bucket)."""
    buckets = sorted({b for _, b, _ in points})
    xs, ys = [], []
    for b in buckets:
        pts = sorted((w, ms) for w, bb, ms in points if bb == b)
        x, y = isotonic_knots([p[0] for p in pts], [p[1] for p in pts])
        xs.append(x)
        ys.append(y)
    return {"buckets": buckets, "xs": xs, "ys": ys}


def loo_errors(points: list[tuple[int, int, float]]) -> list[dict]:
    """Relative error at every interior grid width of every bucket, fitted without it."""
    from ..runtime.cost import Curve

    out = []
    for b in sorted({b for _, b, _ in points}):
        pts = sorted((w, ms) for w, bb, ms in points if bb == b)
        for i in range(1, len(pts) - 1):
            rest = [(w, b, ms) for j, (w, ms) in enumerate(pts) if j != i]
            c = Curve.from_json(fit_curve(rest), "loo")
            w, ms = pts[i]
            pred = float(np.interp(w, c.xs[0], c.ys[0]))
            out.append({"bucket": b, "width": w, "ms": ms, "pred": pred, "rel": abs(pred - ms) / ms})
    return out


def fit_profile(rows: list[dict]) -> tuple[dict, dict]:
    """Curves for verify/draft/head from profile rows and their held-out errors."""
    fit, errors, all_rel = {}, {}, []
    for kind in ("verify", "draft", "head"):
        pts = [(r["width"], r["bucket"], r["median_ms"]) for r in rows if r["kind"] == kind]
        if not pts:
            raise YggError(f"the profile has no {kind!r} points")
        fit[kind] = fit_curve(pts)
        if kind == "head":
            continue
        loo = loo_errors(pts)
        rel = [e["rel"] for e in loo]
        all_rel += rel
        errors[kind] = {
            "median_rel": float(np.median(rel)) if rel else 0.0,
            "max_rel": float(np.max(rel)) if rel else 0.0,
            "n": len(rel),
            "points": loo,
        }
    errors["overall"] = {
        "median_rel": float(np.median(all_rel)) if all_rel else 0.0,
        "max_rel": float(np.max(all_rel)) if all_rel else 0.0,
        "n": len(all_rel),
    }
    return fit, errors


def plot_profile(profile: dict, path: Path) -> Path:
    """T_verify and T_draft against width, one line per context bucket, fit drawn through."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..runtime.cost import Curve

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("verify", "draft")):
        curve = Curve.from_json(profile["fit"][kind], "plot")
        rows = [r for r in profile["points"] if r["kind"] == kind]
        for i, b in enumerate(curve.buckets):
            pts = sorted((r for r in rows if r["bucket"] == b), key=lambda r: r["width"])
            if not pts:
                continue
            w = np.array([r["width"] for r in pts])
            m = np.array([r["median_ms"] for r in pts])
            lo = m - np.array([r["p10_ms"] for r in pts])
            hi = np.array([r["p90_ms"] for r in pts]) - m
            ctx = pts[0]["context"]
            line = ax.errorbar(w, m, yerr=[lo, hi], fmt="o", ms=4, capsize=2,
                               label=f"ctx {ctx} (bucket {b})")
            dense = np.unique(np.geomspace(w.min(), w.max(), 60).round(2))
            ax.plot(dense, [curve.predict(x, ctx) for x in dense], "-", color=line[0].get_color(), lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("width (tree nodes per call)")
        ax.set_ylabel("ms (median, p10-p90)")
        err = profile["fit_error"][kind]
        ax.set_title(f"T_{kind[0]}: {'target verify' if kind == 'verify' else 'drafter step'} "
                     f"(held-out err median {err['median_rel']:.1%})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    hw = profile["hardware"]
    fig.suptitle(f"profile {profile['name']}: {hw['cpu_model']}, {hw['threads']} thread(s), "
                 f"{profile['software']['dtype']}, torch {profile['software']['torch']}")
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- acceptance calibration


def _slug(name: str | None) -> str:
    if name in (None, "default", "self"):
        return str(name)
    return Path(name).name.removesuffix(".gguf") or "model"


def pair_dir(plan, root: str | Path = "predictors") -> Path:
    """Artifacts of the plan's (target, drafter) pair: ``predictors/<target>__<drafter>/``."""
    return Path(root) / f"{_slug(plan.target)}__{_slug(plan.drafter)}__{plan.dtype}"


def step_edges(rec, d_max: int) -> dict:
    """One calibration step -> per drafted node: drafter prob of its edge, target accepts the
    edge, path accepted, depth (numpy arrays over valid non-root nodes) and the tree arrays."""
    import torch

    tree, kept, ok = rec.tree, rec.kept, rec.kept_valid
    n = tree.num_nodes
    arg = torch.full((n,), -1, dtype=torch.int64)
    arg[kept[ok]] = rec.target_argmax[ok]
    par = tree.parent
    lp = torch.where(tree.valid, tree.logp, 0.0)
    q = torch.exp((lp - lp[par]).clamp(max=0.0))
    edge_ok = tree.valid & (arg[par] == tree.token)
    edge_ok[0] = True
    path_ok = edge_ok.clone()
    anc = par.clone()
    for _ in range(d_max):
        path_ok &= edge_ok[anc]
        anc = par[anc]
    sel = tree.valid.clone()
    sel[0] = False
    return {
        "q": q[sel].numpy(), "edge": edge_ok[sel].numpy(), "path": path_ok[sel].numpy(),
        "depth": tree.depth[sel].numpy(), "tree": tree, "path_ok": path_ok,
    }


def measured_aal(tree, path_ok, wd: int, d_max: int, widths: list[int]) -> list[list[float]]:
    """Accepted length (bonus included) had the step drafted D calls and kept W_v nodes, for
    D = 1..d_max and W_v in ``widths``: EGT's first D calls fill slots 1..D*W_d."""
    from ..runtime.prune import prune_topk
    from ..runtime.tree import Tree

    out = []
    for d in range(1, d_max + 1):
        n = 1 + d * wd
        sub = Tree(tree.token[:n], tree.parent[:n], tree.depth[:n], tree.valid[:n], tree.logp[:n])
        row = []
        for w in widths:
            kept, ok = prune_topk(sub, sub.logp, w)
            row.append(float((path_ok[:n][kept] & ok).sum()))  # root + accepted nodes
        out.append(row)
    return out


def _calibration_engine(plan):
    """A reference engine of ``plan``'s pair that verifies every drafted tree whole (W_v = 1 + D W_d)."""
    from dataclasses import replace

    from ..runtime.build import EngineSpec, build_engine
    from ..runtime.engine import TreeParams

    full = tuple(1 + plan.d_max * wd for wd in plan.draft_widths)
    spec = EngineSpec.from_plan(plan, mode="reference")
    spec = replace(spec, tree=TreeParams(max(plan.draft_widths), plan.d_max, max(full), plan.top_k),
                   draft_widths=tuple(plan.draft_widths), verify_widths=full)
    return build_engine(spec)


def _collect_edges(engine, ids: list[list[int]], plan, max_new_tokens: int) -> tuple[list[dict], dict]:
    """Decode every prompt at each draft width with full trees: the draft edges of every step
    (``step_edges`` with ``wd`` and ``prompt``) and, per draft width, the mean measured AAL table
    over the steps (``measured_aal`` at the plan's verify widths)."""
    from ..runtime.engine import SamplingParams
    from ..runtime.policy import FixedPolicy, StepChoice

    d_max, widths = plan.d_max, list(plan.verify_widths)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    edges: list[dict] = []
    aal: dict[str, list] = {}
    with stderr_progress() as progress:
        task = progress.add_task("calibration", total=len(plan.draft_widths) * len(ids))
        for wd in plan.draft_widths:
            pol = FixedPolicy(StepChoice(d_max, wd), 1 + d_max * wd)
            tables = []
            for i, x in enumerate(ids):
                recs = []
                engine.generate(x, params, policy=pol, on_step=recs.append)
                for r in recs:
                    e = step_edges(r, d_max)
                    e.update(wd=wd, prompt=i)
                    tables.append(measured_aal(e["tree"], e["path_ok"], wd, d_max, widths))
                    del e["tree"], e["path_ok"]
                    edges.append(e)
                progress.advance(task)
            aal[str(wd)] = np.mean(np.asarray(tables), axis=0).round(4).tolist()
    return edges, aal


def _isotonic(q, acc, mask):
    """Drafter probability -> acceptance, monotone and within [0, 1], fitted on the edges in ``mask``."""
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    return iso.fit(q[mask], acc[mask])


def _held_out(q, acc, prompt_of, n_prompts: int) -> dict:
    """The map fitted on the first prompts and scored on the last quarter (Brier score, and the
    raw drafter probability's); empty with one prompt or nothing on one side."""
    n_hold = max(1, n_prompts // 4) if n_prompts > 1 else 0
    train = prompt_of < n_prompts - n_hold
    if not (n_hold and train.any() and (~train).any()):
        return {}
    pred = _isotonic(q, acc, train).predict(q[~train])
    return {
        "prompts": n_hold,
        "edges": int((~train).sum()),
        "mean_pred": float(pred.mean()),
        "mean_true": float(acc[~train].mean()),
        "brier": float(np.mean((pred - acc[~train]) ** 2)),
        "brier_raw_q": float(np.mean((q[~train] - acc[~train]) ** 2)),
    }


def _by_depth(q, acc, depth, d_max: int) -> list[dict]:
    """Edge acceptance and mean drafter probability at each draft depth that has edges."""
    rows = []
    for dd in range(1, d_max + 1):
        m = depth == dd
        if m.any():
            rows.append({"depth": dd, "edges": int(m.sum()), "edge_accept": float(acc[m].mean()),
                         "mean_q": float(q[m].mean())})
    return rows


def run_calibrate(args) -> int:
    import torch

    from ..data import calibration_chat_prompts
    from ..runtime.artifacts import CALIBRATION_KIND, artifact_head, pair_identity
    from ..runtime.loading import encode_auto

    torch.set_num_threads(args.threads)
    plan = load_plan(args.plan) if args.plan else default_plan()
    if not plan.speculative:
        raise YggError(f"plan {plan.name!r} has no drafter: nothing to calibrate")
    out_dir = Path(args.out_dir) if args.out_dir else pair_dir(plan)
    dst = out_dir / "calibration.json"
    if dst.exists() and not args.force:
        raise YggError(f"calibration {dst} already exists (pass --force to overwrite it)")
    t_start = time.perf_counter()
    prompts = calibration_chat_prompts(args.prompts, seed=args.seed)
    engine, tok = _calibration_engine(plan)
    cap = plan.max_context - args.max_new_tokens - 1
    ids = [encode_auto(tok, p.text)[-cap:] for p in prompts]
    edges, aal = _collect_edges(engine, ids, plan, args.max_new_tokens)
    q = np.concatenate([e["q"] for e in edges])
    acc = np.concatenate([e["edge"] for e in edges]).astype(float)
    depth = np.concatenate([e["depth"] for e in edges])
    prompt_of = np.concatenate([np.full(len(e["q"]), e["prompt"]) for e in edges])
    held = _held_out(q, acc, prompt_of, len(ids))
    iso = _isotonic(q, acc, np.ones(len(q), dtype=bool))
    out = artifact_head(CALIBRATION_KIND, pair_identity(plan)) | {
        "plan": {"name": plan.name, "hash": plan.hash(), "d_max": plan.d_max,
                 "draft_widths": list(plan.draft_widths), "top_k": plan.top_k},
        "data": {"source": "yggtree.data.calibration_chat_prompts", "prompts": len(ids),
                 "seed": args.seed, "max_new_tokens": args.max_new_tokens, "edges": int(len(q))},
        "map": {"x": [float(v) for v in iso.X_thresholds_],
                "y": [float(min(max(v, 0.0), 1.0)) for v in iso.y_thresholds_]},
        "verify_widths": list(plan.verify_widths),
        "aal": aal,
        "by_depth": _by_depth(q, acc, depth, plan.d_max),
        "held_out": held,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(dst, json.dumps(out, indent=1) + "\n")
    png = plot_calibration(out, q, acc, depth, edges, out_dir / "calibration.png")
    summary = {
        "calibration": str(dst), "plot": str(png), "prompts": len(ids), "edges": int(len(q)),
        "edge_accept": float(acc.mean()),
        "aal_best": max(max(max(r) for r in t) for t in aal.values()),
        "held_out_brier": held.get("brier"), "held_out_brier_raw_q": held.get("brier_raw_q"),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(summary))
    return 0


def plot_calibration(cal: dict, q, acc, depth, edges, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bins = np.linspace(0, 1, 11)
    for dd in sorted(set(depth.tolist())):
        m = depth == dd
        idx = np.clip(np.digitize(q[m], bins) - 1, 0, 9)
        xs, ys = [], []
        for b in range(10):
            sel = idx == b
            if sel.sum() >= 5:
                xs.append(q[m][sel].mean())
                ys.append(acc[m][sel].mean())
        a1.plot(xs, ys, "o-", ms=3, lw=0.8, label=f"depth {dd}")
    a1.plot(cal["map"]["x"], cal["map"]["y"], "k-", lw=2, label="isotonic map")
    a1.plot([0, 1], [0, 1], ":", color="grey")
    a1.set_xlabel("drafter probability q of the drafted token")
    a1.set_ylabel("target acceptance rate")
    a1.set_title("acceptance vs drafter probability, per depth")
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3)
    for wd in sorted({e["wd"] for e in edges}):
        dep = np.concatenate([e["depth"] for e in edges if e["wd"] == wd])
        ok = np.concatenate([e["path"] for e in edges if e["wd"] == wd])
        n_steps = sum(1 for e in edges if e["wd"] == wd)
        ds = sorted(set(dep.tolist()))
        # P(accepted length >= d) = accepted-path nodes at depth d per step
        a2.plot(ds, [ok[dep == d].sum() / n_steps for d in ds], "o-", label=f"W_d {wd}")
    a2.set_xlabel("depth d")
    a2.set_ylabel("P(accepted length >= d)")
    a2.set_title("measured acceptance per depth (whole drafted tree verified)")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(f"acceptance calibration: plan {cal['plan']['name']}, {cal['data']['prompts']} "
                 f"calibration prompts, {cal['data']['edges']} drafted edges")
    return save_figure(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", default=None, help="plan YAML (default: the embedded default plan)")
    p.add_argument("--prompts", type=int, default=6, help="calibration prompts (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default=None, help="default predictors/<target>__<drafter>__<dtype>/")
    p.add_argument("--force", action="store_true", help="overwrite an existing calibration")


def run(args) -> int:
    """The ``calibrate`` subcommand: :func:`run_calibrate` once its flags are checked."""
    if args.prompts < 1 or args.max_new_tokens < 1 or args.threads < 1:
        raise YggError("--prompts, --max-new-tokens and --threads must be >= 1")
    return run_calibrate(args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``calibrate`` on a CLI's subparsers (help line, flags), handled by :func:`run`."""
    p = subparsers.add_parser(
        "calibrate", help="fit the drafter-probability -> acceptance map on calibration prompts"
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.fit ...``: the same options as ``yggtree calibrate``."""
    return module_main("yggtree.offline.fit", "calibrate", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
