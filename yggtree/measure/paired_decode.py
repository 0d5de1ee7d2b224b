"""Two settings of one compiled engine, timed by decoding: the measurement behind the choices a
compiled plan records after its packages are built (where the kernel library's loops run,
``loops_choice``; how far its products prefetch their weights, ``prefetch_choice``).

A setting that wins a microbenchmark can lose a decode step, whose products run between the
attention, the norms and the caches' traffic; so these choices are judged on what a run does. The
plan's plain engine decodes a few calibration chat prompts (``probe_prompts``, never evaluation
prompts) with setting ``a`` and with setting ``b`` in turn, the order alternating by prompt, over a
few rounds, ended as soon as the remaining pairs cannot change the choice. ``b`` is chosen where
its median per-prompt speed-up over ``a`` is above 1 and it was faster on more than half of the
prompts: a setting that is faster only by the noise of a shared host is as likely to be kept as
not, one that is slower is not kept.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from ..errors import YggError

ROUNDS = 3  # of the calibration prompts of ``probe_prompts`` (after one warm-up each way)


def decide(pairs: list[tuple[float, float]]) -> tuple[bool, dict]:
    """``(b wins, stats)`` from ``pairs`` of (ms per token with ``a``, with ``b``) on the same
    prompts: ``b`` wins where its median speed-up is above 1 and it was faster on more than half
    of the pairs (pure)."""
    ratios = [a / b for a, b in pairs]
    stats = {"speedup": statistics.median(ratios), "won": sum(r > 1 for r in ratios) / len(ratios),
             "pairs": len(ratios)}
    return stats["speedup"] > 1 and stats["won"] > 0.5, stats


def settled(pairs: list[tuple[float, float]], total: int) -> bool:
    """Whether :func:`decide` over ``total`` pairs is already known from the first ``pairs``
    (pure): ``b`` won more than half of ``total`` (then more than half of the ratios are above 1,
    and so is their median), or lost at least half (it cannot win more than half)."""
    won = sum(a / b > 1 for a, b in pairs)
    return 2 * won > total or 2 * (len(pairs) - won) >= total


def measure_pair(engine, tok, max_context: int, a: dict, b: dict) -> list[tuple[float, float]]:
    """(ms per token with ``a``, with ``b``) per calibration prompt on ``engine`` (a plain
    engine), each setting a dict of :class:`~yggtree.runtime.engine.EngineConfig` fields applied
    for its decodes; the engine's config is restored after. YggError if nothing decoded."""
    from .probe_prompts import decode_ms_per_token, probe_requests

    prompts, params = probe_requests(tok, max_context)
    base = engine.cfg

    def run(ids, setting: dict) -> float | None:
        engine.cfg = replace(base, **setting)
        return decode_ms_per_token(engine.generate(ids, params))

    try:
        run(prompts[0], a), run(prompts[0], b)  # warm-up
        pairs, order = [], [(rnd, i, ids) for rnd in range(ROUNDS) for i, ids in enumerate(prompts[1:])]
        for n, (rnd, i, ids) in enumerate(order):
            if settled(pairs, len(pairs) + len(order) - n):  # the rest cannot change the choice
                break
            if (i + rnd) % 2:
                tb = run(ids, b); ta = run(ids, a)
            else:
                ta = run(ids, a); tb = run(ids, b)
            if ta is not None and tb is not None:
                pairs.append((ta, tb))
    finally:
        engine.cfg = base
    if not pairs:
        raise YggError("the measurement decoded no tokens")
    return pairs
