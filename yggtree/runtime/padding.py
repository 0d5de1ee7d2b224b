"""The padding and product kernel of a plan's packed layers, as measured (runtime/packed.py).

A plan's profile records them in its ``packed_padding`` section (:data:`PADDING_KEY`): the rows
short packed products are padded to (:func:`profile_min_rows`), the product kernel measured
fastest (:func:`profile_kernel`), the kernel library's prefetch setting (:func:`profile_prefetch`)
and where the padding was found batch-invariant (:func:`profile_invariance`). A plan without a
profile takes them from this machine's cached measurement (:func:`cached_padding`,
runtime/kernel_cache.py). :func:`plan_padding` is the one answer for a plan, which the engine
(runtime/build.py ``EngineSpec.from_plan``), ``yggtree compile`` and the artifact check
(``yggtree.compiled.check_artifacts``) read. A ``plan`` here is a :class:`yggtree.plan.Plan`.
Light: torch is imported only by the readers that need the runtime.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import YggError
from ..files import read_json
from ..shapes import measured_prefetch

PADDING_KEY = "packed_padding"  # a profile's measurement of padded short packed products
# the padding of a profile without that key: until profiles measured it, every packed product of
# fewer rows ran padded to this many (a constant of the runtime then), so such a profile's
# latency curves hold for it
LEGACY_MIN_ROWS = 4


def profile_min_rows(path: str | Path) -> int:
    """The ``min_rows`` (see :mod:`yggtree.runtime.packed`) the profile at ``path`` chose for its
    machine: ``packed_padding.min_rows``, or :data:`LEGACY_MIN_ROWS` for a profile older than
    that field. YggError if the file is unreadable or the value invalid."""
    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    if pad is None:
        return LEGACY_MIN_ROWS
    v = pad.get("min_rows") if isinstance(pad, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise YggError(f"profile {path}: '{PADDING_KEY}.min_rows' must be an integer >= 1, got {v!r} "
                       "(measure it again: yggtree profile --force)")
    return v


def profile_kernel(path: str | Path) -> str:
    """The product kernel of packed layers (runtime/packed.py ``KERNELS``) the profile at ``path``
    measured fastest on its machine: ``packed_padding.kernel``, ``"torch"`` for a profile older
    than that field. YggError if the file is unreadable or the value unknown."""
    from .packed import KERNELS

    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    v = pad.get("kernel", "torch") if isinstance(pad, dict) else "torch"
    if v not in KERNELS:
        raise YggError(f"profile {path}: '{PADDING_KEY}.kernel' must be one of {', '.join(KERNELS)}, got {v!r} "
                       "(measure it again: yggtree profile --force)")
    return v


def profile_invariance(path: str | Path) -> tuple[int, tuple[int, ...]] | None:
    """(threads, widths) at which the profile at ``path`` found its chosen padding batch-invariant
    (``packed_padding.invariant`` at ``packed_padding.widths``, in the profile's thread count), or
    None when it did not record that (older profiles) or found it not invariant."""
    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    if not isinstance(pad, dict) or not isinstance(pad.get("invariant"), dict):
        return None
    threads = (d.get("hardware") or {}).get("threads")
    chosen = "tiled" if pad.get("kernel") == "tiled" else str(pad.get("min_rows"))
    if pad["invariant"].get(chosen) is not True or not isinstance(threads, int):
        return None
    return threads, tuple(int(w) for w in pad.get("widths", ()))


def plan_min_rows(plan) -> int:
    """How many rows the packed products of ``plan``'s engine run with at least
    (:func:`plan_padding`)."""
    return _measured(plan)["min_rows"]


def plan_kernel(plan) -> str:
    """The product kernel of ``plan``'s packed layers (:func:`plan_padding`)."""
    return _measured(plan)["kernel"]


def plan_prefetch(plan) -> tuple[int, int] | None:
    """How far ahead the kernel library's products of ``plan``'s engine prefetch their weights,
    ``(near, far)`` bytes (:func:`plan_padding`; None: the library's default)."""
    return measured_prefetch(_measured(plan).get("prefetch"))


def profile_prefetch(path: str | Path) -> tuple[int, int] | None:
    """The prefetch setting, ``(near, far)`` bytes, the kernel library's products streamed their
    weights fastest at on the profile's machine (``packed_padding.prefetch``; runtime/kernels.py
    ``prefetch``; one distance in profiles before the second level: ``(distance, 0)``), None
    where it was not measured (a profile older than that field, or no product of the library).
    YggError if the value is invalid."""
    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    return measured_prefetch(pad.get("prefetch") if isinstance(pad, dict) else None,
                             f"profile {path}: '{PADDING_KEY}.prefetch'", "measure it again: yggtree profile --force")


def plan_padding(plan) -> dict | None:
    """``{"kernel", "min_rows", "prefetch"}`` of ``plan``'s products: its profile's measurement
    (:func:`profile_kernel`, :func:`profile_min_rows`, :func:`profile_prefetch`); for a plan
    without a profile, this machine's (:func:`cached_padding`), None where it was not measured.
    ``prefetch`` may be None or absent: the kernel library's default setting."""
    if plan.profile is None:
        return cached_padding(plan)
    return {"kernel": profile_kernel(plan.profile), "min_rows": profile_min_rows(plan.profile),
            "prefetch": profile_prefetch(plan.profile)}


def _measured(plan) -> dict:
    """:func:`plan_padding`, YggError where it was not measured (``yggtree compile`` measures it)."""
    pad = plan_padding(plan)
    if pad is None:
        from .kernel_cache import plan_threads_widths

        raise YggError(f"plan {plan.name!r} has no profile and its product kernel was not measured on this "
                       f"machine at {plan_threads_widths(plan)[0]} thread(s): `yggtree compile` measures it")
    return pad


def cached_padding(plan) -> dict | None:
    """For a plan without a profile: its product kernel and padding as measured on this machine
    at the plan's threads and widths and cached (``yggtree.measure.kernel_choice.measure_plan``, which
    ``yggtree compile`` and the commands running a plan call first; read with
    ``runtime/kernel_cache.py``), or None where it was not; oneDNN unpadded for a backend that
    packs nothing (eager: reference mode; accelerators)."""
    if plan.backend != "inductor-cpu":
        return {"kernel": "torch", "min_rows": 1}
    from .kernel_cache import cached_choice, plan_threads_widths
    from .loading import resolve_model

    threads, widths = plan_threads_widths(plan)
    return cached_choice(resolve_model(plan.target), plan.dtype, plan.weights, widths, threads)[0]
