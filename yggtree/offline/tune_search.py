"""The search phase of ``yggtree tune``: this process and, with ``--workers N``, N - 1 local
worker processes (``python -m yggtree.offline.tune --search-only``) take the study's trials and
run them (:func:`.tune_trial.evaluate`) until its budget is spent."""

from __future__ import annotations

import subprocess
import sys

from ..errors import YggError
from .tune_artifacts import say
from .tune_inputs import Inputs, Setup, base_params
from .tune_trial import evaluate, keep_best_dirs

STALE_S = 3600.0  # a trial of another host silent this long is taken as dead


def search(s: Setup, inp: Inputs, worker: int = 0, deadline: float | None = None,
           on_event=None) -> int:
    """Take and run trials until the study's budget is spent; returns the trials run here."""
    import optuna
    from optuna.trial import TrialState

    from .tune_study import enqueue_base, make_pruner, next_trial, open_study, retry

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=s.seed + worker, n_startup_trials=8, constant_liar=True)
    study = open_study(s.url, s.study, s.identity, sampler, make_pruner(s.measure_top))
    params, _ = base_params(s, inp)
    if params is not None:  # the base plan is always a candidate: the study's first trial
        enqueue_base(study, s.url, params)
    n = 0
    while True:
        trial = next_trial(study, s.url, s.trials, STALE_S, deadline)
        if trial is None:
            return n
        notes: dict = {}
        try:
            state, value = evaluate(trial, study, s, inp, on_event, notes)
        except KeyboardInterrupt:
            study.tell(trial, state=TrialState.FAIL)
            retry(study, trial.number, trial.params)
            raise
        except Exception as e:  # noqa: BLE001 - one candidate that cannot build or run fails alone
            why = str(e) if isinstance(e, YggError) else f"{type(e).__name__}: {e}"
            trial.set_user_attr("error", " ".join(why.split())[:500])
            study.tell(trial, state=TrialState.FAIL)
            say(f"trial {trial.number} failed: {why.splitlines()[0] if why else type(e).__name__}")
            n += 1
            continue
        if state == "complete":
            study.tell(trial, value)
        else:
            study.tell(trial, state=TrialState.PRUNED)
        if state == "complete":
            keep_best_dirs(s, study)
        if on_event is not None:
            on_event("told", trial.number)
        say(f"trial {trial.number}: {state}" + (f", {value:.1f} tok/s" if value is not None else "")
             + f" ({_why(notes)})")
        n += 1


def _why(a: dict) -> str:
    bits = []
    if "predicted_tps" in a:
        bits.append(f"predicted {a['predicted_tps']:.1f} tok/s")
    for k in ("unpriced", "infeasible", "pruned_at"):
        if k in a:
            bits.append(str(a[k]))
    if "duplicate_of" in a:
        bits.append(f"same plan as #{a['duplicate_of']}")
    return ", ".join(bits) or "-"


def run_workers(s: Setup, argv: list[str], workers: int, inp: Inputs, deadline: float | None) -> int:
    """This process and ``workers - 1`` subprocesses (``python -m yggtree.offline.tune
    --search-only``) search the study together."""
    procs = []
    args = _without_flag(argv, "--workers")
    for w in range(1, workers):
        cmd = [sys.executable, "-m", "yggtree.offline.tune", *args, "--search-only",
               "--worker-index", str(w)]
        procs.append(subprocess.Popen(cmd))
    try:
        n = search(s, inp, 0, deadline)
    finally:
        codes = [p.wait() for p in procs]
    bad = [c for c in codes if c != 0]
    if bad:
        raise YggError(f"{len(bad)} of {workers - 1} worker process(es) failed (exit {bad[0]})")
    return n


def _without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out
