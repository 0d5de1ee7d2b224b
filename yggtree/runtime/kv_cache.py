"""Static KV cache: preallocated slots, slot-indexed writes, and the static-shape commit gather.

A model's layers keep their caches in one tensor (:class:`KVStore`): each layer's keys and values
are views of it, so the commit moves the accepted path's slots in every layer with one gather and
one indexed write instead of four operations per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class KVCache(nn.Module):
    """One layer's keys and values for ``n_slots`` cache slots: one buffer ``kv`` [2, B, H, S, D]
    (keys, then values).

    Head-major layout: each KV head's keys (and values) are one contiguous run of slots, so
    attention streams a head's context bucket (its first C slots) in one sequential read, in place
    (``k`` and ``v`` are [B, S, H, D] views of it; the strided matmuls read them without a copy).
    Slot-major storage (a slot's heads side by side) made the row-by-row kernel read every head
    in strides (measured slower).

    Slots are plain storage: which slot holds which position is decided by the caller (the engine
    keeps the committed sequence in slots ``0..L-1`` and puts speculative tokens after it). Keys
    and values share one buffer so that a layer's cache is one graph input, whatever tensor it is
    a view of (a compiled region refuses two inputs that alias each other).
    """

    def __init__(self, kv: torch.Tensor) -> None:  # [2, B, H, S, D], contiguous (a KVStore's view, or its own)
        super().__init__()
        self.register_buffer("kv", kv, persistent=False)

    @classmethod
    def zeros(cls, batch: int, heads: int, n_slots: int, head_dim: int, dtype, device) -> "KVCache":
        """A cache of its own (one layer tested alone); models allocate theirs in a :class:`KVStore`."""
        return cls(torch.zeros(2, batch, heads, n_slots, head_dim, dtype=dtype, device=device))

    @property
    def k(self) -> torch.Tensor:  # [B, S, H, D] (a view: stride 1 along D, D along S)
        return self.kv[0].transpose(1, 2)

    @property
    def v(self) -> torch.Tensor:  # [B, S, H, D] (a view)
        return self.kv[1].transpose(1, 2)

    def write(
        self,
        slots: torch.Tensor,  # [B, W] int64
        k: torch.Tensor,  # [B, W, H, D]
        v: torch.Tensor,  # [B, W, H, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v at ``slots``; return the whole cache's keys and values ([B, S, H, D] each).

        One ``index_put_`` on the buffer itself (not ``scatter_``, not through a view) so inductor
        updates the cache in place instead of cloning it and copying it back every call. k and v
        are rounded to the cache's dtype (a 16-bit cache of a float32 model)."""
        dev = slots.device
        kind = torch.arange(2, device=dev)[:, None, None, None]  # [2, 1, 1, 1]
        bi = torch.arange(k.shape[0], device=dev)[None, :, None, None]  # [1, B, 1, 1]
        hi = torch.arange(k.shape[2], device=dev)[None, None, :, None]  # [1, 1, H, 1]
        vals = torch.stack([k, v]).transpose(2, 3)  # [2, B, H, W, D]
        self.kv.index_put_((kind, bi, hi, slots[None, :, None, :]), vals.to(self.kv.dtype))
        return self.k, self.v

    def reset(self) -> None:
        self.kv.zero_()


@dataclass(frozen=True)
class KVStore:
    """Every layer's cache in one tensor; layer i's cache is the view ``kv[i]``."""

    kv: torch.Tensor  # [L, 2, B, H, S, D]: layer, keys/values, batch, kv head, slot, head dim
    caches: tuple[KVCache, ...]  # L caches; cache i's buffer is the view kv[i] [2, B, H, S, D]

    @classmethod
    def zeros(cls, n_layers: int, batch: int, heads: int, n_slots: int, head_dim: int, dtype, device) -> "KVStore":
        shape = (n_layers, 2, batch, heads, n_slots, head_dim)
        if torch.device(device).type == "cpu":  # attention streams it: on 2 MiB pages (runtime/hugepages.py)
            from .hugepages import huge_zeros

            return cls.over(huge_zeros(shape, dtype))
        return cls.over(torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def over(cls, kv: torch.Tensor) -> "KVStore":
        return cls(kv, tuple(KVCache(kv[i]) for i in range(kv.shape[0])))

    def attach(self, layers) -> None:
        """Make each decoder layer of ``layers`` read and write its cache in this store."""
        for block, cache in zip(layers, self.caches, strict=True):
            block.self_attn.cache = cache

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` [B, K] to slots ``dst`` [B, K] in every layer (the gather is taken
        before the write, so overlapping slot sets are safe). Row by row along the slot axis: half
        the time of one advanced-indexing gather and write over the batch and slot axes together."""
        for b in range(src.shape[0]):
            kv = self.kv[:, :, b]  # [L, 2, H, S, D] a view
            kv.index_copy_(3, dst[b], kv.index_select(3, src[b]))

    def keep_rows(self, idx: torch.Tensor) -> "KVStore":
        """A store of the batch rows ``idx`` [B'] only (a batch whose finished rows leave)."""
        return KVStore.over(self.kv.index_select(2, idx))
