"""Pruning: the knapsack DP equals brute force for arbitrary values; device top-k equals the DP
for path-monotone values; kept sets are connected, contain the root and re-index correctly."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yggtree.runtime.prune import prune_dp, prune_topk, subtree
from yggtree.runtime.tree import Tree, ancestor_mask, build_tree, check_invariants


def prune_bruteforce(
    parent: list[int], value: list[float], w_v: int, exact: bool = False
) -> float:
    """Best value over every connected root-containing subset of size <= w_v (== if exact)."""
    n = len(parent)
    best = -math.inf
    size = min(w_v, n)
    for mask in range(1 << (n - 1)):
        nodes = [0] + [i for i in range(1, n) if mask >> (i - 1) & 1]
        if len(nodes) > w_v or (exact and len(nodes) != size):
            continue
        s = set(nodes)
        if all(parent[i] in s for i in nodes):
            best = max(best, sum(value[i] for i in nodes))
    return best


def random_parents(seed: int, n: int) -> list[int]:
    """A random tree on n nodes with root 0 and the other labels shuffled (not topological)."""
    rng = random.Random(seed)
    gen_parent = [0] + [rng.randrange(g) for g in range(1, n)]
    label = [0] + rng.sample(range(1, n), n - 1)
    parent = [0] * n
    for g in range(n):
        parent[label[g]] = label[gen_parent[g]]
    return parent


def is_connected_with_root(parent: list[int], nodes) -> bool:
    s = set(nodes)
    return 0 in s and all(parent[i] in s for i in s)


small_real = st.floats(-10, 10, allow_nan=False, width=32)


@settings(max_examples=75, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**31 - 1), st.integers(1, 10), st.data())
def test_dp_equals_bruteforce(n, seed, w_v, data) -> None:
    parent = random_parents(seed, n)
    value = data.draw(st.lists(small_real, min_size=n, max_size=n))
    for exact in (False, True):
        best, nodes = prune_dp(parent, value, w_v, exact=exact)
        assert best == pytest.approx(prune_bruteforce(parent, value, w_v, exact), abs=1e-9)
        assert is_connected_with_root(parent, nodes)
        assert len(nodes) <= w_v and (not exact or len(nodes) == min(w_v, n))
        assert sum(value[i] for i in nodes) == pytest.approx(best, abs=1e-9)


def test_dp_example_and_errors() -> None:
    assert prune_dp([0, 0, 0, 1, 1], [1.0, 0.5, 0.25, 0.5, 0.125], 3) == (2.0, (0, 1, 3))
    # negative values: "at most" stops early, "exact" must pay for them
    assert prune_dp([0, 0, 1], [1.0, -1.0, 5.0], 3) == (5.0, (0, 1, 2))
    assert prune_dp([0, 0, 1], [1.0, -1.0, -5.0], 3) == (1.0, (0,))
    assert prune_dp([0, 0, 1], [1.0, -1.0, -5.0], 3, exact=True) == (-5.0, (0, 1, 2))
    with pytest.raises(ValueError):
        prune_dp([0, 2, 1], [1.0, 1.0, 1.0], 2)  # 1 <-> 2 is a cycle, unreachable from 0


def monotone_tree(seed: int, n_valid: int, n_pad: int, factors: list[float]):
    """Random tree with padded slots; value = product of per-edge factors in [0, 1]."""
    rng = random.Random(seed)
    parent = random_parents(seed, n_valid)
    order = [0]  # a topological order to compute products
    children = {i: [j for j in range(1, n_valid) if parent[j] == i] for i in range(n_valid)}
    for u in order:
        order.extend(children[u])
    value = [1.0] * n_valid
    for u in order[1:]:
        value[u] = value[parent[u]] * factors[u]
    tree = build_tree(parent, [rng.randrange(50) for _ in range(n_valid)],
                      logp=[math.log(v) if v > 0 else -1e30 for v in value],
                      size=n_valid + n_pad)
    # padded slots get garbage values that would win a naive top-k
    vals = torch.tensor(value + [2.0] * n_pad, dtype=torch.float32)
    return tree, parent, value, vals


@settings(max_examples=75, deadline=None)
@given(
    st.integers(1, 9), st.integers(0, 3), st.integers(0, 2**31 - 1), st.integers(1, 13),
    st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0, 1, width=32),
             min_size=9, max_size=9),
)
def test_topk_equals_dp_for_monotone_values(n_valid, n_pad, seed, w_v, factors) -> None:
    tree, parent, value, vals = monotone_tree(seed, n_valid, n_pad, factors)
    kept, ok = prune_topk(tree, vals, w_v)
    assert kept.shape == (w_v,) and ok.shape == (w_v,)
    nodes = kept[ok].tolist()
    assert int(ok.sum()) == min(w_v, n_valid)
    assert bool(ok[: int(ok.sum())].all())  # padding only at the end
    assert kept[~ok].eq(0).all()
    assert nodes[0] == 0 and len(set(nodes)) == len(nodes)
    assert is_connected_with_root(parent, nodes)
    # topological: parents before children, sorted by (depth, index)
    pos = {u: i for i, u in enumerate(nodes)}
    assert all(pos[parent[u]] < pos[u] for u in nodes[1:])
    depth = tree.depth.tolist()
    assert [(depth[u], u) for u in nodes] == sorted((depth[u], u) for u in nodes)
    best, _ = prune_dp(parent, value, w_v)
    got = sum(value[u] for u in nodes)
    assert got == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert got == pytest.approx(prune_bruteforce(parent, value, w_v), rel=1e-6, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(0, 3), st.integers(0, 2**31 - 1), st.integers(1, 13),
       st.lists(st.floats(0.0625, 1, width=32), min_size=9, max_size=9))
def test_subtree_reindexes(n_valid, n_pad, seed, w_v, factors) -> None:
    tree, parent, _, vals = monotone_tree(seed, n_valid, n_pad, factors)
    kept, ok = prune_topk(tree, vals, w_v)
    sub = subtree(tree, kept, ok)
    check_invariants(sub)
    assert sub.num_nodes == w_v
    assert torch.equal(sub.valid, ok)
    kl = kept.tolist()
    for i in range(w_v):
        if ok[i]:
            assert kl[int(sub.parent[i])] == parent[kl[i]] or i == 0
            assert sub.token[i] == tree.token[kl[i]] and sub.logp[i] == tree.logp[kl[i]]
            assert sub.depth[i] == tree.depth[kl[i]]
        else:
            assert sub.parent[i] == 0 and sub.depth[i] == 0 and sub.logp[i] == -math.inf
    # the ancestor relation is the original one restricted to the kept nodes
    m = ancestor_mask(sub.parent, sub.depth, sub.valid, w_v)
    big = ancestor_mask(tree.parent, tree.depth, tree.valid, tree.num_nodes)
    v = ok.nonzero().flatten()
    assert torch.equal(m[v][:, v], big[kept[v]][:, kept[v]])


def test_docstring_example() -> None:
    tree = build_tree([0, 0, 0, 1, 1], [10, 11, 12, 13, 14])
    kept, ok = prune_topk(tree, torch.tensor([1.0, 0.5, 0.25, 0.5, 0.125]), 3)
    assert kept.tolist() == [0, 1, 3] and ok.all()
    sub = subtree(tree, kept, ok)
    assert sub.parent.tolist() == [0, 0, 1] and sub.token.tolist() == [10, 11, 13]


def test_root_kept_whatever_its_value() -> None:
    tree = build_tree([0, 0], [1, 2])
    kept, ok = prune_topk(tree, torch.tensor([-5.0, 3.0]), 1)
    assert kept.tolist() == [0] and ok.tolist() == [True]


def test_device_side_on_meta() -> None:
    n, w = 9, 4
    m = "meta"
    tree = Tree(
        token=torch.zeros(n, dtype=torch.long, device=m),
        parent=torch.zeros(n, dtype=torch.long, device=m),
        depth=torch.zeros(n, dtype=torch.long, device=m),
        valid=torch.zeros(n, dtype=torch.bool, device=m),
        logp=torch.zeros(n, device=m),
    )
    for w_v in (w, n + 3):
        kept, ok = prune_topk(tree, torch.zeros(n, device=m), w_v)
        sub = subtree(tree, kept, ok)
        assert sub.token.shape == (w_v,) and sub.token.device.type == "meta"


def test_bruteforce_is_itself_sane() -> None:
    # path 0-1-2 with values 1, 2, 3; budget 2 -> {0, 1}
    assert prune_bruteforce([0, 0, 1], [1.0, 2.0, 3.0], 2) == 3.0
    assert prune_bruteforce([0, 0, 1], [1.0, 2.0, 3.0], 3) == 6.0
    # enumerate all subsets once more by itertools for a star
    parent, value = [0, 0, 0, 0], [0.0, 1.0, -1.0, 2.0]
    want = max(
        sum(value[i] for i in (0,) + c)
        for r in range(0, 3)
        for c in itertools.combinations(range(1, 4), r)
    )
    assert prune_bruteforce(parent, value, 3) == want == 3.0


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 12), st.integers(0, 4), st.integers(0, 2**31 - 1), st.integers(1, 16),
    st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0, 1, width=32), min_size=12, max_size=12),
    st.booleans(),
)
def test_host_prune_equals_the_device_path(n_valid, n_pad, seed, w_v, factors, by_logp) -> None:
    """prune_lists gives prune_topk's kept nodes, subtree's tree and ancestor_mask's mask,
    exactly (ties among equal values included: factors 1.0 and 0.0 make many), by the tree's own
    path log-probabilities as the engine prunes and by other monotone values."""
    from yggtree.runtime.prune import prune_lists

    tree, _, _, vals = monotone_tree(seed, n_valid, n_pad, factors)
    value = tree.logp if by_logp else vals
    max_depth = max(int(tree.depth.max()), 1)
    kept, ok = prune_topk(tree, value, w_v)
    sub = subtree(tree, kept, ok)
    anc = ancestor_mask(sub.parent, sub.depth, sub.valid, max_depth)
    h_kept, h_ok, h_sub, h_anc = prune_lists(tree, value, w_v, max_depth)
    assert torch.equal(h_kept, kept) and torch.equal(h_ok, ok) and torch.equal(h_anc, anc)
    for f in ("token", "parent", "depth", "valid", "logp"):
        a, b = getattr(h_sub, f), getattr(sub, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
