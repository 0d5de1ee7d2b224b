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
(never evaluation prompts) with the loops on OpenMP and on the pool in turn (measure/paired_decode.py);
the pool is chosen when its median per-prompt speed-up is above 1 and it was faster on more than half
of the prompts. ``YGGTREE_LOOPS=openmp`` (or ``pool``) records that
choice without measuring; ``auto``, the default, measures.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import env_choice
from . import paired_decode

LOOPS_ENV = "YGGTREE_LOOPS"  # auto | openmp | pool (module docstring)
CHOICES = ("openmp", "pool")


def decide(pairs: list[tuple[float, float]]) -> tuple[str, dict]:
    """``("pool" | "openmp", stats)`` from ``pairs`` of (ms per token on OpenMP, on the pool) of
    the same prompts: the pool where its median speed-up is above 1 and it won more than half of
    the pairs (paired_decode.decide; pure)."""
    pool, stats = paired_decode.decide(pairs)
    return ("pool" if pool else "openmp"), stats


def forced() -> str | None:
    """The choice ``YGGTREE_LOOPS`` names, None for ``auto`` or unset; YggError in one line for
    anything else."""
    return env_choice(LOOPS_ENV, CHOICES)


def measure_compiled(plan, art: str | Path, say=None, engine=None) -> dict:
    """The loops' record of ``plan`` (a Plan) compiled in ``art`` (its manifest's ``loops``),
    measured now on its plain engine (or forced by ``YGGTREE_LOOPS``). ``say(line)`` hears the
    result. ``engine``: a callable returning that engine and its tokenizer
    (``build_plan_engine``'s pair), shared with another measurement; None: built here."""
    choice = forced()
    if choice is not None:
        return {"choice": choice, "forced": LOOPS_ENV}
    from ..runtime.build import build_plan_engine

    engine, tok = engine() if engine is not None else build_plan_engine(plan, art, speculate=False)
    threads = engine.plan_threads(engine.plan)
    pairs = paired_decode.measure_pair(engine, tok, plan.max_context, {"loop_pool": False}, {"loop_pool": True})
    choice, stats = decide(pairs)
    if say is not None:
        say(f"kernel loops measured on this machine at {threads} threads: {choice} (the pool "
            f"{stats['speedup']:.3f}x OpenMP, faster on {stats['won']:.0%} of {stats['pairs']} prompts)")
    return {"choice": choice, "threads": threads, "stats": stats,
            "ms_per_token": [[round(a, 4), round(b, 4)] for a, b in pairs]}
