"""``yggtree train-predictor``: records and training of the depth predictor (docs/design.md section 6).

1. Records: the plan's pair decodes calibration prompts (never evaluation prompts) with one deep
   tree every step (D = D_max calls at one draft width W_d, the whole tree verified, greedy,
   reference mode: acceptance does not depend on the mode). Per step: the target's final-norm
   hidden state at the root, the realised accepted length, and the length it would have had with
   only D = 1..D_max calls (same tree, first D calls' nodes). Stored as safetensors with a JSON
   sidecar (pair identity, plan hash, drafter, seed, prompts, data hash).
2. Training: the MLP (:class:`yggtree.runtime.predictor.DepthPredictor`) with a per-head BCE on
   y_d = 1[len >= d]; a scikit-learn baseline (``LogisticRegression`` per depth on the same
   standardised features); a constant predictor (the training rows' length distribution, whose
   expected length is the mean length). The last prompts are held out (by prompt, not by step).
3. Report: held-out MAE of the expected accepted length for the three, per-depth Brier scores, a
   calibration plot (predicted vs realised P(len >= d) per depth), a metrics CSV, the predictor's
   inference cost, and ``depth_manifest.json`` next to the weights (``predictors/<pair>/``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..errors import YggError, module_main
from ..files import atomic_path, manifest_path, save_figure, write_text_atomic
from ..plan import default_plan, load_plan
from ..progress import stderr_progress
from .predictor_fit import (
    MLPParams, constant_p_ge, depth_bias, depth_headroom, evaluate, fit_baseline, holdout_mask, length_targets,
    train_mlp,
)
from .predictor_records import (
    Records, collect_records, concat_records, data_hash, load_records, save_records, sidecar_path,
)

HEAD_FEATURES = 2  # default --head-features
OUTPUT_FILES = ("depth_manifest.json", "depth_predictor.safetensors", "depth_baseline.safetensors",
                "depth_metrics.csv", "depth_calibration.png")


# ----------------------------------------------------------------------------- the outputs


def calibration_bins(p, y, bins: int = 10) -> tuple[list[float], list[float], list[int]]:
    """Equal-width bins of predicted probability p [S]: (mean predicted, realised rate, count)."""
    idx = np.clip((np.asarray(p) * bins).astype(int), 0, bins - 1)
    xs, ys, ns = [], [], []
    for b in range(bins):
        m = idx == b
        if m.sum() > 0:
            xs.append(float(np.asarray(p)[m].mean()))
            ys.append(float(np.asarray(y)[m].mean()))
            ns.append(int(m.sum()))
    return xs, ys, ns


def plot_calibration(preds: dict, n_accepted, path: Path, title: str) -> Path:
    """One panel per model: predicted vs realised P(len >= d) per depth on held-out rows, plus
    predicted expected length against the realised length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(preds)
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5 * (len(names) + 1), 4.5))
    for ax, name in zip(axes, names):
        p = preds[name].numpy()
        y = length_targets(n_accepted, p.shape[1]).numpy()
        for d in range(p.shape[1]):
            xs, ys, ns = calibration_bins(p[:, d], y[:, d])
            keep = [i for i, n in enumerate(ns) if n >= 5]
            ax.plot([xs[i] for i in keep], [ys[i] for i in keep], "o-", ms=3, lw=0.8, label=f"d = {d + 1}")
        ax.plot([0, 1], [0, 1], ":", color="grey")
        ax.set_xlabel("predicted P(len >= d)")
        ax.set_ylabel("realised rate")
        ax.set_title(f"{name}: held-out calibration (bins with >= 5 steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    true = n_accepted.numpy()
    for name in names:
        e = preds[name].sum(-1).numpy()
        means = [e[true == k].mean() if (true == k).any() else np.nan for k in range(int(true.max()) + 1)]
        ax.plot(range(len(means)), means, "o-", label=name)
    ax.plot([0, true.max()], [0, true.max()], ":", color="grey")
    ax.set_xlabel("realised accepted length")
    ax.set_ylabel("mean predicted expected length")
    ax.set_title("expected vs realised length (held out)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=100)


def write_metrics_csv(path: Path, metrics: dict) -> Path:
    """Rows: model, split, steps, mae, mean_pred_len, mean_true_len, brier_d1..brier_dD."""
    d_max = len(next(iter(next(iter(metrics.values())).values()))["brier"])
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "split", "steps", "mae_expected_length", "mean_pred_len", "mean_true_len",
                    *[f"brier_d{d}" for d in range(1, d_max + 1)]])
        for split, by_model in metrics.items():
            for model, m in by_model.items():
                w.writerow([model, split, m["steps"], f"{m['mae']:.4f}", f"{m['mean_pred_len']:.4f}",
                            f"{m['mean_true_len']:.4f}", *[f"{b:.4f}" for b in m["brier"]]])
    return path


