"""The plan space ``yggtree tune`` searches: which plan fields vary, over which values, and which
combinations are valid.

Every tunable field a plan exposes (``yggtree/plan.py``) is a dimension:

=============== ============================== ===============================================
dimension       values (default)               optuna parameters
=============== ============================== ===============================================
draft_widths    a non-empty subset of          ``draft_widths``, e.g. ``"1,2,8"``
                candidates (the base plan's)
verify_widths   a non-empty subset of          ``verify_widths_index`` (an index into the
                candidates (the base plan's)   subsets, :func:`suggest`)
d_max           1..base d_max                  ``d_max_index`` (index into the values)
top_k           {2, 4, 8} and the base's       ``top_k``
lookup          {0, 4, 8} and the base's       ``lookup_index`` (lookup nodes per step)
prefill_chunk   {32, 64, 128} and the base's   ``prefill_chunk``
stages          ``sequential@T``, ``ahead@T``  ``stages`` (execution plan with its thread
                for T = 1..threads,            split, runtime/schedule.py); ``threads`` is
                ``overlap@T+D`` for            the worker's ``--threads``, itself within the
                T + D <= threads               process's usable cores
weights         the base plan's format, then   ``weights`` (runtime/quant.py): the float
                float in dtype, ``int8``,      format of the plan's dtype and the quantized
                ``int4@32``, ``gguf-native``,  ones this torch/CPU and the model run
                ``w4a8``
=============== ============================== ===============================================

A dimension with one value is fixed (no optuna parameter). ``--space KEY=V1,V2`` or
``--space KEY=LO..HI`` overrides one dimension (``stages`` and ``weights`` take comma-separated
names; a stage plan without a split gets the worker's threads: ``sequential`` is
``sequential@T``, ``overlap`` is ``overlap@(T-1)+1``); an override that no valid plan can
satisfy is refused before anything runs (:func:`check_space`): a thread split above the
worker's ``--threads`` or above the usable cores (``schedule.resolve_plan``'s check against
the affinity mask), a weight format the machine or the model cannot run.

Weight formats: :func:`.weight_check.weight_problems` probes each candidate before the search, with
runtime/quant.py's own checks: ``check_kernel`` (this torch/CPU runs the weight-only kernel for
the dtype) and ``check_batch_invariant`` on one probe layer per input width of the model
(``rows`` = the widest verify); ``int4@G`` needs G to divide every input width of the models it
quantizes, ``gguf-native`` (and ``w4a8`` of a GGUF target) a GGUF target whose block tensors are
Q4_0, Q4_1 or Q8_0 (or float). A default
candidate that fails is left out of the space (``yggtree tune`` names it and why); an override
naming one is refused. A trial's engine checks batch invariance again on the model's own layers.

The sampler draws valid plans only (:func:`suggest`): the dimensions are drawn in :data:`ORDER`,
each among the values :func:`allowed` leaves given the ones before it (a verify width never above
1 + d_max * max W_d, lookup never above the largest verify width, the drafted tree within the
context), so that no trial of the budget goes to a combination that cannot be built; a space with
no valid plan at all is refused before the study starts (:func:`check_space`, :func:`plan_count`).
Stage plans are all runnable (:func:`check_space`); the tune samples only those its profile
prices (tune.py). :func:`infeasible` still checks every sampled plan before a trial builds
anything (a guard: it finds nothing). Which combinations the latency model can
*price* is the objective's business (tune_objective.py): the profile prices one weight format
and, with stage forms, every split it measured. Context buckets and product kernels are not
plan fields (constants of the runtime) and are not searched; the padding of short packed
products is measured by the profile, not searched.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import YggError
from ..runtime.schedule import split_name
from ..shapes import DEFAULT_INT4_GROUP, weight_format

SET_KEYS = ("draft_widths", "verify_widths")
SCALAR_KEYS = ("d_max", "top_k", "lookup", "prefill_chunk")
NAME_KEYS = ("stages", "weights")  # categorical names, not integers
KEYS = SET_KEYS + SCALAR_KEYS + NAME_KEYS
STAGE_NAMES = ("sequential", "ahead", "overlap")  # the execution plans searched (not auto)
DEFAULT_TOP_K = (2, 4, 8)
DEFAULT_LOOKUP = (0, 4, 8)
DEFAULT_PREFILL = (32, 64, 128)


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values per dimension (ascending tuples)."""

    draft_widths: tuple[int, ...]
    verify_widths: tuple[int, ...]
    d_max: tuple[int, ...]
    top_k: tuple[int, ...]
    lookup: tuple[int, ...]
    prefill_chunk: tuple[int, ...]
    stages: tuple[str, ...]  # execution plans with their thread split (sequential@1, overlap@1+1)
    weights: tuple[str, ...]  # canonical weight formats (float32, int8, int4@32, gguf-native)

    def to_dict(self) -> dict[str, list]:
        return {f.name: list(getattr(self, f.name)) for f in fields(self)}

    @property
    def envelope(self) -> dict[str, Any]:
        """The widest plan fields the space can produce: what a profile and a calibration must
        cover for every candidate (all widths, the largest d_max and top_k)."""
        return {"draft_widths": self.draft_widths, "verify_widths": self.verify_widths,
                "d_max": max(self.d_max), "top_k": max(self.top_k)}

    def size(self) -> int:
        """Number of distinct parameter combinations (valid or not)."""
        n = 1
        for k in SET_KEYS:
            n *= 2 ** len(getattr(self, k)) - 1
        for k in SCALAR_KEYS + NAME_KEYS:
            n *= len(getattr(self, k))
        return n


