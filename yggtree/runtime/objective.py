"""The latency-aware objective (docs/design.md section 5, docs/objective.md) and the policy that maximises it every step.

    speedup(W_d, D, W_v) = AAL(tree, W_v) * T_plain(ctx) / T_step(D, W_d, W_v, ctx)
    T_step               = T_head + n_D * T_d(W_d) + D * egt(W_d) + prune + T_v(W_v) + accept + commit
    n_D                  = D - 1 for an EAGLE head (the last level is not fed), D for an LM drafter
    AAL(tree, W_v)       = 1 + sum over the W_v kept nodes (root excluded) of P(path accepted)

The latencies come from the measured profile (:class:`~yggtree.runtime.cost.CostModel`),
``P(path accepted)`` from the acceptance calibration
(:class:`~yggtree.runtime.calibration.Calibration`), both corrected online by
:class:`~yggtree.runtime.feedback.Feedback`; each step's expectation is logged as a
:class:`~yggtree.runtime.prediction.Prediction`. Nothing here imports the offline package or
scikit-learn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from ..errors import YggError
from .calibration import Calibration, tree_aal_by_width
from .cost import CostModel, catch_up_calls, catch_up_heads
from .feedback import Feedback
from .policy import StepChoice, StepPolicy
from .prediction import Prediction
from .tree import Tree

__all__ = ["TreeChoices", "tree_choices", "best_tree", "best_verify", "ObjectivePolicy", "plan_policy"]


# ----------------------------------------------------------------------------- the objective


@dataclass(frozen=True)
class TreeChoices:
    """Every tree step a plan can take at one context, priced offline: the (D, W_d, W_v) with a
    calibrated AAL (W_v 1: the root alone, AAL 1), and the cost model's times of every (D, W_d,
    W_v) and of a plain step. The costs depend on the context only through its bucket."""

    rows: list  # [n] (D, W_d, W_v), by D, then W_d, then W_v (1 first)
    depth: np.ndarray  # [n] int64 D of each row
    aal: np.ndarray  # [n] float64 the calibration's expected accepted length (bonus included)
    step_ms: np.ndarray  # [n] float64 the predicted step time
    verify_ms: np.ndarray  # [n] float64 its verify call's time
    verify_width: np.ndarray  # [n] int64 W_v of each row
    width_index: np.ndarray  # [n] int64 each row's W_v as an index into (1, *verify_widths)
    plain_ms: float  # a plain step's predicted time
    costs: dict  # (D, W_d, W_v) -> (step ms, verify ms), every triple, calibrated or not


def tree_choices(cost: CostModel, calib: Calibration, d_max: int, draft_widths: tuple[int, ...],
                 verify_widths: tuple[int, ...], ctx: int) -> TreeChoices:
    """The :class:`TreeChoices` of D = 1..``d_max``, ``draft_widths`` and 1 and ``verify_widths`` at
    context ``ctx``, from the profile's curves (``cost``) and the acceptance calibration."""
    rows, aal, ms, vms, costs = [], [], [], [], {}
    for dd in range(1, d_max + 1):
        for wd in draft_widths:
            for wv in (1, *verify_widths):
                costs[dd, wd, wv] = (cost.step_ms(dd, wd, wv, ctx), cost.t_verify(wv, ctx))
                a = calib.expected_aal(wd, dd, wv) if wv > 1 else 1.0
                if a is None:
                    continue
                rows.append((dd, wd, wv))
                aal.append(a)
                ms.append(costs[dd, wd, wv][0])
                vms.append(costs[dd, wd, wv][1])
    depth = np.array([r[0] for r in rows], dtype=np.int64)
    wvs = np.array([r[2] for r in rows], dtype=np.int64)
    index = np.array([(1, *verify_widths).index(r[2]) for r in rows], dtype=np.int64)
    return TreeChoices(rows, depth, np.array(aal), np.array(ms), np.array(vms), wvs, index, cost.plain_ms(ctx), costs)


