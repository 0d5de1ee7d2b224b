"""``yggtree tune --hw NAME``: one command from a fresh machine to a tuned, compiled plan.

Phases (each reports its wall time; every valid artifact found is reused and named,
:mod:`.tune_artifacts`):

1. profile: this machine's latency curves for the envelope of the search space (all candidate
   widths, the largest d_max; the one weight format it prices, :func:`.tune_space.profiled_weights`).
   Reused when ``profiles/NAME.json`` or another profile in the output directory was measured
   for the same models, dtype and weight format on this device with the same thread count and
   covers the widths; otherwise measured and written to ``profiles/NAME.json``.
2. calibration: the pair's acceptance map (it belongs to target, drafter and dtype, not to the
   machine). Reused when the pair's ``predictors/<pair>/calibration.json`` (or one an earlier
   tune made, ``profiles/*.calibration/``) covers the space's widths and depth; otherwise
   ``yggtree calibrate`` runs on the envelope plan into ``profiles/NAME.calibration/``.
3. search (:mod:`.tune_search`; one trial: :mod:`.tune_trial`): an optuna study
   (:mod:`.tune_study`) over the plan space (:mod:`.tune_space`: widths, depth, top-k, lookup,
   prefill chunk, stage plan with its thread split, weight format); objective
   (:mod:`.tune_objective`): predicted tokens/s first, then compile and measure the leading
   candidates on held-out calibration prompts with pruning (a weight format the profile did not
   measure has no prediction: measured directly); compile seconds and artifact bytes recorded
   per measured trial. ``--workers N`` runs N local processes on the study; more processes or
   machines may join with the same ``--storage`` and ``--study``. The base plan's own values
   (``--plan``, else the default plan) are the study's first trial, enqueued once per study
   (:func:`.tune_study.enqueue_base`) when the space holds them.
4. confirm (:mod:`.tune_confirm`): the ``--measure-top`` best measured trials and the base
   plan's trial decode ``--confirm-prompts`` further held-out calibration prompts side by side
   (one engine each, warmed once; every candidate on a prompt before the next, the order
   rotating); the fastest over those prompts wins, its speed over the base plan's given with a
   95% bootstrap interval over prompts. The highest of several few-prompt trial measurements
   alone is a winner's curse: per-prompt speed varies widely with the prompt.
5. compile + report (:mod:`.tune_finish`): the winner becomes ``profiles/NAME.yaml`` (written
   last, whole or not at all), compiled into ``compile/NAME/``; ``profiles/NAME.tuning.json``
   (phases, best trials, the confirmation, Pareto front of speed vs graphs to compile), a rich
   table and PNGs (``NAME.history.png``, ``NAME.importances.png``, ``NAME.pareto.png``).

A stopped tune resumes: run the same command again (trials continue under new numbers; a trial a
killed process left RUNNING is re-run; completed trials never are; the confirmation, which
stores nothing, runs again). Nothing a user made is
overwritten without ``--force`` (a plan, profile or compiled directory this study did not write).
Evaluation prompts (MT-Bench, HumanEval) are never used: every prompt is a calibration prompt.

This module is the command: its setup (the study's identity, the refusal of outputs it did not
write), the phases in order and its flags; what its processes share is :mod:`.tune_inputs`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..errors import YggError, module_main
from .tune_artifacts import (
    ensure_calibration,
    ensure_profile,
    envelope_plan,
    find_calibration,
    find_profile,
    say,
)
from .tune_finish import finish, plan_owner
from .tune_inputs import Setup, base_params, load_inputs
from .tune_search import run_workers, search

# 2: only valid plans are sampled, d_max, verify_widths and lookup as *_index parameters
# (tune_space.suggest); a format-1 study's parameters are encoded otherwise and are refused
STUDY_FORMAT = 2


# ----------------------------------------------------------------------------- setup


def study_identity(base, device: dict, threads: int, space) -> dict:
    """What a study's trials depend on: the pair, dtype, backend, context, device, threads and
    the search space."""
    from ..runtime.artifacts import timing_identity

    return {
        "format": STUDY_FORMAT,
        "target": base.target if base.target == "default" else Path(base.target).name,
        "drafter": base.drafter if base.drafter in (None, "default", "self") else Path(base.drafter).name,
        "models": hashlib.sha256(json.dumps(timing_identity(base), sort_keys=True).encode()).hexdigest()[:16],
        "dtype": base.dtype,
        "backend": base.backend,
        "max_context": base.max_context,
        "device": f"{device['kind']} {device['name']}",
        "device_identity": device.get("identity"),  # a study's trials timed another CPU of this name
        "threads": threads,
        "space": space.to_dict(),
    }


def study_key(url: str, study: str) -> str:
    from .tune_study import redacted

    return f"{study} @ {redacted(url)}"


def check_outputs(hw: str, out_dir: Path, compile_root: Path, key: str, force: bool) -> bool:
    """Refuse (before any work) to replace a plan or compiled directory this study did not
    write; returns whether the existing ones (if any) are this study's."""
    from ..runtime.artifacts import read_manifest

    plan_path = out_dir / f"{hw}.yaml"
    ours = plan_owner(plan_path) == key
    if plan_path.exists() and not ours and not force:
        raise YggError(f"{plan_path} exists and was not written by this tune (study {key}); pass "
                       "--force to replace it, or choose another --hw")
    art = compile_root / hw
    if art.exists() and not ours and not force:
        m = read_manifest(art) if art.is_dir() else None
        what = f"the artifacts of plan {m.get('plan_name')!r}" if m else "files"
        raise YggError(f"{art} holds {what} this tune did not write; pass --force to replace them, "
                       "or choose another --hw")
    return ours


