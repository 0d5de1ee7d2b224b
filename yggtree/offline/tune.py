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
3. search: an optuna study (:mod:`.tune_study`) over the plan space (:mod:`.tune_space`:
   widths, depth, top-k, lookup, prefill chunk, stage plan with its thread split, weight
   format); objective (:mod:`.tune_objective`): predicted tokens/s first, then compile and
   measure the leading candidates on held-out calibration prompts with pruning (a weight format
   the profile did not measure has no prediction: measured directly); compile seconds and
   artifact bytes recorded per measured trial. ``--workers N`` runs N local processes on the
   study; more processes or machines may join with the same ``--storage`` and ``--study``.
   The base plan's own values (``--plan``, else the default plan) are the study's first trial,
   enqueued once per study (:func:`.tune_study.enqueue_base`) when the space holds them.
4. confirm: the ``--measure-top`` best measured trials and the base plan's trial decode
   ``--confirm-prompts`` further held-out calibration prompts side by side (one engine each,
   warmed once; every candidate on a prompt before the next, the order rotating); the fastest
   over those prompts wins, its speed over the base plan's given with a 95% bootstrap interval
   over prompts. The highest of several few-prompt trial measurements alone is a winner's
   curse: per-prompt speed varies about 2x with the prompt.
5. compile + report: the winner becomes ``profiles/NAME.yaml`` (written last,
   whole or not at all), compiled into ``compile/NAME/``; ``profiles/NAME.tuning.json`` (phases,
   best trials, the confirmation, Pareto front of speed vs graphs to compile), a rich table and
   PNGs (``NAME.history.png``, ``NAME.importances.png``, ``NAME.pareto.png``).

A stopped tune resumes: run the same command again (trials continue under new numbers; a trial a
killed process left RUNNING is re-run; completed trials never are; the confirmation, which
stores nothing, runs again). Nothing a user made is
overwritten without ``--force`` (a plan, profile or compiled directory this study did not write).
Evaluation prompts (MT-Bench, HumanEval) are never used: every prompt is a calibration prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import YggError, module_main
from ..files import write_text_atomic
from .tune_artifacts import (
    ensure_calibration,
    ensure_profile,
    envelope_plan,
    find_calibration,
    find_profile,
    say,
)

MARKER = "# yggtree-tune-study: "  # first line of a plan this command wrote, naming its study
STALE_S = 3600.0  # a trial of another host silent this long is taken as dead
# 2: only valid plans are sampled, d_max, verify_widths and lookup as *_index parameters
# (tune_space.suggest); a format-1 study's parameters are encoded otherwise and are refused
STUDY_FORMAT = 2


@dataclass(frozen=True)
class Setup:
    """What every worker of one tune shares (all paths absolute)."""

    hw: str
    base: object  # the base Plan
    space: object  # SearchSpace
    url: str
    study: str
    identity: dict
    out_dir: Path
    compile_root: Path
    threads: int
    trials: int
    measure_top: int
    measure_prompts: int
    confirm_prompts: int
    max_new_tokens: int
    prompt_tokens: int
    seed: int


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
        "threads": threads,
        "space": space.to_dict(),
    }


def plan_owner(path: Path) -> str | None:
    """The study key a tuned plan file names in its first line (None: not written by tune)."""
    try:
        first = path.read_text().split("\n", 1)[0]
    except OSError:
        return None
    return first[len(MARKER):].strip() if first.startswith(MARKER) else None


def study_key(url: str, study: str) -> str:
    from .tune_study import redacted

    return f"{study} @ {redacted(url)}"


def check_outputs(hw: str, out_dir: Path, compile_root: Path, key: str, force: bool) -> bool:
    """Refuse (before any work) to replace a plan or compiled directory this study did not
    write; returns whether the existing ones (if any) are this study's."""
    from ..plan import read_manifest

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