def stage_candidates(threads: int) -> tuple[str, ...]:
    """``sequential@T`` and ``ahead@T`` for every T, ``overlap@T+D`` for every T + D, of the
    splits of ``threads`` (profile_stages.thread_splits: the splits the profile's stage forms
    measure)."""
    from .profile_stages import thread_splits

    splits = thread_splits(threads)
    one = [sp for sp in splits if "+" not in sp]
    return (tuple(f"{name}@{sp}" for name in ("sequential", "ahead") for sp in one)
            + tuple(f"overlap@{sp}" for sp in splits if "+" in sp))


def canonical_weights(text: str, dtype: str) -> str:
    """A weight format as the space holds it: ``dtype`` for float weights, ``int4@G`` with its
    group spelled out (YggError, one line, for an unknown format; :func:`shapes.weight_format`)."""
    fmt, group = weight_format(text, dtype)
    return f"int4@{group}" if fmt == "int4" else fmt


def plan_weights(plan) -> str:
    """The canonical weight format of a Plan (``weights`` None: float in its dtype)."""
    return canonical_weights(plan.weights, plan.dtype) if plan.weights else plan.dtype


def weight_candidates(base) -> tuple[str, ...]:
    """The base plan's format, then float in its dtype, int8, int4 with the default group and
    gguf-native and w4a8 (before :func:`.weight_check.weight_problems` removes what cannot run)."""
    cands = (plan_weights(base), base.dtype, "int8", f"int4@{DEFAULT_INT4_GROUP}", "gguf-native", "w4a8")
    return tuple(dict.fromkeys(cands))


def canonical_stage(text: str, threads: int) -> str:
    """A stage plan with its thread split spelled out (``sequential`` -> ``sequential@T``,
    ``overlap`` -> ``overlap@(T-1)+1`` for a worker of ``threads``); YggError for a name that is
    not a searched execution plan or a malformed split."""
    name, t, d = split_name(text)
    if name not in STAGE_NAMES:
        raise YggError(f"unknown stage plan {text!r} (the tune searches {', '.join(STAGE_NAMES)}, "
                       "optionally with @T or @T+D)")
    if name == "overlap":
        return f"overlap@{max(threads - 1, 1) if t is None else t}+{1 if d is None else d}"
    if d is not None:
        raise YggError(f"stage plan {text!r}: only overlap has a drafter worker (T+D)")
    return f"{name}@{threads if t is None else t}"


def stage_problem(label: str, threads: int) -> str | None:
    """Why the canonical stage plan ``label`` cannot run in a worker of ``threads`` threads
    (None: it can): schedule.resolve_plan's checks (names, thread splits against the cores of
    the affinity mask), then the worker's own budget."""
    from ..runtime.schedule import resolve_plan

    _, t, d = split_name(label)
    if not t:
        return f"{label}: the target needs >= 1 thread"
    try:
        resolve_plan(label, True)
    except YggError as e:
        return f"{label}: {e}"
    used = t + (d or 0)
    if used > threads:
        return f"{label} uses {used} threads, a worker has --threads {threads}"
    return None


