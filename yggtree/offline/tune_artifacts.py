"""The profile and calibration a ``yggtree tune`` needs: found and reused when valid (and said
so), otherwise measured.

Both must cover the whole search space: the *envelope* plan (every candidate width, the largest
d_max, the one weight format the profile prices: :func:`tune_space.profiled_weights`) is what
they are checked against and, when missing, measured for. A profile is valid when it was measured
for the same models, dtype, backend and weight format on this device with the same thread count
and up to the largest width (a profile without a recorded format measured float weights in its
dtype: it was made before quantized formats existed or recorded); a calibration when it belongs to the same pair and dtype and holds
accepted lengths for every candidate W_d up to the largest d_max and every candidate W_v. A file
of this tune's own name that is not valid is never replaced without ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..errors import YggError


def envelope_plan(base, space, hw: str):
    """A plan spanning the whole space: what the profile and calibration must cover (in the one
    weight format the profile prices)."""
    from .tune_space import candidate_plan, profiled_weights

    env = space.envelope
    cap = 1 + env["d_max"] * max(env["draft_widths"])
    fields = {**env, "verify_widths": [w for w in env["verify_widths"] if w <= cap],
              "lookup": 0, "prefill_chunk": base.prefill_chunk, "weights": profiled_weights(space, base)}
    return candidate_plan(base, fields, f"{hw}-envelope", None, None)


def profile_covers(path: Path, plan, threads: int) -> str | None:
    """Why the profile at ``path`` cannot serve ``plan`` on this machine (None: it can)."""
    from ..runtime.cost import CostModel

    try:
        CostModel.from_profile(path, plan)
        prof = json.loads(path.read_text())
    except (YggError, OSError, ValueError) as e:
        return str(e)
    if prof.get("hardware", {}).get("threads") != threads:
        return f"it was measured with {prof.get('hardware', {}).get('threads')} thread(s), not {threads}"
    need = max(*plan.draft_widths, *plan.verify_widths)
    have = max(prof.get("grid", {}).get("widths", [0]))
    if have < need:
        return f"it measured widths up to {have}, the space needs {need}"
    return None  # (another weight format than the plan's: CostModel.from_profile refuses it)


def calibration_covers(path: Path, plan) -> str | None:
    """Why the calibration at ``path`` cannot serve every candidate of ``plan``'s envelope."""
    from ..runtime.calibration import Calibration

    try:
        cal = Calibration.load(path, plan)
    except YggError as e:
        return str(e)
    for wd in plan.draft_widths:
        table = cal.aal.get(str(wd))
        if table is None or len(table) < plan.d_max:
            return f"it has no accepted lengths for W_d {wd} up to depth {plan.d_max}"
    missing = sorted(set(plan.verify_widths) - set(cal.verify_widths))
    if missing:
        return f"it has no accepted lengths for verify widths {missing}"
    return None


def say(text: str) -> None:
    """One progress line of ``yggtree tune`` on stderr."""
    sys.stderr.write(f"tune: {text}\n")
    sys.stderr.flush()


def find_profile(env, hw: str, out_dir: Path, threads: int) -> tuple[Path | None, str | None]:
    """A profile in ``out_dir`` valid for ``env`` (``NAME.json`` first) or None, and why
    ``NAME.json`` (if it exists) is not."""
    own = out_dir / f"{hw}.json"
    others = sorted(p for p in out_dir.glob("*.json") if p != own) if out_dir.is_dir() else []
    candidates = [p for p in [own, *others] if not p.name.endswith(".tuning.json")]
    found, why_own = first_valid(candidates, own, lambda p: profile_covers(p, env, threads))
    if found is None:
        namesake(candidates)
    return found, why_own


def namesake(profiles: list[Path]) -> None:
    """Say (once) that a profile measured on a device of this device's name but another identity
    (runtime/device.py) is not reused."""
    from ..runtime.device import detect_device, device_difference

    here = detect_device()
    for p in profiles:
        try:
            hw = json.loads(p.read_text()).get("hardware")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(hw, dict) and (hw.get("device"), hw.get("device_name")) == (here["kind"], here["name"]):
            differs = device_difference(hw, here)
            if differs is not None:
                say(f"not reusing profile {p}: {differs}")
                return


