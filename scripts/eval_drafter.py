"""Evaluate a drafter on the evaluation prompts: AAL per tree shape, equality with plain greedy
decoding, and the cost of one drafter step against one target verify step.

    python scripts/eval_drafter.py --drafter default --mtbench 40 --humaneval 40 \\
        --max-new-tokens 128 --tree tree=8,6,32,8 --tree chain=1,4,5,1 --cost

A tree is ``NAME=W_d,D,W_v,top_k`` (yggtree.runtime.engine.TreeParams). AAL (mean accepted tokens
per verify step, bonus included) does not depend on the mode, so the default is the eager
reference mode; ``--cost`` times the two steps in both modes (eager and compiled), interleaved,
medians over ``--cost-repeats``.

Output: a table on stdout, then ONE JSON line with every number. Progress on stderr.
These prompts are for evaluation only: nothing here feeds back into training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import astuple
from pathlib import Path

import torch

from yggtree.data import interleave, load_prompts
from yggtree.progress import stderr_progress
from yggtree.errors import YggError, run_reporting
from yggtree.runtime import steps
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams, TreeParams
from yggtree.runtime.loading import load_tokenizer, resolve_model


def parse_tree(text: str) -> tuple[str, TreeParams]:
    try:
        name, spec = text.split("=", 1)
        wd, d, wv, k = (int(x) for x in spec.split(","))
    except ValueError:
        raise YggError(f"bad --tree {text!r}: expected NAME=W_d,D,W_v,top_k") from None
    tp = TreeParams(draft_width=wd, draft_depth=d, verify_width=wv, top_k=k)
    tp.validate()
    return name, tp


def make_engine(args, tp: TreeParams | None):
    """An engine as ``yggtree run`` builds it: plain decoding (``tp`` None) or ``tp``'s tree."""
    spec = EngineSpec(model=args.model, drafter=args.drafter if tp is not None else None, dtype=args.dtype,
                      mode=args.mode, max_context=args.max_context, prefill_chunk=args.chunk,
                      tree=tp or TreeParams())
    return build_engine(spec)[0]


def summarise(name: str, tp: TreeParams | None, recs: list[dict]) -> dict:
    out = {"config": name, "tree": None if tp is None else [tp.draft_width, tp.draft_depth, tp.verify_width, tp.top_k]}
    out["prompts"] = len(recs)
    out["new_tokens"] = sum(r["n"] for r in recs)
    if tp is None:
        return out
    acc = sum(r["accepted"] for r in recs)
    ver = sum(r["verify"] for r in recs)
    out["aal_mean"] = statistics.fmean(r["aal"] for r in recs)
    out["aal_pooled"] = (acc + ver) / max(ver, 1)
    for kind in ("mtbench", "humaneval", "heldout"):
        sub = [r for r in recs if r["id"].startswith(kind)]
        out[f"prompts_{kind}"] = len(sub)
        if sub:
            out[f"aal_{kind}"] = statistics.fmean(r["aal"] for r in sub)
    d = tp.draft_depth
    out["accept_by_position"] = [
        sum(r["abp"][i] * r["verify"] for r in recs) / max(ver, 1) for i in range(d)
    ]
    out["identical"] = sum(1 for r in recs if r.get("equal"))
    out["compared"] = sum(1 for r in recs if "equal" in r)
    return out


# ----------------------------------------------------------------------------- cost


