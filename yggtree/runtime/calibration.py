"""The acceptance calibration and the expected accepted length of a drafted tree under it.

``P(path accepted)`` is the product of calibrated per-edge acceptance probabilities:
:class:`Calibration` maps the drafter's probability of a token to its measured acceptance rate
(``yggtree calibrate``, offline/fit.py) and holds the measured mean accepted length of every
(W_d, D, W_v). A calibration is refused when it was fitted for another target, drafter (weights
included) or dtype than the plan's. :func:`path_values` and :func:`aal_by_width` turn a drafted
tree into expected accepted lengths per verify width. Nothing here imports the offline package or
scikit-learn.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import YggError
from .artifacts import CALIBRATION_KIND, first_difference, pair_identity, read_artifact
from .tree import Tree

__all__ = ["Calibration", "path_values", "aal_by_width", "aal_by_width_lists", "tree_aal_by_width"]


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

    def edge_prob_at(self, q: float) -> float:
        """:meth:`edge_prob` of one probability, on the host (float arithmetic)."""
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        qc = min(max(q, xs[0]), xs[-1])
        i = min(max(bisect.bisect_left(xs, qc), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        t = (qc - x0) / max(x1 - x0, 1e-12) if x1 > x0 else 0.0
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
            key = first_difference(ident, want) if isinstance(ident, dict) else "identity"
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


def aal_by_width_lists(tree: Tree, calib: Calibration, d_max: int, widths: list[int]) -> list[float]:
    """:func:`aal_by_width` of :func:`path_values` (with ``calib.edge_prob``) on the host: the tree
    read once into lists, the same edges, ancestors (``d_max`` of them at most), keys and
    tie-breaks in Python floats (so equal up to float32 rounding). On a CPU a drafted tree's
    ~40 small tensor ops cost more than these few hundred float operations, most of all after a
    verify has flushed the caches."""
    parent, depth, valid = (t.tolist() for t in (tree.parent, tree.depth, tree.valid))
    lp = tree.logp.tolist()
    n = len(parent)
    lp0 = [v if ok else 0.0 for v, ok in zip(lp, valid)]
    edge = [1.0] + [calib.edge_prob_at(math.exp(min(lp0[i] - lp0[parent[i]], 0.0))) if valid[i] else 0.0
                    for i in range(1, n)]
    val = []
    for i in range(n):
        v, a = edge[i], parent[i]
        for _ in range(d_max):  # one more ancestor's edge each pass, up to the root
            if a == 0:
                break
            v, a = v * edge[a], parent[a]
        val.append(v if valid[i] else 0.0)
    order = sorted(range(n), key=lambda i: (not valid[i], -math.inf if i == 0 else -lp[i], depth[i]))
    csum, total = [], 0.0
    for i in order:
        total += val[i]
        csum.append(total)
    return [csum[min(w, n) - 1] for w in widths]


def tree_aal_by_width(tree: Tree, calib: Calibration, d_max: int, widths: list[int]) -> list[float]:
    """Expected accepted length of ``tree``'s kept nodes at each W_v in ``widths``, as the policy
    computes it: on the host (:func:`aal_by_width_lists`) for a tree on a CPU, else on its device.
    What the policy runs and the profile times."""
    if tree.logp.device.type == "cpu":
        return aal_by_width_lists(tree, calib, d_max, widths)
    return aal_by_width(path_values(tree, calib.edge_prob, d_max), tree, widths)
