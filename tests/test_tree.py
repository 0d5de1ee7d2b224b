"""Tree tensors: closed forms on full trees, properties on random trees, invariant checks, and
tree attention == per-path causal attention."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from yggtree.runtime.tree import (
    Tree,
    TreeInvariantError,
    ancestor_mask,
    ancestor_table,
    build_tree,
    check_invariants,
    positions,
)

# ---------------------------------------------------------------- helpers


def full_tree_parents(k: int, levels: int) -> list[int]:
    """Parents of a full k-ary tree with ``levels`` levels below the root, in BFS order.

    Node i >= 1 has parent (i - 1) // k (heap layout)."""
    n = sum(k**l for l in range(levels + 1))
    return [0] + [(i - 1) // k for i in range(1, n)]


def random_tree(seed: int, n_valid: int, n_pad: int, shuffle: bool) -> Tree:
    """A random tree with n_valid valid nodes and n_pad padded slots scattered among them.

    Padded slots get an arbitrary parent (another padded slot or a valid node, acyclic) and a
    garbage depth, to prove nothing downstream reads them."""
    rng = random.Random(seed)
    n = n_valid + n_pad
    # generation order: root first, then valid nodes, then padded ones
    gen_parent = [0] + [rng.randrange(g) for g in range(1, n_valid)]
    gen_parent += [rng.randrange(g) for g in range(n_valid, n)]
    label = list(range(1, n))
    if shuffle:
        rng.shuffle(label)
    label = [0] + label  # generation position -> slot index
    parent = [0] * n
    valid = [False] * n
    depth = [0] * n
    gen_depth = [0] * n
    for g in range(1, n):
        gen_depth[g] = gen_depth[gen_parent[g]] + 1
    for g in range(n):
        parent[label[g]] = label[gen_parent[g]]
        valid[label[g]] = g < n_valid
        depth[label[g]] = gen_depth[g] if g < n_valid else rng.randrange(0, 2 * n + 3)
    token = [rng.randrange(100) for _ in range(n)]
    logp = [0.0 if i == 0 else -rng.random() * depth[i] for i in range(n)]
    logp = [lp if v else float("-inf") for lp, v in zip(logp, valid)]
    return Tree(
        token=torch.tensor(token),
        parent=torch.tensor(parent),
        depth=torch.tensor(depth),
        valid=torch.tensor(valid),
        logp=torch.tensor(logp, dtype=torch.float32),
    )


def brute_ancestors(parent: list[int], i: int) -> set[int]:
    out = {i}
    while i != 0:
        i = parent[i]
        out.add(i)
    return out


tree_params = st.tuples(
    st.integers(0, 2**31 - 1), st.integers(1, 10), st.integers(0, 4), st.booleans()
)

# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("k,levels", [(2, 3), (3, 2), (1, 5)])
def test_full_tree_mask_closed_form(k: int, levels: int) -> None:
    parent = full_tree_parents(k, levels)
    tree = build_tree(parent, list(range(len(parent))))
    check_invariants(tree)
    n = len(parent)
    # heap layout: j is an ancestor-or-self of i iff repeatedly mapping i -> (i-1)//k hits j
    if k == 1:
        expected = torch.tril(torch.ones(n, n, dtype=torch.bool))
    else:
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            a = i
            while True:
                expected[i, a] = True
                if a == 0:
                    break
                a = (a - 1) // k
    # closed form of depth in the heap layout: floor(log_k((k-1) i + 1))
    if k > 1:
        want_depth = [int(math.floor(math.log((k - 1) * i + 1, k) + 1e-9)) for i in range(n)]
        assert tree.depth.tolist() == want_depth
    m = ancestor_mask(tree.parent, tree.depth, tree.valid, levels)
    assert torch.equal(m, expected)
    # each row has depth + 1 ancestors-or-self; the root column is all True
    assert torch.equal(m.sum(1), tree.depth + 1)
    assert bool(m[:, 0].all())


def test_docstring_example() -> None:
    tree = build_tree([0, 0, 0, 1], [5, 6, 7, 8], size=5)
    a = ancestor_table(tree.parent, 2)
    assert a.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]
    m = ancestor_mask(tree.parent, tree.depth, tree.valid, 2)
    assert m.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    pos = positions(tree.depth, torch.tensor(10))
    assert pos.tolist() == [10, 11, 11, 12, 10]


