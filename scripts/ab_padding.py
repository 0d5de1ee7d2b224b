#!/usr/bin/env python
"""In-process A/B of padded vs unpadded short packed products (runtime/packed.py ``MIN_ROWS``).

Plain greedy decoding on a compiled plan's engine, every prompt decoded once with products of 1-3
rows padded to ``MIN_ROWS`` = 4 and once unpadded (``MIN_ROWS`` = 1), the order alternating per
prompt and repeat so machine drift hits both alike. Prints the mean and median decode ms per
token of each, their ratio, and whether the tokens are identical. A measurement, not a test.

    OMP_NUM_THREADS=1 python scripts/ab_padding.py --plan PLAN.yaml
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from yggtree.errors import run_reporting


def run(args) -> int:
    import yggtree.runtime.packed as packed
    from yggtree.data import load_prompts
    from yggtree.offline.compile import ensure_artifacts
    from yggtree.plan import load_plan
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.policy import FixedPolicy, StepChoice

    torch.set_num_threads(args.threads)
    plan = load_plan(args.plan)
    engine, tok = build_plan_engine(plan, ensure_artifacts(plan, False, args.compile_root))
    prompts = load_prompts(args.prompts, args.prompts, tok)
    plain = FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1) if plan.speculative else None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    engine.generate(prompts[0][1], params, policy=plain)  # warm-up
    ms, toks = {1: [], packed.MIN_ROWS: []}, {1: [], packed.MIN_ROWS: []}
    settings = sorted(ms)
    try:
        for rep in range(args.repeats):
            for i, (_, ids) in enumerate(prompts):
                for m in settings if (i + rep) % 2 == 0 else settings[::-1]:
                    packed.MIN_ROWS = m
                    r = engine.generate(ids, params, policy=plain)
                    ms[m].append((r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1))
                    toks[m].append(r.token_ids)
    finally:
        packed.MIN_ROWS = settings[-1]
    lo, hi = settings
    for m in settings:
        print(f"MIN_ROWS {m}: mean {sum(ms[m]) / len(ms[m]):.2f} ms/token, median {statistics.median(ms[m]):.2f}")
    print(f"unpadded / padded: {sum(ms[lo]) / sum(ms[hi]):.3f}; tokens identical: {toks[lo] == toks[hi]}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="a plan tuned for this machine (profiles/*.yaml)")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench and as many HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile-root", default="compile")
    return run_reporting("ab_padding", run, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