def default_space(base, threads: int) -> SearchSpace:
    """The default space around ``base`` (a Plan) for a worker of ``threads`` threads: its width
    sets as candidates, d_max 1..its own, the scalar choices above that fit its context and its
    own value of each (the base plan is a point of its default space: the tune's first trial),
    every stage plan within the threads and every weight candidate (:func:`weight_candidates`)."""
    return SearchSpace(
        draft_widths=tuple(base.draft_widths),
        verify_widths=tuple(base.verify_widths),
        d_max=tuple(range(1, base.d_max + 1)),
        top_k=tuple(sorted({*DEFAULT_TOP_K, base.top_k})),
        lookup=tuple(sorted({n for n in DEFAULT_LOOKUP if n <= max(base.verify_widths)} | {base.lookup})),
        prefill_chunk=tuple(sorted({c for c in DEFAULT_PREFILL if c < base.max_context} | {base.prefill_chunk})),
        stages=stage_candidates(threads),
        weights=weight_candidates(base),
    )


def parse_names(key: str, text: str, dtype: str, threads: int) -> tuple[str, ...]:
    """``"sequential@1,overlap@1+1"`` -> canonical stage plans, ``"float32,int8"`` -> canonical
    weight formats (distinct, in the order given); YggError naming the override."""
    where = f"--space {key}={text}"
    vals = [v.strip() for v in text.split(",") if v.strip()]
    if not vals:
        raise YggError(f"{where}: no values")
    try:
        out = [canonical_stage(v, threads) if key == "stages" else canonical_weights(v, dtype) for v in vals]
    except YggError as e:
        raise YggError(f"{where}: {e}") from None
    return tuple(dict.fromkeys(out))