def test_device_side_on_meta() -> None:
    """The device-side functions run on meta tensors, so they cannot branch on data."""
    n = 7
    parent = torch.zeros(n, dtype=torch.int64, device="meta")
    depth = torch.zeros(n, dtype=torch.int64, device="meta")
    valid = torch.zeros(n, dtype=torch.bool, device="meta")
    assert ancestor_table(parent, 3).shape == (4, n)
    assert ancestor_mask(parent, depth, valid, 3).shape == (n, n)
    assert positions(depth, torch.tensor(3, device="meta")).shape == (n,)


# ---------------------------------------------------------------- random trees


@settings(max_examples=60, deadline=None)
@given(tree_params)
def test_random_tree_mask_properties(params) -> None:
    seed, n_valid, n_pad, shuffle = params
    tree = random_tree(seed, n_valid, n_pad, shuffle)
    check_invariants(tree)
    n = tree.num_nodes
    parent = tree.parent.tolist()
    valid = tree.valid.tolist()
    max_depth = max(d for d, v in zip(tree.depth.tolist(), valid) if v)
    m = ancestor_mask(tree.parent, tree.depth, tree.valid, max_depth)
    for i in range(n):
        if valid[i]:
            want = brute_ancestors(parent, i)
        else:
            want = {i}
        assert {j for j in range(n) if m[i, j]} == want
    eye = torch.eye(n, dtype=torch.bool)
    # the diagonal is always set; off the diagonal the relation is antisymmetric
    assert bool(m[eye].all())
    assert not bool((m & m.t() & ~eye).any())
    # valid rows and valid columns never touch invalid ones
    v = tree.valid
    assert not bool(m[v][:, ~v].any()) and not bool(m[~v][:, v].any())
    # transitivity: ancestors of ancestors are ancestors (boolean matrix product)
    mm = (m.float() @ m.float()) > 0
    assert torch.equal(mm, m)
    # positions
    cl = torch.tensor(17)
    assert torch.equal(positions(tree.depth, cl), tree.depth + 17)
    # ancestor table rows follow the recursion
    a = ancestor_table(tree.parent, max_depth)
    for l in range(max_depth):
        assert torch.equal(a[l + 1], tree.parent[a[l]])


# ---------------------------------------------------------------- invariants


def _mutate(tree: Tree, **fields) -> Tree:
    d = {f: getattr(tree, f).clone() for f in ("token", "parent", "depth", "valid", "logp")}
    for name, (idx, value) in fields.items():
        d[name][idx] = value
    return Tree(**d)


BASE = build_tree([0, 0, 0, 1, 1, 2], [1, 2, 3, 4, 5, 6], size=8)


def test_base_tree_is_valid() -> None:
    check_invariants(BASE)


