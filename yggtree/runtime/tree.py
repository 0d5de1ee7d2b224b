"""Accelerator-safe tree tensors: the draft tree, its ancestor table, mask and positions.

A draft tree of ``N`` slots is five flat tensors (no batch dimension). Node 0 is the root: the last
committed token. Every parent index is in ``[0, N)`` ("dummy-root indexing": the root is its own
parent, padded slots point at the root), so gathers never see a ``-1`` sentinel.

Example: a root with two children, the first of which has a child, plus one padded slot::

          0  (root, depth 0)            token  = [t0, t1, t2, t3, 0]
         / \\                            parent = [ 0,  0,  0,  1, 0]
        1   2   (depth 1)               depth  = [ 0,  1,  1,  2, 0]
        |                               valid  = [ T,  T,  T,  T, F]
        3       (depth 2)               logp   = [ 0, a1, a2, a1+a3, -inf]
        4 = padding (invalid)

    ancestor_mask (row i attends to column j):   positions(depth, L) = L + depth
          0 1 2 3 4                                  = [L, L+1, L+1, L+2, L]
       0  1 . . . .
       1  1 1 . . .
       2  1 . 1 . .
       3  1 1 . 1 .
       4  . . . . 1    <- an invalid row sees only itself

All functions except :func:`check_invariants` are device-side: they take and return tensors on
any device and never synchronise with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "Tree",
    "TreeInvariantError",
    "ancestor_table",
    "ancestor_mask",
    "positions",
    "check_invariants",
    "build_tree",
]


@dataclass(frozen=True)
class Tree:
    """A draft tree of ``N`` slots (see the module docstring for a drawn example).

    ``logp`` is the drafter's path log-probability from the root (root 0.0, invalid slots -inf).
    Padded slots have ``valid`` False; their other fields are placeholders (parent 0).
    """

    token: torch.Tensor  # [N] int64, token of each node; token[0] = last committed token
    parent: torch.Tensor  # [N] int64 in [0, N); parent[0] = 0 (dummy root)
    depth: torch.Tensor  # [N] int64, root 0; parent's depth + 1 for valid nodes
    valid: torch.Tensor  # [N] bool, False for padded / unused slots; valid[0] = True
    logp: torch.Tensor  # [N] float32, path log-prob from the root; root 0.0, invalid -inf

    @property
    def num_nodes(self) -> int:
        """N, the (static) number of slots."""
        return self.token.shape[0]


class TreeInvariantError(ValueError):
    """A tree violates one of the invariants listed in :func:`check_invariants`."""


def ancestor_table(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """The table of ancestors, ``A[l, k]`` = the ancestor of ``k`` that is ``l`` levels up.

    ``A[0, k] = k`` and ``A[l + 1, k] = parent[A[l, k]]``. Walks saturate at the root because
    ``parent[0] = 0``. Device-side.

    Args:
        parent: [N] int64 parent indices in [0, N).
        max_depth: number of levels to walk (static Python int).

    Returns:
        [max_depth + 1, N] int64.

    For the tree in the module docstring, ``ancestor_table(parent, 2)`` is::

        [[0, 1, 2, 3, 4],
         [0, 0, 0, 1, 0],
         [0, 0, 0, 0, 0]]
    """
    rows = [torch.arange(parent.shape[0], dtype=torch.int64, device=parent.device)]
    for _ in range(max_depth):
        rows.append(parent[rows[-1]])
    return torch.stack(rows)


def ancestor_mask(
    parent: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, max_depth: int
) -> torch.Tensor:
    """Tree attention mask: ``m[i, j]`` is True iff ``j`` is an ancestor of ``i`` or ``i`` itself.

    Valid rows only ever see valid columns, so padded slots cannot change a valid node's output.
    An invalid row sees only itself (``m[i, i] = True``): it is never all-False, so a softmax over
    it (plus whatever committed prefix the caller adds) cannot produce NaN. ``max_depth`` must be
    at least the largest depth of a valid node. Device-side.

    Args:
        parent: [N] int64.
        depth: [N] int64 (only read for valid nodes; clamped, so garbage in padded slots is safe).
        valid: [N] bool.
        max_depth: static Python int.

    Returns:
        [N, N] bool.

    Closed form (used by the tests): ``j`` is an ancestor-or-self of ``i`` iff
    ``depth[j] <= depth[i]`` and ``A[depth[i] - depth[j], i] == j``.
    """
    table = ancestor_table(parent, max_depth)  # [L+1, N]
    n = parent.shape[0]
    diff = depth[:, None] - depth[None, :]  # [N, N]
    level = diff.clamp(0, max_depth)
    cols = torch.arange(n, dtype=torch.int64, device=parent.device)
    up = table.gather(0, level.t()).t()  # up[i, j] = A[level[i, j], i]  -> [N, N]
    is_anc = (diff >= 0) & (up == cols[None, :])
    both_valid = valid[:, None] & valid[None, :]
    self_only = torch.eye(n, dtype=torch.bool, device=parent.device) & ~valid[:, None]
    return (is_anc & both_valid) | self_only


def positions(depth: torch.Tensor, committed_len: torch.Tensor) -> torch.Tensor:
    """Position ids of the tree nodes: ``committed_len + depth``. Device-side.

    Args:
        depth: [N] int64.
        committed_len: [] int64, position of the root (number of tokens before it).

    Returns:
        [N] int64.
    """
    return committed_len + depth


def _violation(name: str, node: int, detail: str) -> TreeInvariantError:
    return TreeInvariantError(f"tree invariant '{name}' violated at node {node}: {detail}")


def check_invariants(tree: Tree) -> None:
    """Check the tree invariants (reference mode only: this synchronises with the host).

    Checked in this order, raising :class:`TreeInvariantError` for the first violation found,
    naming the invariant and the lowest offending node index:

    - ``'shape'``: all fields are 1-D of the same length N >= 1 with the documented dtypes.
    - ``'root'``: node 0 is valid, has depth 0 and parent 0.
    - ``'parent range'``: every parent index (valid or padded slot) is in [0, N).
    - ``'acyclicity'``: walking parents from every node reaches the root within N steps.
    - ``'validity closure'``: the parent of a valid node is valid.
    - ``'depth consistency'``: a valid non-root node has depth = depth of its parent + 1.
    - ``'logp'``: the root's logp is 0.0, valid nodes' logp is not NaN, padded slots' is -inf.
    """
    fields = {
        "token": (tree.token, torch.int64),
        "parent": (tree.parent, torch.int64),
        "depth": (tree.depth, torch.int64),
        "valid": (tree.valid, torch.bool),
        "logp": (tree.logp, torch.float32),
    }
    n = tree.token.shape[0] if tree.token.dim() == 1 else -1
    for name, (t, dtype) in fields.items():
        if t.dim() != 1 or t.shape[0] != n or n < 1 or t.dtype != dtype:
            raise _violation(
                "shape", 0, f"field {name} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                f"expected [{n}] {dtype}"
            )
    parent = tree.parent.cpu().tolist()
    depth = tree.depth.cpu().tolist()
    valid = tree.valid.cpu().tolist()
    logp = tree.logp.cpu().tolist()

    if not valid[0]:
        raise _violation("root", 0, "the root is invalid")
    if depth[0] != 0:
        raise _violation("root", 0, f"the root has depth {depth[0]}, expected 0")
    if parent[0] != 0:
        raise _violation("root", 0, f"the root has parent {parent[0]}, expected 0")

    for i, p in enumerate(parent):
        if not 0 <= p < n:
            raise _violation("parent range", i, f"parent {p} is outside [0, {n})")

    for i in range(n):
        k = i
        for _ in range(n):
            if k == 0:
                break
            k = parent[k]
        if k != 0:
            raise _violation(
                "acyclicity", i, f"walking parents from it does not reach the root in {n} steps"
            )

    for i in range(1, n):
        if valid[i] and not valid[parent[i]]:
            raise _violation("validity closure", i, f"parent {parent[i]} is invalid")

    for i in range(1, n):
        if valid[i] and depth[i] != depth[parent[i]] + 1:
            raise _violation(
                "depth consistency",
                i,
                f"depth {depth[i]} but parent {parent[i]} has depth {depth[parent[i]]}",
            )

    if logp[0] != 0.0:
        raise _violation("logp", 0, f"the root has logp {logp[0]}, expected 0.0")
    for i in range(n):
        if valid[i] and math.isnan(logp[i]):
            raise _violation("logp", i, "logp is NaN")
        if not valid[i] and logp[i] != float("-inf"):
            raise _violation("logp", i, f"padded slot has logp {logp[i]}, expected -inf")


def build_tree(
    parent: Sequence[int],
    token: Sequence[int],
    logp: Sequence[float] | None = None,
    size: int | None = None,
    device: torch.device | str | None = None,
) -> Tree:
    """Build a :class:`Tree` from host lists (for tests, fixed trees and tools; syncs by nature).

    Depths are computed from ``parent`` (``parent[0]`` must be 0 and parents must form a tree).
    ``logp`` defaults to 0.0 for every node. ``size`` > ``len(parent)`` appends padded slots
    (parent 0, depth 0, token 0, invalid, logp -inf).

    Example: ``build_tree([0, 0, 0, 1], [5, 7, 8, 9])`` is the module docstring's tree without
    the padded slot.
    """
    n = len(parent)
    size = n if size is None else size
    if size < n or len(token) != n or (logp is not None and len(logp) != n):
        raise ValueError("build_tree: inconsistent lengths")
    depth = [0] * n
    for i in range(n):
        k, d = i, 0
        while k != 0 and d <= n:
            k, d = parent[k], d + 1
        depth[i] = d
    pad = size - n
    lp = [0.0] * n if logp is None else list(logp)
    return Tree(
        token=torch.tensor(list(token) + [0] * pad, dtype=torch.int64, device=device),
        parent=torch.tensor(list(parent) + [0] * pad, dtype=torch.int64, device=device),
        depth=torch.tensor(depth + [0] * pad, dtype=torch.int64, device=device),
        valid=torch.tensor([True] * n + [False] * pad, dtype=torch.bool, device=device),
        logp=torch.tensor(lp + [float("-inf")] * pad, dtype=torch.float32, device=device),
    )
