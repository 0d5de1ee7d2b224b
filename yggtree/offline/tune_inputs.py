"""What the processes of one ``yggtree tune`` share: the command's settings (:class:`Setup`) and
the objective's inputs, loaded once per worker (:class:`Inputs`: cost model, calibration, the
calibration prompts' contexts, the held-out prompts of the trials and of the confirmation, the
stage plans the profile prices), and what follows from them alone: the profile and calibration a
candidate plan names, a stage plan's pricing, the base plan's optuna parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import YggError


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


def trial_stage_scale(plan, stages: str, threads: int, inp: Inputs):
    """The StageScale of a trial's stage plan over its tree shapes (None: ``sequential`` at the
    profile's threads); YggError when the profile's stage forms cannot price it."""
    from ..runtime.prepare import drafter_feeds_leaves
    from .plan_search import hit_rate
    from .tune_objective import stage_scale

    shapes = [(d, wd, wv) for d in range(1, plan.d_max + 1) for wd in plan.draft_widths
              for wv in plan.verify_widths]
    return stage_scale(stages, inp.forms, threads, shapes, lambda sh: inp.cost.overhead_ms(*sh),
                       lambda sh: hit_rate(inp.calib.aal, inp.calib.verify_widths, *sh),
                       drafter_feeds_leaves(plan))


def base_params(s: Setup, inp: Inputs) -> tuple[dict | None, str | None]:
    """The optuna parameters of the base plan's own values, or (None, why) when the search
    space (with the stage plans the profile prices) does not hold them."""
    from .tune_space import base_fields, trial_params

    return trial_params(s.space, s.base.max_context, base_fields(s.base, s.threads), inp.stages)
