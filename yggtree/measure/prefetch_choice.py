"""Whether a compiled plan's products decode faster at the prefetch setting measured for them
than at the kernel library's default, on this machine.

The product kernel's measurement (``offline/profile_padding.py``) times one row through every
product at each of the library's prefetch settings (``shapes.PREFETCH_CHOICES``) and keeps the
fastest. Eighteen settings a few percent apart, timed on a shared host, leave the fastest often
fastest by its noise, and products called back to back are not a decode step (the attention, the
norms and the caches' traffic run between them): a setting measured fastest that way has decoded
slower than the library's default (docs/results.md section 10). So the setting is confirmed by decoding before runs
take it: the compiled plan's plain engine decodes calibration chat prompts at the library's default
and at the measured setting in turn (measure/paired_decode.py), and the measured setting is kept
only where it decodes faster. Measured once per compile by ``yggtree compile`` (and by the build of
this machine's plan after its verdict) and recorded in the manifest (``prefetch``), which
``build_plan_engine`` reads (``runtime/build.py`` ``confirmed_prefetch``: a record whose setting is the
one an engine would take and which says ``default`` gives that engine the library's default instead).

``YGGTREE_PREFETCH=measured`` keeps the measured setting without decoding, ``default`` takes the
library's (whatever setting was measured); ``auto``, the default, measures.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import env_choice
from . import paired_decode

PREFETCH_ENV = "YGGTREE_PREFETCH"  # auto | measured | default (module docstring)
CHOICES = ("measured", "default")


def forced() -> str | None:
    """The choice ``YGGTREE_PREFETCH`` names, None for ``auto`` or unset; YggError in one line for
    anything else."""
    return env_choice(PREFETCH_ENV, CHOICES)


def measure_compiled(plan, art: str | Path, say=None, engine=None) -> dict | None:
    """The prefetch record of ``plan`` (a Plan) compiled in ``art`` (its manifest's
    ``prefetch``), measured now on its plain engine (or forced by ``YGGTREE_PREFETCH``); None
    where its engine takes the library's default already (nothing to confirm). ``say(line)``
    hears the result. ``engine``: a callable returning that engine and its tokenizer
    (``build_plan_engine``'s pair), shared with another measurement; None: built here."""
    choice = forced()
    if choice is not None:  # for whatever setting the plan's engines take
        return {"choice": choice, "forced": PREFETCH_ENV}
    from ..runtime.build import build_plan_engine
    from ..runtime.kernels import prefetch_now
    from ..shapes import prefetch_name

    engine, tok = engine() if engine is not None else build_plan_engine(plan, art, speculate=False)
    setting = engine.cfg.prefetch
    if setting is None or tuple(setting) == prefetch_now():  # the library's default: nothing to confirm
        return None
    pairs = paired_decode.measure_pair(engine, tok, plan.max_context, {"prefetch": None}, {"prefetch": setting})
    kept, stats = paired_decode.decide(pairs)
    if say is not None:
        say(f"the products' prefetch measured by decoding at {engine.plan_threads(engine.plan)} threads: "
            f"{prefetch_name(setting) + ' kept' if kept else 'the library default'} ({prefetch_name(setting)} "
            f"{stats['speedup']:.3f}x the default, faster on {stats['won']:.0%} of {stats['pairs']} prompts)")
    return {"choice": "measured" if kept else "default", "setting": list(setting), "stats": stats,
            "ms_per_token": [[round(a, 4), round(b, 4)] for a, b in pairs]}