def save_predictor(out_dir: str | Path, plan, mlp, baseline, extra: dict | None = None) -> Path:
    """Write the MLP and the baseline (safetensors) and ``depth_manifest.json`` for ``plan``'s pair
    (identity, feature layer, hidden size, D_max, training W_d, file hashes, plus ``extra``)."""
    import torch
    from safetensors.torch import save_file

    from ..files import file_sha256
    from ..runtime.artifacts import artifact_head, pair_identity
    from ..runtime.predictor import (
        FEATURE_LAYER, FORMAT_VERSION, MANIFEST_FILE, MODEL_FILES, PREDICTOR_KIND,
        predictor_state,
    )

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    models = {}
    for name, model, kind in (("mlp", mlp, "mlp"), ("baseline", baseline, "logistic")):
        f = d / MODEL_FILES[name]
        with atomic_path(f) as tmp:
            save_file(predictor_state(model), str(tmp), metadata={"kind": PREDICTOR_KIND, "model": name})
        models[name] = {"type": kind, "file": f.name, "sha256": file_sha256(f)}
        if kind == "mlp":
            models[name]["units"] = model.units
    manifest = artifact_head(PREDICTOR_KIND, pair_identity(plan), FORMAT_VERSION) | {
        "plan": {"name": plan.name, "hash": plan.hash(), "d_max": plan.d_max,
                 "draft_widths": list(plan.draft_widths), "verify_widths": list(plan.verify_widths)},
        "feature": {"layer": FEATURE_LAYER, "description": "target final-norm output at the root "
                    "position (StepRecord.h_root), then the drafter head's top head_k log-probs at "
                    "the root (sorted, floored at predictor.LOGP_FLOOR), standardised with the "
                    "stored mean/std", "hidden_size": mlp.hidden_size, "head_k": mlp.head_k,
                    "dtype": str(torch.float32).removeprefix("torch.")},
        "d_max": mlp.d_max,
        "draft_width": mlp.draft_width,
        "target": "P(accepted length >= d), d = 1..d_max, tree of D_max calls, whole tree verified",
        "models": models,
    } | (extra or {})
    path = d / MANIFEST_FILE  # written last: it holds the model files' checksums
    return write_text_atomic(path, json.dumps(manifest, indent=1) + "\n")


# ----------------------------------------------------------------------------- the command