# ----------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Inputs:
    """The objective's inputs, loaded once per worker."""

    cost: object
    calib: object
    contexts: list
    measure_ids: list  # the trials' held-out prompts
    confirm_ids: list  # the confirmation's: held out from the calibration and the trials
    profile: Path
    calibration: Path
    forms: dict | None  # the profile's stage forms (None: it has none)
    profile_weights: str  # the weight format the profile measured
    stages: tuple = ()  # the space's stage plans the profile prices (the ones sampled)
    unpriced_stages: dict = field(default_factory=dict)  # the others, with why


def load_inputs(s: Setup, env, profile: Path, calibration: Path) -> Inputs:
    """Cost model, calibration, the calibration prompts' contexts and the held-out prompts: in
    ``calibration_chat_prompts`` order the calibration's own, then the trials', then the
    confirmation's (never MT-Bench or HumanEval)."""
    from ..data import calibration_chat_prompts
    from ..runtime.loading import encode_auto, load_tokenizer, resolve_model
    from ..runtime.calibration import Calibration
    from ..runtime.cost import CostModel, profile_weights
    from .tune_objective import token_contexts

    cost = CostModel.from_profile(profile, env)
    prof = json.loads(profile.read_text())
    calib = Calibration.load(calibration, env)
    n_cal = int(json.loads(calibration.read_text()).get("data", {}).get("prompts", 0)) or 1
    tok = load_tokenizer(resolve_model(s.base.target))
    prompts = calibration_chat_prompts(n_cal + s.measure_prompts + s.confirm_prompts)
    ids = [encode_auto(tok, p.text) for p in prompts]
    contexts = token_contexts([len(x) for x in ids[:n_cal]], s.max_new_tokens, s.base.max_context)
    cap = min(s.prompt_tokens, s.base.max_context - s.max_new_tokens - 1)
    held = [x[-cap:] for x in ids[n_cal:]]  # never the prompts the calibration was fitted on
    trial_ids, confirm_ids = held[:s.measure_prompts], held[s.measure_prompts:]
    inp = Inputs(cost, calib, contexts, trial_ids, confirm_ids, profile, calibration,
                 prof.get("stage_forms"), profile_weights(prof, env.dtype))
    unpriced = {}
    for label in s.space.stages:  # priced over the envelope's shapes: then over every plan's
        try:
            trial_stage_scale(env, label, s.threads, inp)
        except YggError as e:
            unpriced[label] = str(e)
    stages = tuple(x for x in s.space.stages if x not in unpriced)
    if not stages:
        raise YggError(f"the profile {profile} prices none of the space's stage plans: "
                       f"{next(iter(unpriced.values()))}")
    return replace(inp, stages=stages, unpriced_stages=unpriced)


def objective_files(inp: Inputs, fields: dict) -> tuple[str | None, str | None]:
    """The profile and calibration a candidate plan names: none when it runs another weight
    format than the profile measured (a plan's latency objective refuses a profile of another
    format, CostModel.from_profile): such a plan runs its envelope tree."""
    if fields["weights"] != inp.profile_weights:
        return None, None
    return str(inp.profile), str(inp.calibration)


def _fields_key(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True)


def evaluate(trial, study, s: Setup, inp: Inputs, on_event=None, notes: dict | None = None
             ) -> tuple[str, float | None]:
    """Run one trial to its end; returns (state, value) for ``study.tell``. Every user
    attribute set on the trial is also put in ``notes``."""
    from optuna.trial import TrialState

    from ..offline.compile import compile_plan
    from .tune_objective import block_shapes, measure_plan, predicted_tokens_per_s
    from .tune_space import candidate_plan, infeasible, plan_fields, suggest

    notes = {} if notes is None else notes

    def note(k: str, v) -> None:
        trial.set_user_attr(k, v)
        notes[k] = v

    def event(name: str) -> None:
        trial.set_user_attr("alive_at", time.time())
        if on_event is not None:
            on_event(name, trial.number)

    event("start")
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
        return "pruned", None
    note("shapes", block_shapes(plan))
    try:
        scale = trial_stage_scale(plan, fields["stages"], s.threads, inp)
    except YggError as e:
        note("infeasible", str(e))  # the latency model cannot price this stage plan
        trial.report(0.0, 0)
        return "pruned", None
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
    note("build_s", round(m.build_s, 3))
    if m.aal is not None:
        note("aal", round(m.aal, 4))
    event("end")
    return ("pruned", None) if m.pruned else ("complete", m.tokens_per_s)


