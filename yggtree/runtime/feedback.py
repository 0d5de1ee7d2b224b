"""Online correction of the offline model (profile + calibration) from the steps actually run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .prediction import Prediction

__all__ = ["Feedback"]


@dataclass
class Feedback:
    """Online correction of the offline model from the steps actually run.

    The profile times each stage in isolation and the calibration measures acceptance on
    calibration prompts; on a real workload the machine may be slower or faster than when it was
    profiled (other processes), one graph width may run relatively faster or slower than it did
    then, a drafted step pays loop overhead the stage timings miss, and the prompts may be easier
    or harder for the drafter than the calibration's. Moving averages, starting at "the offline
    model is right", track what the offline model misses:

    - ``machine`` (fast, ``alpha``): measured / predicted time of the target's call, learnt from
      EVERY step (a plain step; a drafted step's verify stage), so it follows the machine's load
      whichever kind of step dominates;
    - per verify width W, a relative factor (slow, ``slow_alpha``): what remains of the measured /
      predicted ratio of width-W calls after ``machine``. Widths whose measured ratio drifts apart
      from the profile's (a plain graph slower than a wider one next to it) would otherwise push
      that error into the drafted step's overhead and bias the choice between plain and tree steps;
    - ``spec_extra`` (fast): measured / (``machine`` x predicted) time of the drafted step's
      non-verify part (drafter head and steps, tree building, pruning, acceptance, commit, the
      policy), the part the profile times stage by stage; ``lookup_extra`` the same of lookup-only
      steps (no drafter call), kept apart: their few stages (the lookup, the policy's pricing, the
      commit) run over or under the profile by other factors than a drafted step's, and where
      they shared one factor the lookup-only steps, most of the steps on text lookup continues,
      priced every drafted tree out (docs/objective.md);
    - acceptance per draft depth D: realised / expected drafted tokens accepted (AAL - 1) over
      D-deep steps, as discounted sums (weight ``1 - accept_alpha`` per step of that depth: per
      step acceptance is a coin toss) with ``prior_tokens`` pseudo-tokens at the scale of depth
      D - 1 (1 for D = 1): a depth not run yet inherits what the shallower trees showed, as a
      deeper tree multiplies more over-rated edges, instead of the offline model's optimism
      (which made the policy try every depth in turn on text the drafter does badly on);
      Evidence also ages with the steps that do not add to it (``age_alpha`` per step of any
      kind, the depth the step drafted excepted): acceptance is the text's, and the text moves
      on. Without it a policy that fell back to plain steps on a stretch of text the drafter
      does badly on (an answer's prose) kept that stretch's estimate for good, plain steps
      teaching nothing: on a stream of prose requests and then code requests it stayed on plain
      steps through every code request after, where a fixed tree paid (docs/objective.md). With it the
      estimate returns toward the prior (the offline calibration) within a few hundred plain
      steps, the policy drafts again, and the text's own steps decide anew. (Aging is applied
      ``age_every`` plain steps at a time, as one multiplication: a policy reprices its trees
      only when the feedback changes.)
    - optionally per request (``request_prior_tokens``, default None: off): the same sums over
      this request's steps alone, with that many pseudo-tokens at the all-requests scale. It was
      on (3) until measured to lock requests into plain steps: a request's first trees, at the
      start of an answer, where the drafter does worst, priced the tree below plain steps, and
      plain steps teach nothing, so requests stayed on them (most of their steps) while the tree
      paid; held out, decoding was slower with it than without in the same processes. Probes and
      the discounted all-requests sums still follow a text the drafter does badly on.

    - ``catch_up`` (fast): ms per call of the drafter's catch-up (the ``resync`` stage: a
      drafted step after plain steps first absorbs the tokens they committed, and after a request
      whose drafter prefill was deferred, the whole prompt, in prefill chunks of static width: one
      call per chunk, whatever its tokens; per token where the policy knows no chunk), measured;
      until a catch-up has run, the profile's figure stands.
    - ``plan_ratio`` (slow): realised / planned speed-up of drafted steps, as discounted sums
      (weight ``1 - accept_alpha`` per drafted step, ``prior_tokens`` pseudo-steps at 1): the
      speed-up a step realised ((1 + accepted) x T_plain' over its measured time, the catch-up
      left out) against the one its tree was chosen for before drafting. That choice is the
      best of ~100 priced trees, so its price errs high (on short answers a request's first tree
      was priced well above what its trees realised): the catch-up is
      weighed against the speed-up such choices realise (see ``ObjectivePolicy``).

    Corrected: AAL' = 1 + (AAL - 1) x scale(D); T_plain' = machine x rel(1) x T_plain;
    T_step' = machine x (rel(W_v) x T_v(W_v) + spec_extra x (T_step - T_v(W_v))) (lookup_extra for
    a lookup-only step).
    A ratio enters clipped to within ``clip`` x the current estimate, so one outlier step (a page
    fault, another process) moves an estimate by at most ``alpha * (clip - 1)``."""

    alpha: float = 0.1
    clip: float = 1.5
    accept_alpha: float = 0.02
    slow_alpha: float = 0.02
    prior_tokens: float = 2.0
    request_prior_tokens: float | None = None  # None: no per-request acceptance
    age_alpha: float = 0.01  # acceptance evidence's fading per step that does not add to it (0: none)
    age_every: int = 16  # plain steps whose aging is applied at once
    machine: float = 1.0
    spec_extra: float = 1.0
    lookup_extra: float = 1.0
    catch_up: float | None = None  # ms per call of the drafter's catch-up (None: none measured yet)
    probe_cost: float | None = None  # a policy's probe's cost in plain steps (mean of the last ones; None: none yet)
    probe_scale: float = 1.0  # the share of plain steps' time a policy's probes may take, over its full share
    _width: dict = field(default_factory=dict)  # W -> relative factor of width-W target calls
    _by_depth: dict = field(default_factory=dict)  # D -> [discounted accepted, discounted expected]
    _request: dict = field(default_factory=dict)  # D -> [accepted, expected] in this request
    _planned: tuple = (0.0, 0.0)  # discounted sums of (realised, planned) speed-ups of drafted steps
    _aging: int = 0  # plain steps whose aging of the acceptance sums is not applied yet
    state: int = 0  # counts the changes of everything but ``machine`` and the plain width's factor

    def learnt(self) -> dict:
        """What the steps so far taught, JSON-ready (the settings and this request's own sums
        left out): a later process of the same machine and plan starts from it
        (:meth:`with_learnt`) instead of from the offline model's optimism."""
        self._age(self._aging)
        return {"machine": self.machine, "spec_extra": self.spec_extra, "lookup_extra": self.lookup_extra,
                "catch_up_call": self.catch_up,
                "width": {str(w): f for w, f in self._width.items()},
                "by_depth": {str(d): list(v) for d, v in self._by_depth.items()},
                "planned": list(self._planned), "probe_cost": self.probe_cost, "probe_scale": self.probe_scale}

    def with_learnt(self, record) -> "Feedback":
        """This feedback continuing from ``record`` (a :meth:`learnt` dict); unchanged where the
        record does not read as one (it only ever changes choices, never tokens)."""
        try:
            fields = dict(
                machine=float(record["machine"]), spec_extra=float(record["spec_extra"]),
                lookup_extra=float(record.get("lookup_extra", 1.0)),  # (absent from older records)
                # (records before it was priced per call held "catch_up", ms per token: not read)
                catch_up=None if record.get("catch_up_call") is None else float(record["catch_up_call"]),
                _width={int(w): float(f) for w, f in record["width"].items()},
                _by_depth={int(d): (float(a), float(e)) for d, (a, e) in record["by_depth"].items()},
                _planned=tuple(float(x) for x in record["planned"][:2]),
                # (records before probes were kept hold neither: a fresh probe state)
                probe_cost=None if record.get("probe_cost") is None else float(record["probe_cost"]),
                probe_scale=float(record.get("probe_scale", 1.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return self
        finite = [fields["machine"], fields["spec_extra"], fields["lookup_extra"], fields["probe_scale"],
                  *fields["_width"].values()]
        if not all(np.isfinite(x) and x > 0 for x in finite) or len(fields["_planned"]) != 2:
            return self
        return replace(self, **fields)

    def start_request(self) -> None:
        """A new request begins: its own acceptance starts at the all-requests estimate."""
        self._request = {}
        self.state += 1

    def width_factor(self, w: int) -> float:
        return self._width.get(int(w), 1.0)

    def plain_ms(self, plain_ms: float) -> float:
        """Corrected time of a plain step predicted at ``plain_ms``."""
        return self.machine * self.width_factor(1) * plain_ms

    def step_ms(self, step_ms, verify_ms, wv, lookup: bool = False):
        """Corrected time of drafted steps (``lookup``: lookup-only steps) predicted at ``step_ms``
        with ``verify_ms`` of it in the verify call at width ``wv`` (floats, or numpy arrays alike)."""
        if np.ndim(wv):  # every row's width factor from a table over the widths (the policy
            wv = np.asarray(wv)  # prices ~100 rows a step)
            table = np.ones(int(wv.max()) + 1 if wv.size else 1)
            for w, f in self._width.items():
                if w < len(table):
                    table[w] = f
            rel = table[wv]
        else:
            rel = self.width_factor(wv)
        extra = self.lookup_extra if lookup else self.spec_extra
        return self.machine * (rel * verify_ms + extra * (step_ms - verify_ms))

    def _global_scales(self, d_max: int) -> list[float]:
        """Acceptance scales of depths 0..d_max over all requests, each with the depth above's as
        its prior (1 at depths 0 and 1)."""
        out, prior = [], 1.0
        for d in range(d_max + 1):
            prior = _shrunk(self._by_depth.get(d), self.prior_tokens, prior if d > 1 else 1.0)
            out.append(prior)
        return out

    def global_scale_at(self, d: int) -> float:
        """Acceptance scale of D-deep trees over all requests (prior: depth D - 1's)."""
        return self._global_scales(d)[d]

    def accept_scale_at(self, d: int) -> float:
        """Acceptance scale of D-deep trees in this request (prior: all requests')."""
        if self.request_prior_tokens is None:
            return self.global_scale_at(d)
        return _shrunk(self._request.get(d), self.request_prior_tokens, self.global_scale_at(d))

    def aal(self, aal, depth):
        """Corrected expected accepted length (float or numpy array) of trees of ``depth`` draft
        calls (an int, or an int array like ``aal``)."""
        if np.ndim(depth) == 0:
            return 1.0 + (aal - 1.0) * self.accept_scale_at(int(depth))
        depth = np.asarray(depth)
        scales = self._global_scales(int(depth.max()))
        if self.request_prior_tokens is not None:  # accept_scale_at, every depth at once
            scales = [_shrunk(self._request.get(d), self.request_prior_tokens, g) for d, g in enumerate(scales)]
        return 1.0 + (aal - 1.0) * np.array(scales)[depth]

    def catch_up_per_call(self, prior: float | None) -> float | None:
        """ms per call of the drafter's catch-up: the measured estimate, else ``prior`` (the
        profile's, or None)."""
        return self.catch_up if self.catch_up is not None else prior

    def update_catch_up(self, ms: float, calls: int) -> None:
        """Fold in one drafted step's catch-up: ``ms`` for its ``calls`` calls."""
        if calls <= 0:
            return
        r = ms / calls
        self.catch_up = r if self.catch_up is None else _toward(self.catch_up, r, self.alpha, self.clip)

    def plan_ratio(self) -> float:
        """Realised / planned speed-up of drafted steps (1 before any)."""
        return _shrunk(self._planned, self.prior_tokens, 1.0)

    def update_planned(self, planned: float, realised: float) -> None:
        """Fold in one drafted step's speed-up over plain steps: ``realised`` against ``planned``
        (0: the step had no price; nothing is learnt)."""
        if planned > 0:
            b = self.accept_alpha
            self._planned = ((1 - b) * self._planned[0] + realised, (1 - b) * self._planned[1] + planned)

    def update(self, pred: Prediction, n_accepted: int, step_ms: float, verify_ms: float | None = None) -> None:
        """Fold in one step: its prediction, drafted tokens accepted, measured wall time, and
        (drafted steps) the measured time of its verify stage. A plain step is all target call."""
        def toward(est: float, ratio: float, a: float) -> float:
            return _toward(est, ratio, a, self.clip)

        plain = pred.draft_depth == 0 and pred.verify_width == 1  # (D 0, W_v > 1: lookup-only)
        if plain:
            w, v_ms, v_pred = 1, step_ms, pred.plain_ms
        else:
            w = pred.verify_width
            have = verify_ms is not None and pred.verify_ms
            v_ms, v_pred = (verify_ms, pred.verify_ms) if have else (None, 0.0)
        if v_ms is not None and v_pred > 0:
            # the machine first: the slow width factor then learns only what the machine's
            # factor does not explain (it still takes a small share of a change in the
            # machine's speed while ``machine`` catches up)
            self.machine = toward(self.machine, v_ms / (self.width_factor(w) * v_pred), self.alpha)
            self._width[int(w)] = toward(self.width_factor(w), v_ms / (self.machine * v_pred), self.slow_alpha)
        if plain:
            self._aging += 1
            if self._aging >= self.age_every:
                self._age(self._aging)
            return
        self._age(self._aging + 1, but=pred.draft_depth)
        self.state += 1
        rest, rest_pred = step_ms - (v_ms or 0.0), pred.step_ms - v_pred
        if rest_pred > 0 and pred.draft_depth == 0:  # a lookup-only step
            self.lookup_extra = toward(self.lookup_extra, rest / (self.machine * rest_pred), self.alpha)
        elif rest_pred > 0:
            self.spec_extra = toward(self.spec_extra, rest / (self.machine * rest_pred), self.alpha)
        b = self.accept_alpha
        acc, exp = self._by_depth.get(pred.draft_depth, (0.0, 0.0))
        self._by_depth[pred.draft_depth] = ((1 - b) * acc + n_accepted, (1 - b) * exp + pred.aal - 1.0)
        acc, exp = self._request.get(pred.draft_depth, (0.0, 0.0))
        self._request[pred.draft_depth] = (acc + n_accepted, exp + pred.aal - 1.0)

    def _age(self, steps: int, but: int | None = None) -> None:
        """Age every depth's acceptance sums by ``steps`` steps (depth ``but`` by one step fewer:
        the step under way ages it by ``accept_alpha`` as it adds to it), the pending plain
        steps' aging included; none is pending after."""
        self._aging = 0
        if steps <= 0 or not self.age_alpha:
            return
        for d, (acc, exp) in self._by_depth.items():
            f = (1.0 - self.age_alpha) ** (steps - (d == but))
            self._by_depth[d] = (f * acc, f * exp)
        self.state += 1


def _toward(est: float, ratio: float, a: float, clip: float) -> float:
    """``est`` moved by ``a`` toward ``ratio`` clipped to within ``clip`` x ``est``."""
    return est + a * (min(max(ratio, est / clip), est * clip) - est)


def _shrunk(sums: tuple[float, float] | None, k: float, prior: float) -> float:
    """(accepted + k x prior) / (expected + k) of ``sums`` = (accepted, expected)."""
    acc, exp = sums or (0.0, 0.0)
    return prior if exp + k < 1e-9 else (acc + k * prior) / (exp + k)

