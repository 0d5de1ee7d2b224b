"""Depth predictor (docs/design.md section 6): how many drafter calls to run, from the target's hidden state.

Each speculation step the engine hands the policy ``h_root`` [H], the target's final-norm hidden
state at the root, and (after the drafter's head call, which every tree step makes whatever its
depth) ``head_logp`` [k], the head's top-k log-probabilities for the root's children. A predictor
maps the features (h_root, and the head's top ``head_k`` log-probs when it was trained with them)
to ``p_ge`` [D_max]: ``p_ge[d-1] = P(accepted length >= d)`` for a tree drafted D_max calls deep
(trained offline by ``yggtree train-predictor`` on calibration prompts). The hidden state says
what kind of text comes next; the head's confidence says how sure the drafter is of the very next
token, and on the default pair it is what most of the predictive power comes from. Expected
accepted length with D calls, bonus token included::

    AAL(D) = 1 + sum_{d <= D} p_ge[d-1]

and :func:`choose_depth` picks the D maximising ``AAL(D) * T_plain / T_step(D)`` (0: a plain step
when no D beats plain decoding). D only changes how many times the same drafter graph runs: no
recompilation. Files (one directory per (target, drafter, dtype), ``predictors/<pair>/``)::

    depth_manifest.json          kind, version, pair identity, feature layer, D_max, W_d used,
                                 data hash, metrics, hyperparameters; the models below
    depth_predictor.safetensors  the MLP (:class:`DepthPredictor`)
    depth_baseline.safetensors   logistic regression per depth (:class:`LinearDepthPredictor`)

A predictor trained for another target, drafter, dtype or hidden size, or a corrupt file, is
refused with one line naming the file. Nothing here imports the offline package or scikit-learn.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import YggError
from ..files import file_sha256
from .artifacts import first_difference, pair_identity, read_artifact
from .loading import read_safetensors

__all__ = [
    "PREDICTOR_KIND", "FORMAT_VERSION", "MANIFEST_FILE", "MODEL_FILES", "FEATURE_LAYER",
    "LOGP_FLOOR", "features", "DepthPredictor", "LinearDepthPredictor", "expected_aal", "verify_width_for", "choose_depth",
    "load_predictor", "DepthFn", "measure_ms", "depth_fn_for", "policy_with_predictor", "predictor_state"
]

PREDICTOR_KIND = "yggtree-depth-predictor"
FORMAT_VERSION = 1
MANIFEST_FILE = "depth_manifest.json"
MODEL_FILES = {"mlp": "depth_predictor.safetensors", "baseline": "depth_baseline.safetensors"}
FEATURE_LAYER = "final_norm"  # StepRecord.h_root: the target's final-norm output at the root
LOGP_FLOOR = -20.0  # head log-probs below this (or missing children, -inf) enter as this


def check_head(head_logp: torch.Tensor | None, head_k: int) -> None:
    """YggError in one line unless ``head_logp`` [..., k] holds the ``head_k`` log-probs a predictor reads."""
    if head_logp is None or head_logp.shape[-1] < head_k:
        have = "none" if head_logp is None else head_logp.shape[-1]
        raise YggError(f"the depth predictor reads the drafter head's top {head_k} log-probs, got {have}")


def features(h: torch.Tensor, head_logp: torch.Tensor | None, head_k: int) -> torch.Tensor:
    """A predictor's input: ``h`` [..., H] and the ``head_k`` largest of ``head_logp`` [..., k]
    (sorted, floored at LOGP_FLOOR) -> [..., H + head_k] float32. ``head_k = 0``: ``h`` alone."""
    h = h.to(torch.float32)
    if head_k == 0:
        return h
    check_head(head_logp, head_k)
    top = head_logp.to(torch.float32).sort(dim=-1, descending=True).values[..., :head_k]
    return torch.cat([h, top.clamp_min(LOGP_FLOOR)], dim=-1)


# ----------------------------------------------------------------------------- models


class DepthPredictor(nn.Module):
    """Two-layer MLP encoder over the standardised hidden state, one head per depth.

    Head d outputs the logit of the conditional P(len >= d | len >= d-1); ``forward`` returns
    their cumulative product, P(len >= d), which is monotone non-increasing in d by construction
    (training applies a per-head BCE to exactly these products)."""

    def __init__(
        self, hidden_size: int, d_max: int, units: int = 64, dropout: float = 0.0, draft_width: int = 0,
        head_k: int = 0,
    ) -> None:
        super().__init__()
        self.hidden_size, self.d_max, self.units, self.head_k = hidden_size, d_max, units, head_k
        self.draft_width = draft_width  # W_d of the trees it was trained on (0: unknown)
        n = hidden_size + head_k  # F: features (see :func:`features`)
        self.register_buffer("mean", torch.zeros(n))  # [F] feature mean (training rows)
        self.register_buffer("std", torch.ones(n))  # [F] feature std (> 0)
        self.fc1 = nn.Linear(n, units)
        self.fc2 = nn.Linear(units, units)
        self.heads = nn.Linear(units, d_max)
        self.drop = nn.Dropout(dropout)

    def log_p_ge(self, h: torch.Tensor) -> torch.Tensor:
        """[..., F] features -> [..., D_max] log P(len >= d)."""
        x = (h - self.mean) / self.std
        x = self.drop(nn.functional.gelu(self.fc1(x)))
        x = self.drop(nn.functional.gelu(self.fc2(x)))
        return torch.cumsum(nn.functional.logsigmoid(self.heads(x)), dim=-1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[..., F] float32 features -> [..., D_max] P(len >= d), non-increasing in d."""
        return torch.exp(self.log_p_ge(h))


