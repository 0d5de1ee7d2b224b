"""Wall-clock timing of calls for the offline measurements (profile, stage forms).

A machine shared with other guests slows down for seconds at a time. Timing one call's repeats in
a block puts such a slow stretch on that call alone (a profile once recorded one-thread verify
times 15-43% above the same widths timed a minute earlier); :func:`time_rounds` times several
calls in rounds, one call of each per round, so a slow stretch touches every call alike and the
medians stay comparable."""

from __future__ import annotations

import time
from typing import Callable, Hashable


def time_ms(fn, warmup: int, repeats: int) -> list[float]:
    """``warmup`` untimed calls of ``fn``, then the milliseconds of ``repeats`` timed ones."""
    return time_rounds({None: fn}, warmup, repeats)[None]


def time_rounds(fns: dict[Hashable, Callable[[], object]], warmup: int, repeats: int,
                on_round: Callable[[], None] | None = None) -> dict[Hashable, list[float]]:
    """``warmup`` untimed rounds, then ``repeats`` timed ones, each calling every call of ``fns``
    once, in order (``on_round`` after each round): the milliseconds of each call's ``repeats``
    timed runs, by key."""
    out: dict[Hashable, list[float]] = {key: [] for key in fns}
    for r in range(warmup + repeats):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            if r >= warmup:
                out[key].append((time.perf_counter() - t) * 1e3)
        if on_round is not None:
            on_round()
    return out
