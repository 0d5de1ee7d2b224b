"""The step cost model: predicted latency of every tree choice, from a measured profile.

Latencies come from a measured profile (``yggtree profile``), never from constants:
:class:`CostModel` reads the fitted curves (monotone piecewise-linear in width, one :class:`Curve`
per context bucket: attention reads the whole bucket, so within a bucket the context length does
not matter) and the non-model stages' times. A profile is refused when it was measured for other
models, another dtype, backend or weight format than the plan's (a quantized format's products
scale with the rows unlike float ones: each format is profiled under its own plan), or on another
device. Nothing here imports the offline package or scikit-learn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import YggError
from .artifacts import PROFILE_KIND, first_difference, read_artifact, timing_identity
from .device import detect_device, device_difference

__all__ = ["Curve", "CostModel", "profile_weights", "catch_up_calls"]


def profile_weights(prof: dict, dtype: str) -> str:
    """The weight format a profile measured (its ``plan.weights``; absent: float in ``dtype``)."""
    plan = prof.get("plan")
    fmt = plan.get("weights") if isinstance(plan, dict) else None
    return fmt if isinstance(fmt, str) else dtype


@dataclass(frozen=True)
class Curve:
    """A latency curve: per context bucket, monotone piecewise-linear knots in width (ms)."""

    buckets: tuple[int, ...]  # ascending context buckets (cache slots attention reads)
    xs: tuple[tuple[float, ...], ...]  # per bucket: widths of the knots (ascending)
    ys: tuple[tuple[float, ...], ...]  # per bucket: ms at the knots (non-decreasing)

    def bucket(self, need: int) -> int:
        return next((i for i, b in enumerate(self.buckets) if b >= need), len(self.buckets) - 1)

    def predict(self, width: float, ctx: int) -> float:
        """ms for ``width`` inputs with ``ctx`` committed tokens (the bucket holds ctx + width);
        linear extrapolation past the last knot."""
        i = self.bucket(int(ctx + width))
        x, y = self.xs[i], self.ys[i]
        if width > x[-1] and len(x) > 1:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            return float(y[-1] + max(slope, 0.0) * (width - x[-1]))
        return float(np.interp(width, x, y))

    def to_json(self) -> dict:
        return {"buckets": list(self.buckets), "xs": [list(x) for x in self.xs],
                "ys": [list(y) for y in self.ys]}

    @staticmethod
    def from_json(d, where: str) -> "Curve":
        try:
            c = Curve(tuple(int(b) for b in d["buckets"]),
                      tuple(tuple(float(v) for v in x) for x in d["xs"]),
                      tuple(tuple(float(v) for v in y) for y in d["ys"]))
        except (KeyError, TypeError, ValueError) as e:
            raise YggError(f"{where}: malformed latency curve ({e!r})") from None
        ok = len(c.buckets) >= 1 and len(c.xs) == len(c.ys) == len(c.buckets)
        ok = ok and all(len(x) == len(y) >= 1 for x, y in zip(c.xs, c.ys))
        ok = ok and all(np.all(np.diff(x) > 0) and np.all(np.isfinite(y)) and min(y) >= 0
                        for x, y in zip(c.xs, c.ys))
        if not ok:
            raise YggError(f"{where}: malformed latency curve (knots must be ascending, ms finite >= 0)")
        return c


@dataclass(frozen=True)
class CostModel:
    """Predicted step latency of every tree choice, from a measured profile."""

    verify: Curve  # T_v(W, ctx): target over W tree nodes (LM head included)
    draft: Curve  # T_d(W_d, ctx): one drafter step over W_d nodes
    head: Curve  # the drafter's head call (its width is fixed; x is a single knot)
    stage_ms: dict = field(default_factory=dict)  # non-model stages, see step_ms
    name: str = ""
    feeds_leaves: bool = True  # the drafter's Drafter.feeds_leaves: D or D - 1 steps after the head
    absorbs: int = 0  # the drafter's Drafter.absorbs: tokens behind its head call takes in (0: none)

    def t_verify(self, w: int, ctx: int) -> float:
        return self.verify.predict(w, ctx)

    def t_draft(self, w: int, ctx: int) -> float:
        return self.draft.predict(w, ctx)

    def _stage(self, name: str, key: int | None = None) -> float:
        v = self.stage_ms.get(name, 0.0)
        if isinstance(v, dict):
            ks = sorted(int(k) for k in v)
            if not ks:
                return 0.0
            return float(np.interp(key, ks, [v[str(k)] for k in ks]))
        return float(v)

    def overhead_ms(self, d: int, wd: int, wv: int) -> float:
        """Non-model stages of one speculation step (EGT, pruning, acceptance, commit, policy)."""
        return (d * self._stage("egt", wd) + self._stage("prune", wv) + self._stage("accept", wv)
                + self._stage("commit") + self._stage("policy"))

    def step_ms(self, d: int, wd: int, wv: int, ctx: int) -> float:
        """Predicted wall time of one speculation step; d = 0 is a plain step."""
        if d == 0:
            return self.plain_ms(ctx)
        head = self.head_ms(ctx)
        calls = d if self.feeds_leaves else d - 1
        return (head + calls * self.t_draft(wd, ctx) + self.t_verify(wv, ctx)
                + self.overhead_ms(d, wd, wv))

    def head_ms(self, ctx: int) -> float:
        """The drafter's head call at context ``ctx``."""
        return self.head.predict(self.head.xs[0][0], ctx)

    def lookup_ms(self, wv: int, ctx: int) -> float:
        """A lookup-only step (no drafter call): the target over ``wv`` nodes and the non-model
        stages; ``wv = 1`` is a plain step."""
        if wv == 1:
            return self.plain_ms(ctx)
        return self.t_verify(wv, ctx) + self.overhead_ms(0, 1, wv)

    def resync_per_call(self, chunk: int) -> float | None:
        """ms a drafted step pays per call of the drafter's catch-up (after plain steps, the
        ``resync`` stage), its prefill in chunks of ``chunk`` tokens, one call each (``chunk`` 1:
        per token): the profile times a catch-up of N tokens from the start (``stage_ms["resync"]
        = {"N": ms}``), ``catch_up_calls(N, N, chunk)`` calls; None in a profile without it."""
        v = self.stage_ms.get("resync")
        if not isinstance(v, dict) or not v:
            return None
        n = max(int(k) for k in v)
        return float(v[str(n)]) / max(catch_up_calls(n, n, chunk), 1)

    def plain_ms(self, ctx: int) -> float:
        """One plain decoding step: the target at width 1 plus choosing the token (a function
        of the context bucket alone, so priced once per bucket: the policy asks every step)."""
        return self._plain_by_bucket[self.verify.bucket(ctx + 1)]

    @cached_property
    def _plain_by_bucket(self) -> tuple[float, ...]:
        """:meth:`plain_ms` per verify bucket."""
        return tuple(self.t_verify(1, b - 1) + self._stage("plain_accept") for b in self.verify.buckets)

    @classmethod
    def from_profile(cls, path: str | Path, plan) -> "CostModel":
        """Load ``path`` for ``plan``; YggError if missing, malformed, or measured for other
        models / another dtype, backend or weight format (:func:`profile_weights`) than the
        plan's. The plan's drafter sets ``feeds_leaves`` and ``absorbs``."""
        d = read_artifact(path, "profile", PROFILE_KIND)
        where = f"profile {path}"
        ident = d.get("identity")
        want = timing_identity(plan)
        if not isinstance(ident, dict) or ident != want:
            key = first_difference(ident, want) if isinstance(ident, dict) else "identity"
            raise YggError(
                f"{where} was measured for another setup than plan {plan.name!r} (differs in "
                f"{key}: profile {ident.get(key) if isinstance(ident, dict) else None!r} vs plan "
                f"{want.get(key)!r}); run `yggtree profile --plan ...` for this plan"
            )
        if profile_weights(d, plan.dtype) != (plan.weights or plan.dtype):
            raise YggError(
                f"{where} measured {profile_weights(d, plan.dtype)} weights, plan {plan.name!r} runs "
                f"{plan.weights or plan.dtype}: each weight format has its own curves; run `yggtree "
                "profile --plan ...` for this plan"
            )
        hw = d.get("hardware")
        if isinstance(hw, dict) and hw.get("device_name") is not None:
            differs = device_difference(hw, detect_device())
            if differs is not None:
                raise YggError(
                    f"{where} is not of this machine: {differs}; profile this machine with `yggtree "
                    "profile --hw NAME --plan ...` (latency curves do not transfer between devices)"
                )
        from .prepare import drafter_absorbs, drafter_feeds_leaves  # here: prepare imports the models, loading, torch

        return replace(cls.from_profile_dict(d, where), feeds_leaves=drafter_feeds_leaves(plan),
                       absorbs=drafter_absorbs(plan))

    @classmethod
    def from_profile_dict(cls, d: dict, where: str = "profile") -> "CostModel":
        """The curves of an already identity-checked profile dict."""
        fit = d.get("fit")
        if not isinstance(fit, dict):
            raise YggError(f"{where}: no 'fit' section (re-run yggtree profile)")
        for key in ("verify", "draft", "head"):
            if key not in fit:
                raise YggError(f"{where}: the fit has no {key!r} curve")
        stages = d.get("stage_ms", {})
        if not isinstance(stages, dict):
            raise YggError(f"{where}: malformed stage_ms")
        return cls(
            Curve.from_json(fit["verify"], where),
            Curve.from_json(fit["draft"], where),
            Curve.from_json(fit["head"], where),
            stages,
            str(d.get("name", "")),
        )


def catch_up_heads(behind: int, absorbs: int) -> int:
    """Head calls of a drafter's catch-up of ``behind`` tokens in head calls (Drafter.absorb:
    ``absorbs`` + 1 tokens a call, the last ``absorbs`` or fewer left to the step's own head call);
    0 where its head takes in none (``absorbs`` 0)."""
    if absorbs <= 0 or behind <= absorbs:
        return 0
    return -(-(behind - absorbs) // (absorbs + 1))


def catch_up_calls(behind: int, committed: int, chunk: int) -> int:
    """Calls of a drafter's catch-up of the ``behind`` tokens below ``committed``: its prefill
    redoes the chunks of the full prefill's grid from the one holding the first (one call of
    ``chunk`` rows each, however few of them are new: runtime/eagle.py ``prefill``); ``chunk``
    1 (not known): one per token."""
    from .eagle import prefill_first

    if behind <= 0 or chunk <= 1:
        return max(behind, 0)
    return len(range(prefill_first(committed - behind, committed, chunk), committed, chunk))
