#!/usr/bin/env python
"""O2 ablation (Yggdrasil section 7.4): the same tree decoding, eager vs compiled graphs.

Both systems decode with the plan's drafter and one fixed tree (``--tree W_d,D,W_v``, each a
compiled choice of the plan) on an engine built from the same plan (same cache envelope):

- ``eager``: reference mode (plain PyTorch ops, no graphs);
- ``compiled``: performance mode running the plan's AOTInductor packages from compile/<name>/;
- ``jit`` (only with ``--jit``): performance mode compiling with torch.compile/dynamo in-process.

Prompts (the first MT-Bench first turns and HumanEval prompts, chat template, the two sets
alternating) run one at a time, every (dtype, system) on the prompt before the next prompt, the
order rotating per prompt, so drift of a shared machine hits all systems alike. Reported per
dtype and system: tokens/s (new tokens / wall time of ``generate``), AAL, and how many greedy
outputs equal the eager system's; the ratio compiled/eager is the O2 speed-up. ``--rows`` keeps
every prompt's timings as it finishes. Output: a table, then ONE JSON line. One run; timings from different runs are not comparable.

    python scripts/ablation_o2.py --prompts-mtbench 5 --prompts-humaneval 5 --max-new-tokens 64 \\
        --dtypes float32,bfloat16 --threads 1 --compile-missing

The bfloat16 plan is the ``--plan`` with ``dtype: bfloat16`` and the name ``<name>-bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from yggtree.errors import YggError, run_reporting

DEFAULT_PLAN = Path(__file__).resolve().parents[1] / "yggtree" / "plans" / "default.yaml"


def plan_for(base, dtype: str):
    """``base`` at ``dtype`` (renamed ``<name>-<dtype>`` unless it already has that dtype)."""
    if base.dtype == dtype:
        return base
    return replace(base, dtype=dtype, name=f"{base.name}-{dtype}")


def engines_for(plan, tree, art: Path, jit: bool) -> dict:
    from yggtree.runtime.build import build_plan_engine, fixed_policy

    out = {}
    for name, artifacts, mode in (("eager", None, "reference"), ("compiled", art, "performance"),
                                  ("jit", None, "performance")):
        if name == "jit" and not jit:
            continue
        t0 = time.perf_counter()
        engine, tok = build_plan_engine(plan, artifacts, mode)
        policy = fixed_policy(engine, plan, tree[0], tree[2], tree[1])
        out[name] = (engine, time.perf_counter() - t0, policy)
    return out, tok


def summarise(rows: list[dict], systems: list[str]) -> dict:
    res = {}
    for s in systems:
        n = sum(r[s]["new_tokens"] for r in rows)
        secs = sum(r[s]["total_s"] for r in rows)
        steps = sum(r[s]["verify_calls"] for r in rows)
        res[s] = {
            "new_tokens": n,
            "tok_s": n / secs if secs else 0.0,
            "aal": n / steps if steps else float("nan"),
            "same_as_eager": sum(r[s]["tokens"] == r["eager"]["tokens"] for r in rows),
            "per_prompt_ratio_median": statistics.median(
                r[s]["total_s"] / max(r[s]["new_tokens"], 1) / (r["eager"]["total_s"] / max(r["eager"]["new_tokens"], 1))
                for r in rows
            ) if s != "eager" else 1.0,
        }
    return res


def report(args, results: dict, meta: dict, n_prompts: int, partial: bool = False) -> None:
    """The table and the JSON line of a run (or of a --summarise'd rows file)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"O2 ablation: tree {args.tree} (W_d,D,W_v), {n_prompts} prompts x {args.max_new_tokens} tokens, "
                        f"{args.threads} thread(s), one run")
    for c in ("dtype", "system", "tok/s", "x eager", "median per-prompt x", "AAL", "= eager tokens", "build s"):
        table.add_column(c, justify="left" if c in ("dtype", "system") else "right")
    for dtype, res in results.items():
        for s, r in res.items():
            table.add_row(dtype, s, f"{r['tok_s']:.2f}", f"{r['tok_s'] / res['eager']['tok_s']:.3f}",
                          f"{1 / r['per_prompt_ratio_median']:.3f}", f"{r['aal']:.2f}",
                          f"{r['same_as_eager']}/{n_prompts}", f"{meta.get(dtype, {}).get('build_s', {}).get(s, float('nan')):.1f}")
    Console(width=None if sys.stdout.isatty() else 150).print(table)
    line = {
        "command": "ablation_o2", "tree": args.tree, "threads": args.threads,
        "prompts": {"mtbench": args.prompts_mtbench, "humaneval": args.prompts_humaneval},
        "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
        "results": {d: {s: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                        for s, r in res.items()} for d, res in results.items()},
        "speedup": {d: round(res["compiled"]["tok_s"] / res["eager"]["tok_s"], 4) for d, res in results.items()},
        "meta": meta,
        "partial": partial, "prompts_done": n_prompts,
    }
    print(json.dumps(line), flush=True)


