"""Acceptance: walk the verified tree with the target's choices; emit accepted tokens + a bonus.

Input is a verified tree of ``W`` slots (pruned, locally indexed, root at 0, any order) and the
target's logits at every node: ``target_logits[u]`` is the target's distribution for the token
*after* node ``u``'s path. At node ``u`` the target chooses a token ``c(u)``; if a valid child of
``u`` carries ``c(u)`` the walk moves there, otherwise ``c(u)`` is the bonus token and the walk
stops. Example (tokens in brackets)::

            0 [the]                 c(0) = cat   -> move to 1
           /       \\                c(1) = sat   -> move to 3
      1 [cat]     2 [dog]           c(3) = on    -> no child [on]: bonus
       /    \\                      emitted: cat sat on   (n_accepted = 2)
  3 [sat]  4 [ran]                  path = [0, 1, 3, 3]  (max_depth 3, padded)

- Greedy: ``c(u) = argmax target_logits[u]`` (ties: lowest token id, like ``torch.argmax``).
- Sampling: ``c(u) ~ filter_probs(target_logits[u], temperature, top_p)``, one independent draw
  per node. This is the design's sibling-by-sibling scheme in closed form: the drafter's
  candidates are deterministic (a point-mass proposal), so "accept child x with probability
  p(x), else remove x, renormalise and try the next sibling, else sample from the residual"
  accepts child x with probability exactly p(x) and emits a non-child y as the bonus with
  probability exactly p(y) - the same joint law as one draw y ~ p, independent of sibling order.
  Hence every emitted token is distributed exactly as the target's (lossless).

Both walks are device-side on an accelerator: a fixed ``max_depth``-step loop of small tensor
ops, no host sync (sampling draws one uniform per node, for all W nodes at once, from the
caller's generator, and inverts the CDF). On the CPU, where the host is the device and each small
op costs more than the whole walk, the same walk runs over Python lists (:func:`walk_lists`).
EOS and max-new-tokens are not handled here: see :func:`truncate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import torch

from yggtree.runtime.tree import Tree

__all__ = [
    "Accepted",
    "filter_probs",
    "sample_tokens",
    "walk",
    "walk_lists",
    "walk_tensors",
    "greedy_accept",
    "sample_accept",
    "sample_choices",
    "truncate",
]


@dataclass(frozen=True)
class Accepted:
    """Result of one acceptance walk (``D`` = the walk's ``max_depth``)."""

    path: torch.Tensor  # [D+1] int64, local node indices from the root; padded with the last one
    n_accepted: torch.Tensor  # [] int64, accepted draft tokens (root excluded), in [0, D]
    tokens: torch.Tensor  # [D+1] int64, tokens[:n_accepted+1] = accepted tokens, then the bonus;
    #                       padded by repeating the bonus

    def emitted(self) -> list[int]:
        """The emitted tokens (accepted draft tokens + bonus) as a list. Syncs with the host."""
        n = int(self.n_accepted)
        return self.tokens[: n + 1].tolist()


def filter_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Target sampling distribution: softmax(logits / temperature), then top-p (nucleus) filtering.

    Top-p keeps the smallest set of highest-probability tokens whose cumulative probability
    reaches ``top_p`` (a token is kept iff the mass strictly before it, in descending order,
    is < ``top_p``; ties in order of token id) and renormalises. ``top_p >= 1`` keeps everything.
    Plain sampling and :func:`sample_accept` must both use this function. Device-side.

    Args:
        logits: [..., V] float.
        temperature: > 0 (use greedy decoding for temperature 0).
        top_p: in (0, 1].

    Returns:
        [..., V] float32 probabilities.
    """
    if not temperature > 0:
        raise ValueError(f"filter_probs: temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"filter_probs: top_p must be in (0, 1], got {top_p}")
    probs = torch.softmax(logits.to(torch.float32) / temperature, dim=-1)
    if top_p >= 1:
        return probs
    keep = _nucleus_of_top(probs, top_p) if _host(probs) else None
    if keep is None:  # every row's descending order, in full
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True  # the most likely token always (a top_p below float32's range is 0)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _host(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the CPU outside a graph being traced (host paths may branch on values)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


SCAN_ROUNDING = 3e-7  # > two float32 ulps at masses below 2: how far a scan's "mass before" may sit below the prefix's


def _nucleus_of_top(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """:func:`filter_probs`' top-p mask [..., V] bool from each row's largest probabilities alone,
    or None where a row's nucleus could not be settled so (the caller sorts in full). A
    vocabulary's stable descending sort costs milliseconds on a CPU; a nucleus is mostly a few
    dozen tokens.

    The same mask as the full sort's: a row's entries above any threshold are the first entries of
    its full stable order (ties never straddle a threshold), in token order they sort stably into
    that order's prefix, and their cumulative sums are the prefix of the full scan's (a sequential
    scan). Where the prefix's mass clears ``top_p`` by more than the scan's rounding the mask ends
    inside it (an entry's mass before it is its scan value less itself, in float32). The thresholds: a
    thousandth of the row's largest value, then one below which the whole vocabulary holds less
    than ``1 - top_p`` (the rest of a softmax row's unit mass is then above it)."""
    v = probs.shape[-1]
    rows = probs.detach().reshape(-1, v).numpy()
    keep = np.zeros(rows.shape, dtype=np.bool_)
    # a prefix settles the mask where the entries left out cannot be kept: each one's mass before it
    # (its scan value less itself, as the full path computes it) is at least the prefix's mass less
    # two float32 ulps of rounding, so the prefix must clear top_p by that much
    need = float(np.float32(top_p)) + SCAN_ROUNDING
    for r, row in enumerate(rows):
        for t in (float(row.max()) * 1e-3, (1.0 - top_p) / (2 * v)):
            idx = np.flatnonzero(row > t)  # ascending token ids
            top = row[idx]
            order = np.argsort(-top, kind="stable")  # descending, ties by token id
            sorted_p = torch.from_numpy(top[order])
            mass = torch.cumsum(sorted_p, dim=-1)  # the full path's scan (numpy's would differ)
            if mass.numel() and float(mass[-1]) >= need:
                keep_sorted = ((mass - sorted_p) < top_p).numpy()
                keep_sorted[0] = True
                keep[r, idx[order[keep_sorted]]] = True
                break
        else:
            return None
    return torch.from_numpy(keep).reshape(probs.shape)


def sample_tokens(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of ``probs`` from uniforms in [0, 1). Device-side.

    Token ``i`` is drawn iff ``cdf[i-1] <= uniform * cdf[-1] < cdf[i]``, so zero-probability
    tokens are never drawn (rounding at the top end falls back to the last token with positive
    probability). Resolution is that of float32 (2^-24). Taking the uniforms as an input keeps
    this traceable by ``torch.compile(fullgraph=True)``, which cannot take a ``torch.Generator``.

    Args:
        probs: [..., V] float, non-negative, rows not all zero (need not sum to 1).
        uniform: [...] float in [0, 1).

    Returns:
        [...] int64 token ids.
    """
    cdf = torch.cumsum(probs.to(torch.float32), dim=-1)  # [..., V]
    x = (uniform.to(torch.float32) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)  # [...]
    v = probs.shape[-1]
    # a draw lands on a positive probability below the top end (a flat stretch of the CDF is never
    # its first value above x): only idx = V, a rounding at the top, needs the last positive one
    if _host(probs) and not bool((idx == v).any()):
        return idx
    last_pos = (v - 1) - torch.argmax((probs.flip(-1) > 0).to(torch.int32), dim=-1)  # [...]
    return torch.minimum(idx, last_pos)


def walk(tree: Tree, choice: torch.Tensor, max_depth: int | None = None) -> Accepted:
    """Follow the target's choices down the tree. Device-side.

    Args:
        tree: verified tree, W slots.
        choice: [W] int64, the target's token at every node (argmax, or a sample).
        max_depth: static bound on the tree depth (the output length is max_depth + 1);
            default W - 1, which always suffices.

    The greedy and sampling acceptances are this walk with different ``choice``; a compiled
    verify graph can call it directly with choices from :func:`sample_tokens`.
    """
    n = tree.num_nodes
    max_depth = n - 1 if max_depth is None else max_depth
    if choice.device.type == "cpu" and not torch.compiler.is_compiling():
        return walk_lists(tree, choice, max_depth)
    return walk_tensors(tree, choice, max_depth)


def walk_tensors(tree: Tree, choice: torch.Tensor, max_depth: int) -> Accepted:
    """:func:`walk` as tensor ops only (no host sync; any device, and inside a compiled graph)."""
    n = tree.num_nodes
    dev = choice.device
    can_enter = tree.valid & (torch.arange(n, device=dev) != 0)  # [W]
    # u is a 1-element index tensor: indexing with a 0-dim tensor would call .item() (a sync)
    u = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]
    alive = torch.ones(1, dtype=torch.bool, device=dev)  # [1]
    n_acc = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]
    path = [u]
    for _ in range(max_depth):
        match = can_enter & (tree.parent == u) & (tree.token == choice[u])  # [W]
        alive = alive & match.any()
        nxt = torch.argmax(match.to(torch.int32), dim=0, keepdim=True)  # [1], first match
        u = torch.where(alive, nxt, u)
        n_acc = n_acc + alive.to(torch.int64)
        path.append(u)
    path_t = torch.cat(path)  # [D+1]
    bonus = choice[u]  # [1]
    i = torch.arange(max_depth + 1, device=dev)
    nxt_tok = tree.token[path_t[(i + 1).clamp(max=max_depth)]]
    tokens = torch.where(i < n_acc, nxt_tok, bonus)
    n_acc = n_acc.squeeze(0)
    return Accepted(path=path_t, n_accepted=n_acc, tokens=tokens)


def walk_lists(tree: Tree, choice: torch.Tensor, max_depth: int) -> Accepted:
    """:func:`walk` on the host: the tree read once into lists, followed in Python (the same
    first-matching-child rule), the result as :class:`Accepted` tensors."""
    parent, token, valid, ch = (t.tolist() for t in (tree.parent, tree.token, tree.valid, choice))
    child = {}  # (parent, token) -> its first valid child (lowest index), as torch.argmax picks
    for j in range(1, len(parent)):
        if valid[j]:
            child.setdefault((parent[j], token[j]), j)
    u, n_acc, path, alive = 0, 0, [0], True
    for _ in range(max_depth):
        nxt = child.get((u, ch[u])) if alive else None
        alive = nxt is not None
        if alive:
            u, n_acc = nxt, n_acc + 1
        path.append(u)  # padded with the last node once the walk stops
    bonus = ch[u]
    tokens = [token[path[i + 1]] if i < n_acc else bonus for i in range(max_depth + 1)]
    i64 = torch.int64
    return Accepted(path=torch.tensor(path, dtype=i64), n_accepted=torch.tensor(n_acc, dtype=i64),
                    tokens=torch.tensor(tokens, dtype=i64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: [...] int64, the first maximum of every row of logits [..., V] (a
    NaN counts as the maximum). Float32 or float64 rows on the CPU go through numpy, whose argmax
    is vectorised: ATen's CPU argmax reduces element by element, much slower over a
    vocabulary. The same index on every input."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))
    return logits.argmax(dim=-1)


def greedy_accept(
    tree: Tree, target_logits: torch.Tensor, max_depth: int | None = None
) -> Accepted:
    """Greedy acceptance: the target's argmax at every node. Device-side (no host sync).

    Args:
        tree: verified tree, W slots.
        target_logits: [W, V] float, the target's logits at every node.
        max_depth: static bound on the tree depth (the output length is max_depth + 1);
            default W - 1, which always suffices.
    """
    return walk(tree, argmax(target_logits), max_depth)


def sample_accept(
    tree: Tree,
    target_logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    max_depth: int | None = None,
) -> Accepted:
    """Lossless stochastic acceptance (see the module docstring for why). Device-side.

    Args:
        tree: verified tree, W slots.
        target_logits: [W, V] float.
        temperature: > 0.
        top_p: in (0, 1].
        generator: the source of all randomness (one uniform per node, drawn with
            ``torch.rand``); None uses torch's default generator.
        max_depth: as in :func:`greedy_accept`.

    Under ``torch.compile(fullgraph=True)`` (which cannot trace a generator), draw the uniforms
    outside and compose ``walk(tree, sample_tokens(filter_probs(...), uniform))`` instead.
    """
    return walk(tree, sample_choices(target_logits, temperature, top_p, generator), max_depth)


def sample_choices(
    target_logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """[W] int64: the target's sampled token at every node, one independent draw each (one
    uniform per node from ``generator``): the ``choice`` :func:`sample_accept` walks with."""
    probs = filter_probs(target_logits, temperature, top_p)  # [W, V]
    uniform = torch.rand(
        probs.shape[:-1], generator=generator, device=probs.device, dtype=torch.float32
    )  # [W]
    return sample_tokens(probs, uniform)


def truncate(
    tokens: Sequence[int], eos_ids: Collection[int], remaining: int
) -> tuple[list[int], str | None]:
    """Cut an emission at the first EOS (kept) or at the remaining token budget.

    Returns:
        (tokens to emit, finish reason): ``"stop"`` if an EOS token is emitted, else
        ``"length"`` if the budget is used up, else ``None`` (keep decoding).

    >>> truncate([5, 2, 7], eos_ids={2}, remaining=10)
    ([5, 2], 'stop')
    >>> truncate([5, 6, 7], eos_ids={2}, remaining=2)
    ([5, 6], 'length')
    >>> truncate([5, 6], eos_ids={2}, remaining=5)
    ([5, 6], None)
    """
    out = list(tokens[: max(remaining, 0)])
    for i, t in enumerate(out):
        if t in eos_ids:
            return out[: i + 1], "stop"
    if len(out) >= remaining:
        return out, "length"
    return out, None
