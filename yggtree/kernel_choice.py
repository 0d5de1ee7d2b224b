"""The product kernel of an engine built from flags or from a plan without a profile, measured
once per machine.

A plan's profile records which product kernel (``runtime/packed.py`` ``KERNELS``: oneDNN's or our
tiled one) and which padding its engine runs (``packed_padding``). An engine built from flags
(``yggtree run --weights int8``, ``--no-speculate``, ``--drafter ...``, ``yggtree bench``) or
from a plan without a profile (a plain plan: ``yggtree.plan.plan_kernel``) has none: the first
such engine on a machine times the model's own one-row products on every kernel this CPU runs
(:func:`yggtree.offline.profile.model_padding`: seconds), with batch invariance checked at the
engine's verify widths, and caches the answer under the user cache directory
(``kernels/choice-*.json``); later engines read it. The key holds everything the answer depends
on: the device, the thread count, the model file, dtype, weight format, widths, the torch version
and the kernel library's sources. Nothing is measured off CPUs or for an engine that packs nothing.
A measurement taken while other processes kept the cores busy is cached with a warning naming
the file to delete (its times, and so perhaps its choice, are off).

``YGGTREE_KERNEL=torch`` (or ``tiled``) in the environment runs that kernel unpadded instead,
without measuring (a speculative engine still pads oneDNN's products until they are
batch-invariant); ``auto``, the default, measures.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from .errors import YggError
from .files import cache_root, write_text_atomic

KERNEL_ENV = "YGGTREE_KERNEL"  # auto | a kernel of runtime/packed.py KERNELS (module docstring)


def choice_key(src, dtype: str, weights: str | None, widths: tuple[int, ...], threads: int, device: dict) -> dict:
    """What a measured kernel choice depends on (``src``: a ModelSource)."""
    import torch

    from .runtime.kernels import SOURCES

    st = Path(src.path).stat()
    library = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES)).hexdigest()[:12]
    return {"device": device["kind"], "device_name": device["name"], "threads": threads,
            "model": str(Path(src.path).resolve()), "model_bytes": st.st_size, "model_mtime_ns": st.st_mtime_ns,
            "dtype": dtype, "weights": weights, "widths": sorted(set(widths)), "torch": torch.__version__,
            "library": library}


def choice_path(key: dict, root: Path | None = None) -> Path:
    """Where the choice of ``key`` is cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_root()) / "kernels" / f"choice-{key['device']}-t{key['threads']}-{digest}.json"


def measured_choice(src, dtype: str, weights: str | None, widths: tuple[int, ...], threads: int,
                    root: Path | None = None, say=None) -> dict:
    """The packed products' kernel and padding for the model ``src`` in ``dtype`` and ``weights``
    at ``threads`` threads, for an engine running ``widths`` rows: the profile's
    ``packed_padding`` dict (``kernel``, ``min_rows``, the medians), read from the cache or
    measured now and cached. ``say(line)`` hears a measurement (default: one line on stderr)."""
    import torch

    from .offline.profile import model_padding, padding_line
    from .offline.timing import LoadMeter, load_warning
    from .runtime.device import detect_device

    forced = forced_kernel()
    if forced is not None:
        return {"kernel": forced, "min_rows": 1, "products": 0, "median_ms": {}, "forced": KERNEL_ENV}
    device = detect_device()
    if device["kind"] != "cpu":  # accelerators pack nothing
        return {"kernel": "torch", "min_rows": 1, "products": 0, "median_ms": {}}
    key = choice_key(src, dtype, weights, widths, threads, device)
    path = choice_path(key, root)
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached["padding"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent or unreadable: measured again, the file replaced
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with LoadMeter() as load:
            padding = model_padding(src, dtype, weights, tuple(widths), warmup=1, repeats=5)
    finally:
        torch.set_num_threads(before)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"key": key, "padding": padding, "load": load.result}, indent=1) + "\n")
    if padding["products"]:
        busy = load_warning("the measurement", load.result)
        (say or (lambda line: sys.stderr.write(f"yggtree: {line}\n")))(
            f"product kernel measured for this CPU at {threads} thread(s): {padding_line(padding)}; cached in {path}"
            + (f" ({busy}: delete the file to measure again)" if busy else ""))
    return padding


def forced_kernel() -> str | None:
    """The kernel ``YGGTREE_KERNEL`` names, None for ``auto`` or unset; YggError in one line for
    anything else."""
    from .runtime.packed import KERNELS

    v = os.environ.get(KERNEL_ENV, "auto").strip() or "auto"
    if v == "auto":
        return None
    if v not in KERNELS:
        raise YggError(f"{KERNEL_ENV}={v!r}: must be auto, {' or '.join(KERNELS)}")
    return v


def measured_spec(spec, root: Path | None = None, say=None):
    """``spec`` (an EngineSpec built from flags) with the product kernel and padding measured for
    it on this machine (:func:`measured_choice`); unchanged if it packs nothing."""
    from .runtime.build import torch_threads
    from .runtime.loading import resolve_model
    from .runtime.schedule import resolve_plan

    if not spec.pack:
        return spec
    spec_on = spec.drafter is not None or spec.lookup > 0
    widths = (1, *spec.verify_widths, spec.tree.verify_width) if spec_on else (1,)
    threads = resolve_plan(spec.stages, spec_on, threads=spec.threads).threads or torch_threads()
    padding = measured_choice(resolve_model(spec.model), spec.dtype, spec.weights, widths, threads, root, say)
    return replace(spec, kernel=padding["kernel"], min_rows=padding["min_rows"],
                   padding_checked=(threads, tuple(padding.get("widths", widths))) if padding["products"] else None)
