"""Equal-Growth Tree (EGT) drafting: the tree grows by exactly ``W_d`` nodes per drafter call.

State: a :class:`~yggtree.runtime.tree.Tree` of ``N = 1 + D_max * W_d`` slots and a fixed-size
candidate pool of ``P = N * k`` slots. Pool slots ``u*k .. u*k + k-1`` hold the drafter's top-k
children of tree node ``u`` (empty, score -inf, until ``u`` has been fed to the drafter). Step
``s`` (0-based) picks the ``W_d`` best candidates of the whole pool by path score
``logp[parent] + log q(child)``, writes them to tree slots ``1 + s*W_d .. (s+1)*W_d`` and marks
them consumed; the caller feeds those nodes to the drafter in one call and passes the returned
top-k back to :func:`egt_expand`.

Example, k = 2, W_d = 2, root children scores a=-0.1, b=-1.0; after step 0 both are nodes 1, 2.
The drafter returns children of 1 with log q (-0.2, -3.0) and of 2 with (-0.1, -2.0)::

    pool after expand:  1a: -0.3   1b: -3.1   2a: -1.1   2b: -3.0
    step 1 picks -0.3 (child of 1) and -1.1 (child of 2):

            0
           / \\
          1   2        nodes 1, 2  (step 0)
          |   |
          3   4        nodes 3, 4  (step 1)

Picks are not restricted to the last level: had node 2's children scored below 1b, step 1 would
have taken both children of node 1.

Tie-breaking is deterministic: candidates are ordered by score (descending) with a *stable*
sort, so among equal scores the lower pool slot wins, i.e. the child of the lower tree node, then
the child the drafter ranked first. With equal child log-probs everywhere this is BFS order,
which is how a full k-ary tree comes out of the same code (and W_d = k = 1 gives a chain).

All functions here are device-side: no host synchronisation, static shapes given the Python
ints (``d_max``, ``w_d``, ``k``, ``step``). :func:`draft_tree` is the drafting loop that runs them
with a drafter (a speculation step's draft, and the overlap plan's worker); on a CPU it runs the
same steps on the host, in numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from yggtree.runtime.tree import Tree, ancestor_mask, positions

if TYPE_CHECKING:
    from yggtree.runtime.drafters import TopK

__all__ = ["EGTState", "egt_init", "egt_select", "egt_expand", "egt_feed_inputs", "draft_tree"]


@dataclass(frozen=True)
class EGTState:
    """Drafting state of one EGT step sequence.

    ``N = 1 + d_max * w_d`` tree slots, ``P = N * k`` pool slots. Unfilled tree slots are invalid
    (parent 0, depth 0, token 0, logp -inf).
    """

    tree: Tree  # N slots; slot 0 is the root
    cand_token: torch.Tensor  # [P] int64, candidate token; pool slot p belongs to node p // k
    cand_parent: torch.Tensor  # [P] int64, tree node the candidate would attach to (= p // k)
    cand_score: torch.Tensor  # [P] float32, path log-prob; -inf = empty or consumed
    d_max: int  # maximum number of drafter calls (static)
    w_d: int  # nodes added per drafter call (static)
    k: int  # children per fed node (static)


def egt_init(
    root_token: torch.Tensor,
    root_topk_token: torch.Tensor,
    root_topk_logp: torch.Tensor,
    d_max: int,
    w_d: int,
) -> EGTState:
    """Start a draft tree at the root with its top-k children in the pool.

    Args:
        root_token: [] int64, the last committed token.
        root_topk_token: [k] int64, the drafter's top-k next tokens after the root.
        root_topk_logp: [k] float, their log-probs.
        d_max: maximum number of drafter calls (tree slots = 1 + d_max * w_d).
        w_d: nodes per drafter call.
    """
    if d_max < 0 or w_d < 1:
        raise ValueError(f"egt_init: need d_max >= 0 and w_d >= 1, got {d_max}, {w_d}")
    dev = root_topk_token.device
    k = root_topk_token.shape[0]
    n = 1 + d_max * w_d
    p = n * k
    is_root = torch.arange(n, device=dev) == 0
    tree = Tree(
        token=torch.where(is_root, root_token.to(torch.int64), 0),
        parent=torch.zeros(n, dtype=torch.int64, device=dev),
        depth=torch.zeros(n, dtype=torch.int64, device=dev),
        valid=is_root,
        logp=torch.where(is_root, 0.0, float("-inf")).to(torch.float32),
    )
    empty = torch.full((p - k,), float("-inf"), dtype=torch.float32, device=dev)
    return EGTState(
        tree=tree,
        cand_token=torch.cat(
            [root_topk_token.to(torch.int64), torch.zeros(p - k, dtype=torch.int64, device=dev)]
        ),
        cand_parent=torch.arange(p, dtype=torch.int64, device=dev) // k,
        cand_score=torch.cat([root_topk_logp.to(torch.float32), empty]),
        d_max=d_max,
        w_d=w_d,
        k=k,
    )


def _write(t: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
    return torch.slice_scatter(t, new, dim=0, start=start, end=start + new.shape[0])


def egt_select(state: EGTState, step: int) -> tuple[EGTState, torch.Tensor]:
    """Draft step ``step``: move the ``w_d`` best pool candidates into the tree.

    Args:
        state: current state.
        step: 0-based step index (static Python int, ``0 <= step < d_max``).

    Returns:
        (new state, fed_idx [w_d] int64 = the tree slots written, ``1 + step*w_d + arange(w_d)``).
        If fewer than ``w_d`` finite candidates remain, the extra slots stay invalid (they are
        still returned in ``fed_idx``; feed them anyway, their outputs are ignored).
    """
    if not 0 <= step < state.d_max:
        raise ValueError(f"egt_select: step {step} outside [0, {state.d_max})")
    w = state.w_d
    dev = state.cand_score.device
    score_sorted, order = torch.sort(state.cand_score, descending=True, stable=True)
    # P = N * k >= N > w, so there are always w pool slots to pick from
    pick = order[:w]  # [w] pool slots, distinct
    score = score_sorted[:w]  # [w]
    ok = score > float("-inf")  # [w]
    parent = torch.where(ok, state.cand_parent[pick], 0)
    tree = state.tree
    start = 1 + step * w
    new_tree = Tree(
        token=_write(tree.token, torch.where(ok, state.cand_token[pick], 0), start),
        parent=_write(tree.parent, parent, start),
        depth=_write(tree.depth, torch.where(ok, tree.depth[parent] + 1, 0), start),
        valid=_write(tree.valid, ok, start),
        logp=_write(tree.logp, torch.where(ok, score, float("-inf")), start),
    )
    consumed = torch.full((w,), float("-inf"), dtype=torch.float32, device=dev)
    cand_score = state.cand_score.scatter(0, pick, consumed)
    fed_idx = torch.arange(start, start + w, dtype=torch.int64, device=dev)
    return replace(state, tree=new_tree, cand_score=cand_score), fed_idx


def egt_expand(
    state: EGTState, fed_idx: torch.Tensor, topk_token: torch.Tensor, topk_logp: torch.Tensor
) -> EGTState:
    """Add the drafter's top-k children of the fed nodes to the pool.

    Args:
        state: state returned by :func:`egt_select`.
        fed_idx: [w_d] int64 tree slots that were fed (as returned by :func:`egt_select`).
        topk_token: [w_d, k] int64, top-k next tokens after each fed node.
        topk_logp: [w_d, k] float, their log-probs under the drafter.

    Candidate score = ``logp[node] + topk_logp``; children of invalid nodes get -inf.
    """
    k = state.k
    node_logp = state.tree.logp[fed_idx]  # [w_d], -inf for invalid nodes
    ok = state.tree.valid[fed_idx]  # [w_d]
    child = node_logp[:, None] + topk_logp.to(torch.float32)  # [w_d, k]
    score = torch.where(ok[:, None], child, float("-inf"))
    slots = (fed_idx[:, None] * k + torch.arange(k, device=fed_idx.device)).reshape(-1)
    return replace(
        state,
        cand_token=state.cand_token.scatter(0, slots, topk_token.to(torch.int64).reshape(-1)),
        cand_score=state.cand_score.scatter(0, slots, score.reshape(-1)),
    )


def egt_feed_inputs(
    state: EGTState, fed_idx: torch.Tensor, committed_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the drafter call for ``fed_idx`` needs: tokens, positions and mask rows.

    Returns:
        tokens [w_d] int64, positions [w_d] int64 (``committed_len + depth``), and
        mask [w_d, N] bool: row i = the tree nodes fed node ``fed_idx[i]`` attends to (its
        ancestors and itself; an invalid fed node sees only itself). The caller adds the
        committed prefix.
    """
    tree = state.tree
    mask = ancestor_mask(tree.parent, tree.depth, tree.valid, state.d_max)
    return tree.token[fed_idx], positions(tree.depth, committed_len)[fed_idx], mask[fed_idx]


