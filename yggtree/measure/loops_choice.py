"""Where the kernel library's parallel loops run in a compiled plan on this machine: OpenMP, or the
library's own thread pool (``runtime/kernels.py`` ``loop_pool``; ``runtime/csrc/loops.cpp`` says why a
pool: a two-thread OpenMP region costs microseconds to start where the CPUs sit apart, ~180 regions
a w4a8 step). Measured once per compile by ``yggtree compile`` and recorded in the manifest
(``loops``), which ``build_plan_engine`` reads.

Only for a plan whose every product, the target's and its drafter's, runs on the library
(``aoti.loops_serial``: the w4a8 format, any format on the tiled kernel), whose packages are compiled
with inductor's own loops serial so that the library's are the step's only parallel regions, and at
2+ threads. The compiled plan's plain decoding (as ``yggtree run --plan P --no-speculate`` runs it;
a speculative plan's tree steps run the same packages and kernels) decodes a few calibration chat prompts
(never evaluation prompts) with the loops on OpenMP and on the pool in turn, the order alternating by
prompt, over a few rounds (ended as soon as the remaining pairs cannot change the choice); the pool is
chosen when its median per-prompt speed-up is above 1 and it was faster on more than half of the
prompts. ``YGGTREE_LOOPS=openmp`` (or ``pool``) records that
choice without measuring; ``auto``, the default, measures.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from ..errors import YggError, env_choice

LOOPS_ENV = "YGGTREE_LOOPS"  # auto | openmp | pool (module docstring)
CHOICES = ("openmp", "pool")

ROUNDS = 3  # of the calibration prompts of ``probe_prompts`` (after one warm-up each way)


def decide(pairs: list[tuple[float, float]]) -> tuple[str, dict]:
    """``("pool" | "openmp", stats)`` from ``pairs`` of (ms per token on OpenMP, on the pool) of
    the same prompts: the pool where its median speed-up is above 1 and it won more than half of
    the pairs (pure)."""
    ratios = [a / b for a, b in pairs]
    stats = {"speedup": statistics.median(ratios), "won": sum(r > 1 for r in ratios) / len(ratios),
             "pairs": len(ratios)}
    return ("pool" if stats["speedup"] > 1 and stats["won"] > 0.5 else "openmp"), stats


def settled(pairs: list[tuple[float, float]], total: int) -> bool:
    """Whether :func:`decide` over ``total`` pairs is already known from the first ``pairs``
    (pure): the pool won more than half of ``total`` (then more than half of the ratios are above 1,
    and so is their median), or lost at least half (it cannot win more than half). The
    measurement stops there: what it decides is what all ``total`` pairs would."""
    won = sum(a / b > 1 for a, b in pairs)
    return 2 * won > total or 2 * (len(pairs) - won) >= total


def forced() -> str | None:
    """The choice ``YGGTREE_LOOPS`` names, None for ``auto`` or unset; YggError in one line for
    anything else."""
    return env_choice(LOOPS_ENV, CHOICES)


def measure_compiled(plan, art: str | Path, say=None) -> dict:
    """The loops' record of ``plan`` (a Plan) compiled in ``art`` (its manifest's ``loops``),
    measured now on its plain engine (or forced by ``YGGTREE_LOOPS``). ``say(line)`` hears the
    result."""
    choice = forced()
    if choice is not None:
        return {"choice": choice, "forced": LOOPS_ENV}
    from .probe_prompts import decode_ms_per_token, probe_requests
    from ..runtime.build import build_plan_engine

    engine, tok = build_plan_engine(plan, art, speculate=False)
    threads = engine.plan_threads(engine.plan)
    prompts, params = probe_requests(tok, plan.max_context)
    base = engine.cfg

    def run(ids, pool: bool) -> float:
        engine.cfg = replace(base, loop_pool=pool)
        return decode_ms_per_token(engine.generate(ids, params))

    try:
        run(prompts[0], False), run(prompts[0], True)  # warm-up
        pairs, order = [], [(rnd, i, ids) for rnd in range(ROUNDS) for i, ids in enumerate(prompts[1:])]
        for n, (rnd, i, ids) in enumerate(order):
            if settled(pairs, len(pairs) + len(order) - n):  # the rest cannot change the choice
                break
            if (i + rnd) % 2:
                b = run(ids, True); a = run(ids, False)
            else:
                a = run(ids, False); b = run(ids, True)
            if a is not None and b is not None:
                pairs.append((a, b))
    finally:
        engine.cfg = base
    if not pairs:
        raise YggError("the loops measurement decoded no tokens")
    choice, stats = decide(pairs)
    if say is not None:
        say(f"kernel loops measured on this machine at {threads} threads: {choice} (the pool "
            f"{stats['speedup']:.3f}x OpenMP, faster on {stats['won']:.0%} of {stats['pairs']} prompts)")
    return {"choice": choice, "threads": threads, "stats": stats,
            "ms_per_token": [[round(a, 4), round(b, 4)] for a, b in pairs]}
