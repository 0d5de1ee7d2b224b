"""Batch-aware trees (runtime/batch_objective.py): the joint choice is the brute-force optimum,
equals the single-request objective at one request, and falls back to plain steps as the
batch grows where extra verify rows stop paying."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from yggtree.runtime.batch_objective import Menu, joint_choice, menu_of, plain_menu, rate
from yggtree.runtime.objective import TreeChoices, best_tree

WIDTHS = (1, 2, 4, 8, 16)


def curve(rng: random.Random, knee: int = 8):
    """A verify curve: flat-ish (memory-bound) up to ``knee`` rows, then steeper; non-decreasing."""
    base, flat, steep = rng.uniform(5, 10), rng.uniform(0.01, 0.1), rng.uniform(0.3, 1.5)
    return lambda rows: base + flat * min(rows, knee) + steep * max(rows - knee, 0)


def random_menu(rng: random.Random, n: int) -> Menu:
    choices = [(0, 1, 1)] + [(rng.randint(1, 4), rng.choice((1, 2, 4)), rng.choice(WIDTHS[1:])) for _ in range(n - 1)]
    aal = [1.0] + [1.0 + rng.uniform(0, 3) for _ in range(n - 1)]
    own = [rng.uniform(0, 0.5)] + [rng.uniform(0.5, 6) for _ in range(n - 1)]
    return Menu(tuple(choices), np.array(aal), np.array(own), np.array([c[2] for c in choices], dtype=np.int64))


def brute(menus, verify_ms, batch_rows) -> float:
    return max(rate(menus, p, verify_ms, batch_rows) for p in itertools.product(*(range(len(m.aal)) for m in menus)))


@pytest.mark.parametrize("seed", range(40))
def test_the_joint_choice_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    b = rng.randint(1, 4)
    menus = [random_menu(rng, rng.randint(1, 6)) if rng.random() < 0.85 else plain_menu(rng.uniform(0, 0.5))
             for _ in range(b)]
    rows = rng.choice([r for r in (1, 2, 4) if r >= b])
    fn = curve(rng)
    picks, r = joint_choice(menus, fn, rows)
    assert len(picks) == b and r == rate(menus, picks, fn, rows)
    assert r == brute(menus, fn, rows)


@pytest.mark.parametrize("seed", range(40))
def test_one_request_is_the_single_request_objective(seed):
    """At one request the joint choice is best_tree's tree where it beats a plain step, else plain."""
    rng = random.Random(100 + seed)
    fn = curve(rng)
    rows = [(d, wd, wv) for d in (1, 2, 3) for wd in (1, 2, 4) for wv in WIDTHS if rng.random() < 0.6]
    own = np.array([rng.uniform(0.5, 6) for _ in rows])
    vms = np.array([fn(r[2]) for r in rows])
    aal = np.array([1.0 if r[2] == 1 else 1.0 + rng.uniform(0, 2.5) for r in rows])
    plain = fn(1) + rng.uniform(0, 0.5)
    g = TreeChoices(rows, np.array([r[0] for r in rows]), aal, own + vms, vms,
                    np.array([r[2] for r in rows]), np.array([WIDTHS.index(r[2]) for r in rows]),
                    plain, {})
    i, s = best_tree(g.aal, g.step_ms, g.plain_ms)
    want = g.rows[i] if i >= 0 and s > 1.0 else (0, g.rows[0][1], 1)
    m = menu_of(g, fn(1))
    picks, _ = joint_choice([m], fn, 1)
    assert m.choices[picks[0]] == want


def test_trees_fall_back_to_plain_steps_as_the_batch_grows():
    """Identical requests whose tree pays alone: the chosen verify rows shrink as the batch grows,
    down to plain steps once the call's rows are past the curve's flat part."""
    def fn(rows):
        return 10.0 + 0.02 * min(rows, 16) + 1.2 * max(rows - 16, 0)

    m = Menu(((0, 1, 1), (2, 2, 4), (3, 4, 8)), np.array([1.0, 2.2, 2.9]), np.array([0.3, 2.0, 4.0]),
             np.array([1, 4, 8]))
    widths = []
    for b in (1, 2, 4, 8):
        picks, _ = joint_choice([m] * b, fn, b)
        widths.append(max(m.rows[p] for p in picks))
    assert widths[0] == 8 and widths[-1] == 1
    assert all(a >= b for a, b in zip(widths, widths[1:]))


def test_plain_requests_keep_plain_steps():
    rng = random.Random(5)
    menus = [plain_menu(0.2), random_menu(rng, 5)]
    picks, _ = joint_choice(menus, curve(rng), 2)
    assert picks[0] == 0
