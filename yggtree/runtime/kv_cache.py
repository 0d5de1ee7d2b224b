"""Static KV cache: preallocated slots, slot-indexed writes, and the static-shape commit gather."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """One layer's keys and values for ``n_slots`` cache slots.

    Slots are plain storage: which slot holds which position is decided by the caller (the engine
    keeps the committed sequence in slots ``0..L-1`` and puts speculative tokens after it).
    """

    def __init__(self, batch: int, heads: int, n_slots: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, heads, n_slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(
        self,
        slots: torch.Tensor,  # [B, W] int64
        k: torch.Tensor,  # [B, H, W, D]
        v: torch.Tensor,  # [B, H, W, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v at ``slots``; return the whole cache ([B, H, S, D] each)."""
        idx = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k.scatter_(2, idx, k)
        self.v.scatter_(2, idx, v)
        return self.k, self.v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` [B, K] to slots ``dst`` [B, K] (gather first, so overlaps are safe)."""
        b, h, _, d = self.k.shape
        gi = src[:, None, :, None].expand(b, h, -1, d)
        si = dst[:, None, :, None].expand(b, h, -1, d)
        k, v = self.k.gather(2, gi), self.v.gather(2, gi)
        self.k.scatter_(2, si, k)
        self.v.scatter_(2, si, v)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