def best_tree(aal: np.ndarray, step_ms: np.ndarray, plain_ms: float, depth: np.ndarray | None = None,
              d: int | None = None) -> tuple[int, float]:
    """(row, predicted speed-up) maximising ``aal * plain_ms / step_ms`` over a :class:`TreeChoices`'
    rows (``aal``, ``step_ms`` [n], as corrected; only rows of depth ``d`` when given: ``depth``
    [n]); a NaN never wins, and the first maximum does, as a sequential scan would keep.
    (-1, -inf) without rows."""
    if not len(aal):
        return -1, -math.inf
    s = aal * plain_ms / step_ms
    s = np.where(np.isnan(s), -np.inf, s)
    if d is not None:
        s = np.where(depth == d, s, -np.inf)
    i = int(np.argmax(s))
    return i, float(s[i])


def best_verify(
    aal: list[float], widths: list[int], step_ms: list[float], plain_ms: float
) -> tuple[int, float]:
    """(W_v, predicted speed-up vs plain) maximising ``aal * plain_ms / step_ms`` (first wins ties)."""
    best, best_s = widths[0], -1.0
    for w, a, t in zip(widths, aal, step_ms):
        s = a * plain_ms / t
        if s > best_s:
            best, best_s = w, s
    return best, best_s


# ----------------------------------------------------------------------------- the policy