def _record(args, plan, rec_path: Path | None) -> tuple[Records, dict]:
    """Records from ``--records`` (checked against the plan) or a fresh record run."""
    import torch

    from ..runtime.artifacts import pair_identity

    want = {"identity": pair_identity(plan), "d_max": plan.d_max}
    if args.records:
        parts, metas = [], []
        for f in args.records:
            rec, meta = load_records(f)
            for k, v in want.items():
                if meta.get(k) != v:
                    raise YggError(f"depth records {f} were made for another pair or D_max than plan "
                                   f"{plan.name!r} (differs in {k})")
            if metas and meta.get("draft_width") != metas[0].get("draft_width"):
                raise YggError(f"depth records {f} were made at W_d {meta.get('draft_width')}, "
                               f"{args.records[0]} at W_d {metas[0].get('draft_width')}")
            parts.append(rec)
            metas.append(meta)
        rec = concat_records(parts)
        if len(torch.unique(rec.prompt)) != sum(len(torch.unique(r.prompt)) for r in parts):
            raise YggError("the --records files share prompts (pass disjoint prompt ranges)")
        meta = metas[0] | {"data_hash": data_hash(rec),
                           "files": [{"path": str(f), "data_hash": m["data_hash"],
                                      "prompts": m.get("prompts")} for f, m in zip(args.records, metas)]}
        return rec, meta
    from dataclasses import replace

    from ..data import calibration_chat_prompts
    from ..runtime.build import EngineSpec, build_engine
    from ..runtime.engine import TreeParams
    from ..runtime.loading import encode_auto

    wd = args.draft_width
    full = 1 + plan.d_max * wd
    k = args.first_prompt
    prompts = calibration_chat_prompts(k + args.prompts, seed=args.seed)[k:]
    spec = replace(EngineSpec.from_plan(plan, mode="reference"),
                   tree=TreeParams(wd, plan.d_max, full, plan.top_k),
                   draft_widths=(wd,), verify_widths=(full,))
    engine, tok = build_engine(spec)
    cap = plan.max_context - args.max_new_tokens - 1
    ids = [encode_auto(tok, p.text)[-cap:] for p in prompts]
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    with stderr_progress() as progress:
        task = progress.add_task("records (D_max tree per step)", total=len(ids))
        rec = collect_records(engine, ids, plan.d_max, wd, args.max_new_tokens,
                              lambda: progress.advance(task), first_index=k)
    meta = want | {
        "plan": {"name": plan.name, "hash": plan.hash()},
        "target": plan.target, "drafter": plan.drafter, "dtype": plan.dtype,
        "draft_width": wd, "verify_width": full, "top_k": plan.top_k, "mode": "reference",
        "sampling": "greedy", "feature_layer": "final_norm",
        "prompts": {"source": "yggtree.data.calibration_chat_prompts", "first": k, "n": len(ids),
                    "seed": args.seed, "ids": [p.id for p in prompts]},
        "max_new_tokens": args.max_new_tokens, "seed": args.seed,
        "collect_s": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
    }
    if rec_path is not None:
        save_records(rec_path, rec, meta)
        meta = json.loads(sidecar_path(rec_path).read_text())
    else:
        meta = meta | {"data_hash": data_hash(rec)}
    return rec, meta


def _output_paths(args, plan) -> tuple[Path, Path | None]:
    """``(out_dir, rec_path)``: where the predictor goes and where new depth records go (None:
    ``--records`` given); YggError if one of them exists and not ``--force``."""
    from .fit import pair_dir

    out_dir = Path(args.out_dir) if args.out_dir else pair_dir(plan)
    clash = [out_dir / f for f in OUTPUT_FILES if (out_dir / f).exists()]
    rec_path = None if args.records else Path(args.save_records or out_dir / "depth_records.safetensors")
    if rec_path is not None and (rec_path.exists() or sidecar_path(rec_path).exists()):
        clash.append(rec_path)
    if clash and not args.force:
        raise YggError(f"{clash[0]} already exists (pass --force to overwrite)")
    return out_dir, rec_path


