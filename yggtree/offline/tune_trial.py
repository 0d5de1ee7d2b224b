"""One trial of a ``yggtree tune`` study: its evaluation (:func:`evaluate`: a valid plan sampled,
predicted, compiled and measured with pruning) and its compiled directory,
``<compile-root>/_tune-<study>/<number>``, kept while the trial may be confirmed, then moved to
``<compile-root>/<hw>`` (the winner's) or removed."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..errors import YggError
from .tune_inputs import Inputs, Setup, objective_files, trial_stage_scale


def _fields_key(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True)


def evaluate(trial, study, s: Setup, inp: Inputs, on_event=None, notes: dict | None = None
             ) -> tuple[str, float | None]:
    """Run one trial to its end; returns (state, value) for ``study.tell``. Every user
    attribute set on the trial is also put in ``notes``."""
    from optuna.trial import TrialState

    from .tune_objective import predicted_tokens_per_s

    notes = {} if notes is None else notes

    def note(k: str, v) -> None:
        trial.set_user_attr(k, v)
        notes[k] = v

    def event(name: str) -> None:
        trial.set_user_attr("alive_at", time.time())
        if on_event is not None:
            on_event(name, trial.number)

    event("start")
    sampled = _sampled_plan(trial, s, inp, note)
    if sampled is None:
        return "pruned", None
    fields, plan, scale = sampled
    if fields["weights"] != inp.profile_weights:
        note("unpriced", f"weights {fields['weights']}: the profile measured {inp.profile_weights} "
                         "weights; no prediction, measured directly with the envelope tree")
    else:
        note("stage_pricing", _stage_pricing(scale, s.threads, inp))
        pred = predicted_tokens_per_s(inp.cost, inp.calib, plan.draft_widths, plan.verify_widths,
                                      plan.d_max, inp.contexts, scale)
        note("predicted_tps", round(pred, 3))
        trial.report(pred, 0)
    key = _fields_key(fields)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if _fields_key(t.user_attrs.get("fields", {})) == key:
            note("duplicate_of", t.number)
            return "pruned", None
    if "predicted_tps" in notes and trial.should_prune():
        note("pruned_at", "predicted")
        return "pruned", None
    m = _compiled_and_measured(trial, s, inp, plan, note, event)
    note("build_s", round(m.build_s, 3))
    if m.aal is not None:
        note("aal", round(m.aal, 4))
    event("end")
    return ("pruned", None) if m.pruned else ("complete", m.tokens_per_s)


def _sampled_plan(trial, s: Setup, inp: Inputs, note) -> tuple | None:
    """``(fields, plan, stage scale)`` of the plan ``trial`` samples, its fields and block shapes
    noted (``note(key, value)``); None, noted ``infeasible`` and reported as predicting nothing,
    where it cannot be built or its stage plan priced."""
    from .tune_objective import block_shapes
    from .tune_space import candidate_plan, infeasible, plan_fields, suggest

    fields = plan_fields(suggest(trial, s.space, s.base.max_context, inp.stages), s.space)
    note("fields", fields)
    # suggest samples valid plans only (tune_space.allowed): these checks are a guard
    why = infeasible(fields, s.base.max_context, s.base.speculative, s.threads)
    plan = None
    if why is None:
        try:
            # named as the tuned plan: the winner's compiled directory becomes compile/<hw>
            plan = candidate_plan(s.base, fields, s.hw, *objective_files(inp, fields))
        except YggError as e:
            why = str(e)
    if why is not None:
        note("infeasible", why)
        trial.report(0.0, 0)  # refused before anything ran; the sampler learns it predicts nothing
        return None
    note("shapes", block_shapes(plan))
    try:
        scale = trial_stage_scale(plan, fields["stages"], s.threads, inp)
    except YggError as e:
        note("infeasible", str(e))  # the latency model cannot price this stage plan
        trial.report(0.0, 0)
        return None
    return fields, plan, scale


def _compiled_and_measured(trial, s: Setup, inp: Inputs, plan, note, event):
    """``plan`` compiled into the trial's directory and measured (tune_objective.measure_plan),
    each measured rung reported and the trial pruned there where optuna says so; the directory
    is kept only for a trial that completes (it may win). ``note(key, value)`` and
    ``event(name)`` as in :func:`evaluate`."""
    from ..offline.compile import compile_plan
    from .tune_objective import measure_plan

    event("compile")
    root = trial_root(s, trial.number)
    shutil.rmtree(root, ignore_errors=True)
    m = None
    try:
        summary = compile_plan(plan, root, force=True, console=_quiet_console())
        note("compile_s", round(summary["wall_s"], 3))
        note("size_bytes", int(summary["size_bytes"]))
        note("graphs", int(summary["n_graphs"]))
        event("measure")
        art = Path(summary["dir"]) if plan.backend != "eager" else None

        def report(step: int, value: float) -> bool:
            trial.report(value, step)
            event(f"rung{step}")
            if trial.should_prune():
                note("pruned_at", f"measured rung {step}")
                note("measured_tps", round(value, 3))
                return True
            return False

        m = measure_plan(plan, art, inp.measure_ids, s.max_new_tokens, report, s.threads)
    finally:
        if m is None or m.pruned:  # a complete trial keeps its graphs while it may win
            shutil.rmtree(root, ignore_errors=True)
            _rmdir_empty(root.parent)
    return m


def _stage_pricing(scale, threads: int, inp: Inputs) -> str:
    """How a trial's stage plan was priced (its user attribute ``stage_pricing``)."""
    if scale is not None:
        return f"{scale.label}: the profile's sequential@{threads} curves scaled by its stage forms (plan_search)"
    if inp.forms is None:
        return (f"sequential@{threads}: the profile's curves; the profile has no stage forms, so "
                f"sequential@{threads} is the only stage plan it prices")
    return f"sequential@{threads}: the profile's curves"