@dataclass
class ObjectivePolicy(StepPolicy):
    """A :class:`~yggtree.runtime.policy.StepPolicy` maximising the latency objective.

    - ``choose_draft``: (D, W_d) maximising ``max_{W_v} AAL(W_d, D, W_v) * T_plain / T_step``
      over the plan's depths and draft widths, the step being plain (D = 0) when no tree beats
      plain decoding (predicted speed-up <= 1). AAL is the calibration's expectation; with a
      depth ``predictor`` (:class:`~yggtree.runtime.predictor.DepthFn`) its drafted part
      (AAL - 1) at depth D is scaled by what the predictor expects of this context (from the
      target's hidden state at the root) over what the calibration expects of the predictor's
      tree shape, so the context picks D (and W_d) and the predictor's own cost joins every
      tree step's time. A predictor that reads the drafter head's confidence is consulted in
      ``after_head`` instead: ``choose_draft`` decides plain step or tree as without a
      predictor, and once the head has run the predictor picks (D >= 1, W_d). ``depth_fn`` (a
      fixed depth, ``--depth N``) forces D instead (0: a plain step).
    - ``choose_verify``: W_v among the verify widths (and 1) maximising the objective on the
      drafted tree's calibrated path probabilities, the drafting cost being already spent.
    - ``observe``: with ``feedback``, every finished step corrects the offline model (see
      :class:`Feedback`). After a run of plain steps the best tree runs once, so a policy
      that fell back to plain decoding keeps measuring whether speculation pays again
      (depth-predictor steps are not probed: the predictor sees every context). The run is
      ``probe_every`` plain steps, or longer where a probe costs more than ``probe_share`` of
      them: a probe's measured cost in plain steps (the drafter's catch-up included; an average
      over probes, kept across requests: it is the machine's and the plan's) divided by
      ``probe_share``. On a fast target a probe costs several plain steps, and 16 of them would
      put a quarter of the time into probes. A probe that loses (its tokens took longer than
      plain steps would have, the catch-up included) doubles the run before the next one, up to
      ``probe_max`` plain steps' worth; a probe that wins, or a tree chosen on its merits, resets
      it. A losing probe also multiplies the share by ``probe_decay`` (down to ``probe_floor``
      of ``probe_share``), and that share is kept across requests: the gap restarts with every
      request, but on text where speculation keeps losing, every request's probes together cost
      ever less of its plain steps (a request of 128 tokens has about one probe, ~3-5% of its time
      on a fast target at the full share); a probe that wins, or a tree chosen on its merits,
      restores the full share (docs/objective.md has the measured figures).
    - the drafter's catch-up (``see_catch_up``: after plain steps, and at a request's start,
      whose drafter prefill the engine defers to the first drafted step, the drafter must first
      absorb the tokens it lacks): a tree is chosen only where its saving over the tokens the
      request may still emit pays for the catch-up first (a call per prefill chunk of the
      ``behind`` tokens, ``chunk`` wide, at the feedback's measured ms per call, else the
      profile's: a call costs the same however few of its rows are new; the saving at the speed-up the trees chosen so
      far realised, the feedback's ``plan_ratio`` times the price), and a probe only where its
      catch-up costs at most ``probe_share`` of the plain steps before it and of the tokens still
      to come. On a fast target a prompt's catch-up costs many plain steps, which a short
      request's marginal trees never earn back (docs/objective.md has the measured figures).

    ``log`` collects one :class:`Prediction` per step (plain steps included) for benches.
    """

    cost: CostModel
    calib: Calibration
    draft_widths: tuple[int, ...]
    verify_widths: tuple[int, ...]
    d_max: int
    depth_fn: Callable[[torch.Tensor, int], int] | None = None
    predictor: object | None = None  # a predictor.DepthFn: per-context AAL by depth
    allow_plain: bool = True
    feedback: Feedback | None = None
    probe_every: int = 16
    probe_max: int = 256
    probe_share: float = 0.1  # a probe costs at most this share of the plain steps' time before it
    probe_decay: float = 0.5  # the share's factor after a losing probe (1: a fixed share)
    probe_floor: float = 1 / 16  # the lowest share, as a fraction of probe_share
    chunk: int = 1  # the drafter's prefill chunk: a catch-up costs a call a chunk (1: priced per token)
    log: list = field(default_factory=list)
    _grid: dict = field(default_factory=dict)  # bucket index -> TreeChoices
    _plain_run: int = 0  # plain steps in a row
    _probe_gap: int = 0  # plain steps before the next probe (0: probe_every)
    _probing: bool = False  # the step under way is a probe
    _pending: Prediction | None = None  # the prediction of the step under way
    _scale: np.ndarray | None = None  # [d_max] the predictor's AAL factors of the step under way
    _lookup: tuple[float, ...] = ()  # path values of this step's lookup candidates, best first
    _lookup_s: float = math.inf  # this step's best lookup-only speed-up as choose_draft priced it (inf: not priced)
    _lk_grid: dict = field(default_factory=dict)  # bucket index -> {W_v: (lookup-only step ms, verify ms)}
    _best_rate: dict = field(default_factory=dict)  # bucket index -> (feedback state, best row, its AAL / step ms)
    _behind: int = 0  # tokens the drafter lacks before the coming step (see_catch_up)
    _remaining: int | None = None  # tokens the request may still emit (None: not told)
    _step_calls: int = 0  # the catch-up of the drafted step under way (its calls)
    _planned: float = 0.0  # the speed-up the drafted step under way was chosen for (0: none)

    def _choices(self, ctx: int) -> TreeChoices:
        """The plan's :class:`TreeChoices` at ``ctx``, kept per context bucket."""
        key = self.cost.verify.bucket(ctx + max(self.verify_widths))
        if key not in self._grid:
            self._grid[key] = tree_choices(self.cost, self.calib, self.d_max, self.draft_widths,
                                           self.verify_widths, ctx)
        return self._grid[key]

    def _online_plain(self, plain_ms: float) -> float:
        return self.feedback.plain_ms(plain_ms) if self.feedback else plain_ms

    def _online_step(self, step_ms, verify_ms, wv, lookup: bool = False):
        return self.feedback.step_ms(step_ms, verify_ms, wv, lookup) if self.feedback else step_ms

    def _best_tree(self, ctx: int) -> tuple[int, float] | None:
        """The best drafted tree at ``ctx`` as the feedback stands (lookup candidates aside): its
        row and its speed-up over a plain step; None where the plan has no tree. Between drafted
        steps the feedback moves only its machine factor, which scales plain and tree steps alike,
        and the plain width's factor; so the best row and its corrected AAL over its corrected step
        time (the machine factor taken out) are kept per context bucket and feedback state, and a
        plain step's choice is one multiplication. A drafted step's report moves the rest, and the
        next step prices every tree once, for its choice and this bound alike. A policy makes this
        choice every step, after a verify has pushed its code and arrays out of the caches."""
        key = self.cost.verify.bucket(ctx + max(self.verify_widths))
        fb = self.feedback
        state = fb.state if fb else 0
        hit = self._best_rate.get(key)
        g = self._choices(ctx)
        if hit is None or hit[0] != state:
            if not len(g.rows):
                return None
            a = fb.aal(g.aal, g.depth) if fb else g.aal
            t = self._online_step(g.step_ms, g.verify_ms, g.verify_width) / (fb.machine if fb else 1.0)
            hit = (state, *best_tree(a, t, 1.0))  # the best row and its AAL per ms
            self._best_rate[key] = hit
        return hit[1], hit[2] * (fb.width_factor(1) if fb else 1.0) * g.plain_ms

    def plan_choice(self, ctx: int, d: int | None = None, allow_plain: bool | None = None,
                    scale: np.ndarray | None = None, extra_ms: float = 0.0) -> tuple[StepChoice, float]:
        """The best (D, W_d) before drafting at context ``ctx`` and its expected speed-up
        (``d``: only that depth; ``scale`` [n <= d_max]: factors on AAL - 1 for D = 1..n, deeper
        trees excluded; ``extra_ms``, paid by every step whatever it does (the depth predictor),
        added to plain and tree steps alike; first of equals wins, deeper and wider choices
        after). Where a plain step is allowed, a tree must also repay the drafter's catch-up
        (:meth:`_catch_up_pays`)."""
        allow = self.allow_plain if allow_plain is None else allow_plain
        plain = StepChoice(0, self.draft_widths[0])
        lookup_only = bool(self._lookup) and allow and d is None  # a lookup-only step (no drafter call)
        if lookup_only:
            self._lookup_s = self._lookup_best(ctx, extra_ms)[1]
        unpriced = allow and d is None and scale is None and not extra_ms  # the shortcuts' case
        best = self._best_tree(ctx) if unpriced else None
        if best is not None and not self._lookup:  # the kept best tree, or a plain step
            i, s = best
            if s > 1.0 and self._catch_up_pays(s, ctx):
                g = self._choices(ctx)
                return StepChoice(g.rows[i][0], g.rows[i][1]), s
            return plain, 1.0
        # A drafted step of W_v nodes costs at least the lookup-only step of W_v (the same verify
        # call and stages, plus the drafter's), so a merged tree is worth at most the better of its
        # drafted tree and the lookup-only step: where every drafted tree loses to a plain step, the
        # choice is plain or lookup-only, without pricing them.
        if best is not None and best[1] < 1.0 - 1e-6:
            return plain, max(1.0, self._lookup_s)
        g = self._choices(ctx)
        fb = self.feedback
        aal = g.aal
        if scale is not None:
            f = np.full(self.d_max + 1, np.nan)
            f[1 : len(scale) + 1] = scale[: self.d_max]
            aal = 1.0 + (aal - 1.0) * f[g.depth]
        plain_on = self._online_plain(g.plain_ms) + extra_ms
        aal = fb.aal(aal, g.depth) if fb and len(g.depth) else aal
        if self._lookup:  # the merged tree is worth at least the better of its two parts
            per_width = np.array([self._lookup_aal(w) for w in (1, *self.verify_widths)])
            aal = np.maximum(aal, per_width[g.width_index])
        step_on = self._online_step(g.step_ms, g.verify_ms, g.verify_width) + extra_ms
        i, s = best_tree(aal, step_on, plain_on, g.depth, d)
        best, best_s = plain, 1.0 if allow else -1.0
        if lookup_only:
            best_s = max(best_s, self._lookup_s)
        if i >= 0 and s > best_s and (not allow or self._catch_up_pays(s, ctx)):
            best, best_s = StepChoice(g.rows[i][0], g.rows[i][1]), s
        return best, best_s

    def see_lookup(self, prop, committed: int) -> None:
        """The engine's lookup candidates for the coming step (a lookup.Proposal): their path
        values enter every choice of this step."""
        self._lookup = tuple(sorted(prop.value, reverse=True))

    def takes_lookup_only(self) -> bool:
        """A plain step's lookup candidates become a tree only where ``choose_draft`` priced the
        best lookup-only step above a plain one (``_lookup_best``, from the candidates' path
        values): where it did not, ``choose_verify`` on that tree chooses W_v = 1 (docs/objective.md
        gives the measurement; a property test checks it), so building and pricing it is skipped.
        Unpriced steps (a depth predictor, a fixed depth) build it."""
        return self._lookup_s > 1.0

    def lookup_logq(self, p: float) -> float:
        """A lookup edge accepted with probability ``p`` on the drafter's scale (see merge.py)."""
        return self.calib.drafter_logq(p)

    def _lookup_aal(self, wv: int) -> float:
        """Expected accepted length (bonus included) of the ``wv - 1`` best lookup nodes,
        feedback-corrected as depth-0 (lookup-only) steps."""
        a = 1.0 + sum(self._lookup[: wv - 1])
        return self.feedback.aal(a, 0) if self.feedback else a

    def _lookup_costs(self, ctx: int) -> dict:
        """{W_v: (lookup-only step ms, its verify ms)} for 1 and every verify width at ``ctx``
        (per context bucket, as ``_choices``)."""
        key = self.cost.verify.bucket(ctx + max(self.verify_widths))
        if key not in self._lk_grid:
            self._lk_grid[key] = {w: (self.cost.lookup_ms(w, ctx), self.cost.t_verify(w, ctx))
                                  for w in (1, *self.verify_widths)}
        return self._lk_grid[key]

    def _lookup_best(self, ctx: int, extra_ms: float = 0.0) -> tuple[int, float]:
        """The best lookup-only verify width and its expected speed-up over plain decoding."""
        costs = self._lookup_costs(ctx)
        plain_on = self._online_plain(costs[1][0]) + extra_ms
        ws = list(self.verify_widths)
        return best_verify([self._lookup_aal(w) for w in ws], ws,
                           [self._online_step(*costs[w], w, lookup=True) + extra_ms for w in ws], plain_on)

    def choose_draft(self, h_root: torch.Tensor, committed: int) -> StepChoice:
        self._scale, self._probing, self._lookup_s = None, False, math.inf
        if self.depth_fn is not None:
            d = int(self.depth_fn(h_root, committed))  # D > 0: drafting was decided, pick W_d
            choice, s = ((StepChoice(0, self.draft_widths[0]), 1.0) if d == 0
                         else self.plan_choice(committed, d, allow_plain=False))
        elif self.predictor is not None and not self.predictor.uses_head:  # no probes: the
            self._scale = self.predictor.aal_scale(h_root, self.calib)  # predictor sees every context
            choice, s = self.plan_choice(committed, scale=self._scale, extra_ms=self.predictor.overhead_ms)
        else:
            choice, s = self.plan_choice(committed)
            if choice.draft_depth > 0:
                self._probe_gap = self.probe_every  # speculation pays again: probes at full share
                if self.feedback is not None:
                    self.feedback.probe_scale = 1.0
            elif (self.feedback is not None and self._plain_run >= self._probe_after()
                  and self._probe_affordable(committed)):
                choice, s = self.plan_choice(committed, allow_plain=False)  # probe
                self._probing = True
        # (a catch-up in head calls teaches no chunk call's cost)
        chunked = choice.draft_depth > 0 and self._behind > 0 and not self.catch_up_by_heads(self._behind, committed)
        self._step_calls = self._catch_up_calls(committed) if chunked else 0
        self._planned = s if choice.draft_depth > 0 else 0.0
        if choice.draft_depth == 0:  # the engine asks no W_v for a plain step
            self._plain_run += 1
            plain = self.cost.plain_ms(committed)
            on = self._online_plain(plain)
            self._log(Prediction(committed, 0, 1, 1.0, plain, plain, 1.0, on, on, plain))
        else:
            self._plain_run = 0
        return choice

    def after_head(self, h_root: torch.Tensor, head_logp: torch.Tensor, choice: StepChoice,
                   committed: int) -> StepChoice:
        """The drafter's head has run for a tree step (``choice``): a predictor reading its
        confidence (``head_logp`` [k], the root's top-k children) now picks (D >= 1, W_d) with
        the context's AAL factors; other policies keep ``choice``."""
        if self.predictor is None or not self.predictor.uses_head or self.depth_fn is not None:
            return choice
        self._scale = self.predictor.aal_scale(h_root, self.calib, head_logp)
        choice, self._planned = self.plan_choice(committed, allow_plain=False, scale=self._scale,
                                                 extra_ms=self.predictor.overhead_ms)
        return choice

    def see_catch_up(self, behind: int, remaining: int) -> None:
        self._behind, self._remaining = int(behind), int(remaining)

    def _catch_up_calls(self, ctx: int) -> int:
        return catch_up_calls(self._behind, ctx, self.chunk)

    def catch_up_ms(self, ctx: int) -> float:
        """Predicted time of the drafter's catch-up before a drafted step at context ``ctx`` now
        (0: in step, or no price known yet): the cheaper of its two ways (:meth:`_catch_up_ways`)."""
        return min(self._catch_up_ways(self._behind, ctx))

    def _catch_up_ways(self, behind: int, ctx: int) -> tuple[float, float]:
        """(in prefill chunks, in head calls) ms of a catch-up of ``behind`` tokens at ``ctx``: a
        call per prefill chunk it redoes, at the feedback's measured ms per call, else the
        profile's (0 where neither is known); a head call per ``absorbs`` + 1 tokens beyond what
        the step's own head call takes in, at the profile's head call times the machine factor
        (inf where the drafter's head takes in none)."""
        if behind <= 0:
            return 0.0, 0.0
        calls = catch_up_calls(behind, ctx, self.chunk)
        prior = self.cost.resync_per_call(self.chunk)
        per = self.feedback.catch_up_per_call(prior) if self.feedback else prior
        chunks = calls * per if calls > 0 and per else 0.0
        if not self.cost.absorbs:
            return chunks, math.inf
        heads = catch_up_heads(behind, self.cost.absorbs)
        return chunks, heads * self.cost.head_ms(ctx) * (self.feedback.machine if self.feedback else 1.0)

    def catch_up_by_heads(self, behind: int, committed: int) -> bool:
        """The drafter's catch-up in head calls where the profile prices them below its prefill
        chunks: a chunk's call costs the same however few of its rows are new, and a resumed
        prefill redoes the chunk holding the first token behind, where every row of a head call
        (``absorbs`` + 1 of them) is new; which costs less is the machine's (its profile's)."""
        chunks, heads = self._catch_up_ways(int(behind), int(committed))
        return heads < chunks

    def _catch_up_pays(self, speedup: float, ctx: int) -> bool:
        """Whether a tree at ``speedup`` over plain steps repays the drafter's catch-up within
        the tokens the request may still emit (each saving ``T_plain x (1 - 1 / speedup)``, the
        speed-up scaled by the feedback's realised / planned ratio of drafted steps: the trees
        that follow are priced as the best of many, and realise less); true where the engine did
        not report them or the catch-up has no price."""
        cost = self.catch_up_ms(ctx)
        if cost <= 0.0 or self._remaining is None:
            return True
        if self.feedback is not None:  # as fast as the trees chosen so far turned out, not as priced
            speedup *= self.feedback.plan_ratio()
        saving = self._online_plain(self.cost.plain_ms(ctx)) * (1.0 - 1.0 / speedup)  # a token's
        return speedup > 1.0 and cost < self._remaining * saving

    def _probe_affordable(self, ctx: int) -> bool:
        """Whether a probe's catch-up costs at most ``probe_share`` of the plain steps before it
        and of the plain steps the request may still take (a probe near a request's end pays its
        catch-up for tokens that cannot repay it)."""
        cost = self.catch_up_ms(ctx)
        steps = self._plain_run if self._remaining is None else min(self._plain_run, self._remaining)
        return cost <= self._probe_share() * steps * self._online_plain(self.cost.plain_ms(ctx))

    def _probe_share(self) -> float:
        """The share of plain steps' time the probes may take now: ``probe_share``, times
        ``probe_decay`` for every probe lost since the last win (not below the floor; kept in the
        feedback, as the probes' cost is, so later requests and runs start from it)."""
        return self.probe_share * (self.feedback.probe_scale if self.feedback is not None else 1.0)

    def _probe_after(self) -> int:
        """Plain steps in a row before the next probe: the current gap (``probe_every``, doubled
        by every losing probe), scaled up where a probe costs more than ``probe_share`` of
        ``probe_every`` plain steps (its measured cost, once a probe has run)."""
        gap = self._probe_gap or self.probe_every
        cost = self.feedback.probe_cost if self.feedback is not None else None
        if cost is None:
            return gap
        return max(gap, math.ceil(gap / self.probe_every * cost / self._probe_share()))

    def choose_verify(self, tree: Tree, choice: StepChoice, committed: int) -> int:
        d, wd = choice.draft_depth, choice.draft_width
        widths = [1, *self.verify_widths]
        # lookup nodes may hang deeper than the drafter's D
        deep = max(d, int(tree.depth.max()))
        aal = tree_aal_by_width(tree, self.calib, deep, widths)
        g = self._choices(committed)
        if d == 0:  # a lookup-only tree: the step chosen as plain may verify it instead
            steps, vms = zip(*(self._lookup_costs(committed)[w] for w in widths))
            if self._pending is not None and self.log and self.log[-1] is self._pending:
                self.log.pop()  # choose_draft's plain prediction: this prediction replaces it
        else:
            steps, vms = zip(*(g.costs[d, wd, w] for w in widths))
        extra = 0.0
        if self._scale is not None:  # the predictor's view of this context, as in choose_draft
            aal = [1.0 + (a - 1.0) * float(self._scale[d - 1]) for a in aal]
            extra = self.predictor.overhead_ms
        fb = self.feedback
        scale = fb.accept_scale_at(d) if fb else 1.0  # fb.aal's, once for every width
        aal_on = [1.0 + (a - 1.0) * scale for a in aal] if fb else aal
        steps_on = [(self._online_plain(t) if d == 0 and w == 1 else self._online_step(t, v, w, d == 0)) + extra
                    for t, v, w in zip(steps, vms, widths)]
        plain_on = self._online_plain(g.plain_ms)
        wv, _ = best_verify(aal_on, widths, steps_on, plain_on + extra)
        i = widths.index(wv)
        # logged against plain decoding without a predictor, as the bench's plain system runs
        self._log(Prediction(committed, d, wv, aal[i], steps[i] + extra, g.plain_ms,
                             aal_on[i], steps_on[i], plain_on, vms[i]))
        return wv

    def fresh(self, **changes) -> "ObjectivePolicy":
        """A copy with ``changes`` applied and no state carried over (log, feedback, caches)."""
        f = self.feedback
        fb = (Feedback(f.alpha, f.clip, f.accept_alpha, f.slow_alpha, f.prior_tokens,
                       f.request_prior_tokens, f.age_alpha, f.age_every) if f is not None else None)
        changes = {"feedback": fb} | changes
        return replace(self, log=[], _grid={}, _lk_grid={}, _best_rate={}, _plain_run=0, _probe_gap=0, _probing=False,
                       _behind=0, _remaining=None, _step_calls=0, _planned=0.0,
                       _pending=None, _scale=None, _lookup=(), _lookup_s=math.inf, **changes)

    def start_request(self) -> None:
        """The engine starts a request: its acceptance is learnt afresh (from the all-requests
        estimate) and a policy that fell back to plain steps probes again from the start."""
        self._plain_run, self._probe_gap, self._probing, self._pending = 0, 0, False, None
        self._behind, self._remaining, self._step_calls, self._planned = 0, None, 0, 0.0
        if self.feedback is not None:
            self.feedback.start_request()

    def _log(self, pred: Prediction) -> None:
        self.log.append(pred)
        self._pending = pred

    def observe(self, rec) -> None:
        """The engine's report of the step just run (a StepRecord): fold it into the feedback."""
        pred, self._pending = self._pending, None
        calls, self._step_calls = self._step_calls, 0
        planned, self._planned = self._planned, 0.0
        if self.feedback is None or pred is None:
            return
        if calls > 0 and "resync" in rec.stage_ms:
            self.feedback.update_catch_up(rec.stage_ms["resync"], calls)
        # the drafter's catch-up after plain steps ("resync") is left out: it is the price of the
        # plain steps before, grows with their number, and counted against speculation it made
        # every later probe look worse (a feedback loop that kept a policy on plain steps)
        step_ms = sum(v for k, v in rec.stage_ms.items() if k != "resync")
        plain_ms = self.feedback.plain_ms(pred.plain_ms)
        if pred.draft_depth > 0 and step_ms > 0:  # the speed-up it realised against its price
            self.feedback.update_planned(planned, (1 + rec.n_accepted) * plain_ms / step_ms)
        if self._probing:  # did the probe beat the plain steps its tokens would have taken?
            won = (1 + rec.n_accepted) * plain_ms > step_ms
            cost = sum(rec.stage_ms.values()) / plain_ms  # in plain steps, the catch-up included
            fb = self.feedback
            fb.probe_cost = cost if fb.probe_cost is None else (fb.probe_cost + cost) / 2
            gap = self._probe_gap or self.probe_every
            self._probe_gap = self.probe_every if won else min(2 * gap, self.probe_max)
            fb.probe_scale = 1.0 if won else max(fb.probe_scale * self.probe_decay, self.probe_floor)
        if pred.draft_depth == 0 and pred.verify_width == 1:  # the target call and choosing its
            step_ms = rec.stage_ms.get("verify", step_ms) + rec.stage_ms.get("accept", 0.0)  # token
        self.feedback.update(pred, rec.n_accepted, step_ms, rec.stage_ms.get("verify"))


