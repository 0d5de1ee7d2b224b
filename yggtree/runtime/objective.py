"""The latency-aware objective (docs/design.md section 5, docs/objective.md) and the policy that maximises it every step.

    speedup(W_d, D, W_v) = AAL(tree, W_v) * T_plain(ctx) / T_step(D, W_d, W_v, ctx)
    T_step               = T_head + n_D * T_d(W_d) + D * egt(W_d) + prune + T_v(W_v) + accept + commit
    n_D                  = D - 1 for an EAGLE head (the last level is not fed), D for an LM drafter
    AAL(tree, W_v)       = 1 + sum over the W_v kept nodes (root excluded) of P(path accepted)

Latencies come from a measured profile (``yggtree profile``), never from constants:
:class:`CostModel` reads the fitted curves (monotone piecewise-linear in width, one curve per
context bucket: attention reads the whole bucket, so within a bucket the context length does not
matter). ``P(path accepted)`` is the product of calibrated per-edge acceptance probabilities:
:class:`Calibration` maps the drafter's probability of a token to its measured acceptance rate
(``yggtree calibrate``). Both files are refused when they were measured for other models or
another dtype than the plan's. Nothing here imports the offline package or scikit-learn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import YggError
from .graphs import context_buckets
from .policy import StepChoice, StepPolicy
from .tree import Tree

__all__ = [
    "PROFILE_KIND", "CALIBRATION_KIND", "Curve", "CostModel", "Calibration", "timing_identity",
    "pair_identity", "read_artifact", "path_values", "aal_by_width", "best_verify", "ObjectivePolicy", "Prediction", "predicted_speedup", "Feedback", "plan_policy",
]

PROFILE_KIND = "yggtree-profile"
CALIBRATION_KIND = "yggtree-acceptance-calibration"
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- identities


def _entries(plan, role: str) -> list[dict]:
    from ..plan import model_fingerprints

    return [f for f in model_fingerprints(plan) if f["role"] == role]


def timing_identity(plan) -> dict:
    """What latency depends on: dtype, backend, the target's files (name, size, config hashes)
    and the drafter's shapes (its config and weight file sizes; retrained weights keep it)."""
    out = {"dtype": plan.dtype, "backend": plan.backend, "target": [], "drafter": []}
    for f in _entries(plan, "target"):
        out["target"].append({k: f[k] for k in ("size", "sha256", "missing") if k in f}
                             | {"name": Path(f["path"]).name})
    for f in _entries(plan, "drafter"):
        name = Path(f["path"]).name
        if name == "config.json" or name.endswith((".safetensors", ".gguf", ".bin")):
            out["drafter"].append({k: f[k] for k in ("size", "sha256") if k in f} | {"name": name})
    if plan.drafter == "self":
        out["drafter"] = "self"
    return out