def first_valid(paths: list[Path], own: Path, why_not) -> tuple[Path | None, str | None]:
    """The first existing file of ``paths`` (each once) for which ``why_not`` returns None, or None
    and what ``why_not`` said of ``own``."""
    seen, why_own = set(), None
    for p in paths:
        if p.resolve() in seen or not p.is_file():
            continue
        seen.add(p.resolve())
        why = why_not(p)
        if why is None:
            return p, None
        if p == own:
            why_own = why
    return None, why_own


def ensure_profile(env, hw: str, out_dir: Path, threads: int, force: bool, quick: bool,
                   compile_root: Path) -> tuple[Path, str]:
    """A profile valid for ``env``: reused (:func:`find_profile`) or measured into
    ``profiles/NAME.json``. Returns (path, "reused" | "measured")."""
    found, why_own = find_profile(env, hw, out_dir, threads)
    if found is not None:
        say(f"reusing profile {found} (this device, {threads} thread(s), covers the space's widths)")
        return found, "reused"
    own = out_dir / f"{hw}.json"
    if why_own is not None and not force:
        raise YggError(f"profile {own} exists but cannot serve this tune ({why_own}); pass --force "
                       "to measure it again")
    from .profile import measure_profile, write_profile
    from .profile_grid import ProfileGrid

    need = max(*env.draft_widths, *env.verify_widths)
    grid = ProfileGrid(max_width=need, warmup=1 if quick else 3, repeats=3 if quick else 9, quick=quick)
    say(f"measuring profile {own} (no valid profile found)")
    prof = measure_profile(env, hw, threads, grid, f"yggtree tune --hw {hw}",
                           compile_root / "_inductor-profile")
    write_profile(prof, out_dir)
    return own, "measured"


def calibration_dir(out_dir: Path, hw: str) -> Path:
    """Where a calibration made by ``tune --hw NAME`` goes (with the envelope plan it used)."""
    return out_dir / f"{hw}.calibration"


def find_calibration(env, hw: str, out_dir: Path) -> tuple[Path | None, str | None]:
    """A calibration covering ``env`` (the pair's, this tune's, then any other tune's in
    ``out_dir``) or None, and why this tune's own (if it exists) does not."""
    from ..quickstart import shipped_calibration
    from .fit import pair_dir

    own = calibration_dir(out_dir, hw) / "calibration.json"
    places = [pair_dir(env) / "calibration.json", *filter(None, [shipped_calibration(env)]), own,
              *(sorted(out_dir.glob("*.calibration/calibration.json")) if out_dir.is_dir() else [])]
    return first_valid(places, own, lambda p: calibration_covers(p, env))


def ensure_calibration(env, hw: str, out_dir: Path, threads: int, force: bool, prompts: int,
                       max_new_tokens: int) -> tuple[Path, str]:
    """A calibration covering ``env``: reused or measured (``yggtree calibrate`` on the
    envelope plan) into ``profiles/NAME.calibration/``."""
    from ..plan import save_plan
    from .fit import run_calibrate

    found, why_own = find_calibration(env, hw, out_dir)
    if found is not None:
        say(f"reusing calibration {found} (this pair and dtype, covers the space's widths)")
        return found, "reused"
    d = calibration_dir(out_dir, hw)
    own = d / "calibration.json"
    if why_own is not None and not force:
        raise YggError(f"calibration {own} exists but cannot serve this tune ({why_own}); pass "
                       "--force to measure it again")
    say(f"calibrating the pair on {prompts} calibration prompts into {own}")
    d.mkdir(parents=True, exist_ok=True)
    plan_file = save_plan(env, d / "envelope.yaml")
    args = argparse.Namespace(plan=str(plan_file), prompts=prompts, max_new_tokens=max_new_tokens,
                              seed=0, threads=threads, out_dir=str(d), force=True)
    with contextlib.redirect_stdout(sys.stderr):  # its JSON line is not tune's
        run_calibrate(args)
    return own, "measured"
