"""Plans tuned for this machine: where they are looked for (:func:`tuned_plan_dirs`) and the one
``yggtree run`` without a plan takes (:func:`find_tuned_plan`)."""

from __future__ import annotations

import json
from pathlib import Path

from .compiled import artifact_dir, check_artifacts
from .errors import YggError
from .plan import load_plan


def tuned_plan_dirs() -> tuple[Path, ...]:
    """Where tuned plans are looked for: the user's data directory
    (``$XDG_DATA_HOME/yggtree/profiles``, by default ``~/.local/share/yggtree/profiles``), then,
    when yggtree runs from a source checkout, the checkout's ``profiles/``."""
    from .files import data_root

    dirs = [data_root() / "profiles"]
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        dirs.append(checkout / "profiles")
    return tuple(dirs)


def find_tuned_plan(dtype: str, device: dict, search: tuple[Path, ...] | None = None,
                    compile_root: str | Path = "compile", say=None) -> tuple[Path | None, Path | None]:
    """Plans tuned for this device: ``(ready, uncompiled)``, or None for either.

    A tuned plan is a plan YAML for the embedded pair (target and drafter ``default``) with float
    weights and its cache in ``dtype`` (no ``weights`` format, no ``kv_cache``: a quantized plan or
    a 16-bit cache computes another model, so it is never taken unasked) naming a profile
    measured on ``device`` (``{"kind", "name", "identity"}`` as from
    ``yggtree.runtime.device.detect_device``) and a calibration. ``ready``: of the plans whose
    compiled artifacts are usable (or that need none), the one whose profile measured the fastest
    plain step (ties and plans without that point: the first by directory, then file name);
    ``uncompiled``: the first that would be, once compiled. The directories are ``search``
    (default :func:`tuned_plan_dirs`). Unreadable files are skipped: this only looks for
    something better than the default plan. A plan whose profile was measured on a device of the
    same name but another identity (``runtime/device.py``: another CPU model or stepping, other
    features or cores, or no identity recorded) is not taken either: when nothing is found,
    ``say(line)`` is told so once, naming what differs."""
    from .runtime.device import device_difference

    ready, waiting, namesakes = [], None, []
    for d in tuned_plan_dirs() if search is None else search:
        for f in sorted(Path(d).glob("*.yaml")) if Path(d).is_dir() else ():
            try:
                plan = load_plan(f)
                if (plan.target, plan.drafter, plan.dtype, plan.weights, plan.kv_cache) != (
                        "default", "default", dtype, None, None):
                    continue
                if plan.profile is None or plan.calibration is None:
                    continue
                profile = json.loads(Path(plan.profile).read_text())
                hw = profile.get("hardware", {})
            except (YggError, OSError, ValueError, AttributeError):
                continue
            differs = device_difference(hw, device)
            if differs is not None:
                named = isinstance(hw, dict) and (hw.get("device"), hw.get("device_name"))
                if named == (device["kind"], device["name"]):
                    namesakes.append((f, differs))
                continue
            if plan.backend == "eager" or not check_artifacts(plan, artifact_dir(plan, compile_root)):
                ready.append((_plain_step_ms(profile), len(ready), f))
            elif waiting is None:
                waiting = f
    if namesakes and not ready and waiting is None and say is not None:
        more = f" (and {len(namesakes) - 1} more plan(s) like it)" if len(namesakes) > 1 else ""
        say(f"not using tuned plan {namesakes[0][0]}{more}: {namesakes[0][1]}")
    return (min(ready)[2] if ready else None), waiting


def _plain_step_ms(profile: dict) -> float:
    """A profile's plain step: its width-1 verify point at the shortest context (inf if none)."""
    points = profile.get("points") if isinstance(profile, dict) else None
    plain = [(p.get("context", 0), p.get("median_ms")) for p in points or ()
             if isinstance(p, dict) and p.get("kind") == "verify" and p.get("width") == 1]
    plain = [(c, ms) for c, ms in plain if isinstance(c, int) and isinstance(ms, (int, float))]
    return float(min(plain)[1]) if plain else float("inf")
