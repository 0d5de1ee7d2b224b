#!/usr/bin/env python
"""Two code versions on the same prompts: paired speed ratio and identical outputs per system.

Reads the ``OUT.rows.jsonl`` files that ``scripts/bench_objective.py`` or ``scripts/bench_stages.py``
writes, one run of each
version, side by side on the same machine (one process per version, started together, the same
prompts and systems), and reports per system: decode speed of B over A (summed tokens over summed
decode time, 95% bootstrap interval over prompts, ``yggtree.bench.paired_ratio``) and how many
prompts produced the same tokens in both versions.

    python scripts/ab_versions.py --a before.json.rows.jsonl --b after.json.rows.jsonl \\
        --label-a 594856f --label-b 577162c
"""

from __future__ import annotations

import argparse
import json
import sys

from yggtree.bench import paired_ratio
from yggtree.errors import YggError, run_reporting


def read_rows(path: str) -> dict[str, dict]:
    """Prompt id -> row of a bench_objective (``prompt``) or bench_stages (``id``) rows file."""
    rows = {}
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows[row["prompt"] if "prompt" in row else row["id"]] = row
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise YggError(f"cannot read rows file {path}: {e}") from None
    return rows


def compare(rows_a: dict[str, dict], rows_b: dict[str, dict]) -> list[dict]:
    """One record per system present in both files: B/A speed and identical outputs."""
    prompts = sorted(set(rows_a) & set(rows_b))
    if not prompts:
        raise YggError("the two rows files have no prompt in common")
    systems = [s for s, v in rows_a[prompts[0]].items()
               if isinstance(v, dict) and "decode_s" in v and s in rows_b[prompts[0]]]
    out = []
    for system in systems:
        joined = [{"a": rows_a[p][system], "b": rows_b[p][system]} for p in prompts]
        r = paired_ratio(joined, "b", "a")
        same = sum(j["a"].get("tokens") == j["b"].get("tokens") for j in joined)
        out.append({"system": system, "prompts": len(prompts), "b_over_a": r["ratio"],
                    "ci95": r["ci95"], "b_faster_share": r["a_faster_share"],
                    "same_tokens": same})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="rows file of version A (the baseline)")
    ap.add_argument("--b", required=True, help="rows file of version B")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    args = ap.parse_args(argv)
    return run_reporting("ab_versions", report, args)


def report(args) -> int:
    result = compare(read_rows(args.a), read_rows(args.b))
    print(f"| system | prompts | {args.label_b} / {args.label_a} decode speed (95% CI) "
          f"| {args.label_b} faster on | identical tokens |")
    print("|---|---|---|---|---|")
    for r in result:
        lo, hi = r["ci95"]
        print(f"| {r['system']} | {r['prompts']} | {r['b_over_a']:.3f} ({lo:.3f}-{hi:.3f}) "
              f"| {r['b_faster_share']:.0%} | {r['same_tokens']}/{r['prompts']} |")
    print(json.dumps({"command": "ab_versions", "a": args.a, "b": args.b,
                      "label_a": args.label_a, "label_b": args.label_b, "systems": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