def trial_stage_scale(plan, stages: str, threads: int, inp: Inputs):
    """The StageScale of a trial's stage plan over its tree shapes (None: ``sequential`` at the
    profile's threads); YggError when the profile's stage forms cannot price it."""
    from ..runtime.build import drafter_feeds_leaves
    from .plan_search import hit_rate
    from .tune_objective import stage_scale

    shapes = [(d, wd, wv) for d in range(1, plan.d_max + 1) for wd in plan.draft_widths
              for wv in plan.verify_widths]
    return stage_scale(stages, inp.forms, threads, shapes, lambda sh: inp.cost.overhead_ms(*sh),
                       lambda sh: hit_rate(inp.calib.aal, inp.calib.verify_widths, *sh),
                       drafter_feeds_leaves(plan))


def _stage_pricing(scale, threads: int, inp: Inputs) -> str:
    """How a trial's stage plan was priced (its user attribute ``stage_pricing``)."""
    if scale is not None:
        return f"{scale.label}: the profile's sequential@{threads} curves scaled by its stage forms (plan_search)"
    if inp.forms is None:
        return (f"sequential@{threads}: the profile's curves; the profile has no stage forms, so "
                f"sequential@{threads} is the only stage plan it prices")
    return f"sequential@{threads}: the profile's curves"


def _keep_best_dirs(s: Setup, study) -> None:
    """Remove the compiled directories of completed trials the confirmation will not measure
    (:func:`.tune_report.confirm_candidates`)."""
    from .tune_report import confirm_candidates, trial_rows
    from .tune_space import base_fields

    rows = trial_rows(study)
    keep = {r["number"] for r in confirm_candidates(rows, base_fields(s.base, s.threads), s.measure_top)}
    for r in rows:
        if r["state"] == "complete" and r["number"] not in keep:
            shutil.rmtree(trial_root(s, r["number"]), ignore_errors=True)


def trial_graphs(s: Setup, plan, number: int) -> Path | None:
    """The compiled directory of trial ``number``'s ``plan`` (None: the eager backend), compiled
    again when the trial left none that matches (a pruned trial, a study of an older tune)."""
    from ..plan import check_artifacts
    from .compile import compile_plan

    if plan.backend == "eager":
        return None
    d = trial_root(s, number) / s.hw
    if d.is_dir() and not check_artifacts(plan, d):
        return d
    shutil.rmtree(trial_root(s, number), ignore_errors=True)
    return Path(compile_plan(plan, trial_root(s, number), force=True, console=_quiet_console())["dir"])


def base_params(s: Setup, inp: Inputs) -> tuple[dict | None, str | None]:
    """The optuna parameters of the base plan's own values, or (None, why) when the search
    space (with the stage plans the profile prices) does not hold them."""
    from .tune_space import base_fields, trial_params

    return trial_params(s.space, s.base.max_context, base_fields(s.base, s.threads), inp.stages)


def _clean_trial_dirs(s: Setup, study) -> None:
    """Remove what killed trials left in their compile directories (finished trials only)."""
    top = s.compile_root / f"_tune-{s.study}"
    finished = {str(t.number) for t in study.get_trials(deepcopy=False) if t.state.is_finished()}
    for d in top.iterdir() if top.is_dir() else ():
        if d.name in finished:
            shutil.rmtree(d, ignore_errors=True)
    _rmdir_empty(top)