def draft_tree(drafter, root: torch.Tensor, head: TopK, d: int, wd: int, L: torch.Tensor, k: int
               ) -> tuple[Tree, int]:
    """D levels of EGT from ``head`` at ``root`` (position ``L``): every level picks W_d nodes
    and the drafter proposes the top-k children of each. Returns the tree (``1 + d * wd`` slots)
    and the drafter calls made. On a CPU the levels' bookkeeping runs on the host
    (:func:`_draft_tree_host`, the same tree bit for bit): there every tensor operation costs its
    dispatch, a few microseconds, against a few nanoseconds of work on tensors of a dozen
    nodes, and a level's ~60 of them cost as much as the drafter call itself."""
    if root.device.type == "cpu":
        return _draft_tree_host(drafter, root, head, d, wd, L, k)
    return _draft_tree_device(drafter, root, head, d, wd, L, k)


def _draft_tree_device(drafter, root: torch.Tensor, head: TopK, d: int, wd: int, L: torch.Tensor, k: int
                       ) -> tuple[Tree, int]:
    """:func:`draft_tree` on the device: the tensor functions above, no host synchronisation."""
    state = egt_init(root, head.token[0], head.logp[0], d, wd)
    for s in range(d):
        state, fed = egt_select(state, s)  # fed [W_d] int64: the tree slots just written
        if s == d - 1 and not drafter.feeds_leaves:
            break  # the children of the last level would never be picked
        tokens, pos, rows = egt_feed_inputs(state, fed, L)
        top = drafter.step(tokens, pos - L, fed, state.tree.parent[fed], rows, L, k)  # [W_d, k]
        state = egt_expand(state, fed, top.token, top.logp)
    return state.tree, d - 1 + int(drafter.feeds_leaves)


