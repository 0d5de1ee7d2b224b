"""Which memory allocator decodes fastest on this machine, measured once (``runtime/allocator.py``
reads the answer: why it matters, the cache, ``YGGTREE_ALLOCATOR``).

``yggtree compile`` of a CPU plan calls :func:`measure_compiled`: when the machine has another
allocator than glibc's installed (jemalloc, tcmalloc) and no choice is cached for it, the
compiled plan's decoding (as `yggtree run --plan` runs it) runs in one child process per allocator (``LD_PRELOAD``), the
allocators taking turns over a few rounds in a rotating order so that a shared host's drifting
speed hits all of them alike. Each child decodes a few chat prompts of the calibration corpus
(never evaluation prompts) after a warm-up and reports its median ms per token. An allocator is
chosen over the system's only when its median per-round speed-up is above 1 and it was faster
in more than half of the rounds; the rounds' times are cached with the choice. A child is
``python -m yggtree.measure.allocator_probe PLAN.yaml --compile-root DIR``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..errors import YggError
from ..files import write_text_atomic
from ..runtime.allocator import SYSTEM, cached, forced, installed, preload_env

ROUNDS = 5  # turns of every allocator (after one untimed child: the model file into the page cache)


def _child(plan_path: str, compile_root: str, library: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env = preload_env(env, library) if library else env
    cmd = [sys.executable, "-m", "yggtree.measure.allocator_probe", plan_path, "--compile-root", compile_root]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise YggError(f"the allocator measurement failed ({'system' if library is None else library}): {last}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ms_per_token"])


def decide(rounds: list[dict[str, float]]) -> tuple[str, dict]:
    """The allocator to run on from ``rounds`` (each: allocator -> ms per token, ``system``
    among them) and each one's median per-round speed-up over the system's and share of rounds
    won (pure; see the module docstring for the rule)."""
    stats = {}
    for name in rounds[0]:
        if name == SYSTEM:
            continue
        ratios = [r[SYSTEM] / r[name] for r in rounds]
        stats[name] = {"speedup": statistics.median(ratios), "won": sum(x > 1 for x in ratios) / len(ratios)}
    best = max(stats, key=lambda n: stats[n]["speedup"], default=None)
    if best is not None and stats[best]["speedup"] > 1 and stats[best]["won"] > 0.5:
        return best, stats
    return SYSTEM, stats


def measure_compiled(plan_path: str | Path, compile_root: str | Path, say=None) -> dict | None:
    """The allocator choice of this machine (the cache file's record), measured now on the
    compiled plan at ``plan_path`` when nothing is cached; None when ``YGGTREE_ALLOCATOR``
    forces one. ``say(line)`` hears the measurement's result."""
    if forced() is not None:
        return None
    record, path, key = cached()
    if record is not None:
        return record
    libs = installed()
    if not libs:
        record = {"key": key, "choice": SYSTEM, "library": None, "rounds": [], "stats": {},
                  "note": "no other allocator installed (jemalloc, tcmalloc)"}
    else:
        names = [SYSTEM, *libs]
        _child(str(plan_path), str(compile_root), None)
        rounds = []
        for i in range(ROUNDS):
            order = names[i % len(names):] + names[: i % len(names)]
            rounds.append({n: _child(str(plan_path), str(compile_root), None if n == SYSTEM else str(libs[n]))
                           for n in order})
        choice, stats = decide(rounds)
        record = {"key": key, "choice": choice, "library": str(libs[choice]) if choice != SYSTEM else None,
                  "rounds": rounds, "stats": stats, "plan": str(plan_path)}
        if say is not None:
            gains = ", ".join(f"{n} {s['speedup']:.3f}x (faster in {s['won']:.0%} of rounds)" for n, s in stats.items())
            say(f"memory allocator measured on this machine: {choice} ({gains}); cached in {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    return record