def pair_identity(plan) -> dict:
    """What acceptance depends on: the timing identity plus the drafter's weights (sha256)."""
    import hashlib

    ident = timing_identity(plan)
    weights = []
    for f in _entries(plan, "drafter"):
        p = Path(f["path"])
        if p.suffix in (".safetensors", ".gguf", ".bin"):
            weights.append({"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    return ident | {"drafter_weights": weights}


def _diff(have: dict, want: dict) -> str:
    for k in sorted(set(have) | set(want)):
        if have.get(k) != want.get(k):
            return k
    return "?"


def read_artifact(path: str | Path, what: str, kind: str, version: int = FORMAT_VERSION,
                  missing_hint: str = "") -> dict:
    """The JSON object of an offline artifact (profile, calibration, predictor manifest):
    YggError naming ``what`` and the file when it is missing, not JSON, of another kind or of
    another format version."""
    p = Path(path)
    if not p.is_file():
        raise YggError(f"{what} {p} does not exist{missing_hint}")
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise YggError(f"{what} {p} is not valid JSON: {e}") from None
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise YggError(f"{what} {p} is not a {kind} file")
    if d.get("version") != version:
        raise YggError(f"{what} {p} has format version {d.get('version')!r}, expected {version}")
    return d


# ----------------------------------------------------------------------------- latency


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
        head = self.head.predict(self.head.xs[0][0], ctx)
        calls = d if self.feeds_leaves else d - 1
        return (head + calls * self.t_draft(wd, ctx) + self.t_verify(wv, ctx)
                + self.overhead_ms(d, wd, wv))

    def lookup_ms(self, wv: int, ctx: int) -> float:
        """A lookup-only step (no drafter call): the target over ``wv`` nodes and the non-model
        stages; ``wv = 1`` is a plain step."""
        if wv == 1:
            return self.plain_ms(ctx)
        return self.t_verify(wv, ctx) + self.overhead_ms(0, 1, wv)

    def plain_ms(self, ctx: int) -> float:
        """One plain decoding step: the target at width 1 plus choosing the token."""
        return self.t_verify(1, ctx) + self._stage("plain_accept")

    @classmethod
    def from_profile(cls, path: str | Path, plan) -> "CostModel":
        """Load ``path`` for ``plan``; YggError if missing, malformed, or measured for other
        models / another dtype or backend than the plan's. The plan's drafter sets
        ``feeds_leaves``."""
        d = read_artifact(path, "profile", PROFILE_KIND)
        where = f"profile {path}"
        ident = d.get("identity")
        want = timing_identity(plan)
        if not isinstance(ident, dict) or ident != want:
            key = _diff(ident, want) if isinstance(ident, dict) else "identity"
            raise YggError(
                f"{where} was measured for another setup than plan {plan.name!r} (differs in "
                f"{key}: profile {ident.get(key) if isinstance(ident, dict) else None!r} vs plan "
                f"{want.get(key)!r}); run `yggtree profile --plan ...` for this plan"
            )
        hw = d.get("hardware")
        if isinstance(hw, dict) and hw.get("device_name") is not None:
            from .device import detect_device, measured_on

            here = detect_device()
            if not measured_on(hw, here):
                raise YggError(
                    f"{where} was measured on {hw.get('device')} {hw.get('device_name')!r}, this process "
                    f"runs on {here['kind']} {here['name']!r}; profile this machine with `yggtree profile "
                    "--hw NAME --plan ...` (latency curves do not transfer between devices)"
                )
        from .build import drafter_feeds_leaves

        return replace(cls.from_profile_dict(d, where), feeds_leaves=drafter_feeds_leaves(plan))

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


# ----------------------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class Calibration:
    """Monotone map q (drafter probability of a drafted token) -> P(target accepts it), and the
    measured mean accepted length of every (W_d, D, W_v) on the calibration prompts."""

    xs: tuple[float, ...]  # knots in q (ascending, within [0, 1])
    ys: tuple[float, ...]  # acceptance probability at the knots (non-decreasing, within [0, 1])
    aal: dict = field(default_factory=dict)  # {W_d: [[AAL for W_v in verify_widths] for D=1..]}
    verify_widths: tuple[int, ...] = ()  # columns of ``aal``

    def edge_prob(self, q: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probability of edges with drafter probability ``q`` (any shape)."""
        x = torch.tensor(self.xs, dtype=torch.float32, device=q.device)
        y = torch.tensor(self.ys, dtype=torch.float32, device=q.device)
        qc = q.to(torch.float32).clamp(x[0], x[-1])
        i = torch.searchsorted(x, qc.contiguous()).clamp(1, max(len(self.xs) - 1, 1))
        if len(self.xs) == 1:
            return torch.full_like(qc, self.ys[0])
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        t = torch.where(x1 > x0, (qc - x0) / (x1 - x0).clamp_min(1e-12), torch.zeros_like(qc))
        return y0 + t * (y1 - y0)

    def drafter_logq(self, p: float) -> float:
        """log of the drafter probability q this map turns into acceptance ``p`` (the smallest
        such q; below the map's range its first knot): how a lookup edge accepted with
        probability ``p`` is put on the drafter's scale (``Tree.logp``)."""
        xs, ys = self.xs, self.ys
        i = next((i for i, y in enumerate(ys) if y >= p), len(ys) - 1)
        if i == 0 or ys[i] <= ys[i - 1]:
            q = xs[i]
        else:
            q = xs[i - 1] + (p - ys[i - 1]) / (ys[i] - ys[i - 1]) * (xs[i] - xs[i - 1])
        return float(np.log(max(q, 1e-9)))

    def expected_aal(self, wd: int, d: int, wv: int) -> float | None:
        table = self.aal.get(str(wd))
        if table is None or not 1 <= d <= len(table) or wv not in self.verify_widths:
            return None
        return float(table[d - 1][self.verify_widths.index(wv)])

    @classmethod
    def load(cls, path: str | Path, plan) -> "Calibration":
        d = read_artifact(path, "calibration", CALIBRATION_KIND)
        where = f"calibration {path}"
        ident, want = d.get("identity"), pair_identity(plan)
        if not isinstance(ident, dict) or ident != want:
            key = _diff(ident, want) if isinstance(ident, dict) else "identity"
            raise YggError(
                f"{where} was fitted for another target/drafter/dtype than plan {plan.name!r} "
                f"(differs in {key}); run `yggtree calibrate --plan ...` for this plan"
            )
        try:
            xs = tuple(float(v) for v in d["map"]["x"])
            ys = tuple(float(v) for v in d["map"]["y"])
            aal = {str(k): [[float(v) for v in row] for row in t] for k, t in d.get("aal", {}).items()}
            vw = tuple(int(w) for w in d.get("verify_widths", ()))
        except (KeyError, TypeError, ValueError) as e:
            raise YggError(f"{where}: malformed ({e!r})") from None
        ok = len(xs) == len(ys) >= 1 and all(0 <= v <= 1 for v in xs + ys)
        ok = ok and all(b >= a for a, b in zip(xs, xs[1:])) and all(b >= a for a, b in zip(ys, ys[1:]))
        if not ok:
            raise YggError(f"{where}: malformed map (knots must be ascending within [0, 1])")
        return cls(xs, ys, aal, vw)


# ----------------------------------------------------------------------------- pure functions


def path_values(tree: Tree, edge_prob: Callable[[torch.Tensor], torch.Tensor], d_max: int) -> torch.Tensor:
    """[N] float32 calibrated P(path from the root accepted) per node: root 1, invalid 0.

    Edge probability of node u = ``edge_prob(exp(logp[u] - logp[parent[u]]))``; a path value is
    the product along the path, so values never increase from parent to child (the top-k of them
    is a connected subtree, see prune.py). ``d_max`` bounds the depth (static loop count)."""
    n = tree.num_nodes
    root = torch.arange(n, device=tree.logp.device) == 0
    lp = torch.where(tree.valid, tree.logp, 0.0)
    q = torch.exp((lp - lp[tree.parent]).clamp(max=0.0))
    edge = torch.where(tree.valid & ~root, edge_prob(q), 0.0)
    edge = torch.where(root, 1.0, edge)
    val = edge.clone()
    anc = tree.parent
    for _ in range(d_max):  # multiply in one more ancestor's edge each pass
        val = val * torch.where(anc == 0, 1.0, edge[anc])
        anc = tree.parent[anc]
    return torch.where(tree.valid, val, 0.0)


def aal_by_width(values: torch.Tensor, tree: Tree, widths: list[int]) -> list[float]:
    """Expected accepted length (bonus included) of the nodes the engine keeps at each W_v in
    ``widths`` (``prune_topk(tree, tree.logp, w)``: same key and tie-breaks), i.e. the root's 1
    plus the kept nodes' ``values``."""
    n = values.shape[0]
    idx = torch.arange(n, device=values.device)
    key = torch.where(idx == 0, float("inf"), tree.logp.to(torch.float32))
    order = torch.sort(tree.depth, stable=True).indices
    order = order[torch.sort(key[order], descending=True, stable=True).indices]
    order = order[torch.sort(tree.valid[order].to(torch.uint8), descending=True, stable=True).indices]
    csum = torch.cumsum(torch.where(tree.valid, values, 0.0)[order], 0)  # csum[i]: first i+1 kept
    return [float(csum[min(w, n) - 1]) for w in widths]


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


@dataclass(frozen=True)
class Prediction:
    """What the objective expected of one step (the engine's view of a step is a StepRecord).

    ``aal``, ``step_ms`` and ``plain_ms`` come from the offline model alone (profile +
    calibration); the ``*_online`` fields are the same quantities after the policy's
    :class:`Feedback` correction from the steps already run (equal to the offline ones without
    feedback). Both are made before the step runs."""

    committed: int  # committed length before the step
    draft_depth: int  # D chosen (0: a plain step)
    verify_width: int  # W_v chosen (1 for a plain step)
    aal: float  # expected tokens emitted (bonus included; 1 for a plain step)
    step_ms: float  # predicted wall time of the step
    plain_ms: float  # predicted wall time of one plain step at this context
    aal_online: float | None = None
    step_ms_online: float | None = None
    plain_ms_online: float | None = None
    verify_ms: float | None = None  # predicted time of the step's verify call (T_v(W_v) at ctx)

    def terms(self, online: bool = False) -> tuple[float, float, float]:
        """(aal, step_ms, plain_ms), offline or feedback-corrected."""
        if not online or self.aal_online is None:
            return self.aal, self.step_ms, self.plain_ms
        return self.aal_online, self.step_ms_online, self.plain_ms_online

    @property
    def speedup(self) -> float:
        return self.aal * self.plain_ms / self.step_ms


def predicted_speedup(preds: list[Prediction], online: bool = False) -> float:
    """Predicted speed-up of a run of steps over plain decoding: the plain time of the tokens
    expected to be emitted over the predicted time of the steps (``online``: with the feedback
    correction each prediction had when it was made)."""
    terms = [p.terms(online) for p in preds]
    t = sum(s for _, s, _ in terms)
    return sum(a * pl for a, _, pl in terms) / t if t > 0 else float("nan")


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
      policy), the part the profile times stage by stage;
    - acceptance per draft depth D: realised / expected drafted tokens accepted (AAL - 1) over
      D-deep steps, as discounted sums (weight ``1 - accept_alpha`` per step of that depth: per
      step acceptance is a coin toss) with ``prior_tokens`` pseudo-tokens at the scale of depth
      D - 1 (1 for D = 1): a depth not run yet inherits what the shallower trees showed, as a
      deeper tree multiplies more over-rated edges, instead of the offline model's optimism
      (which made the policy try every depth in turn on text the drafter does badly on);
    - and per request (``start_request``): the same sums over this request's steps alone, with
      ``request_prior_tokens`` pseudo-tokens at the all-requests scale. How well a drafter does
      is a property of the text: on MT-Bench with the default pair, a one-call tree paid 0.98x
      on one prompt and 1.25x on the next, and a policy that carried one prompt's bad luck into
      the next stayed on plain steps where the tree paid 1.07x over the set.

    Corrected: AAL' = 1 + (AAL - 1) x scale(D); T_plain' = machine x rel(1) x T_plain;
    T_step' = machine x (rel(W_v) x T_v(W_v) + spec_extra x (T_step - T_v(W_v))).
    A ratio enters clipped to within ``clip`` x the current estimate, so one outlier step (a page
    fault, another process) moves an estimate by at most ``alpha * (clip - 1)``."""

    alpha: float = 0.1
    clip: float = 1.5
    accept_alpha: float = 0.02
    slow_alpha: float = 0.02
    prior_tokens: float = 2.0
    request_prior_tokens: float = 3.0
    machine: float = 1.0
    spec_extra: float = 1.0
    _width: dict = field(default_factory=dict)  # W -> relative factor of width-W target calls
    _by_depth: dict = field(default_factory=dict)  # D -> [discounted accepted, discounted expected]
    _request: dict = field(default_factory=dict)  # D -> [accepted, expected] in this request

    def start_request(self) -> None:
        """A new request begins: its own acceptance starts at the all-requests estimate."""
        self._request = {}

    def width_factor(self, w: int) -> float:
        return self._width.get(int(w), 1.0)

    def plain_ms(self, plain_ms: float) -> float:
        """Corrected time of a plain step predicted at ``plain_ms``."""
        return self.machine * self.width_factor(1) * plain_ms

    def step_ms(self, step_ms, verify_ms, wv):
        """Corrected time of drafted steps predicted at ``step_ms`` with ``verify_ms`` of it in the
        verify call at width ``wv`` (floats, or numpy arrays alike)."""
        rel = (np.array([self.width_factor(w) for w in np.ravel(wv)]).reshape(np.shape(wv))
               if np.ndim(wv) else self.width_factor(wv))
        return self.machine * (rel * verify_ms + self.spec_extra * (step_ms - verify_ms))

    def global_scale_at(self, d: int) -> float:
        """Acceptance scale of D-deep trees over all requests (prior: depth D - 1's)."""
        prior = 1.0 if d <= 1 else self.global_scale_at(d - 1)
        return _shrunk(self._by_depth.get(d), self.prior_tokens, prior)

    def accept_scale_at(self, d: int) -> float:
        """Acceptance scale of D-deep trees in this request (prior: all requests')."""
        return _shrunk(self._request.get(d), self.request_prior_tokens, self.global_scale_at(d))

    def aal(self, aal, depth):
        """Corrected expected accepted length (float or numpy array) of trees of ``depth`` draft
        calls (an int, or an int array like ``aal``)."""
        if np.ndim(depth) == 0:
            return 1.0 + (aal - 1.0) * self.accept_scale_at(int(depth))
        depth = np.asarray(depth)
        scales = np.array([self.accept_scale_at(d) for d in range(int(depth.max()) + 1)])
        return 1.0 + (aal - 1.0) * scales[depth]

    def update(self, pred: Prediction, n_accepted: int, step_ms: float, verify_ms: float | None = None) -> None:
        """Fold in one step: its prediction, drafted tokens accepted, measured wall time, and
        (drafted steps) the measured time of its verify stage. A plain step is all target call."""
        def toward(est: float, ratio: float, a: float) -> float:
            return est + a * (min(max(ratio, est / self.clip), est * self.clip) - est)

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
            return
        rest, rest_pred = step_ms - (v_ms or 0.0), pred.step_ms - v_pred
        if rest_pred > 0:
            self.spec_extra = toward(self.spec_extra, rest / (self.machine * rest_pred), self.alpha)
        b = self.accept_alpha
        acc, exp = self._by_depth.get(pred.draft_depth, (0.0, 0.0))
        self._by_depth[pred.draft_depth] = ((1 - b) * acc + n_accepted, (1 - b) * exp + pred.aal - 1.0)
        acc, exp = self._request.get(pred.draft_depth, (0.0, 0.0))
        self._request[pred.draft_depth] = (acc + n_accepted, exp + pred.aal - 1.0)


def _shrunk(sums: tuple[float, float] | None, k: float, prior: float) -> float:
    """(accepted + k x prior) / (expected + k) of ``sums`` = (accepted, expected)."""
    acc, exp = sums or (0.0, 0.0)
    return prior if exp + k < 1e-9 else (acc + k * prior) / (exp + k)


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
      :class:`Feedback`). After ``probe_every`` plain steps in a row the best tree runs once,
      so a policy that fell back to plain decoding keeps measuring whether speculation pays
      again (depth-predictor steps are not probed: the predictor sees every context). A probe
      that loses (its tokens took longer than plain steps would have, the drafter's catch-up
      included) doubles the gap before the next one, up to ``probe_max``; a probe that wins,
      or a tree chosen on its merits, resets it, so on text where speculation never pays the
      probes cost a few percent (docs/objective.md has the measured figures).

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
    log: list = field(default_factory=list)
    _grid: dict = field(default_factory=dict)  # bucket index -> (choices, D [n], AAL [n], step ms [n], verify ms [n], W_v [n], plain ms, {(D, W_d, W_v): (step ms, verify ms)})
    _plain_run: int = 0  # plain steps in a row
    _probe_gap: int = 0  # plain steps before the next probe (0: probe_every)
    _probing: bool = False  # the step under way is a probe
    _pending: Prediction | None = None  # the prediction of the step under way
    _scale: np.ndarray | None = None  # [d_max] the predictor's AAL factors of the step under way
    _lookup: tuple[float, ...] = ()  # path values of this step's lookup candidates, best first
    _lk_grid: dict = field(default_factory=dict)  # bucket index -> {W_v: (lookup-only step ms, verify ms)}

    def _choices(self, ctx: int):
        """Every (D, W_d, W_v) with a calibrated AAL, their D, AAL and predicted step times, and
        the plain time: the costs depend on ``ctx`` only through the context bucket."""
        key = self.cost.verify.bucket(ctx + max(self.verify_widths))
        if key not in self._grid:
            rows, aal, ms, vms, costs = [], [], [], [], {}
            for dd in range(1, self.d_max + 1):
                for wd in self.draft_widths:
                    for wv in (1, *self.verify_widths):
                        costs[dd, wd, wv] = (self.cost.step_ms(dd, wd, wv, ctx), self.cost.t_verify(wv, ctx))
                        a = self.calib.expected_aal(wd, dd, wv) if wv > 1 else 1.0
                        if a is None:
                            continue
                        rows.append((dd, wd, wv))
                        aal.append(a)
                        ms.append(costs[dd, wd, wv][0])
                        vms.append(costs[dd, wd, wv][1])
            depth = np.array([r[0] for r in rows], dtype=np.int64)
            wvs = np.array([r[2] for r in rows], dtype=np.int64)
            self._grid[key] = (rows, depth, np.array(aal), np.array(ms), np.array(vms), wvs,
                               self.cost.plain_ms(ctx), costs)
        return self._grid[key]

    def _online_plain(self, plain_ms: float) -> float:
        return self.feedback.plain_ms(plain_ms) if self.feedback else plain_ms

    def _online_step(self, step_ms, verify_ms, wv):
        return self.feedback.step_ms(step_ms, verify_ms, wv) if self.feedback else step_ms

    def plan_choice(self, ctx: int, d: int | None = None, allow_plain: bool | None = None,
                    scale: np.ndarray | None = None, extra_ms: float = 0.0) -> tuple[StepChoice, float]:
        """The best (D, W_d) before drafting at context ``ctx`` and its expected speed-up
        (``d``: only that depth; ``scale`` [n <= d_max]: factors on AAL - 1 for D = 1..n, deeper
        trees excluded; ``extra_ms``, paid by every step whatever it does (the depth predictor),
        added to plain and tree steps alike; first of equals wins, deeper and wider choices
        after)."""
        allow = self.allow_plain if allow_plain is None else allow_plain
        rows, depth, aal, ms, vms, wvs, plain, _ = self._choices(ctx)
        fb = self.feedback
        if scale is not None:
            f = np.full(self.d_max + 1, np.nan)
            f[1 : len(scale) + 1] = scale[: self.d_max]
            aal = 1.0 + (aal - 1.0) * f[depth]
        plain_on = self._online_plain(plain) + extra_ms
        aal = fb.aal(aal, depth) if fb and len(depth) else aal
        if self._lookup:  # the merged tree is worth at least the better of its two parts
            aal = np.maximum(aal, [self._lookup_aal(int(w)) for w in wvs])
        s = aal * plain_on / (self._online_step(ms, vms, wvs) + extra_ms)
        s = np.where(np.isnan(s), -np.inf, s)
        if d is not None:
            s = np.where(depth == d, s, -np.inf)
        best, best_s = StepChoice(0, self.draft_widths[0]), 1.0 if allow else -1.0
        if self._lookup and allow and d is None:  # a lookup-only step (no drafter call)
            best_s = max(best_s, self._lookup_best(ctx, extra_ms)[1])
        if len(rows):
            i = int(np.argmax(s))  # the first maximum, as a sequential scan would keep
            if s[i] > best_s:
                best, best_s = StepChoice(rows[i][0], rows[i][1]), float(s[i])
        return best, best_s

    def see_lookup(self, prop, committed: int) -> None:
        """The engine's lookup candidates for the coming step (a lookup.Proposal): their path
        values enter every choice of this step."""
        self._lookup = tuple(sorted(prop.value, reverse=True))

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
        best, best_s = 1, -1.0
        for w in self.verify_widths:
            t = self._online_step(*costs[w], w) + extra_ms
            sp = self._lookup_aal(w) * plain_on / t
            if sp > best_s:
                best, best_s = w, sp
        return best, best_s

    def choose_draft(self, h_root: torch.Tensor, committed: int) -> StepChoice:
        self._scale, self._probing = None, False
        if self.depth_fn is not None:
            d = int(self.depth_fn(h_root, committed))  # D > 0: drafting was decided, pick W_d
            choice = (StepChoice(0, self.draft_widths[0]) if d == 0
                      else self.plan_choice(committed, d, allow_plain=False)[0])
        elif self.predictor is not None and not self.predictor.uses_head:  # no probes: the
            self._scale = self.predictor.aal_scale(h_root, self.calib)  # predictor sees every context
            choice = self.plan_choice(committed, scale=self._scale, extra_ms=self.predictor.overhead_ms)[0]
        else:
            choice = self.plan_choice(committed)[0]
            if choice.draft_depth > 0:
                self._probe_gap = self.probe_every  # speculation pays again
            elif self.feedback is not None and self._plain_run >= (self._probe_gap or self.probe_every):
                choice = self.plan_choice(committed, allow_plain=False)[0]  # probe
                self._probing = True
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
        return self.plan_choice(committed, allow_plain=False, scale=self._scale,
                                extra_ms=self.predictor.overhead_ms)[0]

    def choose_verify(self, tree: Tree, choice: StepChoice, committed: int) -> int:
        d, wd = choice.draft_depth, choice.draft_width
        widths = [1, *self.verify_widths]
        # lookup nodes may hang deeper than the drafter's D
        vals = path_values(tree, self.calib.edge_prob, max(d, int(tree.depth.max())))
        aal = aal_by_width(vals, tree, widths)
        *_, plain, costs = self._choices(committed)
        if d == 0:  # a lookup-only tree: the step chosen as plain may verify it instead
            steps, vms = zip(*(self._lookup_costs(committed)[w] for w in widths))
            if self._pending is not None and self.log and self.log[-1] is self._pending:
                self.log.pop()  # choose_draft's plain prediction: this prediction replaces it
        else:
            steps, vms = zip(*(costs[d, wd, w] for w in widths))
        extra = 0.0
        if self._scale is not None:  # the predictor's view of this context, as in choose_draft
            aal = [1.0 + (a - 1.0) * float(self._scale[d - 1]) for a in aal]
            extra = self.predictor.overhead_ms
        fb = self.feedback
        aal_on = [fb.aal(a, d) for a in aal] if fb else aal
        steps_on = [(self._online_plain(t) if d == 0 and w == 1 else self._online_step(t, v, w)) + extra
                    for t, v, w in zip(steps, vms, widths)]
        plain_on = self._online_plain(plain)
        wv, _ = best_verify(aal_on, widths, steps_on, plain_on + extra)
        i = widths.index(wv)
        # logged against plain decoding without a predictor, as the bench's plain system runs
        self._log(Prediction(committed, d, wv, aal[i], steps[i] + extra, plain,
                             aal_on[i], steps_on[i], plain_on, vms[i]))
        return wv

    def fresh(self, **changes) -> "ObjectivePolicy":
        """A copy with ``changes`` applied and no state carried over (log, feedback, caches)."""
        f = self.feedback
        fb = (Feedback(f.alpha, f.clip, f.accept_alpha, f.slow_alpha, f.prior_tokens,
                       f.request_prior_tokens) if f is not None else None)
        changes = {"feedback": fb} | changes
        return replace(self, log=[], _grid={}, _lk_grid={}, _plain_run=0, _probe_gap=0, _probing=False,
                       _pending=None, _scale=None, _lookup=(), **changes)

    def start_request(self) -> None:
        """The engine starts a request: its acceptance is learnt afresh (from the all-requests
        estimate) and a policy that fell back to plain steps probes again from the start."""
        self._plain_run, self._probe_gap, self._probing, self._pending = 0, 0, False, None
        if self.feedback is not None:
            self.feedback.start_request()

    def _log(self, pred: Prediction) -> None:
        self.log.append(pred)
        self._pending = pred

    def observe(self, rec) -> None:
        """The engine's report of the step just run (a StepRecord): fold it into the feedback."""
        pred, self._pending = self._pending, None
        if self.feedback is None or pred is None:
            return
        # the drafter's catch-up after plain steps ("resync") is left out: it is the price of the
        # plain steps before, grows with their number, and counted against speculation it made
        # every later probe look worse (a feedback loop that kept a policy on plain steps)
        step_ms = sum(v for k, v in rec.stage_ms.items() if k != "resync")
        if self._probing:  # did the probe beat the plain steps its tokens would have taken?
            won = (1 + rec.n_accepted) * self.feedback.plain_ms(pred.plain_ms) > step_ms
            gap = self._probe_gap or self.probe_every
            self._probe_gap = self.probe_every if won else min(2 * gap, self.probe_max)
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
    )
