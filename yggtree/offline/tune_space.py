"""The plan space ``yggtree tune`` searches: which plan fields vary, over which values, and which
combinations are valid.

Every tunable field a plan exposes (``yggtree/plan.py``) is a dimension:

=============== ============================== ===============================================
dimension       values (default)               optuna parameters
=============== ============================== ===============================================
draft_widths    a non-empty subset of          ``draft_widths``, e.g. ``"1,2,8"``
                candidates (the base plan's)
verify_widths   a non-empty subset of          ``verify_widths``
                candidates (the base plan's)
d_max           1..base d_max                  ``d_max``
top_k           {2, 4, 8}                      ``top_k``
lookup          {0, 4, 8}                      ``lookup`` (lookup nodes per step)
prefill_chunk   {32, 64, 128}                  ``prefill_chunk``
=============== ============================== ===============================================

A dimension with one value is fixed (no optuna parameter). ``--space KEY=V1,V2`` or
``--space KEY=LO..HI`` overrides one dimension; an override that no valid plan can satisfy is
refused before anything runs (:func:`check_space`). Sampled combinations that make no valid plan
(a verify width above 1 + d_max * max W_d, lookup above the largest verify width, ...) are found
by :func:`infeasible` before a trial builds anything. Context buckets, product kernels and weight
format are not plan fields (they are constants of the runtime) and are not searched; the padding
of short packed products is measured by the profile, not searched.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import YggError

SET_KEYS = ("draft_widths", "verify_widths")
SCALAR_KEYS = ("d_max", "top_k", "lookup", "prefill_chunk")
KEYS = SET_KEYS + SCALAR_KEYS
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

    def to_dict(self) -> dict[str, list[int]]:
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
        for k in SCALAR_KEYS:
            n *= len(getattr(self, k))
        return n


def default_space(base) -> SearchSpace:
    """The default space around ``base`` (a Plan): its width sets as candidates, d_max 1..its
    own, and the scalar choices above that fit its context."""
    return SearchSpace(
        draft_widths=tuple(base.draft_widths),
        verify_widths=tuple(base.verify_widths),
        d_max=tuple(range(1, base.d_max + 1)),
        top_k=DEFAULT_TOP_K,
        lookup=tuple(n for n in DEFAULT_LOOKUP if n <= max(base.verify_widths)),
        prefill_chunk=tuple(c for c in DEFAULT_PREFILL if c < base.max_context) or (base.prefill_chunk,),
    )


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


def apply_overrides(space: SearchSpace, overrides: list[str]) -> SearchSpace:
    """``space`` with every ``KEY=VALUES`` override applied (unknown keys refused)."""
    changes = {}
    for item in overrides:
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise YggError(f"--space {item!r}: expected KEY=V1,V2 or KEY=LO..HI")
        if key not in KEYS:
            raise YggError(f"--space {item!r}: unknown dimension {key!r} (known: {', '.join(KEYS)})")
        changes[key] = parse_values(key, text.strip())
    return replace(space, **changes)


def check_space(space: SearchSpace, base) -> None:
    """YggError (one line) unless the space holds at least one valid plan around ``base`` (a
    Plan) and its widest plan is within the runtime's limits."""
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


# ----------------------------------------------------------------------------- trials


def subsets(cands: tuple[int, ...]) -> tuple[str, ...]:
    """Every non-empty subset of ``cands`` as a categorical choice ``"1,2,8"`` (ascending)."""
    out = []
    for mask in range(1, 1 << len(cands)):
        out.append(",".join(str(w) for i, w in enumerate(cands) if mask >> i & 1))
    return tuple(out)


def suggest(trial, space: SearchSpace) -> dict[str, Any]:
    """Ask ``trial`` (an optuna trial) for one point of ``space``: one categorical parameter
    per dimension that has more than one value (a width set is one choice among the non-empty
    subsets of its candidates); fixed dimensions are filled in."""
    params: dict[str, Any] = {}
    for key in KEYS:
        vals = subsets(getattr(space, key)) if key in SET_KEYS else getattr(space, key)
        params[key] = vals[0] if len(vals) == 1 else trial.suggest_categorical(key, vals)
    return params


def plan_fields(params: dict[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The plan fields of a parameter set (width subsets -> lists)."""
    out: dict[str, Any] = {}
    for key in KEYS:
        v = params[key]
        out[key] = [int(w) for w in str(v).split(",")] if key in SET_KEYS else v
    return out


def infeasible(fields_: dict[str, Any], max_context: int) -> str | None:
    """Why these plan fields make no valid plan (None: they do). Pure; mirrors the plan
    schema's checks so that an invalid combination never reaches a build."""
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
    return None


def candidate_plan(base, fields_: dict[str, Any], name: str, profile: str | None,
                   calibration: str | None):
    """``base`` (a Plan) with the searched fields, ``name``, profile and calibration; validated
    like a plan file (YggError if invalid)."""
    from ..plan import validate_plan

    raw = base.to_dict() | {k: list(v) if isinstance(v, tuple) else v for k, v in fields_.items()} | {
        "name": name, "profile": profile, "calibration": calibration, "predictor": None}
    return validate_plan(raw, ".", f"candidate plan {name}")