def _draft_tree_host(drafter, root: torch.Tensor, head: TopK, d: int, wd: int, L: torch.Tensor, k: int
                     ) -> tuple[Tree, int]:
    """:func:`draft_tree` with the EGT state in Python lists: the same picks (a stable sort of the
    pool's scores, descending), the same float32 path scores (each sum of two float32 values taken
    in float64, then rounded to float32: exactly float32's sum, as float64 holds more than twice
    float32's digits), the same drafter inputs (tests/test_egt.py checks every one against the
    tensor functions). A level's few dozen values cost less as Python scalars than as numpy
    operations, each paying its dispatch."""
    n, inf = 1 + d * wd, math.inf
    token, parent, depth = [0] * n, [0] * n, [0] * n  # the Tree's fields, as in egt_init
    valid, logp = [False] * n, [-inf] * n  # logp: float32 values
    token[0], valid[0], logp[0] = int(root), True, 0.0
    anc = np.eye(n, dtype=np.bool_)  # [N, N] ancestor-or-self rows (an invalid node: itself only)
    cand_token, cand_score = [0] * (n * k), [-inf] * (n * k)  # the pool: scores are float32 values
    cand_token[:k] = head.token[0].tolist()
    cand_score[:k] = head.logp[0].float().tolist()
    for s in range(d):
        # egt_select over the slots filled so far: beyond them every score is -inf, and a pick
        # of a -inf slot makes an invalid node whichever slot it is (slot `filled` stands for them)
        filled = (1 + s * wd) * k
        pick = sorted(range(filled), key=lambda i: -cand_score[i])[:wd]
        pick += [filled] * (wd - len(pick))
        fed = range(1 + s * wd, 1 + (s + 1) * wd)
        for node, i in zip(fed, pick):
            if cand_score[i] > -inf:
                up = i // k
                token[node], parent[node], depth[node] = cand_token[i], up, depth[up] + 1
                valid[node], logp[node] = True, cand_score[i]
                anc[node] |= anc[up]
            cand_score[i] = -inf
        if s == d - 1 and not drafter.feeds_leaves:
            break
        lo, hi = fed.start, fed.stop
        ins = torch.tensor([token[lo:hi], depth[lo:hi], list(fed), parent[lo:hi]], dtype=torch.int64)  # one tensor: [4, W_d]
        top = drafter.step(ins[0], ins[1], ins[2], ins[3], torch.from_numpy(anc[lo:hi]), L, k)
        tops, lps = top.token.tolist(), top.logp.float().tolist()  # [W_d][k] each
        for j, node in enumerate(fed):  # egt_expand: the children's path scores in float32
            for c in range(k):
                cand_token[node * k + c] = tops[j][c]
                cand_score[node * k + c] = float(np.float32(logp[node] + lps[j][c])) if valid[node] else -inf
    fields = torch.tensor([token, parent, depth], dtype=torch.int64)  # [3, N]
    tree = Tree(fields[0], fields[1], fields[2], torch.tensor(valid, dtype=torch.bool),
                torch.tensor(logp, dtype=torch.float32))
    return tree, d - 1 + int(drafter.feeds_leaves)
