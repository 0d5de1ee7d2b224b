"""Speculation by default: the default plan with a quick latency profile of this machine.

A plain ``yggtree run`` on a machine without a tuned plan (``yggtree tune``) still decodes with
the latency objective: the first such run builds the default plan's graphs, times them (its own
widths only, a few calls each: :class:`yggtree.offline.profile_grid.ProfileGrid` with the plan's
widths) and caches the profile under the user cache directory, keyed by device, thread count and
dtype; later runs load it. The acceptance calibration is the pair's shipped one (it does not
depend on the machine). The objective still takes plain steps wherever no tree pays.
Without a shipped calibration for the dtype, or without the offline extra (the curve fit needs
scikit-learn), the run decodes plainly and says why.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import YggError
from .files import cache_root

TUNE_HINT = "`yggtree tune --hw NAME` tunes a plan for this machine"


def quick_profile_path(device: dict, threads: int, dtype: str, root: Path | None = None) -> Path:
    """The cached quick profile of ``device`` at ``threads`` threads in ``dtype`` (named by the
    device's name and a digest of its identity: runtime/device.py)."""
    from .runtime.device import device_slug

    return (root or cache_root()) / "profiles" / f"{device_slug(device)}-t{threads}-{dtype}.json"


@dataclass(frozen=True)
class QuickStart:
    """The default plan (with its calibration) and where its quick profile is cached."""

    plan: object  # a Plan naming the calibration, without a profile
    profile: Path
    threads: int
    hint: str = TUNE_HINT  # how to do better, said when it runs

    def cached(self) -> bool:
        """Whether a usable quick profile is cached (measured on this device, for this plan)."""
        from .runtime.cost import CostModel

        try:
            CostModel.from_profile(self.profile, self.plan)
        except YggError:
            return False
        return True

    def engine(self, mode: str | None = None, say=None):
        """(engine, tokenizer, policy): the plan's engine with every width built (dynamo graphs,
        cached by inductor under the user cache directory) and its latency objective; the quick
        profile is measured on this very engine first when none is cached (after the padding of
        short packed products, which the engine is built with). ``say(line)`` reports what
        happened (default: one line on stderr)."""
        from .offline.profile import measure_profile
        from .offline.profile_grid import ProfileGrid
        from .offline.profile_padding import measure_padding
        from .plan import validate_plan
        from .runtime.build import build_plan_engine
        from .runtime.graphs import inductor_cache
        from .runtime.padding import profile_kernel, profile_min_rows, profile_prefetch
        from .shapes import measured_prefetch
        from .runtime.objective import plan_policy

        say = say or (lambda line: sys.stderr.write(f"yggtree: {line}\n"))
        measured = not self.cached()
        t0 = time.perf_counter()
        padding = measure_padding(self.plan, self.threads, warmup=1, repeats=5) if measured else None
        pad_s = time.perf_counter() - t0
        min_rows = padding["min_rows"] if measured else profile_min_rows(self.profile)
        kernel = padding["kernel"] if measured else profile_kernel(self.profile)
        prefetch = measured_prefetch(padding.get("prefetch")) if measured else profile_prefetch(self.profile)
        t0 = time.perf_counter()
        with inductor_cache(cache_root() / "inductor"):
            engine, tok = build_plan_engine(self.plan, None, mode, min_rows=min_rows, kernel=kernel,
                                          prefetch=prefetch)
        built = time.perf_counter() - t0
        if measured:
            import contextlib
            import io
            import json

            from .files import write_text_atomic

            t1 = time.perf_counter()
            widths = tuple(sorted({1, *self.plan.verify_widths}))
            grid = ProfileGrid(warmup=1, repeats=3, quick=True, widths=widths, stage_forms=False)
            with contextlib.redirect_stderr(io.StringIO()):  # no progress bar for a plain run
                prof = measure_profile(self.plan, self.profile.stem, self.threads, grid,
                                       "yggtree run (quick profile of the default plan)", engine=engine,
                                       padding=padding)
            self.profile.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.profile, json.dumps(prof, indent=1) + "\n")
            say(f"no tuned plan for this device: measured a quick latency profile in "
                f"{time.perf_counter() - t1 + pad_s:.0f} s (graphs built in {built:.0f} s), cached in "
                f"{self.profile}; the default plan's latency objective chooses every step (plain "
                f"where nothing pays). {self.hint}")
        else:
            say(f"default plan with the quick profile {self.profile} (graphs {built:.0f} s); {self.hint}")
        plan = validate_plan(self.plan.to_dict() | {"profile": str(self.profile)})
        policy = plan_policy(plan)
        if engine.drafter is not None:
            engine.set_lookup(plan.lookup)
        return engine, tok, policy


def quick_start(base, calibration: Path | None, device: dict, threads: int, root: Path | None = None,
                hint: str | None = None) -> tuple[QuickStart | None, str | None]:
    """The quick start of ``base`` (a speculative Plan) on ``device``, or None and why not
    (``hint``: what to say about doing better; default: tune)."""
    if not base.speculative:
        return None, f"plan {base.name!r} has no drafter"
    if calibration is None or not Path(calibration).is_file():
        return None, (f"no acceptance calibration for the default pair in {base.dtype} "
                      f"({TUNE_HINT}, calibrating it)")
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:  # the profile's curve fit
        return None, "a quick profile needs the offline extra: pip install 'yggtree[offline]'"
    from .runtime.calibration import Calibration

    plan = replace(base, calibration=str(Path(calibration).resolve()), profile=None, predictor=None)
    try:
        Calibration.load(plan.calibration, plan)
    except YggError as e:
        return None, f"the shipped calibration does not fit ({e})"
    path = quick_profile_path(device, threads, base.dtype, root)
    return QuickStart(plan, path, threads, hint or TUNE_HINT), None


SHIPPED_PAIRS = Path(__file__).resolve().parent / "assets" / "predictors"  # in the package: a wheel holds them


def shipped_pair_dir(plan) -> Path:
    """Where the package ships the artifacts of ``plan``'s pair (acceptance calibration, depth
    predictor): ``yggtree/assets/predictors/<target>__<drafter>__<dtype>/``, as
    ``yggtree.offline.fit.pair_dir`` names them."""
    def slug(name):
        return str(name) if name in (None, "default", "self") else (Path(name).name.removesuffix(".gguf") or "model")

    return SHIPPED_PAIRS / f"{slug(plan.target)}__{slug(plan.drafter)}__{plan.dtype}"


def shipped_calibration(plan) -> Path | None:
    """The acceptance calibration of ``plan``'s pair the package ships
    (``yggtree/assets/predictors/<pair>/calibration.json``), None if there is none."""
    cal = shipped_pair_dir(plan) / "calibration.json"
    return cal if cal.is_file() else None


def default_quick_start(dtype: str, device: dict, threads: int, hint: str | None = None
                        ) -> tuple[QuickStart | None, str | None]:
    """:func:`quick_start` of the default plan in ``dtype`` with the shipped calibration of the
    embedded pair (:func:`shipped_calibration`)."""
    from .plan import default_plan

    base = replace(default_plan(), dtype=dtype)
    return quick_start(base, shipped_calibration(base), device, threads, hint=hint)