def _rmdir_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty (another worker's trial) or gone


def trial_root(s: Setup, number: int) -> Path:
    return s.compile_root / f"_tune-{s.study}" / str(number)


def _quiet_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO())


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
            _keep_best_dirs(s, study)
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


# ----------------------------------------------------------------------------- the winner


def confirm(s: Setup, inp: Inputs, rows: list[dict], on_event=None) -> dict:
    """The confirmation: the ``measure_top`` best measured trials and the base plan's trial
    decode the confirmation prompts side by side (every candidate on a prompt before the next,
    the order rotating; :func:`.tune_objective.measure_side_by_side`); the winner is the
    fastest over those prompts. Returns the report's ``confirm`` section."""
    from .tune_objective import measure_side_by_side
    from .tune_report import confirm_candidates, confirm_summary
    from .tune_space import base_fields, candidate_plan

    base = base_fields(s.base, s.threads)
    cands = confirm_candidates(rows, base, s.measure_top)
    base_no = next((r["number"] for r in cands if r["fields"] == base), None)
    ref = base_no if base_no is not None else cands[0]["number"]
    plans = {}
    for r in cands:
        plan = candidate_plan(s.base, r["fields"], s.hw, *objective_files(inp, r["fields"]))
        plans[r["number"]] = (plan, trial_graphs(s, plan, r["number"]))
    say(f"confirming trials {', '.join(map(str, plans))} (base plan: "
        f"{'trial ' + str(base_no) if base_no is not None else 'not a trial'}) side by side on "
        f"{len(inp.confirm_ids)} other held-out calibration prompts x {s.max_new_tokens} tokens")
    if on_event is not None:
        on_event("confirm", ref)
    per_prompt = measure_side_by_side(plans, inp.confirm_ids, s.max_new_tokens, s.threads)
    summ = confirm_summary(per_prompt, list(plans), ref)
    win, c = summ["winner"], summ["candidates"]
    note = None
    if base_no is None:
        note = (f"the base plan is not a trial (not in the search space): ratios are to trial {ref}, "
                "the trial phase's best")
    elif not summ["beat_base"]:
        written = ("is the base plan" if win == ref else f"trial {win} ({c[win]['confirmed_tps']:.1f} vs "
                   f"{c[ref]['confirmed_tps']:.1f} tok/s), is within noise of the base")
        note = (f"no candidate beat the base plan (trial {ref}) beyond its 95% interval over "
                f"{len(per_prompt)} prompts: the plan written {written}")
    say(note or f"confirmed: trial {win} at {c[win]['confirmed_tps']:.1f} tok/s, "
        f"{c[win]['ratio_to_base']:.3f}x the base plan (95% CI {c[win]['ci95'][0]:.3f}-{c[win]['ci95'][1]:.3f})")
    return {"prompts": len(per_prompt), "max_new_tokens": s.max_new_tokens,
            "source": "yggtree.data.calibration_chat_prompts, after the calibration's and the trials'",
            "base_trial": base_no, "reference": ref, "winner": win,
            "beat_base": summ["beat_base"], "note": note,
            "candidates": [{"number": r["number"], "fields": r["fields"], "trial_tps": r["measured_tps"]}
                           | c[r["number"]] for r in cands],
            "per_prompt": [{str(k): v for k, v in row.items()} for row in per_prompt]}