def trial_root(s: Setup, number: int) -> Path:
    return s.compile_root / f"_tune-{s.study}" / str(number)


def trial_graphs(s: Setup, plan, number: int) -> Path | None:
    """The compiled directory of trial ``number``'s ``plan`` (None: the eager backend), compiled
    again when the trial left none that matches (a pruned trial, a study of an older tune)."""
    from ..compiled import check_artifacts
    from .compile import compile_plan

    if plan.backend == "eager":
        return None
    d = trial_root(s, number) / s.hw
    if d.is_dir() and not check_artifacts(plan, d):
        return d
    shutil.rmtree(trial_root(s, number), ignore_errors=True)
    return Path(compile_plan(plan, trial_root(s, number), force=True, console=_quiet_console())["dir"])


def keep_best_dirs(s: Setup, study) -> None:
    """Remove the compiled directories of completed trials the confirmation will not measure
    (:func:`.tune_report.confirm_candidates`)."""
    from .tune_report import confirm_candidates, trial_rows
    from .tune_space import base_fields

    rows = trial_rows(study)
    keep = {r["number"] for r in confirm_candidates(rows, base_fields(s.base, s.threads), s.measure_top)}
    for r in rows:
        if r["state"] == "complete" and r["number"] not in keep:
            shutil.rmtree(trial_root(s, r["number"]), ignore_errors=True)


def clean_trial_dirs(s: Setup, study) -> None:
    """Remove what killed trials left in their compile directories (finished trials only)."""
    top = s.compile_root / f"_tune-{s.study}"
    finished = {str(t.number) for t in study.get_trials(deepcopy=False) if t.state.is_finished()}
    for d in top.iterdir() if top.is_dir() else ():
        if d.name in finished:
            shutil.rmtree(d, ignore_errors=True)
    _rmdir_empty(top)


def adopt_trial_graphs(s: Setup, plan, number: int) -> bool:
    """Move the best trial's compiled directory to ``compile/<hw>`` when its artifacts match
    ``plan`` (artifacts are path-independent); False when there is none to move."""
    from ..compiled import check_artifacts

    src = trial_root(s, number) / s.hw
    if plan.backend == "eager" or not src.is_dir() or check_artifacts(plan, src):
        return False
    dst = s.compile_root / s.hw
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.replace(dst)
    return True


def _rmdir_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty (another worker's trial) or gone


def _quiet_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO())
