"""Verification-width pruning: keep the best ``W_v``-node subtree containing the root.

The value of a kept set is the sum of its node values (for the latency objective, a node's value
is the probability that its whole path is accepted, so the sum is the expected accepted length
minus the bonus). Two solvers:

- :func:`prune_topk` (device-side): when values are monotone non-increasing along root-to-leaf
  paths, the ``W_v`` largest values already form a connected subtree containing the root (a node
  is never worth more than its parent, and ties are broken toward the shallower node), so a
  top-k is exact.
- :func:`prune_dp` (host, pure Python): the exact bottom-up tree-knapsack DP for arbitrary
  values, for offline use and to check the former.

Example: values ``[1, .5, .25, .5, .125]`` on the tree below, ``W_v = 3`` keeps ``{0, 1, 3}``,
re-indexed by :func:`subtree` as local nodes ``0, 1, 2``::

          0 (1)                       0
         /     \\                      |
      1 (.5)   2 (.25)     ->         1
      /    \\                          |
   3 (.5)  4 (.125)                   2
"""

from __future__ import annotations

from typing import Sequence

import torch

from yggtree.runtime.tree import Tree

__all__ = ["prune_topk", "subtree", "prune_dp", "prune_lists", "prune_for_verify"]


def prune_topk(tree: Tree, value: torch.Tensor, w_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``w_v`` valid nodes of highest value, in topological order. Device-side.

    Args:
        tree: the draft tree (N slots).
        value: [N] float, monotone non-increasing along root-to-leaf paths among valid nodes
            (e.g. path probability). The root is always kept, whatever its value.
        w_v: number of nodes to keep (static Python int).

    Returns:
        kept [w_v] int64 node indices, sorted by (depth, index) so the root comes first and every
        parent precedes its children; slots beyond the number of valid nodes are padding, set to
        0 (the root).
        kept_valid [w_v] bool, False for the padding.

    Selection order is (valid first, value descending, depth ascending, index ascending); with
    monotone values that makes the kept set closed under taking parents, even among ties.
    """
    n = tree.num_nodes
    dev = value.device
    idx = torch.arange(n, dtype=torch.int64, device=dev)
    val = torch.where(idx == 0, float("inf"), value.to(torch.float32))
    # lexicographic sort by stable passes, least significant key first
    order = torch.sort(tree.depth, stable=True).indices
    order = order[torch.sort(val[order], descending=True, stable=True).indices]
    valid_first = torch.sort(tree.valid[order].to(torch.uint8), descending=True, stable=True)
    order = order[valid_first.indices]
    if w_v > n:
        order = torch.cat([order, torch.zeros(w_v - n, dtype=torch.int64, device=dev)])
        ok = torch.cat([tree.valid[order[:n]], torch.zeros(w_v - n, dtype=torch.bool, device=dev)])
    else:
        ok = tree.valid[order]
    sel = order[:w_v]
    ok = ok[:w_v]
    # topological order: sort the selection by (valid first, depth, index)
    sel = torch.where(ok, sel, 0)
    key = torch.where(ok, tree.depth[sel] * n + sel, torch.iinfo(torch.int64).max)
    perm = torch.sort(key, stable=True).indices
    return sel[perm], ok[perm]


def subtree(tree: Tree, kept: torch.Tensor, kept_valid: torch.Tensor) -> Tree:
    """Re-index the kept nodes as a ``W_v``-slot tree (local parent indices). Device-side.

    ``kept`` must be topologically ordered with the root first and closed under parents (as
    returned by :func:`prune_topk`). Padded slots become invalid with parent 0, depth 0,
    token 0 and logp -inf.

    Args:
        tree: the draft tree (N slots).
        kept: [W] int64 node indices.
        kept_valid: [W] bool.

    Returns:
        a :class:`Tree` of W slots; slot i is node ``kept[i]`` of ``tree``.
    """
    n = tree.num_nodes
    w = kept.shape[0]
    dev = kept.device
    # global -> local map; padding writes go to a scratch slot n that is then dropped
    target = torch.where(kept_valid, kept, n)
    local = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    local = local.scatter(0, target, torch.arange(w, dtype=torch.int64, device=dev))[:n]
    parent = torch.where(kept_valid, local[tree.parent[kept]], 0)
    return Tree(
        token=torch.where(kept_valid, tree.token[kept], 0),
        parent=parent,
        depth=torch.where(kept_valid, tree.depth[kept], 0),
        valid=kept_valid,
        logp=torch.where(kept_valid, tree.logp[kept], float("-inf")),
    )


def prune_lists(tree: Tree, value: torch.Tensor, w_v: int, max_depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, Tree, torch.Tensor]:
    """:func:`prune_topk`, :func:`subtree` and the kept tree's
    :func:`~yggtree.runtime.tree.ancestor_mask` on the host: the tree read once into lists, the
    same keys, tie-breaks and padding in Python, the results as tensors (the same values as the
    three device-side functions). On a CPU a small tree costs fewer microseconds this way than
    the ~25 tensor ops of the device path. Returns kept [w_v], kept_valid [w_v], the kept tree
    (w_v slots) and its ancestor-or-self mask [w_v, w_v] (``max_depth`` as for ancestor_mask)."""
    token, parent, depth, valid = (t.tolist() for t in (tree.token, tree.parent, tree.depth, tree.valid))
    val = value.to(torch.float32).tolist()
    n = len(parent)
    val[0] = float("inf")  # the root is always kept
    order = sorted(range(n), key=lambda i: (not valid[i], -val[i], depth[i]))  # stable: index last
    if w_v > n:
        order += [0] * (w_v - n)
    ok = [i < n and valid[j] for i, j in enumerate(order[:w_v])]
    sel = [j if o else 0 for j, o in zip(order[:w_v], ok)]
    big = torch.iinfo(torch.int64).max
    perm = sorted(range(w_v), key=lambda i: depth[sel[i]] * n + sel[i] if ok[i] else big)
    kept, kept_ok = [sel[i] for i in perm], [ok[i] for i in perm]
    local = {j: i for i, (j, o) in enumerate(zip(kept, kept_ok)) if o}
    l_parent = [local[parent[j]] if o else 0 for j, o in zip(kept, kept_ok)]
    # ancestor-or-self rows: a kept node's chain up to the root (max_depth levels at most, as the
    # device path's table walks); an invalid row sees itself alone
    anc = [[False] * w_v for _ in range(w_v)]
    for i in range(w_v):
        if not kept_ok[i]:
            anc[i][i] = True
            continue
        u = i
        for _ in range(max_depth + 1):
            anc[i][u] = True
            u = l_parent[u]
    i64 = torch.int64
    lp = tree.logp.tolist()
    vtree = Tree(
        token=torch.tensor([token[j] if o else 0 for j, o in zip(kept, kept_ok)], dtype=i64),
        parent=torch.tensor(l_parent, dtype=i64),
        depth=torch.tensor([depth[j] if o else 0 for j, o in zip(kept, kept_ok)], dtype=i64),
        valid=torch.tensor(kept_ok, dtype=torch.bool),
        logp=torch.tensor([lp[j] if o else float("-inf") for j, o in zip(kept, kept_ok)], dtype=tree.logp.dtype),
    )
    return (torch.tensor(kept, dtype=i64), vtree.valid, vtree, torch.tensor(anc, dtype=torch.bool))


def prune_dp(
    parent: Sequence[int], value: Sequence[float], w_v: int, exact: bool = False
) -> tuple[float, tuple[int, ...]]:
    """Maximum-value connected subtree containing the root, with at most ``w_v`` nodes.

    Bottom-up tree knapsack: ``best[u][s]`` = the best value of a connected subtree rooted at
    ``u`` with exactly ``s`` nodes; children are merged one at a time (O(N * w_v^2)).

    Args:
        parent: parent of each node, ``parent[0] = 0`` (root); any node order.
        value: value of each node (any real numbers).
        w_v: size budget, >= 1.
        exact: require exactly ``min(w_v, N)`` nodes instead of at most ``w_v``.

    Returns:
        (best value, sorted tuple of the chosen node indices; always contains 0).

    >>> prune_dp([0, 0, 0, 1, 1], [1.0, 0.5, 0.25, 0.5, 0.125], 3)
    (2.0, (0, 1, 3))
    """
    n = len(parent)
    if n == 0 or len(value) != n or parent[0] != 0 or w_v < 1:
        raise ValueError("prune_dp: need a non-empty tree with parent[0] = 0 and w_v >= 1")
    cap = min(w_v, n)
    neg = float("-inf")
    children: list[list[int]] = [[] for _ in range(n)]
    for u in range(1, n):
        children[parent[u]].append(u)
    post: list[int] = []  # iterative post-order from the root
    stack = [(0, False)]
    while stack:
        u, done = stack.pop()
        if done:
            post.append(u)
        else:
            stack.append((u, True))
            stack.extend((c, False) for c in children[u])
    if len(post) != n:
        raise ValueError("prune_dp: parent does not describe a tree rooted at 0")

    best: list[list[float]] = [[] for _ in range(n)]
    # split[u][i][s] = nodes given to child i when u's subtree (children 0..i) has s nodes
    split: list[list[list[int]]] = [[] for _ in range(n)]
    for u in post:
        cur = [neg] * (cap + 1)
        cur[1] = float(value[u])
        for c in children[u]:
            bc = best[c]
            nxt = list(cur)
            choice = [0] * (cap + 1)
            for s in range(2, cap + 1):
                for t in range(1, s):
                    if cur[s - t] == neg or bc[t] == neg:
                        continue
                    cand = cur[s - t] + bc[t]
                    if cand > nxt[s]:
                        nxt[s], choice[s] = cand, t
            cur = nxt
            split[u].append(choice)
        best[u] = cur

    sizes = [cap] if exact else range(1, cap + 1)
    size = max(sizes, key=lambda s: (best[0][s], -s))  # ties: the smaller set
    chosen: list[int] = []
    todo = [(0, size)]
    while todo:
        u, s = todo.pop()
        chosen.append(u)
        for i in range(len(children[u]) - 1, -1, -1):
            t = split[u][i][s]
            if t:
                todo.append((children[u][i], t))
                s -= t
    return best[0][size], tuple(sorted(chosen))


def prune_for_verify(tree: Tree, value: torch.Tensor, w_v: int, max_depth: int
                     ) -> tuple[torch.Tensor, torch.Tensor, Tree, torch.Tensor]:
    """The ``w_v`` best nodes of ``tree`` by ``value`` as a step verifies them: their tree nodes,
    validity, the kept tree and its ancestor-or-self mask; on the host (:func:`prune_lists`) for a
    tree on a CPU, else on its device. What the engine runs and the profile times."""
    from .tree import ancestor_mask

    if tree.token.device.type == "cpu":
        return prune_lists(tree, value, w_v, max_depth)
    kept, kept_valid = prune_topk(tree, value, w_v)
    vtree = subtree(tree, kept, kept_valid)
    return kept, kept_valid, vtree, ancestor_mask(vtree.parent, vtree.depth, vtree.valid, max_depth)