def parse_values(key: str, text: str) -> tuple[int, ...]:
    """``"1,2,4"`` or ``"2..6"`` -> ascending distinct integers; YggError naming the override."""
    where = f"--space {key}={text}"
    try:
        if ".." in text:
            lo_s, hi_s = text.split("..", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo > hi:
                raise YggError(f"{where}: empty range ({lo} > {hi})")
            vals = list(range(lo, hi + 1))
        else:
            vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise YggError(f"{where}: expected V1,V2,... or LO..HI (integers)") from None
    if not vals:
        raise YggError(f"{where}: no values")
    if key == "lookup":
        if min(vals) < 0:
            raise YggError(f"{where}: lookup nodes must be >= 0")
    elif min(vals) < 1:
        raise YggError(f"{where}: values must be >= 1")
    return tuple(sorted(set(vals)))


def override_key(item: str) -> str:
    """The dimension a ``--space KEY=VALUES`` item names (as given: not checked)."""
    return item.partition("=")[0].strip().replace("-", "_")


def apply_overrides(space: SearchSpace, overrides: list[str], dtype: str = "float32",
                    threads: int = 1) -> SearchSpace:
    """``space`` with every ``KEY=VALUES`` override applied (unknown keys refused); ``dtype``
    and ``threads`` (the base plan's, the worker's) spell out weight formats and stage plans."""
    changes = {}
    for item in overrides:
        _, eq, text = item.partition("=")
        key = override_key(item)
        if not eq:
            raise YggError(f"--space {item!r}: expected KEY=V1,V2 or KEY=LO..HI")
        if key not in KEYS:
            raise YggError(f"--space {item!r}: unknown dimension {key!r} (known: {', '.join(KEYS)})")
        changes[key] = (parse_names(key, text.strip(), dtype, threads) if key in NAME_KEYS
                        else parse_values(key, text.strip()))
    return replace(space, **changes)


def check_space(space: SearchSpace, base, threads: int = 1) -> None:
    """YggError (one line) unless the space holds at least one valid plan around ``base`` (a
    Plan) for a worker of ``threads`` threads, every stage plan runs there
    (:func:`stage_problem`) and its widest plan is within the runtime's limits."""
    for label in space.stages:
        why = stage_problem(label, threads)
        if why is not None:
            raise YggError(f"--space stages: {why}")
    if not space.weights:
        raise YggError("--space weights: no weight format this machine runs is left")
    cap = 1 + max(space.d_max) * max(space.draft_widths)
    if min(space.verify_widths) > cap:
        raise YggError(f"--space verify_widths: the smallest, {min(space.verify_widths)}, exceeds the "
                       f"largest drafted tree 1 + d_max * W_d = 1 + {max(space.d_max)} * "
                       f"{max(space.draft_widths)} = {cap}: no valid plan")
    if min(space.lookup) > max(space.verify_widths):
        raise YggError(f"--space lookup: the smallest, {min(space.lookup)}, exceeds the largest verify "
                       f"width {max(space.verify_widths)}: no valid plan")
    if min(space.prefill_chunk) > base.max_context:
        raise YggError(f"--space prefill_chunk: the smallest, {min(space.prefill_chunk)}, exceeds "
                       f"max_context {base.max_context}: no valid plan")
    tree = 1 + min(space.d_max) * min(space.draft_widths)
    if tree >= base.max_context:
        raise YggError(f"--space: the smallest drafted tree ({tree} nodes) does not fit the context "
                       f"({base.max_context}): no valid plan")
    widest = {"draft_widths": list(space.draft_widths), "verify_widths": [min(space.verify_widths)],
              "d_max": max(space.d_max), "top_k": max(space.top_k), "lookup": 0,
              "prefill_chunk": min(space.prefill_chunk)}
    try:  # the runtime's limits (D, W_d, top-k, tree size), as the plan schema checks them
        candidate_plan(base, widest, base.name, None, None)
        candidate_plan(base, widest | {"verify_widths": [max(space.verify_widths)],
                                       "d_max": max(space.d_max), "draft_widths": list(space.draft_widths)}
                       if max(space.verify_widths) <= cap else widest, base.name, None, None)
    except YggError as e:
        raise YggError(f"--space: the widest plan is invalid: {str(e).split(': ', 1)[-1]}") from None
    if not plan_count(space, base.max_context):
        raise YggError(f"--space: no combination of draft widths, d_max, verify widths and lookup makes a "
                       f"valid plan (each needs max W_v <= 1 + d_max * max W_d < max_context "
                       f"{base.max_context} and lookup <= max W_v)")


# ----------------------------------------------------------------------------- weight formats


def runnable_weights(space: SearchSpace, problems: dict[str, str], given: bool) -> SearchSpace:
    """``space`` without the weight formats that cannot run; YggError (one line) when the user
    named one (``given``: ``--space weights=...``)."""
    bad = [w for w in space.weights if w in problems]
    if bad and given:
        raise YggError(f"--space weights: {bad[0]} cannot run here: {problems[bad[0]]}")
    return replace(space, weights=tuple(w for w in space.weights if w not in problems))


def profiled_weights(space: SearchSpace, base) -> str:
    """The one weight format the tune's profile measures (its latency curves price only it): the
    base plan's when the space has it, else the space's first."""
    own = plan_weights(base)
    return own if own in space.weights else space.weights[0]


# ----------------------------------------------------------------------------- trials


def subsets(cands: tuple[int, ...]) -> tuple[str, ...]:
    """Every non-empty subset of ``cands`` as a categorical choice ``"1,2,8"`` (ascending)."""
    out = []
    for mask in range(1, 1 << len(cands)):
        out.append(",".join(str(w) for i, w in enumerate(cands) if mask >> i & 1))
    return tuple(out)


ORDER = ("draft_widths", "d_max", "verify_widths", "lookup", "top_k", "prefill_chunk", "stages", "weights")
COUPLED = ("d_max", "verify_widths", "lookup")  # their valid values depend on the keys before them


def choices(space: SearchSpace, key: str) -> tuple:
    """Every value of dimension ``key`` in ``space``, in the space's order (width sets: their
    non-empty subsets, :func:`subsets`, grouped by their largest width)."""
    return subsets(getattr(space, key)) if key in SET_KEYS else getattr(space, key)


def _widest(value) -> int:
    return max(int(w) for w in str(value).split(","))


def allowed(space: SearchSpace, max_context: int, key: str, chosen: dict[str, Any]) -> tuple:
    """The values of ``key`` (in :func:`choices` order) that some valid plan of ``space`` takes
    together with ``chosen``, the values of the keys before ``key`` in :data:`ORDER`. Pure.

    The constraints (:func:`infeasible`): 1 + d_max * max W_d < max_context; max W_v <= 1 +
    d_max * max W_d; lookup <= max W_v; prefill chunk <= max_context. A width set enters only
    by its largest width, so for d_max, the verify set and lookup the valid values are a
    contiguous run of :func:`choices` (what :func:`suggest` relies on)."""
    low = min(space.lookup)  # the verify set must reach the smallest lookup
    if key == "draft_widths":
        return tuple(s for s in choices(space, key) if allowed(space, max_context, "d_max", {key: s}))
    if key == "d_max":
        m = _widest(chosen["draft_widths"])
        floor = min((v for v in space.verify_widths if v >= low), default=None)
        return tuple(d for d in space.d_max if floor is not None and floor <= 1 + d * m < max_context)
    if key == "verify_widths":
        cap = 1 + chosen["d_max"] * _widest(chosen["draft_widths"])
        return tuple(s for s in choices(space, key) if low <= _widest(s) <= cap)
    if key == "lookup":
        return tuple(n for n in space.lookup if n <= _widest(chosen["verify_widths"]))
    if key == "prefill_chunk":
        return tuple(c for c in space.prefill_chunk if c <= max_context)
    return getattr(space, key)


def plan_count(space: SearchSpace, max_context: int) -> int:
    """How many parameter combinations of ``space`` make a valid plan (:func:`allowed`; a width
    set counted as its largest width times the subsets with that largest width)."""
    def with_max(cands, m):  # subsets of cands whose largest width is m
        return 2 ** sum(c < m for c in cands)

    n = 0
    for m in space.draft_widths:
        for d in allowed(space, max_context, "d_max", {"draft_widths": str(m)}):
            for v in space.verify_widths:
                if min(space.lookup) <= v <= 1 + d * m:
                    n += with_max(space.draft_widths, m) * with_max(space.verify_widths, v) * sum(
                        x <= v for x in space.lookup)
    for key in ("top_k", "prefill_chunk", "stages", "weights"):
        n *= len(allowed(space, max_context, key, {}))
    return n


def suggest(trial, space: SearchSpace, max_context: int, stages: tuple[str, ...] | None = None
            ) -> dict[str, Any]:
    """Ask ``trial`` (an optuna trial) for one *valid* point of ``space`` (valid for any trial:
    :func:`infeasible` finds nothing), the keys in :data:`ORDER`, each among the values
    :func:`allowed` leaves given the keys before it. ``stages``: the stage plans to sample (default
    the space's; tune.py passes those the profile prices).

    Optuna parameters (a dimension with one value is fixed, no parameter): an unconstrained key
    is a categorical of its values (fixed per space: TPE needs one choice set per name); a coupled
    key (:data:`COUPLED`) is ``KEY_index``, an integer index into :func:`choices`, its range the
    contiguous run :func:`allowed` leaves (an index always names the same value; optuna and TPE
    take integer ranges that change from trial to trial)."""
    chosen: dict[str, Any] = {}
    for key in ORDER:
        full = choices(space, key)
        ok = stages if key == "stages" and stages is not None else allowed(space, max_context, key, chosen)
        if not ok:
            raise YggError(f"no valid value of {key} is left after {chosen} (the space holds no valid plan)")
        if key in COUPLED:
            lo, hi = full.index(ok[0]), full.index(ok[-1])
            assert full[lo:hi + 1] == ok, (key, ok)
            chosen[key] = full[0] if len(full) == 1 else full[trial.suggest_int(f"{key}_index", lo, hi)]
        elif len(ok) == 1:
            chosen[key] = ok[0]
        else:
            name = key if key != "stages" or ok == space.stages else f"stages[{','.join(ok)}]"
            chosen[key] = trial.suggest_categorical(name, ok)
    return chosen


def plan_fields(params: dict[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The plan fields of a parameter set (width subsets -> lists)."""
    out: dict[str, Any] = {}
    for key in KEYS:
        v = params[key]
        out[key] = [int(w) for w in str(v).split(",")] if key in SET_KEYS else v
    return out


def infeasible(fields_: dict[str, Any], max_context: int, speculative: bool = True,
               threads: int | None = None) -> str | None:
    """Why these plan fields make no valid plan (None: they do). Pure but for the cores of the
    affinity mask; mirrors the plan schema's checks (and, for ``stages``, the worker's
    ``threads`` and :func:`stage_problem`) so that an invalid combination never reaches a build."""
    dw, vw = fields_["draft_widths"], fields_["verify_widths"]
    if not dw:
        return "no draft width chosen"
    if not vw:
        return "no verify width chosen"
    cap = 1 + fields_["d_max"] * max(dw)
    if max(vw) > cap:
        return f"verify width {max(vw)} > 1 + d_max * max W_d = {cap}"
    if fields_["lookup"] > max(vw):
        return f"lookup {fields_['lookup']} > largest verify width {max(vw)}"
    if fields_["prefill_chunk"] > max_context:
        return f"prefill chunk {fields_['prefill_chunk']} > max_context {max_context}"
    if 1 + fields_["d_max"] * max(dw) >= max_context:
        return f"drafted tree 1 + {fields_['d_max']} * {max(dw)} does not fit the context {max_context}"
    stages = fields_.get("stages")
    if stages is not None:
        if split_name(stages)[0] in ("ahead", "overlap") and not speculative:
            return f"stages {stages} needs a drafter"
        why = stage_problem(stages, threads) if threads is not None else None
        if why is not None:
            return why
    return None


def candidate_plan(base, fields_: dict[str, Any], name: str, profile: str | None,
                   calibration: str | None):
    """``base`` (a Plan) with the searched fields, ``name``, profile and calibration; validated
    like a plan file (YggError if invalid)."""
    from ..plan import validate_plan

    raw = base.to_dict() | {k: list(v) if isinstance(v, tuple) else v for k, v in fields_.items()} | {
        "name": name, "profile": profile, "calibration": calibration, "predictor": None}
    return validate_plan(raw, ".", f"candidate plan {name}")


# ----------------------------------------------------------------------------- the base plan


def base_fields(base, threads: int) -> dict[str, Any] | None:
    """The plan fields of ``base`` (a Plan) as a trial holds them (:func:`plan_fields`: stage plan
    and weight format spelled out for a worker of ``threads``); None when its stage plan is not
    one the tune searches (e.g. ``auto``)."""
    try:
        stages = canonical_stage(base.stages, threads)
    except YggError:
        return None
    return {"draft_widths": sorted(base.draft_widths), "verify_widths": sorted(base.verify_widths),
            "d_max": base.d_max, "top_k": base.top_k, "lookup": base.lookup,
            "prefill_chunk": base.prefill_chunk, "stages": stages, "weights": plan_weights(base)}


class _Outside(Exception):
    pass


class _Pinned:
    """Stands in for an optuna trial in :func:`suggest`: answers with given plan fields and
    records the parameters it was asked (optuna's encoding of those fields)."""

    def __init__(self, space: SearchSpace, wanted: dict[str, Any]):
        self.space, self.wanted, self.params = space, wanted, {}

    def suggest_categorical(self, name: str, options):
        key = name.split("[")[0]
        if self.wanted[key] not in options:
            raise _Outside(key)
        self.params[name] = self.wanted[key]
        return self.wanted[key]

    def suggest_int(self, name: str, lo: int, hi: int) -> int:
        key = name[: -len("_index")]
        full = choices(self.space, key)
        if self.wanted[key] not in full[lo:hi + 1]:
            raise _Outside(key)
        self.params[name] = full.index(self.wanted[key])
        return self.params[name]


def trial_params(space: SearchSpace, max_context: int, fields_: dict[str, Any] | None,
                 stages: tuple[str, ...] | None = None) -> tuple[dict | None, str | None]:
    """The optuna parameters under which :func:`suggest` draws the plan ``fields_`` (for
    ``study.enqueue_trial``), or (None, why) when the space cannot draw it. Pure: it runs
    :func:`suggest` itself, so the encoding is the sampler's."""
    if fields_ is None:
        return None, "its stage plan is not one the tune searches"
    wanted = {k: ",".join(map(str, sorted(v))) if k in SET_KEYS else v for k, v in fields_.items()}
    for key in ORDER:
        have = stages if key == "stages" and stages is not None else choices(space, key)
        if wanted[key] not in have:
            return None, f"its {key} {_shown(fields_[key])} is not in the search space"
    pinned = _Pinned(space, wanted)
    try:
        got = plan_fields(suggest(pinned, space, max_context, stages), space)
    except _Outside as e:
        key = str(e)
        return None, f"its {key} {_shown(fields_[key])} is not in the search space"
    except YggError as e:
        return None, str(e)
    bad = next((k for k in KEYS if got[k] != fields_[k]), None)  # a dimension with one value
    if bad is not None:
        return None, f"its {bad} {_shown(fields_[bad])} is not in the search space"
    return pinned.params, None


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
