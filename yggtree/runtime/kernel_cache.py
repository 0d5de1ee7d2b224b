"""The product-kernel choices measured on this machine, as cached (the run side's reader).

``yggtree.measure.kernel_choice`` measures which product kernel (runtime/packed.py ``KERNELS``) and
padding an engine without a profile runs, and caches each answer under the user cache directory
(``kernels/choice-*.json``), keyed by everything it depends on: the device, the thread count, the
model file, dtype, weight format, widths, the torch version and the kernel library's sources.
This module holds the key, the file and the reading, so that the run side (runtime/padding.py's
``plan_kernel`` for a plan without a profile) reads a choice without importing the measurement.

``YGGTREE_KERNEL=torch`` (or ``tiled``) in the environment stands for a choice of that kernel
unpadded, without measuring; ``auto``, the default, measures.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..errors import env_choice
from ..files import cache_root

KERNEL_ENV = "YGGTREE_KERNEL"  # auto | a kernel of runtime/packed.py KERNELS (module docstring)


def choice_key(src, dtype: str, weights: str | None, widths: tuple[int, ...], threads: int, device: dict) -> dict:
    """What a measured kernel choice depends on (``src``: a ModelSource)."""
    import torch

    from .kernels import HEADERS, SOURCES

    st = Path(src.path).stat()
    library = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)).hexdigest()[:12]
    from .device import device_record

    return {**device_record(device), "threads": threads,
            "model": str(Path(src.path).resolve()), "model_bytes": st.st_size, "model_mtime_ns": st.st_mtime_ns,
            "dtype": dtype, "weights": weights, "widths": sorted(set(widths)), "torch": torch.__version__,
            "library": library}


def choice_path(key: dict, root: Path | None = None) -> Path:
    """Where the choice of ``key`` is cached: one file per setup whatever the device's identity
    (a choice recorded on another CPU of the same name is found there, and refused by name)."""
    from .device import IDENTITY_KEY

    digest = hashlib.sha256(json.dumps({k: v for k, v in key.items() if k != IDENTITY_KEY},
                                       sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_root()) / "kernels" / f"choice-{key['device']}-t{key['threads']}-{digest}.json"


def forced_kernel() -> str | None:
    """The kernel ``YGGTREE_KERNEL`` names, None for ``auto`` or unset; YggError in one line for
    anything else."""
    from .packed import KERNELS

    return env_choice(KERNEL_ENV, tuple(KERNELS))


def unmeasured_choice(device: dict) -> dict | None:
    """The choice that needs no measurement: the forced kernel, or oneDNN unpadded off CPUs
    (accelerators pack nothing); None where it must be measured."""
    forced = forced_kernel()
    if forced is not None:
        return {"kernel": forced, "min_rows": 1, "products": 0, "median_ms": {}, "forced": KERNEL_ENV}
    if device["kind"] != "cpu":
        return {"kernel": "torch", "min_rows": 1, "products": 0, "median_ms": {}}
    return None


def cached_choice(src, dtype: str, weights: str | None, widths: tuple[int, ...], threads: int,
                  root: Path | None = None) -> tuple[dict | None, Path | None, dict | None]:
    """``(choice, path, key)``: the packed products' kernel and padding (the profile's
    ``packed_padding`` dict) for the model ``src`` in ``dtype`` and ``weights`` at ``threads``
    threads and ``widths`` rows as cached on this machine, the unmeasured choice
    (:func:`unmeasured_choice`, path None), or None with the path and key a measurement is to
    be cached under (absent or unreadable file)."""
    from .device import detect_device

    device = detect_device()
    fixed = unmeasured_choice(device)
    if fixed is not None:
        return fixed, None, None
    from .device import device_difference

    key = choice_key(src, dtype, weights, widths, threads, device)
    path = choice_path(key, root)
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached["padding"], path, key
        differs = device_difference(cached.get("key"), device)
        if differs is not None:  # the same setup on another CPU of this name: measured again
            sys.stderr.write(f"yggtree: not using the product-kernel choice {path}: {differs}; measuring it "
                             "again\n")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None, path, key


def plan_threads_widths(plan) -> tuple[int, tuple[int, ...]]:
    """The thread count and row counts an engine of ``plan`` (a Plan) runs its products at."""
    import torch

    from .schedule import resolve_plan

    threads = resolve_plan(plan.stages, plan.speculative).threads or torch.get_num_threads()
    return threads, ((1, *plan.verify_widths) if plan.speculative else (1,))