# ----------------------------------------------------------------------------- the command


def run(args, on_event=None) -> int:
    """The ``tune`` subcommand (``on_event(name, trial_number)`` is called at each stage of a
    trial: start, compile, measure, rung<N>, end, told (after its result is stored); and
    ``on_event("confirm", base_trial)`` before the confirmation decodes; the tests stop
    processes there)."""
    from .tune_space import plan_count
    from .tune_study import open_study

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_all = time.perf_counter()
    _check_args(args)
    s, problems, key = _setup(args)
    base, space = s.base, s.space
    open_study(s.url, s.study, s.identity)  # bad URLs and foreign studies: refused before any work
    if not args.search_only:
        check_outputs(args.hw, s.out_dir, s.compile_root, key, args.force)
        for fmt, why in problems.items():  # after every refusal: an error stays one line
            say(f"weights {fmt} not searched: {why}")
    env = envelope_plan(base, space, args.hw)
    phases: dict = {}
    reuse: dict = {}
    profile, calibration = _profile_and_calibration(args, env, s, phases, reuse)
    inp = load_inputs(s, env, profile, calibration)
    deadline = time.time() + args.budget_minutes * 60 if args.budget_minutes else None
    t = time.perf_counter()
    if args.search_only:
        search(s, inp, args.worker_index, deadline, on_event)
        return 0
    for label, why in inp.unpriced_stages.items():
        say(f"stages {label} not sampled: {why}")
    params, why = base_params(s, inp)
    if params is None:
        say(f"the base plan {base.name!r} is not a candidate: {why}")
    say(f"searching {plan_count(replace(space, stages=inp.stages), base.max_context)} valid plans "
        f"(of {space.size()} combinations) in study {key} ({args.trials} trials, {args.workers} worker(s))")
    if args.workers > 1:
        n = run_workers(s, args.argv, args.workers, inp, deadline)
    else:
        n = search(s, inp, 0, deadline, on_event)
    phases["search"] = round(time.perf_counter() - t, 2)
    phases["search_trials_here"] = n
    out = finish(s, inp, key, phases, reuse, on_event)
    out["wall_s"] = round(time.perf_counter() - t_all, 2)
    print(json.dumps(out), flush=True)
    return 0


def _setup(args) -> tuple[Setup, dict, str]:
    """``(setup, problems, study key)`` of a tune from its flags: the base plan, the search space
    (its ``--space`` overrides applied, the weight formats this machine cannot run left out:
    ``problems``, format -> why), the study's storage, name and identity."""
    from ..plan import default_plan, load_plan
    from ..runtime.device import detect_device
    from .profile import NAME_OK
    from .tune_space import (
        apply_overrides, check_space, default_space, override_key, runnable_weights,
    )
    from .weight_check import weight_problems
    from .tune_study import sqlite_url

    device = detect_device()
    if not NAME_OK.match(args.hw):
        raise YggError(f"--hw {args.hw!r}: use letters, digits, '.', '_' or '-' (it names profiles/<hw>.yaml)")
    base = load_plan(args.plan) if args.plan else default_plan()
    if not base.speculative:
        raise YggError(f"plan {base.name!r} has no drafter: there is no speculation to tune")
    space = apply_overrides(default_space(base, args.threads), args.space or [], base.dtype, args.threads)
    problems = weight_problems(base, space.weights, max(base.verify_widths))
    given = "weights" in {override_key(item) for item in args.space or []}
    space = runnable_weights(space, problems, given)
    check_space(space, base, args.threads)
    out_dir = Path(args.out_dir).resolve()
    compile_root = Path(args.compile_root).resolve()
    url = args.storage or sqlite_url(out_dir / f"{args.hw}.study.db")
    if args.storage is None:
        out_dir.mkdir(parents=True, exist_ok=True)
    study_name = args.study or args.hw
    key = study_key(url, study_name)
    identity = study_identity(base, device, args.threads, space)
    s = Setup(args.hw, base, space, url, study_name, identity, out_dir, compile_root, args.threads,
              args.trials, args.measure_top, args.measure_prompts, args.confirm_prompts, args.max_new_tokens,
              args.prompt_tokens, args.seed)
    return s, problems, key