@pytest.mark.parametrize(
    "fields,pattern",
    [
        ({"parent": (3, -1)}, r"'parent range' violated at node 3: parent -1"),
        ({"parent": (4, 8)}, r"'parent range' violated at node 4: parent 8 is outside \[0, 8\)"),
        ({"parent": (7, 9)}, r"'parent range' violated at node 7"),  # padded slots too
        ({"parent": (1, 3)}, r"'acyclicity' violated at node 1"),  # 1 -> 3 -> 1
        ({"parent": (5, 5)}, r"'acyclicity' violated at node 5"),  # self loop
        ({"valid": (1, False)}, r"'validity closure' violated at node 3: parent 1 is invalid"),
        ({"depth": (4, 3)}, r"'depth consistency' violated at node 4: depth 3 but parent 1"),
        ({"depth": (2, 0)}, r"'depth consistency' violated at node 2"),
        ({"valid": (0, False)}, r"'root' violated at node 0: the root is invalid"),
        ({"depth": (0, 1)}, r"'root' violated at node 0"),
        ({"parent": (0, 2)}, r"'root' violated at node 0"),
        ({"logp": (0, -0.5)}, r"'logp' violated at node 0"),
        ({"logp": (4, float("nan"))}, r"'logp' violated at node 4: logp is NaN"),
        ({"logp": (6, 0.0)}, r"'logp' violated at node 6: padded slot"),
    ],
)
def test_check_invariants_rejects(fields, pattern) -> None:
    bad = _mutate(BASE, **fields)
    with pytest.raises(TreeInvariantError, match=pattern):
        check_invariants(bad)


def test_check_invariants_rejects_wrong_dtype_and_is_value_error() -> None:
    bad = Tree(BASE.token, BASE.parent.int(), BASE.depth, BASE.valid, BASE.logp)
    with pytest.raises(ValueError, match=r"'shape' violated at node 0: field parent"):
        check_invariants(bad)


def test_padded_depth_is_not_checked() -> None:
    check_invariants(_mutate(BASE, depth=(7, 42)))


# ---------------------------------------------------------------- tree attention reference


def tree_attention(q, k, v, kp, vp, mask):
    """softmax(Q [K_prefix; K_tree]^T / sqrt(d) + mask) [V_prefix; V_tree] for tree queries."""
    n, d = q.shape
    keys = torch.cat([kp, k])
    vals = torch.cat([vp, v])
    full = torch.cat([torch.ones(n, kp.shape[0], dtype=torch.bool), mask], dim=1)
    scores = (q @ keys.t()) / math.sqrt(d)
    scores = scores.masked_fill(~full, float("-inf"))
    return torch.softmax(scores, dim=-1) @ vals


@settings(max_examples=40, deadline=None)
@given(tree_params, st.integers(0, 5))
def test_tree_attention_equals_per_path_causal_attention(params, prefix_len) -> None:
    seed, n_valid, n_pad, shuffle = params
    tree = random_tree(seed, n_valid, n_pad, shuffle)
    n, d = tree.num_nodes, 8
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    # padded slots carry huge garbage: they must not leak into valid nodes
    pad = ~tree.valid
    k = torch.where(pad[:, None], torch.full_like(k, 1e3), k)
    v = torch.where(pad[:, None], torch.full_like(v, -1e3), v)
    qp, kp, vp = (torch.randn(prefix_len, d, generator=g, dtype=torch.float64) for _ in range(3))
    valid = tree.valid.tolist()
    max_depth = max(dd for dd, vv in zip(tree.depth.tolist(), valid) if vv)
    mask = ancestor_mask(tree.parent, tree.depth, tree.valid, max_depth)
    out = tree_attention(q, k, v, kp, vp, mask)
    assert not bool(out.isnan().any())

    parent = tree.parent.tolist()
    children = {p for i, p in enumerate(parent) if valid[i] and i != 0}
    leaves = [i for i in range(n) if valid[i] and i not in children]
    for leaf in leaves:
        path = [leaf]
        while path[-1] != 0:
            path.append(parent[path[-1]])
        path.reverse()
        idx = torch.tensor(path)
        seq_q = torch.cat([qp, q[idx]])[None, None]
        seq_k = torch.cat([kp, k[idx]])[None, None]
        seq_v = torch.cat([vp, v[idx]])[None, None]
        ref = F.scaled_dot_product_attention(seq_q, seq_k, seq_v, is_causal=True)[0, 0]
        torch.testing.assert_close(out[idx], ref[prefix_len:], rtol=1e-10, atol=1e-10)