def plan_policy(plan, feedback: bool = True) -> ObjectivePolicy | None:
    """The latency-objective policy of ``plan`` (a :class:`yggtree.plan.Plan`): its profile and
    calibration loaded and checked against the plan. None when the plan names neither (the
    engine then runs one fixed tree); a YggError when it names only one of them, or when either
    is missing, malformed, or measured for other models or another dtype."""
    if plan.profile is None and plan.calibration is None:
        return None
    if plan.profile is None or plan.calibration is None:
        have, need, cmd = (("calibration", "profile", "yggtree profile --hw NAME --plan PLAN")
                           if plan.profile is None else
                           ("profile", "calibration", "yggtree calibrate --plan PLAN"))
        raise YggError(f"plan {plan.name!r} names a {have} but no {need}: the latency objective needs "
                       f"both (make one with `{cmd}`)")
    if not plan.speculative:
        raise YggError(f"plan {plan.name!r} has no drafter: a profile and calibration have nothing to choose")
    return ObjectivePolicy(
        CostModel.from_profile(plan.profile, plan),
        Calibration.load(plan.calibration, plan),
        tuple(plan.draft_widths),
        tuple(plan.verify_widths),
        plan.d_max,
        feedback=Feedback() if feedback else None,
        chunk=plan.prefill_chunk,
    )