def _heldout_prompts(prompt, holdout: int | None) -> tuple[int, int]:
    """``(n_prompts, n_hold)``: the prompts recorded and how many are held out (``--holdout``,
    default a quarter); YggError unless at least one is on each side."""
    import torch

    n_prompts = len(torch.unique(prompt))
    n_hold = holdout if holdout is not None else max(1, n_prompts // 4)
    if not 1 <= n_hold < n_prompts:
        raise YggError(f"--holdout must be 1..{n_prompts - 1} (prompts recorded: {n_prompts}), got {n_hold}")
    return n_prompts, n_hold


def _evaluate_all(models: dict, parts: dict, d_max: int) -> tuple[dict, dict]:
    """``(metrics, heldout predictions)``: each model's metrics on each split (``parts``: split ->
    (records, features)); the constant model predicts the training steps' P(len >= d)."""
    import torch

    metrics, preds = {}, {}
    for split, (part, x) in parts.items():
        with torch.inference_mode():
            preds[split] = {k: m(x) for k, m in models.items() if k != "constant"} | {
                "constant": models["constant"].expand(part.h.shape[0], d_max)}
        metrics[split] = {k: evaluate(p, part.n_accepted) for k, p in preds[split].items()}
    return metrics, preds["heldout"]


def _depth_headroom(plan, te, wd: int, d_max: int, held_preds: dict) -> dict | None:
    """What depth choice could gain on the held-out steps at the profile's step costs (None
    without a profile)."""
    if plan.profile is None:
        return None
    from ..runtime.cost import CostModel
    from ..runtime.predictor import verify_width_for

    cost = CostModel.from_profile(plan.profile, plan)
    ctx = te.committed.tolist()
    wvs = [verify_width_for(d, wd, plan.verify_widths) for d in range(1, d_max + 1)]
    step_ms = [[cost.step_ms(d, wd, wvs[d - 1], c) for d in range(1, d_max + 1)] for c in ctx]
    headroom = depth_headroom(te.len_by_depth.numpy(), step_ms, [cost.plain_ms(c) for c in ctx],
                              {k: p.numpy() for k, p in held_preds.items()})
    headroom["tree"] = f"W_d {wd}, D levels, W_v {wvs} (the records' trees), profile {Path(plan.profile).name}"
    return headroom


def _data_record(args, meta: dict, rec, rec_path: Path | None, out_dir: Path, n_prompts: int, n_hold: int,
                 tr, te) -> dict:
    """The manifest's ``data``: the records (paths relative to ``out_dir``), their prompts and splits."""
    return {"records": [manifest_path(f, out_dir) for f in (args.records or [rec_path])],
            "data_hash": meta["data_hash"],
            "files": [f | {"path": manifest_path(f["path"], out_dir)} for f in meta["files"]]
            if meta.get("files") else meta.get("files"),
            "steps": int(rec.h.shape[0]), "prompts": n_prompts,
            "prompt_source": meta.get("prompts", {}).get("source"),
            "prompt_seed": meta.get("prompts", {}).get("seed"),
            "max_new_tokens": meta.get("max_new_tokens"),
            "train_prompts": n_prompts - n_hold, "heldout_prompts": n_hold,
            "train_steps": int(tr.h.shape[0]), "heldout_steps": int(te.h.shape[0])}


def run_train_predictor(args) -> int:
    import sklearn
    import torch

    from ..runtime.predictor import features, measure_ms

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    plan = load_plan(args.plan) if args.plan else default_plan()
    if not plan.speculative:
        raise YggError(f"plan {plan.name!r} has no drafter: there is no depth to predict")
    if args.draft_width < 1:
        raise YggError(f"--draft-width must be >= 1, got {args.draft_width}")
    out_dir, rec_path = _output_paths(args, plan)
    rec, meta = _record(args, plan, rec_path)
    d_max, wd = rec.d_max, int(meta.get("draft_width", args.draft_width))
    if not 0 <= args.head_features <= rec.head_logp.shape[1]:
        raise YggError(f"--head-features must be 0..{rec.head_logp.shape[1]} (the recorded trees' "
                       f"W_d), got {args.head_features}")
    n_prompts, n_hold = _heldout_prompts(rec.prompt, args.holdout)
    hold = holdout_mask(rec.prompt, n_hold)
    tr, te = rec.select(~hold), rec.select(hold)
    hp = MLPParams(units=args.units, epochs=args.epochs)
    torch.manual_seed(args.seed)
    hk = args.head_features
    x_tr, x_te = (features(part.h, part.head_logp, hk) for part in (tr, te))
    mlp = train_mlp(x_tr, tr.n_accepted, d_max, hp, args.seed, wd, hk)
    base = fit_baseline(x_tr, tr.n_accepted, d_max, args.baseline_c, args.seed, wd, hk)
    models = {"mlp": mlp, "baseline": base, "constant": constant_p_ge(tr.n_accepted, d_max)}
    metrics, held_preds = _evaluate_all(models, {"train": (tr, x_tr), "heldout": (te, x_te)}, d_max)
    bias = {k: depth_bias(p, te) for k, p in held_preds.items() if k != "constant"}
    headroom = _depth_headroom(plan, te, wd, d_max, held_preds)
    z = x_te[0].clone()
    with torch.inference_mode():
        cost_ms = {"mlp": measure_ms(lambda: mlp(z), 300), "baseline": measure_ms(lambda: base(z), 300)}

    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_calibration({"mlp": held_preds["mlp"], "baseline": held_preds["baseline"]},
                           te.n_accepted, out_dir / "depth_calibration.png",
                           f"depth predictor, plan {plan.name}: {n_hold} held-out calibration prompts "
                           f"({te.h.shape[0]} steps), D_max {d_max}, W_d {wd}")
    csv_path = write_metrics_csv(out_dir / "depth_metrics.csv", metrics)
    man_path = save_predictor(out_dir, plan, mlp, base, {
        "verify_width": int(meta.get("verify_width", 1 + d_max * wd)),
        "data": _data_record(args, meta, rec, rec_path, out_dir, n_prompts, n_hold, tr, te),
        "metrics": metrics,
        "depth_bias_heldout": bias,
        "depth_headroom_heldout": headroom,
        "inference_ms": {k: round(v, 4) for k, v in cost_ms.items()},
        "hyperparameters": asdict(hp) | {"loss": "per-head BCE on cumprod of conditional sigmoids",
                                         "optimizer": "AdamW", "baseline": "sklearn LogisticRegression",
                                         "baseline_C": args.baseline_c},
        "seed": args.seed,
        "software": {"torch": torch.__version__, "sklearn": sklearn.__version__,
                     "python": sys.version.split()[0]},
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    })
    h = metrics["heldout"]
    summary = {
        "manifest": str(man_path), "plot": str(png), "metrics_csv": str(csv_path),
        "records": args.records or [str(rec_path)], "steps": int(rec.h.shape[0]),
        "heldout_prompts": n_hold, "heldout_steps": int(te.h.shape[0]),
        "mae_mlp": round(h["mlp"]["mae"], 4), "mae_baseline": round(h["baseline"]["mae"], 4),
        "mae_constant": round(h["constant"]["mae"], 4),
        "mean_len_heldout": round(h["constant"]["mean_true_len"], 4),
        "inference_ms_mlp": round(cost_ms["mlp"], 4),
        "headroom": headroom and {k: headroom[k] for k in ("fixed", "mlp", "baseline", "oracle")},
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(summary))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", default=None, help="plan YAML (default: the embedded default plan)")
    p.add_argument("--prompts", type=int, default=32, help="calibration prompts to record (default 32)")
    p.add_argument("--first-prompt", type=int, default=0,
                   help="index of the first calibration prompt to record (to extend earlier records)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-width", type=int, default=4, help="W_d of the recorded trees (default 4)")
    p.add_argument("--holdout", type=int, default=None,
                   help="last prompts held out for evaluation (default: a quarter)")
    p.add_argument("--head-features", type=int, default=HEAD_FEATURES,
                   help="the drafter head's top log-probs at the root read with the hidden state "
                   f"(0: the hidden state alone; default {HEAD_FEATURES})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=MLPParams.epochs)
    p.add_argument("--units", type=int, default=MLPParams.units, help="MLP encoder width")
    p.add_argument("--baseline-c", type=float, default=0.003,
                   help="inverse L2 strength of the logistic baseline (sklearn C; default 0.003, "
                   "chosen like the MLP's defaults by grouped cross-validation)")
    p.add_argument("--out-dir", default=None, help="default predictors/<target>__<drafter>__<dtype>/")
    p.add_argument("--records", action="extend", nargs="+", default=None, metavar="FILE",
                   help="reuse these records (.safetensors, each with its .json sidecar; disjoint "
                   "prompts) instead of decoding")
    p.add_argument("--save-records", default=None,
                   help="where fresh records go (default <out-dir>/depth_records.safetensors)")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")


def run(args) -> int:
    """The ``train-predictor`` subcommand: :func:`run_train_predictor` once its flags are checked."""
    if min(args.prompts, args.max_new_tokens, args.threads, args.epochs, args.units) < 1:
        raise YggError("--prompts, --max-new-tokens, --threads, --epochs and --units must be >= 1")
    if args.first_prompt < 0:
        raise YggError(f"--first-prompt must be >= 0, got {args.first_prompt}")
    if args.records is None and args.prompts < 2:
        raise YggError("--prompts must be >= 2 (the last ones are held out)")
    if not args.baseline_c > 0:
        raise YggError(f"--baseline-c must be > 0, got {args.baseline_c}")
    return run_train_predictor(args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``train-predictor`` on a CLI's subparsers (help line, flags), handled by :func:`run`."""
    p = subparsers.add_parser(
        "train-predictor",
        help="record deep-tree acceptance on calibration prompts and train the depth predictor",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.train_predictor ...``: the same options as ``yggtree train-predictor``."""
    return module_main("yggtree.offline.train_predictor", "train-predictor", __doc__,
                       add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())