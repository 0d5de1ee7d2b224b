"""Wall-clock timing of calls for the offline measurements (profile, stage forms).

A machine shared with other guests slows down for seconds at a time. Timing one call's repeats in
a block puts such a slow stretch on that call alone (its times then compare neither with the other
calls' nor with its own timed a minute later); :func:`time_rounds` times several calls in rounds,
one call of each per round, so a slow stretch touches every call alike and the medians stay
comparable."""

from __future__ import annotations

import time
from typing import Callable, Hashable


def time_ms(fn, warmup: int, repeats: int) -> list[float]:
    """``warmup`` untimed calls of ``fn``, then the milliseconds of ``repeats`` timed ones."""
    return time_rounds({None: fn}, warmup, repeats)[None]


def time_rounds(fns: dict[Hashable, Callable[[], object]], warmup: int, repeats: int,
                on_round: Callable[[], None] | None = None, settle: int = 0,
                before: dict[Hashable, Callable[[], object]] | None = None) -> dict[Hashable, list[float]]:
    """``warmup`` untimed rounds, then ``repeats`` timed ones, each calling every call of ``fns``
    once, in order (``on_round`` after each round): the milliseconds of each call's ``repeats``
    timed runs, by key.

    ``settle``: untimed calls of the same function right before each timed one, so that the timed
    call runs as a decode loop runs it, after calls of its own shape. Dynamo keeps a function's
    graphs in one cache, most recently used first, and a call walks the entries before its own,
    evaluating their guards (not cheap for a decode step, whose weights are graph inputs):
    cycling through a profile grid's many graphs of one step function would put all their lookups
    on every timed call, which a decode loop -- a few shapes, or AOTInductor packages with no
    dynamo at all -- never pays.

    ``before``: per key, an untimed call made last before each timed one (after the settling
    calls), for a call a decode loop makes right after another: a drafter call after the target's
    step, which has streamed the target's weights through the caches."""
    out: dict[Hashable, list[float]] = {key: [] for key in fns}
    for r in range(warmup + repeats):
        for key, fn in fns.items():
            for _ in range(settle):
                fn()
            if before is not None and key in before:
                before[key]()
            t = time.perf_counter()
            fn()
            if r >= warmup:
                out[key].append((time.perf_counter() - t) * 1e3)
        if on_round is not None:
            on_round()
    return out


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(busy, steal) CPU seconds of the whole machine since boot (``/proc/stat``; busy excludes
    idle, iowait and steal) and this process's own CPU seconds (all its threads); None where
    ``/proc/stat`` cannot be read."""
    import os
    import resource

    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    own = resource.getrusage(resource.RUSAGE_SELF)
    return (user + nice + system + irq + softirq) / hz, steal / hz, own.ru_utime + own.ru_stime


class LoadMeter:
    """What else ran on the machine while a measurement did (a context manager): ``other_cores``,
    the average number of cores busy with other processes (the machine's busy CPU time minus
    this process's, over the wall time), and ``steal_cores``, the cores the hypervisor gave to
    other guests. Timings taken beside other work are inflated (the profile's threads take turns
    with the other processes on the same cores); the profile records both numbers and warns. ``result`` is None where ``/proc/stat`` is unreadable (not Linux)."""

    def __init__(self) -> None:
        self.result: dict | None = None

    def __enter__(self) -> "LoadMeter":
        self._t0, self._c0 = time.perf_counter(), _cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        c1, wall = _cpu_seconds(), time.perf_counter() - self._t0
        if self._c0 is None or c1 is None or wall <= 0:
            return
        busy, steal, own = (b - a for a, b in zip(self._c0, c1))
        self.result = {"wall_s": round(wall, 1), "other_cores": round(max(0.0, busy - own) / wall, 2),
                       "steal_cores": round(steal / wall, 2)}


BUSY_CORES = 0.25  # other work above this (cores on average) makes a measurement's times suspect


def other_cores(measured: dict) -> float:
    """Cores other processes kept busy while ``measured`` (a dict with a ``load``: a LoadMeter
    result) was timed; 0 where that was not measurable."""
    return float((measured.get("load") or {}).get("other_cores") or 0.0)


def quietest(measure, waits: tuple[float, ...], what: str, say=None) -> dict:
    """``measure()`` (a dict with a ``load``), taken again after each of ``waits`` seconds while
    other processes kept more than BUSY_CORES cores busy: the quietest result. ``say(line)``
    hears each wait."""
    best = None
    for wait in (*waits, None):
        again = measure()
        if best is None or other_cores(again) < other_cores(best):
            best = again
        if other_cores(best) <= BUSY_CORES or wait is None:
            return best
        if say is not None:
            say(f"other processes kept {other_cores(again):.2f} cores busy while timing {what}: again in {wait} s")
        time.sleep(wait)


def load_warning(what: str, load: dict | None) -> str | None:
    """One line saying ``what``'s times are inflated by other work (``LoadMeter.result``), or None."""
    if load is None:
        return None
    busy = [f"other processes kept {load['other_cores']:.2f} cores busy"] if load["other_cores"] > BUSY_CORES else []
    if load["steal_cores"] > BUSY_CORES:
        busy.append(f"the hypervisor gave {load['steal_cores']:.2f} cores to other guests")
    if not busy:
        return None
    return (f"{what}: while timing, {' and '.join(busy)}: its times are inflated; measure again on a quiet "
            "machine")
