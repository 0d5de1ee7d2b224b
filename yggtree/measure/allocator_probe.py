"""One child of the allocator measurement (``yggtree.measure.allocator_choice``): the compiled
plan's plain decoding on the allocator this process runs on, as one JSON line on stdout.

    python -m yggtree.measure.allocator_probe PLAN.yaml [--compile-root DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ..errors import YggError
from .probe_prompts import NEW_TOKENS, PROMPTS, decode_ms_per_token, probe_requests


def probe(plan_path: str, compile_root: str, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS) -> float:
    """Median decode ms per token (prefill excluded) of the compiled plan as ``yggtree run --plan``
    runs it (a speculative plan with its policy: an allocator may speed a one-row step and not a
    tree's) over ``prompts`` calibration chat prompts, after one warm-up prompt (in this process)."""
    from ..bench import plan_runner

    plan, _, make = plan_runner(plan_path, compile_root=compile_root)
    engine, tok, policy = make()
    ids, params = probe_requests(tok, plan.max_context, prompts, new_tokens)
    ms = []
    for i, prompt in enumerate(ids):
        t = decode_ms_per_token(engine.generate(prompt, params, policy=policy))
        if i and t is not None:
            ms.append(t)
    if not ms:
        raise YggError("the allocator measurement decoded no tokens")
    return statistics.median(ms)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m yggtree.measure.allocator_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("plan")
    p.add_argument("--compile-root", default="compile")
    args = p.parse_args(argv)
    try:
        ms = probe(args.plan, args.compile_root)
    except YggError as e:
        sys.stderr.write(f"yggtree: error: {e}\n")
        return 1
    from ..runtime.allocator import running

    print(json.dumps({"ms_per_token": ms, "allocator": running()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
