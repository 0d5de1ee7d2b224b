"""One candidate tree from two sources: the drafter's EGT tree and the lookup trie.

The lookup trie (:class:`~yggtree.runtime.lookup.Proposal`) is grafted onto the drafted tree
below its root. A lookup node whose token is already a valid child of the same tree node merges
with it (one node, source "both", its edge worth the better of the two); any other lookup node
takes a new slot after the drafted ones. Example, drafted tree ``0 -> a -> b`` and lookup chain
``a c``::

    drafted         lookup        merged (slots)            source
    0               0             0                         drafter (root)
    |               |             |  1 a                    both
    a               a             |  2 b  (below a)         drafter
    |               |             |  3 c  (below a, new)    lookup
    b               c

Every node's ``logp`` stays a path sum of edge log-probabilities on the drafter's scale: a lookup
edge enters with the caller's ``edge_logq`` (its calibrated acceptance turned into the drafter
probability the objective's calibration maps to it), a merged edge takes the larger of the two,
and descendants are re-summed. Values therefore never increase down a path and the verify-width
pruning (``prune_topk`` by ``logp``) still keeps a connected subtree: lookup nodes win the
slots weaker drafter nodes would otherwise get.

Host-side (the trees are small); the output has ``N + budget`` slots whatever was merged.
"""

from __future__ import annotations

import torch

from .lookup import Proposal
from .tree import Tree

__all__ = ["SOURCE_DRAFTER", "SOURCE_LOOKUP", "SOURCE_BOTH", "SOURCE_NAMES", "merge_lookup", "root_tree"]

SOURCE_DRAFTER, SOURCE_LOOKUP, SOURCE_BOTH = 0, 1, 2
SOURCE_NAMES = ("drafter", "lookup", "both")


def root_tree(root: torch.Tensor) -> Tree:
    """The tree of a step without drafter calls: the root alone (1 slot)."""
    return Tree(
        token=root.reshape(1).to(torch.int64),
        parent=torch.zeros(1, dtype=torch.int64),
        depth=torch.zeros(1, dtype=torch.int64),
        valid=torch.ones(1, dtype=torch.bool),
        logp=torch.zeros(1, dtype=torch.float32),
    )


def merge_lookup(tree: Tree, prop: Proposal, edge_logq: list[float], budget: int) -> tuple[Tree, torch.Tensor]:
    """Graft ``prop`` onto ``tree`` (N slots). Returns the merged tree (N + budget slots; unused
    slots invalid) and the source of every slot ([N + budget] int64: SOURCE_DRAFTER for drafted
    nodes, the root and padding, SOURCE_LOOKUP, SOURCE_BOTH).

    ``edge_logq[i]`` (<= 0) is lookup node i's edge log-probability on the drafter's scale;
    ``len(prop) <= budget``."""
    if len(prop) > budget or len(edge_logq) != len(prop):
        raise ValueError(f"merge_lookup: {len(prop)} lookup nodes for a budget of {budget}")
    n = tree.num_nodes
    size = n + budget
    tok = tree.token.tolist() + [0] * budget
    par = tree.parent.tolist() + [0] * budget
    dep = tree.depth.tolist() + [0] * budget
    ok = tree.valid.tolist() + [False] * budget
    lp = tree.logp.tolist()
    edge = [lp[u] - lp[par[u]] if ok[u] and u else 0.0 for u in range(n)] + [0.0] * budget
    src = [SOURCE_DRAFTER] * size
    child = {(par[u], tok[u]): u for u in range(n - 1, 0, -1) if ok[u]}  # lowest slot wins
    slot = [0]  # lookup node j - 1 lives in tree slot slot[j]; slot[0] is the root
    free = n
    for t, p, lq in zip(prop.token, prop.parent, edge_logq):
        ps = slot[p]
        u = child.get((ps, t))
        if u is None:
            u, free = free, free + 1
            tok[u], par[u], dep[u], ok[u], edge[u], src[u] = t, ps, dep[ps] + 1, True, min(lq, 0.0), SOURCE_LOOKUP
            child[(ps, t)] = u
        else:
            edge[u] = max(edge[u], min(lq, 0.0))
            src[u] = SOURCE_LOOKUP if src[u] == SOURCE_LOOKUP else SOURCE_BOTH
        slot.append(u)
    # parents precede children (EGT fills slots in draft order, lookup slots come after)
    out_lp = [0.0] * size
    for u in range(1, size):
        out_lp[u] = out_lp[par[u]] + edge[u] if ok[u] else float("-inf")
    merged = Tree(
        token=torch.tensor(tok, dtype=torch.int64),
        parent=torch.tensor(par, dtype=torch.int64),
        depth=torch.tensor(dep, dtype=torch.int64),
        valid=torch.tensor(ok, dtype=torch.bool),
        logp=torch.tensor(out_lp, dtype=torch.float32),
    )
    return merged, torch.tensor(src, dtype=torch.int64)
