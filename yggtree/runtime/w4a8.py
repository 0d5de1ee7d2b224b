"""The ``w4a8`` weight format: blocks of 32 quantized weights times int8-quantized activations.

llama.cpp's CPU arithmetic for a GGUF's 4-bit model, as a weight format of ours (runtime/quant.py
holds the others). Every linear of the target and of the drafter's model (decoder blocks, LM
head, an EAGLE head's fc and reduce) becomes blocks of 32 input columns ``w = d * u + m`` (d, m float16 per block and output
column):

- a GGUF tensor stored in Q4_0 / Q4_1 / Q8_0 keeps the file's blocks exactly: Q4_1 ``d q + m``
  as it is, Q4_0 ``d (q - 8)`` as m = -8 d, Q8_0 ``d q`` (q int8) as 8-bit codes u = q + 128
  with m = -128 d (both m exact in float16, checked);
- any other linear (a float model, an EAGLE head, a float GGUF tensor) is quantized to Q4_1:
  per block d = (max - min) / 15 and m = min, rounded to float16, u = round((w - m) / d).

A product quantizes its input per row and block of 32 to int8 (a ~= da * qa, da = amax / 127),
sums u * qa in int32 (VNNI's dot products where the CPU has them) and scales each block's sum in float32 (``csrc/w4a8.cpp``
states the exact arithmetic). So the format runs llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 scheme on
the file's own weights, in any run dtype (the kernel takes and returns float32; a bfloat16 run
casts around it). Each row's result is independent of the other rows of a call and of the
thread count, by construction: speculation stays exact (``quant.check_batch_invariant`` checks).

The kernel is C++ (``csrc/w4a8.cpp``) in our kernel library (runtime/kernels.py: built once per
machine and torch version, registered as the op ``yggtree::w4a8_mm``, an extern kernel to
inductor whose C shim AOTInductor packages call directly). Float32 models in this format also
run the library's row-by-row attention (``yggtree::rows_attention``). It needs what the library
needs (an x86 CPU with AVX2, FMA and F16C, or AVX-512; a C++ compiler and ninja); without them the
format is refused in one line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import YggError
from .gguf_blocks import read_blocks
from .kernels import TILE, aoti_shims, runs_attention

__all__ = ["Blocks", "load_kernel", "aoti_shims", "runs_attention", "q4_1_blocks", "gguf_blocks", "cat_blocks", "dequantize_blocks",
           "nibble_blocks", "pack_blocks", "W4A8Linear"]

BLOCK = 32  # input columns per block (GGUF's Q4_0 / Q4_1 / Q8_0)


@dataclass(frozen=True)
class Blocks:
    """A [N, K] weight in blocks of 32 input columns: w = d * u + m."""

    u: torch.Tensor  # [N, K] uint8: 0..15 (bits 4) or 0..255 (bits 8)
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor  # [N, K / 32] float16
    bits: int  # 4 or 8


@functools.cache
def load_kernel() -> None:
    """Load the kernel library (runtime/kernels.py: ``yggtree::w4a8_mm``,
    ``yggtree::rows_attention``); YggError in one line where the format cannot run here."""
    from .kernels import load_library  # (looked up at the call: tests replace it)

    try:
        load_library()
    except YggError as e:
        raise YggError(f"weights w4a8: {e}") from None


def _f16_exact(v: torch.Tensor, what: str) -> torch.Tensor:
    """``v`` (float32) as float16, YggError unless every value is exact."""
    h = v.half()
    if not torch.equal(h.float(), v):
        raise YggError(f"weights w4a8: {what} is not exact in float16")
    return h


def q4_1_blocks(w: torch.Tensor) -> Blocks:
    """Q4_1 of a float weight [N, K] (K a multiple of 32): per block d = (max - min) / 15 and
    m = min in float16, u = round((w - m) / d) in 0..15 with the float16 d and m."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = g.amin(-1), g.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    df = torch.where(d > 0, d.float(), torch.ones_like(lo))
    u = torch.round((g - m.float()[..., None]) / df[..., None]).clamp(0, 15)
    return Blocks(u.reshape(n, k).to(torch.uint8), d, m, 4)


def gguf_blocks(kind: str, raw: torch.Tensor, name: str = "weight") -> Blocks:
    """A GGUF tensor's own blocks: ``raw`` [N, bytes per row] uint8 of GGML type ``kind``
    (Q4_0, Q4_1, Q8_0); YggError for another type."""
    fields = read_blocks(kind, raw)
    if fields is None:
        raise YggError(f"weights w4a8: {name} is stored as {kind}; the kernel reads Q4_0, Q4_1 and "
                       "Q8_0 blocks")
    d, m, q = fields
    if kind == "Q8_0":
        return Blocks((q + 128).to(torch.uint8), d.half(), _f16_exact(-128 * d, f"-128 d of {name}"), 8)
    if kind == "Q4_0":
        return Blocks(q, d.half(), _f16_exact(-8 * d, f"-8 d of {name}"), 4)
    return Blocks(q, d.half(), m.half(), 4)