class LinearDepthPredictor(nn.Module):
    """Independent logistic regressions per depth on the standardised hidden state (the
    scikit-learn baseline, stored as tensors); monotone at inference by a running minimum."""

    def __init__(self, hidden_size: int, d_max: int, draft_width: int = 0, head_k: int = 0) -> None:
        super().__init__()
        self.hidden_size, self.d_max, self.head_k = hidden_size, d_max, head_k
        self.draft_width = draft_width  # W_d of the trees it was trained on (0: unknown)
        n = hidden_size + head_k  # F: features (see :func:`features`)
        self.register_buffer("mean", torch.zeros(n))  # [F] feature mean
        self.register_buffer("std", torch.ones(n))  # [F] feature std (> 0)
        self.register_buffer("weight", torch.zeros(d_max, n))  # [D_max, F] coefficients
        self.register_buffer("bias", torch.zeros(d_max))  # [D_max] intercepts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[..., F] float32 features -> [..., D_max] P(len >= d), non-increasing in d."""
        z = ((h - self.mean) / self.std) @ self.weight.T + self.bias
        return torch.cummin(torch.sigmoid(z), dim=-1).values


MODEL_TYPES = {"mlp": DepthPredictor, "logistic": LinearDepthPredictor}


def predictor_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a predictor's safetensors file holds (contiguous float32 tensors)."""
    return {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- pure functions


def expected_aal(p_ge: torch.Tensor) -> torch.Tensor:
    """[..., D_max] P(len >= d) -> [..., D_max] expected tokens emitted with D = 1..D_max calls
    (bonus included): ``1 + cumsum(p_ge)``."""
    return 1.0 + torch.cumsum(p_ge, dim=-1)


def verify_width_for(d: int, wd: int, verify_widths: Sequence[int]) -> int:
    """The verify width assumed for a tree of D calls at W_d: the smallest compiled width holding
    all of its 1 + D * W_d nodes, else the largest (the tree is then pruned)."""
    need = 1 + d * wd
    fits = [w for w in sorted(verify_widths) if w >= need]
    return fits[0] if fits else max(verify_widths)


def choose_depth(
    p_ge: torch.Tensor | Sequence[float],
    cost,
    committed: int,
    wd: int,
    wv_for_depth: Sequence[int],
    overhead_ms: float = 0.0,
) -> int:
    """The D in 1..len(p_ge) maximising ``AAL(D) * T_plain / (T_step(D) + overhead_ms)``, or 0
    (a plain step) when none beats plain decoding (speed-up <= 1). First D wins ties.

    ``p_ge`` [D_max] P(len >= d); ``cost`` a :class:`~yggtree.runtime.cost.CostModel`;
    ``wv_for_depth[D-1]`` the verify width of a D-call tree; ``overhead_ms`` extra time of a
    speculation step (the predictor's own cost)."""
    p = [float(v) for v in p_ge]
    plain = cost.plain_ms(committed)
    best, best_s, aal = 0, 1.0, 1.0
    for d in range(1, len(p) + 1):
        aal += p[d - 1]
        s = aal * plain / (cost.step_ms(d, wd, wv_for_depth[d - 1], committed) + overhead_ms)
        if s > best_s:
            best, best_s = d, s
    return best


# ----------------------------------------------------------------------------- files


def _manifest(path: Path) -> dict:
    return read_artifact(path, "depth predictor manifest", PREDICTOR_KIND, FORMAT_VERSION,
                         " (train one with `yggtree train-predictor --plan PLAN`)")


def _predictor_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    return p.parent if p.is_file() else p


def load_predictor(
    path: str | Path, plan, which: str = "mlp", hidden_size: int | None = None
) -> nn.Module:
    """The predictor ``which`` ("mlp" or "baseline") stored in directory ``path`` (or next to the
    file ``path``) for ``plan``, in eval mode. YggError (one line, naming the file) when the
    manifest or weights are missing, corrupt or truncated, or were trained for another target,
    drafter or dtype than the plan's (:func:`~yggtree.runtime.artifacts.pair_identity`), or for
    another hidden size than ``hidden_size`` (the target's; not checked when None)."""
    d = _predictor_dir(path)
    mpath = d / MANIFEST_FILE
    m = _manifest(mpath)
    ident, want = m.get("identity"), pair_identity(plan)
    if not isinstance(ident, dict) or ident != want:
        key = first_difference(ident, want) if isinstance(ident, dict) else "identity"
        raise YggError(f"depth predictor {mpath} was trained for another target/drafter/dtype than "
                       f"plan {plan.name!r} (differs in {key}); run `yggtree train-predictor --plan ...`")
    try:
        entry = m["models"][which]
        kind, fname = entry["type"], entry["file"]
        h, dm = int(m["feature"]["hidden_size"]), int(m["d_max"])
        hk = int(m["feature"].get("head_k", 0))
        args = {"draft_width": int(m.get("draft_width", 0)), "head_k": hk}
        if kind == "mlp":
            args["units"] = int(entry["units"])
    except (KeyError, TypeError, ValueError) as e:
        raise YggError(f"depth predictor manifest {mpath} is malformed or has no model {which!r} "
                       f"({e!r})") from None
    if h < 1 or dm < 1 or hk < 0:
        raise YggError(f"depth predictor manifest {mpath}: hidden size {h} and D_max {dm} must be >= 1, "
                       f"head_k {hk} >= 0")
    if kind not in MODEL_TYPES or Path(fname).name != fname:
        raise YggError(f"depth predictor manifest {mpath}: unknown model type {kind!r} or bad file name")
    if hidden_size is not None and h != hidden_size:
        raise YggError(f"depth predictor {mpath} was trained on hidden size {h}, the target has "
                       f"{hidden_size}")
    wpath = d / fname
    state = read_safetensors(wpath, "depth predictor weights")
    with torch.device("meta"):
        model = MODEL_TYPES[kind](h, dm, **args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if set(state) != set(shapes):
        odd = sorted(set(state) ^ set(shapes))
        raise YggError(f"{wpath}: tensors differ from a {kind} predictor ({', '.join(odd)})")
    for k, s in shapes.items():
        if tuple(state[k].shape) != s:
            raise YggError(f"{wpath}: tensor {k} has shape {list(state[k].shape)}, expected "
                           f"{list(s)} (hidden size {h}, head_k {hk}, D_max {dm} in the manifest)")
    if entry.get("sha256") not in (None, file_sha256(wpath)):
        raise YggError(f"depth predictor weights {wpath} do not match {mpath} (sha256 differs)")
    if not all(torch.isfinite(v).all() for v in state.values()) or not bool((state["std"] > 0).all()):
        raise YggError(f"{wpath}: non-finite weights or a non-positive std")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- run time


def matvec(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [F] @ w [F, U] by numpy's own loops: a BLAS call would wake BLAS's worker threads, which
    spin after it on the cores the kernel library's pool works on."""
    return np.einsum("i,ij->j", x, w)


def numpy_forward(model: nn.Module) -> Callable[[np.ndarray], np.ndarray]:
    """``model``'s forward (a :class:`DepthPredictor` or :class:`LinearDepthPredictor`: [F] float32
    features -> [D_max] P(len >= d)) in numpy on copies of its weights: the same function without
    torch's dispatch per operation (a decode step consults it once, on one row, where the module's
    ten operations cost mostly their dispatch: docs/results.md section 5). Its float32 sums run in another
    order, so the values agree with the module's to float32 rounding (tested), not bit for bit."""
    mean, std = model.mean.detach().numpy().copy(), model.std.detach().numpy().copy()
    if isinstance(model, LinearDepthPredictor):
        w, b = model.weight.detach().numpy().T.copy(), model.bias.detach().numpy().copy()

        def linear(f: np.ndarray) -> np.ndarray:
            return np.minimum.accumulate(1.0 / (1.0 + np.exp(-(matvec((f - mean) / std, w) + b))))
        return linear
    layers = [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy())
              for m in (model.fc1, model.fc2, model.heads)]

    def gelu(x: np.ndarray) -> np.ndarray:  # torch's exact GELU (a unit's erf by math: numpy has none)
        erf = np.fromiter((math.erf(v) for v in (x * np.float32(1 / math.sqrt(2.0))).tolist()), np.float32, len(x))
        return 0.5 * x * (1.0 + erf)

    def mlp(f: np.ndarray) -> np.ndarray:
        x = (f - mean) / std
        for w, b in layers[:2]:
            x = gelu(matvec(x, w) + b)
        z = matvec(x, layers[2][0]) + layers[2][1]
        log_sigmoid = np.minimum(z, 0) - np.log1p(np.exp(-np.abs(z)))
        return np.exp(np.cumsum(log_sigmoid))
    return mlp


def numpy_features(h: torch.Tensor, head_logp: torch.Tensor | None, head_k: int) -> np.ndarray:
    """:func:`features` of one step as a numpy float32 vector [H + head_k] (the same values)."""
    x = h.detach().to(torch.float32).numpy()
    if head_k == 0:
        return x
    check_head(head_logp, head_k)
    top = np.sort(head_logp.detach().to(torch.float32).numpy())[::-1][:head_k]
    return np.concatenate([x, np.maximum(top, np.float32(LOGP_FLOOR))])


@dataclass(frozen=True)
class DepthFn:
    """A predictor ready for an :class:`~yggtree.runtime.objective.ObjectivePolicy`: P(len >= d)
    for d = 1..d_max from the features of one step (:meth:`p_ge`), :func:`choose_depth` on them
    (``__call__``), and the factors by which they scale the calibration's AAL (:meth:`aal_scale`).
    A predictor reading the head's confidence (``uses_head``) is consulted after the head call."""

    predictor: nn.Module  # [F] float32 features -> [D_max] P(len >= d)
    cost: object  # CostModel
    draft_width: int  # W_d assumed when costing a D-call tree
    verify_widths: tuple[int, ...]  # [d_max] W_v assumed for D = 1..d_max
    overhead_ms: float = 0.0  # the predictor's own cost per step, added to every tree step
    _base: dict = field(default_factory=dict, compare=False, repr=False)  # id(calib) -> (calib, [d_max])
    _forward: Callable = field(init=False, compare=False, repr=False)  # numpy_forward(predictor)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_forward", numpy_forward(self.predictor))

    @property
    def d_max(self) -> int:
        return len(self.verify_widths)

    @property
    def uses_head(self) -> bool:
        """True when the predictor reads the drafter head's log-probs (known after the head call)."""
        return self.predictor.head_k > 0

    def p_ge(self, h_root: torch.Tensor, head_logp: torch.Tensor | None = None) -> torch.Tensor:
        """h_root [H], head_logp [k] (the head's top-k at the root; needed when ``uses_head``)
        -> [d_max] P(len >= d); YggError on a hidden state of another size."""
        h = self.predictor.hidden_size
        if h_root.shape[-1] != h:
            raise YggError(f"the depth predictor was trained on hidden size {h}, the target's "
                           f"hidden state has {h_root.shape[-1]}")
        x = numpy_features(h_root, head_logp, self.predictor.head_k)
        return torch.from_numpy(np.ascontiguousarray(self._forward(x)[: self.d_max], dtype=np.float32))

    def __call__(self, h_root: torch.Tensor, committed: int, head_logp: torch.Tensor | None = None) -> int:
        return choose_depth(self.p_ge(h_root, head_logp).tolist(), self.cost, committed,
                            self.draft_width, self.verify_widths, self.overhead_ms)

    def aal_scale(self, h_root: torch.Tensor, calib, head_logp: torch.Tensor | None = None) -> np.ndarray:
        """[d_max] factors on the calibration's expected drafted tokens (AAL - 1) of a D-call
        tree, D = 1..d_max: the predictor's expectation for this context, ``cumsum(P(len >=
        d))``, over the calibration's (``calib``, a calibration.Calibration) for the tree shape the
        predictor was trained on (W_d, W_v(D)); 1 where the calibration expects nothing."""
        if id(calib) not in self._base:  # the calibration's side is fixed: computed once
            self._base[id(calib)] = (calib, np.array([
                (calib.expected_aal(self.draft_width, d, wv) or 1.0) - 1.0
                for d, wv in enumerate(self.verify_widths, 1)]))
        base = self._base[id(calib)][1]
        pred = np.cumsum(self.p_ge(h_root, head_logp).numpy().astype(np.float64))
        return np.where(base > 1e-6, pred / np.maximum(base, 1e-6), 1.0)


def measure_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median wall time of ``fn()`` in ms."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def depth_fn_for(
    predictor: nn.Module, cost, plan, wd: int | None = None, overhead_ms: float | None = None
) -> DepthFn:
    """The ``depth_fn`` for ``plan``: depths up to min(the predictor's D_max, the plan's), draft
    width ``wd`` (default: the W_d the predictor was trained with when it is one of the plan's,
    else the plan's median width), verify widths from :func:`verify_width_for`. ``overhead_ms``,
    the predictor's own cost included in the objective, is measured here when None (median of
    30 calls of its forward, :meth:`DepthFn.p_ge`: the choice it feeds is priced as the objective's
    own choices are, not charged to it)."""
    d_max = min(predictor.d_max, plan.d_max)
    widths = sorted(plan.draft_widths)
    if wd is None:
        wd = predictor.draft_width if predictor.draft_width in widths else widths[len(widths) // 2]
    wvs = tuple(verify_width_for(d, wd, plan.verify_widths) for d in range(1, d_max + 1))
    fn = DepthFn(predictor, cost, wd, wvs, 0.0)
    if overhead_ms is None:
        z, q = torch.zeros(predictor.hidden_size), torch.full((max(predictor.head_k, 1),), -1.0)
        overhead_ms = measure_ms(lambda: fn.p_ge(z, q))
    return replace(fn, overhead_ms=float(overhead_ms))


def policy_with_predictor(plan, policy, which: str = "mlp", hidden_size: int | None = None):
    """``policy`` (an ObjectivePolicy from :func:`~yggtree.runtime.objective.plan_policy`) with the
    depth predictor named by ``plan.predictor`` as its ``depth_fn``; ``policy`` unchanged when the
    plan names no predictor. YggError when it names one but there is no objective policy (the
    predictor needs the plan's profile and calibration), or the predictor does not fit the plan
    (see :func:`load_predictor`). Pass the target's ``hidden_size`` to check it at load."""
    if plan.predictor is None:
        return policy
    if policy is None:
        raise YggError(f"plan {plan.name!r} names a depth predictor but no profile and calibration: "
                       "choosing a depth needs the latency objective (run `yggtree profile` and "
                       "`yggtree calibrate`, and name both in the plan)")
    model = load_predictor(plan.predictor, plan, which, hidden_size)
    return policy.fresh(predictor=depth_fn_for(model, policy.cost, plan))