@torch.no_grad()
def measure_cost(args, tokenizer, mode: str, width: int, repeats: int, ctx: int) -> dict:
    """Median ms of one drafter step at W_d = width and one target verify at W = width."""
    tp = TreeParams(draft_width=width, draft_depth=4, verify_width=width, top_k=min(8, width))
    sub = argparse.Namespace(**{**vars(args), "mode": mode})
    eng = make_engine(sub, tp)
    prompt = (load_prompts(1, 0, tokenizer)[0][1] * 64)[:ctx]
    eng.generate(prompt, SamplingParams(max_new_tokens=4))  # fills both caches with a real context
    target, drafter = eng.target, eng.drafter
    L = torch.tensor(len(prompt))
    n = drafter.n_tree
    w = width
    ar = torch.arange(w)
    # drafter: W nodes 1..W, children of the root (their ancestors: the root and themselves)
    anc_d = torch.zeros(w, n, dtype=torch.bool)
    anc_d[:, 0] = True
    anc_d[ar, ar + 1] = True
    tok = torch.tensor(prompt[:w])
    # target: a chain of W nodes (mask shape is what matters for cost)
    anc_v = ar[None, :] <= ar[:, None]

    def draft():
        drafter.step(tok, torch.ones(w, dtype=torch.int64), ar + 1, torch.zeros(w, dtype=torch.int64), anc_d, L, tp.top_k)

    # the engine's verify call: attention over the smallest context bucket holding the tree
    bucket = eng.graphs.bucket(len(prompt) + w, w) if hasattr(eng.graphs, "bucket") else None

    def verify():
        steps.tree_step(target, tok, ar, ar, anc_v, L, drafter.target_layers, bucket)

    times = {"draft": [], "verify": []}
    with eng.graphs.frozen(), drafter.frozen():
        for _ in range(5):
            draft()
            verify()
        for _ in range(repeats):
            for name, fn in (("draft", draft), ("verify", verify)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    d = statistics.median(times["draft"]) * 1e3
    v = statistics.median(times["verify"]) * 1e3
    return {"mode": mode, "dtype": args.dtype, "width": width, "context": ctx, "draft_ms": d, "verify_ms": v, "ratio": d / v}


# ----------------------------------------------------------------------------- main


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.merge:
        return merge(args)
    trees = [] if args.plain_only else [parse_tree(t) for t in (args.tree or ["tree=8,6,32,8", "chain=1,4,5,1"])]
    src = resolve_model(args.model)
    tokenizer = load_tokenizer(src)
    prompts = load_prompts(args.mtbench, args.humaneval, tokenizer) if args.mtbench + args.humaneval else []
    if args.heldout:
        from yggtree.offline.transcripts import heldout_prompts

        prompts += heldout_prompts(Path(args.heldout), args.heldout_n)
    if args.interleave:  # MT-Bench and HumanEval alternate, so a stopped run has both sets
        prompts = interleave(prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    costs, records, tree_of = [], {}, {}
    t_start = time.perf_counter()
    with stderr_progress() as progress:
        if prompts:
            engines = {} if args.no_plain else {"plain": (None, make_engine(args, None))}
            if not engines and not trees:
                raise YggError("nothing to run: --plain-only with --no-plain")
            for name, tp in trees:
                engines[name] = (tp, make_engine(args, tp))
            recs = {name: [] for name in engines}
            task = progress.add_task("prompts", total=len(prompts))
            for pid, ids in prompts:
                for name, (tp, eng) in engines.items():
                    res = eng.generate(ids, params)
                    r = {"id": pid, "n": len(res.token_ids), "tokens": res.token_ids}
                    if tp is not None:
                        s = res.stats
                        r.update(aal=s["aal"], accepted=s["accepted_tokens"], verify=s["verify_calls"],
                                 abp=s["accept_by_position"])
                    recs[name].append(r)
                progress.update(task, advance=1, description=f"prompts ({pid})")
                if args.out:  # partial results survive an interrupted run (usable by --merge)
                    part = {
                        "eval": "drafter", "partial": True, "drafter": args.drafter, "dtype": args.dtype,
                        "mode": args.mode, "max_new_tokens": args.max_new_tokens,
                        "trees": {k: (None if v is None else list(astuple(v))) for k, (v, _) in engines.items()},
                        "per_prompt": recs,
                    }
                    Path(args.out).write_text(json.dumps(part))
                if not sys.stderr.isatty():  # a log file: one line per prompt
                    done = len(next(iter(recs.values())))
                    aal = " ".join(f"{n}={recs[n][-1]['aal']:.2f}" for n in recs if "aal" in recs[n][-1])
                    print(f"[{time.strftime('%H:%M:%S')}] {done}/{len(prompts)} {pid} {aal}", file=sys.stderr, flush=True)
            records = recs
            tree_of = {name: tp for name, (tp, _) in engines.items()}
        if args.cost:
            modes = ["reference", "performance"] if args.cost_mode == "both" else [args.cost_mode]
            task = progress.add_task("cost", total=len(modes))
            for mode in modes:
                costs.append(measure_cost(args, tokenizer, mode, args.cost_width, args.cost_repeats, args.cost_context))
                progress.update(task, advance=1)

    summary = {
        "eval": "drafter",
        "drafter": args.drafter,
        "model": str(src.path),
        "dtype": args.dtype,
        "mode": args.mode,
        "max_new_tokens": args.max_new_tokens,
        "prompts": [pid for pid, _ in prompts],
        "trees": {k: (None if v is None else list(astuple(v))) for k, v in tree_of.items()},
        "cost": costs,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - t_start,
    }
    return report(summary, records, args.out)


def report(summary: dict, records: dict, out: str | None) -> int:
    """Summaries (equality against the "plain" records when present), table, JSON line last."""
    from rich.console import Console
    from rich.table import Table

    plain = {r["id"]: r["tokens"] for r in records.get("plain", [])}
    for name, recs in records.items():
        if name != "plain" and plain:
            for r in recs:
                if r["id"] in plain:
                    r["equal"] = r["tokens"] == plain[r["id"]]
    trees = {k: (None if v is None else TreeParams(*v)) for k, v in summary["trees"].items()}
    rows = [summarise(name, trees[name], recs) for name, recs in records.items()]
    costs = summary.get("cost", [])
    summary = {**summary, "rows": rows}
    console = Console(width=None if sys.stdout.isatty() else 140)
    if rows:
        t = Table(title=f"{summary['drafter']} drafter, greedy, {summary['dtype']}, {summary['max_new_tokens']} new tokens")
        for c in ("config", "W_d,D,W_v,k", "prompts", "AAL mean", "AAL pooled", "AAL mt-bench", "AAL humaneval", "accept by position", "identical"):
            t.add_column(c)
        for r in rows:
            if r["tree"] is None:
                t.add_row(r["config"], "-", str(r["prompts"]), "-", "-", "-", "-", "-", f"{r['new_tokens']} tokens")
                continue
            t.add_row(
                r["config"], ",".join(map(str, r["tree"])), str(r["prompts"]), f"{r['aal_mean']:.3f}", f"{r['aal_pooled']:.3f}",
                f"{r.get('aal_mtbench', float('nan')):.3f}", f"{r.get('aal_humaneval', float('nan')):.3f}",
                " ".join(f"{a:.2f}" for a in r["accept_by_position"]),
                f"{r['identical']}/{r['compared']}" if r["compared"] else "-",
            )
        console.print(t)
    if costs:
        t = Table(title="one drafter step vs one target verify step (median ms)")
        for c in ("mode", "dtype", "width", "context", "drafter ms", "verify ms", "ratio"):
            t.add_column(c)
        for c in costs:
            t.add_row(c["mode"], c["dtype"], str(c["width"]), str(c["context"]), f"{c['draft_ms']:.2f}",
                      f"{c['verify_ms']:.2f}", f"{c['ratio']:.3f}")
        console.print(t)
    if out:
        Path(out).write_text(json.dumps({**summary, "per_prompt": records}, indent=2))
    print(json.dumps(summary), flush=True)
    return 0


def merge(args) -> int:
    """Combine the --out files of runs split across processes (e.g. plain / tree / chain)."""
    records: dict = {}
    summary = None
    for f in args.merge:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            raise YggError(f"cannot read {f}: {e}") from None
        if summary is None:
            summary = {k: v for k, v in d.items() if k not in ("rows", "per_prompt")}
            summary["trees"] = {}
            summary["cost"] = []
            summary["merged_from"] = []
        for k in ("drafter", "dtype", "max_new_tokens"):
            if d.get(k) != summary.get(k):
                raise YggError(f"{f}: {k} {d.get(k)!r} differs from {summary.get(k)!r}")
        summary["cost"] += d.get("cost", [])
        summary["merged_from"].append(str(f))
        summary["wall_s"] = max(summary.get("wall_s", 0), d.get("wall_s", 0))
        for name, recs in d.get("per_prompt", {}).items():
            if name in summary["trees"] and summary["trees"][name] != d["trees"][name]:
                raise YggError(f"{f}: config {name!r} has another tree shape in an earlier file")
            have = {r["id"] for r in records.get(name, [])}
            dup = [r["id"] for r in recs if r["id"] in have]
            if dup:
                raise YggError(f"{f}: config {name!r} prompt {dup[0]} appears in two files")
            records.setdefault(name, []).extend(recs)
        summary["trees"].update(d["trees"])
    return report(summary, records, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="default", help="'default', an EAGLE head directory, 'self', ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mode", default="reference", choices=["reference", "performance"])
    p.add_argument("--mtbench", type=int, default=40)
    p.add_argument("--humaneval", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--heldout", metavar="DIR", help="also decode the held-out synthetic chat prompts of these transcripts")
    p.add_argument("--heldout-n", type=int, default=40, help="held-out conversations (with --heldout)")
    p.add_argument("--interleave", action="store_true",
                   help="alternate MT-Bench and HumanEval prompts (a stopped run keeps both sets)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--tree", action="append", help="NAME=W_d,D,W_v,top_k (repeatable)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain greedy run (no equality check)")
    p.add_argument("--plain-only", action="store_true", help="run only plain greedy decoding (for --merge)")
    p.add_argument("--merge", action="extend", nargs="+", metavar="JSON", help="combine the --out files of split runs")
    p.add_argument("--cost", action="store_true", help="time one drafter step vs one target verify step")
    p.add_argument("--cost-mode", default="both", choices=["reference", "performance", "both"])
    p.add_argument("--cost-width", type=int, default=8)
    p.add_argument("--cost-context", type=int, default=256)
    p.add_argument("--cost-repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="also write the JSON (with per-prompt records) here")
    args = p.parse_args(argv)
    return run_reporting("eval_drafter", run, args)


if __name__ == "__main__":
    sys.exit(main())
