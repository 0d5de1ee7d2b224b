"""Batch-aware trees: the latency objective over every request of a batch step at once.

A batch step drafts each request's tree in turn and verifies all of them in one call of the
target over ``b`` batch rows of ``W`` rows each (``W`` the widest tree of the step; runtime/batch.py),
so a step of choices o_1..o_B takes

    T(o) = sum_i own_ms_i(o_i) + T_v(b * max_i W_v(o_i), ctx)

(own: the request's drafting, pruning and accepting; T_v: the profile's verify curve at the
call's rows) and emits sum_i AAL_i(o_i) tokens. The joint choice maximises the batch's tokens per
ms, ``sum_i AAL_i / T(o)``. At one request (b = 1) it is the single-request objective
``AAL * T_plain / T_step`` (:func:`yggtree.runtime.objective.best_tree`): own + T_v is the step's
time and a plain step's own time is ``T_plain - T_v(1)``. As requests join, the verify call's
rows multiply by b, the extra rows of a wide tree cost more than its expected tokens are worth,
and the choice falls back toward plain steps (W_v = 1) where they stop paying.

:func:`joint_choice` solves it exactly: for every cap on the widest tree it maximises the ratio
of two separable sums by Dinkelbach's iteration (each request's best option for a price per
ms is independent of the others'); the verify curve is non-decreasing, so the best capped
solution over all caps is the optimum (tests/test_batch_objective.py checks it against brute force).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .calibration import Calibration
from .cost import CostModel
from .objective import TreeChoices, tree_choices

MAX_ROUNDS = 64  # Dinkelbach rounds (it converges in a few: every round strictly raises the ratio)


@dataclass(frozen=True)
class Menu:
    """One request's options for the coming step; option 0 is the plain step."""

    choices: tuple[tuple[int, int, int], ...]  # (D, W_d, W_v) of each option; (0, W_d, 1) first
    aal: np.ndarray  # [n] float64 expected tokens emitted (the bonus included; 1 for a plain step)
    own_ms: np.ndarray  # [n] float64 the option's time outside the shared verify call
    rows: np.ndarray  # [n] int64 W_v: the verify rows it needs


def plain_menu(own_ms: float = 0.0, draft_width: int = 1) -> Menu:
    """A request that takes plain steps only (``"speculative": false``, or no drafter)."""
    return Menu(((0, draft_width, 1),), np.ones(1), np.array([own_ms]), np.ones(1, dtype=np.int64))


def menu_of(g: TreeChoices, plain_verify_ms: float) -> Menu:
    """The options of a request at the context ``g`` was priced at: the plain step, then every
    calibrated tree of ``g`` (own time: its step time less its verify call's)."""
    wd0 = g.rows[0][1] if g.rows else 1
    choices = ((0, wd0, 1), *g.rows)
    aal = np.concatenate([[1.0], g.aal])
    own = np.concatenate([[g.plain_ms - plain_verify_ms], g.step_ms - g.verify_ms])
    rows = np.concatenate([[1], g.verify_width]).astype(np.int64)
    return Menu(choices, aal, own, rows)


def _sums(menus: list[Menu], picks) -> tuple[float, float, int]:
    """(expected tokens, own ms, widest W_v) of a step's picks."""
    tokens = sum(float(m.aal[p]) for m, p in zip(menus, picks))
    own = sum(float(m.own_ms[p]) for m, p in zip(menus, picks))
    return tokens, own, max(int(m.rows[p]) for m, p in zip(menus, picks))


def rate(menus: list[Menu], picks, verify_ms: Callable[[int], float], batch_rows: int) -> float:
    """Tokens per ms of the step that takes option ``picks[i]`` of ``menus[i]``, its verify call
    over ``batch_rows`` batch rows of the widest pick's W_v each."""
    tokens, own, width = _sums(menus, picks)
    return tokens / (own + verify_ms(batch_rows * width))


def joint_choice(menus: list[Menu], verify_ms: Callable[[int], float], batch_rows: int) -> tuple[tuple[int, ...], float]:
    """The option of every request maximising :func:`rate` (``verify_ms`` non-decreasing in the
    rows), and that rate. Ties go to the narrower cap, then to earlier options."""
    if not menus:
        return (), 0.0
    caps = sorted({int(w) for m in menus for w in m.rows})
    best, best_rate = None, -np.inf
    for cap in caps:
        fixed = verify_ms(batch_rows * cap)  # the call priced at the cap, whatever the picks' width
        allowed = [m.rows <= cap for m in menus]
        picks = [0] * len(menus)  # the plain step: always under the cap
        tokens, own, _ = _sums(menus, picks)
        lam = tokens / (own + fixed)
        for _ in range(MAX_ROUNDS):
            picks = [int(np.argmax(np.where(ok, m.aal - lam * m.own_ms, -np.inf))) for m, ok in zip(menus, allowed)]
            tokens, own, _ = _sums(menus, picks)
            new = tokens / (own + fixed)
            if not new > lam:
                break
            lam = new
        r = rate(menus, picks, verify_ms, batch_rows)
        if r > best_rate:
            best, best_rate = tuple(picks), r
    return best, best_rate


class BatchObjective:
    """Per-step joint tree choices from a plan's profile and calibration: the menus of the
    requests at their contexts (priced once per verify bucket) and :func:`joint_choice`."""

    def __init__(self, cost: CostModel, calib: Calibration, draft_widths: tuple[int, ...],
                 verify_widths: tuple[int, ...], d_max: int) -> None:
        self.cost, self.calib = cost, calib
        self.draft_widths, self.verify_widths, self.d_max = tuple(draft_widths), tuple(verify_widths), d_max
        self._menus: dict[int, Menu] = {}

    @classmethod
    def of(cls, policy) -> BatchObjective:
        """The objective of an :class:`~yggtree.runtime.objective.ObjectivePolicy`'s plan."""
        return cls(policy.cost, policy.calib, policy.draft_widths, policy.verify_widths, policy.d_max)

    def menu(self, ctx: int) -> Menu:
        key = self.cost.verify.bucket(ctx + max(self.verify_widths))
        if key not in self._menus:
            g = tree_choices(self.cost, self.calib, self.d_max, self.draft_widths, self.verify_widths, ctx)
            self._menus[key] = menu_of(g, self.cost.t_verify(1, ctx))
        return self._menus[key]

    def choose(self, contexts: list[int], speculative: list[bool], batch_rows: int) -> list[tuple[int, int, int]]:
        """(D, W_d, W_v) of every request (committed lengths ``contexts``; a request that is not
        ``speculative`` takes a plain step) for a verify call of ``batch_rows`` batch rows."""
        ctx = max(contexts)
        menus = [self.menu(c) if s else plain_menu(self.menu(c).own_ms[0], self.draft_widths[0])
                 for c, s in zip(contexts, speculative)]
        picks, _ = joint_choice(menus, lambda rows: self.cost.t_verify(rows, ctx), batch_rows)
        return [m.choices[p] for m, p in zip(menus, picks)]