def _profile_and_calibration(args, env, s: Setup, phases: dict, reuse: dict) -> tuple[Path, Path]:
    """The profile and calibration of the envelope plan ``env``: a worker's found (the
    coordinating process made both), else reused or made, with their times (``phases``) and
    whether each was reused (``reuse``)."""
    t = time.perf_counter()
    if args.search_only:  # a worker: the coordinating process made both artifacts
        return _worker_artifacts(env, args.hw, s.out_dir, args.threads)
    profile, reuse["profile"] = ensure_profile(env, args.hw, s.out_dir, args.threads, args.force,
                                               args.quick_profile, s.compile_root)
    phases["profile"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    calibration, reuse["calibration"] = ensure_calibration(
        env, args.hw, s.out_dir, args.threads, args.force, args.calibration_prompts, args.max_new_tokens)
    phases["calibration"] = round(time.perf_counter() - t, 2)
    return profile, calibration


def _worker_artifacts(env, hw: str, out_dir: Path, threads: int) -> tuple[Path, Path]:
    """The profile and calibration a worker process uses (found, never measured)."""
    p, _ = find_profile(env, hw, out_dir, threads)
    c, _ = find_calibration(env, hw, out_dir)
    if p is None or c is None:
        raise YggError(f"worker: no valid {'profile' if p is None else 'calibration'} in {out_dir} "
                       f"(run `yggtree tune --hw {hw}` without --search-only first)")
    return p, c


def _check_args(args) -> None:
    for name in ("trials", "measure_top", "measure_prompts", "confirm_prompts", "max_new_tokens", "prompt_tokens",
                 "threads", "workers", "calibration_prompts"):
        if getattr(args, name) < 1:
            raise YggError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise YggError(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    from ..runtime.schedule import usable_cores

    cores = usable_cores()  # workers measure speed side by side: oversubscribed, they measure contention
    if args.workers * args.threads > cores:
        raise YggError(f"--workers {args.workers} x --threads {args.threads} = {args.workers * args.threads} "
                       f"threads exceeds this machine's {cores} usable cores")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hw", required=True, help="name of this machine's plan: profiles/<hw>.yaml")
    p.add_argument("--plan", default=None, help="base plan (default: the embedded default plan)")
    p.add_argument("--trials", type=int, default=40, help="trials in the study in all (default 40)")
    p.add_argument("--space", action="append", metavar="KEY=VALUES",
                   help="override a dimension: draft_widths=1,2,4 | d_max=2..6 | top_k=4 | lookup=0,8 | "
                   "verify_widths=... | prefill_chunk=... | stages=sequential@1,overlap@1+1 | "
                   "weights=float32,int8,int4@32 (repeatable)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="optuna RDB storage (SQLAlchemy URL; default sqlite:///<out-dir>/<hw>.study.db)")
    p.add_argument("--study", default=None, help="study name (default: --hw)")
    p.add_argument("--workers", type=int, default=1,
                   help="local worker processes (default 1; workers x threads at most the usable cores)")
    p.add_argument("--measure-top", type=int, default=3,
                   help="measure a candidate when its prediction ranks among the N best so far (default 3)")
    p.add_argument("--measure-prompts", type=int, default=4,
                   help="held-out calibration prompts a trial measures, in rungs 1, 2, 4, ... (default 4)")
    p.add_argument("--confirm-prompts", type=int, default=12,
                   help="other held-out calibration prompts on which the --measure-top best trials and the "
                   "base plan are measured again side by side; the fastest is the plan (default 12)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per measured prompt (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="longest measured prompt (default 256 tokens)")
    p.add_argument("--calibration-prompts", type=int, default=12,
                   help="prompts of a calibration made here (default 12)")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="start no new trial after this many minutes of this run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--quick-profile", action="store_true", help="a profile made here uses 3 repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="profiles")
    p.add_argument("--compile-root", default="compile")
    p.add_argument("--force", action="store_true",
                   help="replace a plan, profile, calibration or compiled directory this tune did not write")
    p.add_argument("--search-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``tune`` on a CLI's subparsers (help line, flags), handled by :func:`run`."""
    p = subparsers.add_parser("tune", help="profile, calibrate, search plans with optuna and compile the best")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.tune ...``: the same options as ``yggtree tune`` (the local
    workers of ``--workers N`` run this way)."""
    return module_main("yggtree.offline.tune", "tune", __doc__, add_arguments, run, argv)



if __name__ == "__main__":
    sys.exit(main())
