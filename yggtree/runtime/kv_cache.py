"""Static KV cache: preallocated slots, slot-indexed writes, and the static-shape commit gather."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """One layer's keys and values for ``n_slots`` cache slots, laid out [B, S, H, D].

    Slot-major layout: a context bucket (the first C slots) is a contiguous prefix, so attention
    reads it in place with strided matmuls and no copy. Slots are plain storage: which slot holds
    which position is decided by the caller (the engine keeps the committed sequence in slots
    ``0..L-1`` and puts speculative tokens after it).
    """

    def __init__(self, batch: int, heads: int, n_slots: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, n_slots, heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(
        self,
        slots: torch.Tensor,  # [B, W] int64
        k: torch.Tensor,  # [B, W, H, D]
        v: torch.Tensor,  # [B, W, H, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v at ``slots``; return the whole cache ([B, S, H, D] each).

        An ``index_put_`` (not ``scatter_``) so inductor updates the cache buffer in place instead
        of cloning the whole cache and copying it back every call."""
        bi = torch.arange(k.shape[0], device=slots.device)[:, None]
        self.k.index_put_((bi, slots), k)
        self.v.index_put_((bi, slots), v)
        return self.k, self.v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` [B, K] to slots ``dst`` [B, K] (gather first, so overlaps are safe)."""
        bi = torch.arange(src.shape[0], device=src.device)[:, None]
        k, v = self.k[bi, src], self.v[bi, src]  # advanced indexing copies: [B, K, H, D]
        self.k.index_put_((bi, dst), k)
        self.v.index_put_((bi, dst), v)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
