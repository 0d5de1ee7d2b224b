"""Plot drafter heads' held-out acceptance against their training-set size (the learning curve).

    python scripts/learning_curve.py --out yggtree/assets/drafters/NAME/report/learning_curve.png \\
        runs/t1 runs/t3 runs/t12

Each argument is a ``yggtree distill --transcripts ... --max-tokens N`` output directory. The
figures come from each head's manifest: the validation pass on the held-out synthetic chat
conversations (heldout shards, which no training run reads): est. chain-4 AAL (the head's top-1
chain, 4 deep) and est. tree AAL (a tree holding the head's top-4 at every node of the true path,
eval-depth deep). Writes the PNG and a CSV beside it, prints the table.

``--in-run DIR`` adds the evaluations made during one run (report/train_log.csv: the same
held-out pass every ``--eval-every`` steps) against the tokens the run had trained on so far,
as a dashed line: one long single-epoch run gives the whole curve.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def rows(dirs: list[str]) -> list[dict]:
    out = []
    for d in dirs:
        path = Path(d) / "manifest.json"
        if not path.is_file():
            sys.exit(f"learning_curve: {path} does not exist")
        m = json.loads(path.read_text())
        val = m["training"]["val"]
        out.append({
            "run": Path(d).name,
            "train_tokens": m["data"]["n_train_tokens"],
            "epochs": m["hyperparameters"]["epochs"],
            "est_chain4_aal": val["est_chain4_aal"],
            "est_tree4_aal": val.get("est_tree4_aal"),
            # the same drafts walked as the engine decodes (tokens per verify step); older heads lack it
            "walk_chain4_aal": val.get("walk_chain4_aal"),
            "val_top1": val["val_top1_by_step"][0],
            "train_s": m["wall_time_s"]["train"],
            "hyperparameters": m["hyperparameters"],
        })
    return sorted(out, key=lambda r: r["train_tokens"])


HEAD_SETTINGS = ("draft_vocab", "draft_layers", "target_layers", "max_seq_len", "unroll", "lr", "batch_size")


def design_table(rs: list[dict]) -> str:
    """Markdown: one row per run, the head settings that differ between the runs, the figures."""
    keys = [k for k in HEAD_SETTINGS if len({json.dumps(r["hyperparameters"].get(k, 1 if k == "draft_layers" else None))
                                            for r in rs}) > 1]
    head = ["run", *keys, "train tokens", "epochs", "est. chain-4 AAL", "est. tree AAL", "walk chain-4 AAL", "val top-1",
            "train min"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        hp = r["hyperparameters"]
        vals = [str(hp.get(k, 1 if k == "draft_layers" else None)) for k in keys]
        tree = f"{r['est_tree4_aal']:.3f}" if r["est_tree4_aal"] is not None else "-"
        walk = f"{r['walk_chain4_aal']:.3f}" if r["walk_chain4_aal"] is not None else "-"
        lines.append("| " + " | ".join([r["run"], *vals, str(r["train_tokens"]), f"{r['epochs']:g}",
                                         f"{r['est_chain4_aal']:.3f}", tree, walk, f"{r['val_top1']:.3f}",
                                         f"{r['train_s'] / 60:.0f}"]) + " |")
    return "\n".join(lines)


def in_run_rows(d: str) -> list[dict]:
    """The held-out evaluations logged during one run: tokens trained on so far and the estimates."""
    path = Path(d) / "report" / "train_log.csv"
    if not path.is_file():
        sys.exit(f"learning_curve: {path} does not exist")
    with path.open() as f:
        logged = [r for r in csv.DictReader(f) if r.get("est_chain4_aal")]
    return [{
        "tokens_seen": int(float(r["tokens_seen"])),
        "est_chain4_aal": float(r["est_chain4_aal"]),
        "est_tree4_aal": float(r["est_tree4_aal"]) if r.get("est_tree4_aal") else None,
    } for r in logged]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True, help="PNG path (a CSV is written beside it)")
    p.add_argument("--in-run", metavar="DIR", help="also plot the evaluations logged during this run")
    p.add_argument("--table", action="store_true",
                   help="print a markdown table of the runs and the head settings that differ (a head-design table)")
    args = p.parse_args()
    rs = rows(args.runs)
    if args.table:
        print(design_table(rs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rs[0] if k != "hyperparameters"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["train_tokens"] for r in rs]
    ax.plot(x, [r["est_chain4_aal"] for r in rs], "o-", label="chain of 4 (top-1)")
    if all(r["est_tree4_aal"] is not None for r in rs):
        ax.plot(x, [r["est_tree4_aal"] for r in rs], "s-", label="top-4 tree along the true path")
    if args.in_run:
        ir = in_run_rows(args.in_run)
        xi = [r["tokens_seen"] for r in ir]
        ax.plot(xi, [r["est_chain4_aal"] for r in ir], "--", color="C0", alpha=0.7,
                label=f"chain of 4, during {Path(args.in_run).name}")
        if ir and all(r["est_tree4_aal"] is not None for r in ir):
            ax.plot(xi, [r["est_tree4_aal"] for r in ir], "--", color="C1", alpha=0.7,
                    label=f"tree, during {Path(args.in_run).name}")
        for r in ir:
            print(json.dumps({"in_run": Path(args.in_run).name, **r}))
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (target transcripts)")
    ax.set_ylabel("held-out accepted tokens per step (est.)")
    ax.set_title("drafter learning curve, held-out synthetic chat")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    for r in rs:
        print(json.dumps({k: v for k, v in r.items() if k != "hyperparameters"}))
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("learning_curve", lambda _: main(), None))