def summarise_rows(args) -> int:
    """Table and JSON line from a --rows file (a stopped run: only the prompts it finished)."""
    by_dtype: dict[str, list[dict]] = {}
    try:
        lines = Path(args.summarise).read_text().splitlines()
    except OSError as e:
        raise YggError(f"cannot read rows file {args.summarise}: {e.strerror}") from None
    if not lines:
        raise YggError(f"rows file {args.summarise} is empty: no prompt finished")
    for line in lines:
        r = json.loads(line)
        by_dtype.setdefault(r.pop("dtype"), []).append(r)
    n = min(len(v) for v in by_dtype.values())
    systems = [k for k in by_dtype[next(iter(by_dtype))][0] if k != "prompt"]
    results = {d: summarise(rows[:n], systems) for d, rows in by_dtype.items()}
    report(args, results, {}, n, partial=True)
    return 0


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from yggtree.data import interleave, load_prompts
    from yggtree.progress import stderr_progress
    from yggtree.offline.compile import ensure_artifacts
    from yggtree.plan import load_plan
    from yggtree.runtime.engine import SamplingParams

    torch.set_num_threads(args.threads)
    try:
        tree = tuple(int(x) for x in args.tree.split(","))
        assert len(tree) == 3
    except (ValueError, AssertionError):
        raise YggError(f"--tree wants W_d,D,W_v, got {args.tree!r}") from None
    base = load_plan(args.plan)
    if not base.speculative:
        raise YggError(f"plan {base.name!r} has no drafter: nothing to speculate with")
    dtypes = args.dtypes.split(",")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    engines, meta, tok = {}, {}, None
    for dtype in dtypes:  # every graph is ready before the first prompt runs
        plan = plan_for(base, dtype)
        art = ensure_artifacts(plan, args.compile_missing, args.compile_root)
        engines[dtype], tok = engines_for(plan, tree, art, args.jit)
        meta[dtype] = {"plan": plan.name, "build_s": {s: round(e[1], 2) for s, e in engines[dtype].items()}}
    systems = list(engines[dtypes[0]])
    prompts = interleave(load_prompts(args.prompts_mtbench, args.prompts_humaneval, tok))
    rows: dict[str, list[dict]] = {d: [] for d in dtypes}
    runs = [(d, s) for d in dtypes for s in systems]
    with stderr_progress() as progress:
        task = progress.add_task("prompts", total=len(prompts))
        for i, (pid, ids) in enumerate(prompts):
            row = {d: {"prompt": pid} for d in dtypes}
            # every (dtype, system) on this prompt before the next prompt, the order rotating
            for d, s in runs[i % len(runs):] + runs[: i % len(runs)]:
                t0 = time.perf_counter()
                res = engines[d][s][0].generate(ids, params, policy=engines[d][s][2])
                row[d][s] = {"total_s": time.perf_counter() - t0, "new_tokens": len(res.token_ids),
                             "verify_calls": res.stats.get("verify_calls", 0), "tokens": res.token_ids}
            for d in dtypes:
                rows[d].append(row[d])
                if args.rows:  # one line per prompt as it finishes: a stopped run keeps its rows
                    with open(args.rows, "a") as f:
                        f.write(json.dumps({"dtype": d, **row[d]}) + "\n")
            progress.advance(task)
    results = {d: summarise(rows[d], systems) for d in dtypes}

    report(args, results, meta, len(prompts))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default=str(DEFAULT_PLAN), help="plan YAML (default: the shipped default plan)")
    p.add_argument("--tree", default="4,4,16", help="W_d,D,W_v: one compiled choice of the plan (default 4,4,16)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts-mtbench", type=int, default=40)
    p.add_argument("--prompts-humaneval", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile-root", default="compile")
    p.add_argument("--compile-missing", action="store_true", help="compile a missing/stale plan first")
    p.add_argument("--rows", metavar="FILE", help="append each prompt's timings to FILE (JSON lines) as it finishes")
    p.add_argument("--summarise", metavar="FILE", help="only report a --rows file of an earlier (stopped) run")
    p.add_argument("--jit", action="store_true", help="also time dynamo's in-process compile (slow to build)")
    args = p.parse_args(argv)
    return run_reporting("ablation_o2", summarise_rows if args.summarise else run, args)


if __name__ == "__main__":
    sys.exit(main())
