#!/usr/bin/env python
"""In-process A/B of padded vs unpadded short packed products on whole decode steps.

``yggtree profile`` chooses the padding of short packed products (``min_rows``, see
runtime/packed.py) from a microbenchmark of one step's products; this checks the choice on plain
greedy decoding. One plain engine of the plan's target and dtype per ``min_rows`` (public API:
``EngineSpec(min_rows=...)``, dynamo graphs, since a compiled plan's packages hold one padding),
every prompt decoded once by each, the order rotating per prompt and repeat so machine drift hits
all alike. Prints the mean and median decode ms per token of each, their ratio to no padding, and
whether the tokens are identical. A measurement, not a test.

    OMP_NUM_THREADS=1 python scripts/ab_padding.py --plan PLAN.yaml               # 1 vs its profile's
    OMP_NUM_THREADS=1 python scripts/ab_padding.py --plan PLAN.yaml --min-rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from yggtree.errors import YggError, run_reporting


def run(args) -> int:
    from yggtree.data import load_prompts
    from yggtree.plan import load_plan
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.padding import plan_min_rows

    torch.set_num_threads(args.threads)
    plan = load_plan(args.plan)
    if args.min_rows:
        try:
            settings = sorted({int(v) for v in args.min_rows.split(",")})
        except ValueError:
            raise YggError(f"--min-rows must be a comma-separated list of integers, got {args.min_rows!r}") from None
    else:
        settings = sorted({1, plan_min_rows(plan)})
    if len(settings) < 2 or settings[0] < 1:
        raise YggError(f"--min-rows: at least two values >= 1 to compare, got {settings} "
                       "(the plan's profile does not pad: pass --min-rows)")
    engines, tok = {}, None
    for m in settings:
        spec = EngineSpec(model=plan.target, dtype=plan.dtype, max_context=plan.max_context,
                          prefill_chunk=plan.prefill_chunk, min_rows=m)
        engines[m], tok = build_engine(spec)
    prompts = load_prompts(args.prompts, args.prompts, tok)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    for engine in engines.values():
        engine.generate(prompts[0][1], params)  # warm-up
    ms = {m: [] for m in settings}
    toks = {m: [] for m in settings}
    for rep in range(args.repeats):
        for i, (_, ids) in enumerate(prompts):
            k = (i + rep) % len(settings)
            for m in settings[k:] + settings[:k]:
                r = engines[m].generate(ids, params)
                ms[m].append((r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1))
                toks[m].append(r.token_ids)
    base = settings[0]
    for m in settings:
        print(f"min_rows {m}: mean {sum(ms[m]) / len(ms[m]):.2f} ms/token, median {statistics.median(ms[m]):.2f}, "
              f"x min_rows {base}: {sum(ms[m]) / sum(ms[base]):.3f}; tokens identical: {toks[m] == toks[base]}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="a plan naming this machine's profile (its target, dtype "
                   "and padding)")
    p.add_argument("--min-rows", default=None, help="comma-separated min_rows to compare (default: 1 and "
                   "the plan's profile's)")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench and as many HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    return run_reporting("ab_padding", run, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
