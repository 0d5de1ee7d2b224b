"""The product kernel of an engine built from flags or from a plan without a profile, measured
once per machine.

A plan's profile records which product kernel (``runtime/packed.py`` ``KERNELS``: oneDNN's or our
tiled one) and which padding its engine runs (``packed_padding``). An engine built from flags
(``yggtree run --weights int8``, ``--no-speculate``, ``--drafter ...``, ``yggtree bench``) or from a
plan without a profile (a plain plan: ``yggtree.runtime.padding.plan_kernel``) has none: the first
such engine on a machine times the model's own one-row products on every kernel this CPU runs
(:func:`yggtree.offline.profile_padding.model_padding`: seconds), with batch invariance checked at the
engine's verify widths, and caches the answer under the user cache directory; later engines read it
(``runtime/kernel_cache.py``: the key, the file, ``YGGTREE_KERNEL``). Nothing is measured off CPUs
or for an engine that packs nothing. A measurement taken while other processes kept the cores busy
is cached with a warning naming the file to delete (its times, and so perhaps its choice, are off).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ..files import write_text_atomic
from ..runtime.kernel_cache import cached_choice, plan_threads_widths
from ..shapes import measured_prefetch


def measured_choice(src, dtype: str, weights: str | None, widths: tuple[int, ...], threads: int,
                    root: Path | None = None, say=None, waits: tuple[float, ...] = ()) -> dict:
    """The packed products' kernel and padding for the model ``src`` in ``dtype`` and ``weights``
    at ``threads`` threads, for an engine running ``widths`` rows: the profile's
    ``packed_padding`` dict (``kernel``, ``min_rows``, the medians), read from the cache or
    measured now and cached. ``say(line)`` hears a measurement (default: one line on stderr).
    A measurement taken while other processes kept the cores busy is taken again after each of
    ``waits`` seconds until one is quiet; the quietest is kept (a background build passes waits:
    it has the time, and its choice is compiled into every package)."""
    import torch

    from ..offline.profile_padding import model_padding, padding_line
    from ..offline.timing import LoadMeter, load_warning, quietest

    choice, path, key = cached_choice(src, dtype, weights, widths, threads, root)
    if choice is not None:
        return choice

    def measure() -> dict:
        with LoadMeter() as load:
            padding = model_padding(src, dtype, weights, tuple(widths), warmup=1, repeats=5)
        return {"padding": padding, "load": load.result}

    _library_built()  # a first build of it is the compiler's work, not the measurement's: before its window
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = quietest(measure, waits, "the product kernel", say)
    finally:
        torch.set_num_threads(before)
    padding, load_result = best["padding"], best["load"]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"key": key, "padding": padding, "load": load_result}, indent=1) + "\n")
    if padding["products"] or padding.get("prefetch"):
        busy = load_warning("the measurement", load_result)
        (say or (lambda line: sys.stderr.write(f"yggtree: {line}\n")))(
            f"product kernel measured for this CPU at {threads} thread(s): {padding_line(padding)}; cached in {path}"
            + (f" ({busy}: delete the file to measure again)" if busy else ""))
    return padding


def _library_built() -> None:
    """The kernel library built and loaded where this CPU runs it (a build that fails is left to the
    measurement's own loading, which says so)."""
    from ..errors import YggError
    from ..runtime import kernels

    if not kernels.library_missing():
        try:
            kernels.load_library()
        except YggError:
            pass


def _choice_file(plan, root: Path | None) -> tuple[dict | None, Path | None]:
    """The cached product-kernel choice of ``plan`` (a CPU plan without a profile) and its file."""
    from ..runtime.loading import resolve_model

    threads, widths = plan_threads_widths(plan)
    choice, path, _ = cached_choice(resolve_model(plan.target), plan.dtype, plan.weights, widths, threads, root)
    return choice, path


def choice_record(plan, root: Path | None = None) -> dict | None:
    """The cached record (``key``, ``padding``, ``load``) of the product-kernel choice of
    ``plan``, None where there is none."""
    choice, path = _choice_file(plan, root)
    try:
        return json.loads(path.read_text()) if choice is not None and path is not None else None
    except (OSError, ValueError):
        return None


def forget_choice(plan, root: Path | None = None) -> None:
    """Delete the cached product-kernel choice of ``plan``: the next engine or compile measures it."""
    _, path = _choice_file(plan, root)
    if path is not None:
        path.unlink(missing_ok=True)


def measured_spec(spec, root: Path | None = None, say=None):
    """``spec`` (an EngineSpec built from flags) with the product kernel, padding and prefetch
    setting measured for it on this machine (:func:`measured_choice`); unchanged if it packs nothing."""
    from ..runtime.prepare import check_spec, spec_rows
    from ..runtime.loading import resolve_model

    if not spec.pack:
        return spec
    check_spec(spec)  # bad sizes and formats are refused before the model loads to be measured
    threads, widths = spec_rows(spec)
    padding = measured_choice(resolve_model(spec.model), spec.dtype, spec.weights, widths, threads, root, say)
    return replace(spec, kernel=padding["kernel"], min_rows=padding["min_rows"],
                   prefetch=measured_prefetch(padding.get("prefetch")),
                   padding_checked=(threads, tuple(padding.get("widths", widths))) if padding["products"] else None)


def measure_plan(plan, say=None, waits: tuple[float, ...] = ()) -> None:
    """Measure (or find cached) the product kernel of ``plan``'s engine on this machine when its
    choice is not the profile's: a plan for the CPU backend without a profile
    (``yggtree.runtime.padding.plan_kernel`` reads it). ``yggtree compile`` and the commands that run a plan
    call this first."""
    from ..runtime.loading import resolve_model

    if plan.profile is not None or plan.backend != "inductor-cpu":
        return
    threads, widths = plan_threads_widths(plan)
    measured_choice(resolve_model(plan.target), plan.dtype, plan.weights, widths, threads, say=say, waits=waits)
