"""A GGUF tensor's 32-weight blocks read from its bytes (Q4_0, Q4_1, Q8_0), for the formats that
run them (runtime/quant.py's gguf-native, runtime/w4a8.py).

Q4_0: float16 d, 16 bytes of nibbles, w = d (q - 8); Q4_1: float16 d and m, 16 bytes of nibbles,
w = d q + m; Q8_0: float16 d, 32 int8 q, w = d q. GGML's nibble order: byte j holds element j
(low nibble) and j + 16 (high).
"""

from __future__ import annotations

import torch

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def f16_at(raw: torch.Tensor, at: int) -> torch.Tensor:
    """Float16 at byte ``at`` of every block: raw [N, nb, size] uint8 -> [N, nb] float32."""
    return raw[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGML's 4-bit order: [.., 16] bytes -> [.., 32] codes 0..15."""
    return torch.cat([qs & 15, qs >> 4], -1)


def read_blocks(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """(d [N, K/32] float32, m [N, K/32] float32 for Q4_1 else None, q [N, K]: uint8 codes 0..15
    for Q4_0 / Q4_1, int16 -128..127 for Q8_0) of ``raw`` [N, bytes per row] uint8 of GGML type
    ``kind``; None for another type."""
    if kind not in BLOCK_BYTES:
        return None
    n = raw.shape[0]
    b = raw.reshape(n, -1, BLOCK_BYTES[kind])  # [N, nb, block bytes]
    d = f16_at(b, 0)
    if kind == "Q8_0":
        return d, None, b[..., 2:].contiguous().view(torch.int8).to(torch.int16).reshape(n, -1)
    q = nibbles(b[..., 4 if kind == "Q4_1" else 2 :]).reshape(n, -1)
    return d, (f16_at(b, 2) if kind == "Q4_1" else None), q


def dequantize(kind: str, raw: torch.Tensor) -> torch.Tensor | None:
    """The float32 weights [N, K] of ``raw`` [N, bytes per row] uint8 of GGML type ``kind``, each
    d (q - 8), d q + m or d q (Q4_0, Q4_1, Q8_0) in float32 as gguf.quants computes it (the same
    bits, several times faster); None for another type."""
    fields = read_blocks(kind, raw)
    if fields is None:
        return None
    d, m, q = fields
    q = q.reshape(*d.shape, 32).float()  # [N, K / 32, 32]
    w = (q - 8 if kind == "Q4_0" else q) * d[..., None]
    return (w if m is None else w + m[..., None]).reshape(raw.shape[0], -1)

