"""Which memory allocator decodes fastest on this machine, measured once (``runtime/allocator.py``
reads the answer: why it matters, the cache, ``YGGTREE_ALLOCATOR``).

``yggtree compile`` of a CPU plan calls :func:`measure_compiled`: when the machine has another
allocator than glibc's installed (jemalloc, tcmalloc) and no choice is cached for it, the
compiled plan's plain decoding runs in one child process per allocator (``LD_PRELOAD``), the
allocators taking turns over a few rounds in a rotating order so that a shared host's drifting
speed hits all of them alike. Each child decodes a few chat prompts of the calibration corpus
(never evaluation prompts) after a warm-up and reports its median ms per token. An allocator is
chosen over the system's only when its median per-round speed-up is above 1 and it was faster
in more than half of the rounds; the rounds' times are cached with the choice.

    python -m yggtree.allocator_choice PLAN.yaml [--compile-root DIR]   # one child's measurement
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .errors import YggError
from .files import write_text_atomic
from .runtime.allocator import SYSTEM, cached, forced, installed, preload_env

ROUNDS = 5  # turns of every allocator (after one untimed child: the model file into the page cache)
PROMPTS = 6  # calibration chat prompts a child decodes (after one warm-up)
NEW_TOKENS = 48
SNIPPET_CHARS = 400  # short prompts: the step's fixed work, which the allocator changes, dominates


def probe(plan_path: str, compile_root: str, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS) -> float:
    """Median decode ms per token (prefill excluded) of the compiled plan's plain engine over
    ``prompts`` calibration chat prompts, after one warm-up prompt (in this process)."""
    from .bench import plan_runner
    from .data import calibration_chat_prompts
    from .runtime.engine import SamplingParams
    from .runtime.loading import encode_auto

    plan, _, make = plan_runner(plan_path, compile_root=compile_root)
    engine, tok, _ = make(False)
    new_tokens = max(2, min(new_tokens, plan.max_context // 4))
    params = SamplingParams(max_new_tokens=new_tokens)
    room = plan.max_context - new_tokens  # a small plan's context: the prompts' last tokens
    texts = [p.text for p in calibration_chat_prompts(prompts + 1, max_snippet_chars=SNIPPET_CHARS)]
    ms = []
    for i, text in enumerate(texts):
        r = engine.generate(encode_auto(tok, text)[-room:], params)
        if i and len(r.token_ids) > 1:
            ms.append((r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1))
    if not ms:
        raise YggError("the allocator measurement decoded no tokens")
    return statistics.median(ms)


def _child(plan_path: str, compile_root: str, library: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env = preload_env(env, library) if library else env
    cmd = [sys.executable, "-m", "yggtree.allocator_choice", plan_path, "--compile-root", compile_root]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m yggtree.allocator_choice", description=__doc__.split("\n\n")[0])
    p.add_argument("plan")
    p.add_argument("--compile-root", default="compile")
    args = p.parse_args(argv)
    try:
        ms = probe(args.plan, args.compile_root)
    except YggError as e:
        sys.stderr.write(f"yggtree: error: {e}\n")
        return 1
    from .runtime.allocator import running

    print(json.dumps({"ms_per_token": ms, "allocator": running()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