def cat_blocks(parts: list[Blocks]) -> Blocks:
    """The blocks of the weights stacked along the output (fused q/k/v, gate/up); 4-bit codes
    are exact 8-bit ones, so a mixed stack is 8-bit."""
    bits = max(p.bits for p in parts)
    return Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("u", "d", "m")), bits)


def dequantize_blocks(b: Blocks) -> torch.Tensor:
    """The float32 weight [N, K] the blocks stand for."""
    return b.d.float().repeat_interleave(BLOCK, 1) * b.u.float() + b.m.float().repeat_interleave(BLOCK, 1)


def nibble_blocks(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes ``q`` [N, K] in 0..15 (N a multiple of 16, K of 32) as our kernels read them
    (csrc/w4a8.cpp, csrc/tiled_mm.cpp): [T, K / 32, 256] uint8, per tile t of 16 output columns and
    block b of 32 inputs byte (h, l, i) (h < 4, lane l < 16, i < 4) = q[16t+l][32b+4h+i] |
    q[16t+l][32b+16+4h+i] << 4."""
    n, k = q.shape
    t, nb = n // TILE, k // BLOCK
    tiles = q.view(t, TILE, nb, BLOCK).permute(0, 2, 1, 3)  # [T, B, lane, BLOCK]
    lo = tiles[..., :16].reshape(t, nb, TILE, 4, 4).permute(0, 1, 3, 2, 4)  # [T, B, h, lane, i]
    hi = tiles[..., 16:].reshape(t, nb, TILE, 4, 4).permute(0, 1, 3, 2, 4)
    return (lo | (hi << 4)).reshape(t, nb, 256)


def pack_blocks(b: Blocks) -> torch.Tensor:
    """The kernel's layout (csrc/w4a8.cpp): [T, B, 320 | 576] uint8, per tile of 16 output
    columns and block of 32 inputs the codes (256 bytes 4-bit, 512 8-bit), then d and m (16
    float16 each); N padded with zero blocks (output 0) to T * 16 columns."""
    n, k = b.u.shape
    pad = -n % TILE
    u, d, m = (F.pad(t, (0, 0, 0, pad)) for t in (b.u, b.d, b.m))
    t_, nb = (n + pad) // TILE, k // BLOCK
    tiles = u.view(t_, TILE, nb, BLOCK).permute(0, 2, 1, 3)  # [T, B, lane, 32]
    if b.bits == 4:
        codes = nibble_blocks(u)
    else:
        codes = tiles.reshape(t_, nb, TILE, 8, 4).permute(0, 1, 3, 2, 4).reshape(t_, nb, 512)
    per_tile = lambda s: s.view(t_, TILE, nb).permute(0, 2, 1).contiguous().view(torch.uint8)  # noqa: E731
    return torch.cat([codes, per_tile(d), per_tile(m)], dim=2).contiguous()


@dataclass(frozen=True)
class PackedBlocks:
    """One layer's blocks in the kernel's layout (:func:`pack_blocks`), as a cache keeps them."""

    data: torch.Tensor  # [T, B, 320 | 576] uint8
    n: int  # output columns
    k: int  # input columns
    bits: int


def packed_of(model: nn.Module) -> dict[str, PackedBlocks]:
    """Every W4A8 layer of ``model`` by module name, in its packed layout (what a cache stores)."""
    return {name: PackedBlocks(m.packed, m.out_features, m.in_features, m.bits)
            for name, m in model.named_modules() if isinstance(m, W4A8Linear)}


def layout_hash() -> str:
    """What a cached packed layout depends on: the sources that read and pack the blocks."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for f in (Path(__file__), Path(__file__).with_name("gguf_blocks.py"), Path(__file__).with_name("quant.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


class W4A8Linear(nn.Module):
    """``F.linear`` with block-quantized weights on int8-quantized activations
    (``yggtree::w4a8_mm``, float32 in and out; the result in the run's dtype ``dtype``)."""

    packed: torch.Tensor  # [T, B, 320 | 576] uint8 (pack_blocks: codes, d, m); T = N rounded up to 16, / 16
    bias: torch.Tensor | None  # [N] in the run's dtype

    def __init__(self, blocks: Blocks | None, bias: torch.Tensor | None, dtype: torch.dtype,
                 packed: PackedBlocks | None = None) -> None:
        """From ``blocks`` (packed here), or from their ``packed`` layout as :func:`packed_of` kept it."""
        super().__init__()
        load_kernel()
        if packed is None:
            packed = PackedBlocks(pack_blocks(blocks), *blocks.u.shape, blocks.bits)
        self.out_features, self.in_features, self.bits, self.dtype = packed.n, packed.k, packed.bits, dtype
        self.register_buffer("packed", packed.data, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.ops.yggtree.w4a8_mm(x2, self.packed)
        if y.shape[1] != self.out_features:  # the padded output columns cut
            y = y[:, : self.out_features]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
