#!/usr/bin/env python
"""Fit the lookup calibration (yggtree/runtime/lookup.py): P(target accepts a lookup edge) by
(match length, continuation share), on CALIBRATION prompts only (never MT-Bench or HumanEval).

The target answers ``--prompts`` calibration chat prompts greedily (plain decoding). Then, at every
position of every answer, as if a speculation step's root sat there, the lookup index over the
text so far proposes its trie (every node, no budget), and each edge whose parent path is the true
continuation counts as accepted iff its token is the true next token: an edge probability is the
acceptance given the parent accepted, which is what path values multiply. Per cell, the rate is
shrunk toward its match-length row's rate (the row toward the overall rate) with ``--prior``
pseudo-edges.

    OMP_NUM_THREADS=1 python scripts/fit_lookup.py --prompts 40 --max-new-tokens 128 \\
        --out yggtree/assets/lookup_calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


LENGTHS = (1, 2, 3, 4, 5, 6, 8, 12)  # match-length rows (lower bounds)
SHARES = (0.0, 0.34, 0.5, 0.67, 1.0)  # continuation-share columns (lower bounds; 1.0 = all agree)


def edge_outcomes(tokens: list[int], start: int, max_depth: int, max_occurrences: int):
    """(match length, share, accepted) of every trie edge below a correct parent, at every root
    position from ``start - 1`` on (the root is the last prompt token or an answer token)."""
    from yggtree.runtime.lookup import LookupCalibration, LookupIndex, propose

    flat = LookupCalibration((1,), (0.0,), ((0.5,),))  # values unused: every node is kept
    idx = LookupIndex()
    idx.extend(tokens[:start])
    out = []
    for root in range(start - 1, len(tokens) - 1):
        if root >= start:
            idx.extend(tokens[root : root + 1])
        prop = propose(idx, flat, 10_000, max_depth, max_occurrences)
        ok = [True]  # ok[j]: node j's path (0 = the root) is the true continuation
        for i in range(len(prop)):
            par, dep = prop.parent[i], prop.depth[i]
            truth = tokens[root + dep] if root + dep < len(tokens) else None
            hit = ok[par] and truth is not None and prop.token[i] == truth
            ok.append(hit)
            if ok[par] and truth is not None:
                out.append((prop.match + dep - 1, prop.share[i], hit))
    return out


def _without_texts(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--texts":
            skip = True
        elif not a.startswith("--texts="):
            out.append(a)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--first", type=int, default=0, help="first calibration prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--max-occurrences", type=int, default=16)
    ap.add_argument("--prior", type=float, default=4.0, help="pseudo-edges at the overall rate per cell")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--texts", help="JSON cache of the greedy answers (reused when it exists)")
    args = ap.parse_args(argv)

    import torch

    from yggtree.data import calibration_chat_prompts
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.loading import encode_auto
    from yggtree.runtime.lookup import LOOKUP_CALIBRATION_KIND

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cache = Path(args.texts) if args.texts else None
    if cache is not None and cache.is_file():
        texts = json.loads(cache.read_text())
    else:
        engine, tok = build_engine(EngineSpec())  # the embedded target, plain decoding
        texts = []
        prompts = calibration_chat_prompts(args.first + args.prompts)[args.first :]
        for i, p in enumerate(prompts):
            ids = encode_auto(tok, p.text)[-(engine.cfg.max_context - args.max_new_tokens - 1) :]
            res = engine.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens))
            texts.append({"id": p.id, "prompt": ids, "answer": res.token_ids})
            print(f"[{i + 1}/{len(prompts)}] {p.id}: {len(res.token_ids)} tokens", file=sys.stderr)
        if cache is not None:
            cache.write_text(json.dumps(texts))
    edges = []
    for t in texts:
        edges += edge_outcomes(t["prompt"] + t["answer"], len(t["prompt"]), args.max_depth, args.max_occurrences)
    n_all = len(edges)
    rate = sum(h for *_, h in edges) / max(n_all, 1)
    acc = [[0] * len(SHARES) for _ in LENGTHS]
    cnt = [[0] * len(SHARES) for _ in LENGTHS]
    import bisect

    for length, share, hit in edges:
        i = max(bisect.bisect_right(LENGTHS, length) - 1, 0)
        j = max(bisect.bisect_right(SHARES, share) - 1, 0)
        cnt[i][j] += 1
        acc[i][j] += int(hit)
    # a cell shrinks toward its match-length row's rate, the row toward the overall rate
    row = [(sum(acc[i]) + args.prior * rate) / (sum(cnt[i]) + args.prior) for i in range(len(LENGTHS))]
    table = [[round((acc[i][j] + args.prior * row[i]) / (cnt[i][j] + args.prior), 4) for j in range(len(SHARES))]
             for i in range(len(LENGTHS))]
    out = {"kind": LOOKUP_CALIBRATION_KIND, "version": 1, "lengths": list(LENGTHS), "shares": list(SHARES),
           "table": table, "counts": cnt,
           "fit": {"prompts": f"calibration_chat_prompts[{args.first}:{args.first + args.prompts}]",
                   "max_new_tokens": args.max_new_tokens, "target": "default (float32, greedy)",
                   "edges": n_all, "overall_rate": round(rate, 4), "prior_edges": args.prior,
                   "max_depth": args.max_depth, "max_occurrences": args.max_occurrences,
                   # the command without --texts (a local cache of the answers: it changes nothing)
                   "command": "python scripts/fit_lookup.py " + " ".join(_without_texts(
                       argv if argv is not None else sys.argv[1:]))}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{n_all} edges, overall acceptance {rate:.3f}; wrote {args.out} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    for i, length in enumerate(LENGTHS):
        print(f"  n >= {length:2d}: " + "  ".join(f"{table[i][j]:.2f} ({cnt[i][j]})" for j in range(len(SHARES))),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("fit_lookup", lambda _: main(), None))