def finish(s: Setup, inp: Inputs, key: str, phases: dict, reuse: dict, on_event=None) -> dict:
    """Compile the best trial, write the plan, its report and plots; returns the summary."""
    from rich.console import Console

    from .compile import compile_plan
    from .tune_report import best_table, complete_rows, pareto_front, trial_rows, write_plots
    from .tune_space import candidate_plan
    from .tune_study import open_study

    study = open_study(s.url, s.study, s.identity)
    rows = trial_rows(study)
    done = complete_rows(rows)
    if not done:
        raise YggError(f"no trial of study {s.study!r} has completed a measurement yet "
                       f"({len(rows)} finished, all pruned); run more trials (--trials)")
    t = time.perf_counter()
    conf = confirm(s, inp, rows, on_event)
    phases["confirm"] = round(time.perf_counter() - t, 2)
    confirmed = {c["number"]: c for c in conf["candidates"]}
    best = next(r for r in rows if r["number"] == conf["winner"]) | {
        k: v for k, v in confirmed[conf["winner"]].items() if k not in ("number", "fields")}
    plan_path = s.out_dir / f"{s.hw}.yaml"
    plan = candidate_plan(s.base, best["fields"], s.hw, *objective_files(inp, best["fields"]))
    t = time.perf_counter()
    reused = adopt_trial_graphs(s, plan, best["number"])
    _clean_trial_dirs(s, study)
    say(f"{'using the graphs compiled for' if reused else 'compiling'} the best plan (trial "
         f"{best['number']}) in {s.compile_root / s.hw}")
    if best["fields"]["weights"] != inp.profile_weights:
        say(f"note: the plan runs {best['fields']['weights']} weights, the profile {inp.profile} measured "
            f"{inp.profile_weights}: the plan names no profile or calibration and runs its envelope tree "
            "(profile and calibrate under this plan to give it the latency objective)")
    # check_outputs made sure compile/<hw> is absent, this study's, or --force was given
    summary = compile_plan(plan, s.compile_root, replace=True, console=Console(stderr=True))
    phases["compile"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    front_ids = pareto_front([(r["measured_tps"], r["graphs"], r["number"]) for r in done])
    stem = s.out_dir / s.hw
    plots = write_plots(study, rows, stem)
    report = {
        "kind": "yggtree-tuning-report",
        "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hw": s.hw,
        "study": s.study,
        "storage": key.split(" @ ", 1)[1],
        "identity": s.identity,
        "reused": reuse,
        "phases_s": phases,
        "trials": {"total": len(study.trials), "complete": len(done),
                   "pruned": sum(r["state"] == "pruned" for r in rows),
                   "infeasible": sum(r["infeasible"] for r in rows),
                   "failed_or_killed": len(study.trials) - len(rows)},
        "best": best,
        "confirm": conf,
        "pareto_front": [r for r in done if r["number"] in front_ids],
        "rows": rows,
        "compile": {"dir": summary["dir"], "status": summary["status"], "graphs": summary["n_graphs"],
                    "compile_s": summary["compile_s"], "size_bytes": summary["size_bytes"]},
        "plots": plots,
        "prompts": {"source": "yggtree.data.calibration_chat_prompts",
                    "predicted_contexts": len(inp.contexts), "measured_prompts": len(inp.measure_ids),
                    "confirm_prompts": len(inp.confirm_ids),
                    "max_new_tokens": s.max_new_tokens, "prompt_tokens": s.prompt_tokens},
    }
    write_text_atomic(stem.with_suffix(".tuning.json"), json.dumps(report, indent=1, default=str) + "\n")
    phases["report"] = round(time.perf_counter() - t, 2)
    write_plan_file(plan, plan_path, key, best, report)  # last: a plan exists only when all is done
    console = Console(file=sys.stdout, width=160)
    console.print(best_table(rows, title=f"study {s.study}: best of {len(done)} measured trials, "
                             f"{len(confirmed)} confirmed on {conf['prompts']} prompts", confirmed=confirmed))
    return {"command": "tune", "plan": str(plan_path), "compiled": summary["dir"],
            "best_trial": best["number"], "confirmed_tps": round(best["confirmed_tps"], 2),
            "ratio_to_base": round(best["ratio_to_base"], 4), "ci95": best["ci95"],
            "measured_tps": best["measured_tps"] and round(best["measured_tps"], 2),
            "predicted_tps": best["predicted_tps"], "trials": report["trials"],
            "pareto_front": front_ids, "phases_s": phases, "reused": reuse,
            "report": str(stem.with_suffix(".tuning.json"))}


def adopt_trial_graphs(s: Setup, plan, number: int) -> bool:
    """Move the best trial's compiled directory to ``compile/<hw>`` when its artifacts match
    ``plan`` (artifacts are path-independent); False when there is none to move."""
    from ..plan import check_artifacts

    src = trial_root(s, number) / s.hw
    if plan.backend == "eager" or not src.is_dir() or check_artifacts(plan, src):
        return False
    dst = s.compile_root / s.hw
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.replace(dst)
    return True


def write_plan_file(plan, path: Path, key: str, best: dict, report: dict) -> Path:
    """The tuned plan with a header naming its study and what it measured."""
    import yaml

    from ..plan import validate_plan

    body = yaml.safe_dump(plan.to_dict(relative_to=path.parent), sort_keys=False, default_flow_style=None)
    validate_plan(yaml.safe_load(body), path.parent, str(path))  # it loads back
    t = report["trials"]
    head = [
        f"{MARKER}{key}",
        f"# tuned by `yggtree tune --hw {report['hw']}` on {report['identity']['device']} "
        f"({report['identity']['threads']} thread(s)), {report['created']}",
        f"# best trial {best['number']}: {best['confirmed_tps']:.1f} decode tok/s confirmed on "
        f"{report['confirm']['prompts']} held-out calibration prompts, {_vs_base(best)} ({_predicted_text(best)}), "
        f"{t['complete']} measured of {t['total']} trials; report: {path.stem}.tuning.json",
    ]
    return write_text_atomic(path, "\n".join(head) + "\n" + body)


def _predicted_text(best: dict) -> str:
    trial = "" if best.get("measured_tps") is None else f"trial prompts {best['measured_tps']:.1f}, "
    if best.get("predicted_tps") is None:
        return trial + "not predicted: the profile did not measure its weight format"
    return trial + f"predicted {best['predicted_tps']}"


def _vs_base(best: dict) -> str:
    if best["base"]:
        return "the base plan"
    lo, hi = best["ci95"]
    return f"{best['ratio_to_base']:.3f}x the base plan (95% CI {lo:.3f}-{hi:.3f})"


# ----------------------------------------------------------------------------- the command


def run(args, on_event=None) -> int:
    """The ``tune`` subcommand (``on_event(name, trial_number)`` is called at each stage of a
    trial: start, compile, measure, rung<N>, end, told (after its result is stored); and
    ``on_event("confirm", base_trial)`` before the confirmation decodes; the tests stop
    processes there)."""
    from ..plan import default_plan, load_plan
    from ..runtime.device import detect_device
    from .profile import NAME_OK
    from .tune_space import (
        apply_overrides, check_space, default_space, override_key, plan_count, runnable_weights,
        weight_problems,
    )
    from .tune_study import open_study, sqlite_url

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_all = time.perf_counter()
    _check_args(args)
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
    open_study(url, study_name, identity)  # bad URLs and foreign studies: refused before any work
    if not args.search_only:
        check_outputs(args.hw, out_dir, compile_root, key, args.force)
        for fmt, why in problems.items():  # after every refusal: an error stays one line
            say(f"weights {fmt} not searched: {why}")
    env = envelope_plan(base, space, args.hw)
    phases: dict = {}
    reuse: dict = {}
    t = time.perf_counter()
    if args.search_only:  # a worker: the coordinating process made both artifacts
        profile, calibration = _worker_artifacts(env, args.hw, out_dir, args.threads)
    else:
        profile, reuse["profile"] = ensure_profile(env, args.hw, out_dir, args.threads, args.force,
                                                   args.quick_profile, compile_root)
        phases["profile"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        calibration, reuse["calibration"] = ensure_calibration(
            env, args.hw, out_dir, args.threads, args.force, args.calibration_prompts, args.max_new_tokens)
        phases["calibration"] = round(time.perf_counter() - t, 2)
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
