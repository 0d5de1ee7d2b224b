"""Wall-clock timing of a call for the offline measurements (profile, stage forms)."""

from __future__ import annotations

import time


def time_ms(fn, warmup: int, repeats: int) -> list[float]:
    """``warmup`` untimed calls of ``fn``, then the milliseconds of ``repeats`` timed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out
