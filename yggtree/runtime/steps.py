"""The target's per-call step functions: the units that are captured as static graphs.

Cache layout (batch 1): slots ``0..L-1`` hold the committed sequence (L = ``committed`` tensor);
a step writes its W tokens at slots ``L..L+W-1``; the last slot ``S-1`` is a scratch slot that
padded prefill tokens write to and nothing ever attends to. Every varying quantity is a tensor
except ``n_ctx``, the context bucket (how many leading cache slots attention reads; a few static
sizes): each function gives one graph per (input width, bucket).
"""

from __future__ import annotations

import torch

from .model import Transformer


def prefill_chunk(
    model: Transformer,
    tokens: torch.Tensor,  # [1, C] int64, padded past n_valid
    start: torch.Tensor,  # [] int64: slot/position of tokens[0, 0]
    n_valid: torch.Tensor,  # [] int64: real tokens in this chunk (1..C)
    capture: tuple[int, ...] = (),
    n_ctx: int | None = None,  # context bucket >= start + C (default: the whole cache)
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run one causal prefill chunk.

    Returns logits of the last real token [1, V] (float32), the final hidden states [1, C, H]
    and the captured layers (each [1, C, H]).
    """
    c = tokens.shape[1]
    n_slots = model.cache_slots
    ar = torch.arange(c, device=tokens.device)
    pos = (start + ar)[None]  # [1, C]
    real = ar < n_valid
    slots = torch.where(real, start + ar, n_slots - 1)[None]  # pads -> scratch slot
    pos = torch.where(real[None], pos, start)  # keep pad positions in range
    s = torch.arange(n_ctx or n_slots, device=tokens.device)
    mask = (s[None, :] <= (start + ar)[:, None]) & (s[None, :] < n_slots - 1)  # [C, n_ctx]
    out = model(tokens, pos, slots, mask[None], capture)
    last = out.hidden[:, (n_valid - 1).reshape(1)]  # [1, 1, H]
    return model.logits(last)[:, 0], out.hidden, out.layers


def tree_mask(
    committed: torch.Tensor,  # [] int64
    anc: torch.Tensor,  # [W, N] bool: anc[i, j] = tree node j is visible to input i
    n_ctx: int,
) -> torch.Tensor:
    """[W, n_ctx] bool: the committed prefix, plus tree node j at slot committed + j where anc allows."""
    n = anc.shape[1]
    s = torch.arange(n_ctx, device=anc.device)
    rel = s - committed  # [n_ctx]
    in_tree = (rel >= 0) & (rel < n)
    tree_part = anc[:, rel.clamp(0, n - 1)] & in_tree[None, :]
    return (s < committed)[None, :] | tree_part


def tree_step(
    model: Transformer,
    tokens: torch.Tensor,  # [W] int64
    depth: torch.Tensor,  # [W] int64, depth in the tree (root 0)
    node: torch.Tensor,  # [W] int64, tree node index of each input (its slot is committed + node)
    anc: torch.Tensor,  # [W, N] bool, anc[i, j]: input i sees tree node j (ancestor-or-self)
    committed: torch.Tensor,  # [] int64, committed length = the root's position
    capture: tuple[int, ...] = (),
    n_ctx: int | None = None,  # context bucket >= committed + N (default: the whole cache)
    run=None,  # masked_step or a compiled copy of it (graphs.Graphs); None: masked_step
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """One model call over W tree nodes against the committed cache.

    Node j of the tree lives at cache slot ``committed + j`` and RoPE position
    ``committed + depth[j]``. Verification feeds the whole (pruned) tree: ``node = arange(W)``,
    ``anc`` square; a drafter step feeds W_d nodes of a bigger tree; plain decoding is W = 1
    (the root alone). Returns logits [W, V] float32, final hidden [W, H] and the captured layers
    (each [W, H]).
    """
    mask = tree_mask(committed, anc, n_ctx or model.cache_slots)
    return (run or masked_step)(model, torch.stack([tokens, depth, node]), mask, committed, capture)


def masked_step(
    model: Transformer,
    ids: torch.Tensor,  # [3, W] int64: tree_step's tokens, depth and node, stacked
    mask: torch.Tensor,  # [W, C] bool: tree_mask(committed, anc, C)
    committed: torch.Tensor,  # [] int64
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`tree_step` once its mask is built: the part compiled as one graph per (W, C). The
    ancestor matrix's width N (which grows with every draft depth) stays outside the graph, and
    the stacked ids keep callers' aliasing (plain steps pass one zero as depth and node) out of
    dynamo's guards."""
    x, layers = masked_layers(model, ids, mask, committed, capture)
    logits, hidden = finish_step(model, x)
    return logits, hidden, tuple(h[0] for h in layers)


def masked_layers(
    model: Transformer,
    ids: torch.Tensor,  # [3, W] int64: tree_step's tokens, depth and node, stacked
    mask: torch.Tensor,  # [W, C] bool: tree_mask(committed, anc, C)
    committed: torch.Tensor,  # [] int64
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`masked_step` up to the final norm (what a whole-step package computes,
    runtime/aoti.py): the last layer's output [1, W, H] and the captured layers (each [1, W, H])."""
    tokens, depth, node = ids
    pos = (committed + depth)[None]
    slots = (committed + node)[None]
    return model.decoder(tokens[None], pos, slots, mask[None], capture)


def finish_step(
    model: Transformer,
    x: torch.Tensor,  # [1, W, H] the last layer's output (masked_layers)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of :func:`masked_step`: the final norm and the LM head -> logits [W, V] float32
    and the final hidden state [W, H]."""
    hidden = model.norm(x)[0]
    return model.logits(hidden), hidden


def commit(model: Transformer, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move cache slots src [K] to dst [K] (distinct) in every layer, in one gather and one write
    over the model's :class:`~yggtree.runtime.kv_cache.KVStore` (accepted path -> contiguous
    prefix). Slots already in place (src == dst: a path down the verified tree's first nodes, most
    accepted paths) are left alone, and nothing moves where all are: a move is a scattered read and
    write in every layer, 0.1-0.16 ms right after a verify call, whose weight stream left the
    caches cold.

    Entries past the accepted length, where a caller passes them (a static K of D_max), land beyond
    the new committed length, where the prefix mask never looks."""
    moved = src != dst  # [K] bool
    if bool(moved.any()):
        model.kv.move(src[moved][None], dst[moved][None])
