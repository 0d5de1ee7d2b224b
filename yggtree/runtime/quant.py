"""Weight-only quantized linear layers on the CPU: int8, 4-bit group-wise, and a GGUF's own blocks.

(The ``w4a8`` format, blocks on int8-quantized activations with a kernel of ours, is
runtime/w4a8.py; :func:`quantize_linears` applies every format.)

A plan's ``weights`` (``--weights``; :func:`yggtree.shapes.weight_format`) picks the format of the
decoder-block linears and the LM head of the target and of the drafter's model. The int8 and
4-bit layers run on one of two product kernels, the one the plan's profile measured faster on
the machine (runtime/packed.py ``KERNELS``; ``yggtree profile`` times both on the model's own
products): our tiled kernel (``yggtree::tiled_mm`` / ``yggtree::tiled_q4_mm``, runtime/kernels.py:
w = q s per channel for int8 and w = s q + m per group for 4-bit, float32 scales (4-bit ones
float16 where every one is exact in it, as a GGUF's are), on the activations rounded per row to
16-bit integers -- an error of at most 1 / 65534 of the row's largest activation, against
bfloat16's 1 / 512 of each -- summed exactly in int32 (VNNI dot products where the CPU has them), then scaled in float32 in
a fixed order, the result rounded to the run's dtype once: csrc/tiled_mm.cpp states it), or
torch's, described next. On torch's kernel each product runs through one of torch's CPU kernels (signatures checked
with torch 2.13) *on bfloat16 activations with bfloat16 scales, whatever the run's dtype*: a quantized layer casts its input to bfloat16,
runs the kernel (which accumulates in float32 and rounds its output to bfloat16) and casts the
result back to the run's dtype (the bias, if any, is added in the run's dtype). This is the
format's definition -- the model actually run, to which speculation is exact -- not an
approximation of a float32 product. The reason is speed: torch's vectorized (AVX2/AVX-512) paths
of both kernels take bfloat16 only; their float32 paths are scalar loops, far slower at the
default model's shapes. One rule for every format and dtype,
gguf-native included (a bit-exact float32-activation variant of gguf-native was dropped: it was
only exact where it was too slow to use).

- ``int8``: ``aten._weight_int8pack_mm(x [M, K], q [N, K] int8, scales [N])``, y = x @ (q * s).T;
  symmetric per-output-channel scales (amax / 127).
- ``int4@G``: ``aten._weight_int4pack_mm_for_cpu(x [M, K], packed [N, K/2] uint8, G,
  scale_zeros [K/G, N, 2])``, w = (q - 8) * scale + zero with q in 0..15, G in 32/64/128/256, K a
  multiple of G, N a multiple of 16 (the head is padded with zero rows to one and the output cut);
  ``packed`` from ``aten._convert_weight_to_int4pack_for_cpu(q [N, K] int32, 1)``. Asymmetric
  min/max per group.
- ``gguf-native``: the GGUF file's own blocks of 32 on the int4 kernel with G = 32:
  Q4_0 (w = d (q - 8)): scale d, zero 0; Q4_1 (w = d q + m): scale d, zero m + 8 d; Q8_0
  (w = d q, q int8) as two 4-bit planes whose products are summed in the run's dtype, the high
  nibble (scale 16 d, zero 0, q >> 4 + 8) and the low one (scale d, zero 8 d, q & 15). d and m
  are float16 in the file. The codes hold the blocks exactly (:class:`Int4Codes` keeps scales
  and zeros in float32, where every one is exact -- 16 d and 8 d are, and m + 8 d is unless
  their exponents lie more than 13 binades apart: :func:`gguf_codes` checks each block and
  refuses one that is not -- so :func:`dequantize` gives llama.cpp's float32 weights bit for
  bit); the kernel then takes the scales and zeros rounded to bfloat16 (8 significant bits), so
  the weights it multiplies are llama.cpp's to within that rounding, and its products round in
  its own order (llama.cpp also quantizes the activations to 8 bits). On the tiled kernel a
  Q8_0 weight is one int8 stream with its blocks' float32 scales instead (:func:`gguf_int8`,
  an :class:`Int8Linear` with a scale per block: w = d q exactly, one product where two planes
  read half again as many bytes and ran twice the arithmetic). Tensors stored as float stay
  float (packed by runtime/packed.py), any other GGML type (K-quants) is refused.

Speculation is exact only if a row of a W-row product is bitwise its one-row product (the
kernels' rows are computed independently on the CPUs measured; :func:`check_batch_invariant`
checks it on the model's own layers before a speculative engine runs, and refuses otherwise).
Quantized layers replace the ``nn.Linear`` (its float weight is dropped: the codes are buffers,
not parameters, so a quantized model's state dict lacks them); q/k/v and gate/up become one
product each (the parts are set to None), as :func:`yggtree.runtime.packed.pack_linears` fuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import YggError
from .gguf_blocks import read_blocks
from .model import FUSED_PROJECTIONS

__all__ = ["Int4Codes", "quantize_int8", "quantize_int4", "gguf_codes", "gguf_int8", "dequantize", "int8_pairs", "q4_blocks",
           "Int8Linear", "Int4Linear", "QuantLinear", "quant_layers", "quantize_linears", "check_kernel",
           "check_batch_invariant"]

GGUF_BLOCK = 32  # elements per Q4_0 / Q4_1 / Q8_0 block
N_ALIGN = 16  # the int4 kernel's output width must be a multiple of this
INT8_K_ALIGN = 16  # torch's int8 kernel's input width must be a multiple of this (Int8Linear)
KERNEL_DTYPE = torch.bfloat16  # the kernels' activations, scales and outputs (module docstring)


@dataclass(frozen=True)
class Int4Codes:
    """One 4-bit plane of a [N, K] weight: w = (q - 8) * scale + zero per group of columns."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / group] float32
    zero: torch.Tensor  # [N, K / group] float32

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``w`` [N, K]: (q [N, K] int8, scale [N] float32),
    w ~ q * scale[:, None]; an all-zero row gets scale 1."""
    w = w.detach().float()
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group: int) -> Int4Codes:
    """Asymmetric 4-bit codes of ``w`` [N, K] per group of ``group`` columns (min/max: the
    group's minimum and maximum are represented to within rounding)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Codes(q.reshape(n, k).to(torch.uint8), scale, lo + 8 * scale)


def gguf_codes(kind: str, raw: torch.Tensor, name: str = "weight") -> list[Int4Codes]:
    """The int4 planes (group 32) holding exactly a GGUF tensor's blocks: ``raw`` [N, bytes per
    row] uint8 of GGML type ``kind`` (Q4_0, Q4_1: one plane; Q8_0: high and low nibble planes
    whose sum is the weight). YggError for another type or a block whose zero m + 8 d is not
    exact in float32."""
    fields = read_blocks(kind, raw)
    if fields is None:
        raise YggError(f"weights gguf-native: {name} is stored as {kind}; the int4 kernel runs "
                       "Q4_0, Q4_1 and Q8_0 blocks (use int8 or int4)")
    d, m, q = fields
    if kind == "Q8_0":
        hi = Int4Codes(((q >> 4) + 8).to(torch.uint8), 16 * d, torch.zeros_like(d))
        lo = Int4Codes((q & 15).to(torch.uint8), d, 8 * d)
        return [hi, lo]
    if kind == "Q4_0":
        return [Int4Codes(q, d, torch.zeros_like(d))]
    zero = m + 8 * d
    if not torch.equal(zero.double(), m.double() + 8 * d.double()):
        raise YggError(f"weights gguf-native: a Q4_1 block of {name} has no exact float32 zero "
                       "(m + 8 d rounds); it cannot run on the int4 kernel bit-exactly")
    return [Int4Codes(q, d, zero)]


def gguf_int8(kind: str, raw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GGUF Q8_0 tensor's own blocks as int8 codes and their scales, ``(q [N, K] int8, d [N, K /
    32] float32)`` with w = d q exactly (float16 d, exact in float32); None for another type."""
    if kind != "Q8_0" or raw is None:
        return None
    d, _, q = read_blocks(kind, raw)
    return q.to(torch.int8), d


def dequantize(planes: list[Int4Codes]) -> torch.Tensor:
    """The float32 weight [N, K] the planes stand for: sum of (q - 8) * scale + zero."""
    w = 0
    for c in planes:
        g = c.group
        w = w + (c.q.float() - 8) * c.scale.repeat_interleave(g, 1) + c.zero.repeat_interleave(g, 1)
    return w


# ----------------------------------------------------------------------------- layers


def int8_pairs(q: torch.Tensor) -> torch.Tensor:
    """The tiled kernel's int8 layout (csrc/tiled_mm.cpp) of codes ``q`` [N, K]: [T, K2 / 2, 32]
    int8, pair j of tile t holding q[16t + l][2j], q[16t + l][2j + 1] at bytes 2l, 2l + 1 (N padded
    with zero columns to 16 T, K with a zero input to K2, even)."""
    n, k = q.shape
    q = F.pad(q, (0, k % 2, 0, -n % N_ALIGN))
    return q.view(-1, N_ALIGN, q.shape[1] // 2, 2).permute(0, 2, 1, 3).reshape(q.shape[0] // N_ALIGN, -1, 32).contiguous()


def q4_blocks(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The tiled kernel's 4-bit layout (csrc/tiled_mm.cpp) of codes ``q`` [N, K] in 0..15 with
    scales ``s`` and offsets ``m`` [N, K / G] (w = s q + m per group of G inputs, G a multiple of
    32; float32 or float16, both alike; N a multiple of 16): one stream per tile, [T, K / G, 8 G
    + 32 e] uint8 (e the bytes of a scale), per group the codes (``w4a8.nibble_blocks``), then
    the 16 columns' s, then their m."""
    from .w4a8 import nibble_blocks

    n, k = q.shape
    t, b = n // N_ALIGN, s.shape[1]
    codes = nibble_blocks(q).reshape(t, b, (k // b) * 8)
    per_tile = lambda v: v.view(t, N_ALIGN, b).permute(0, 2, 1).contiguous().view(torch.uint8)  # noqa: E731
    return torch.cat([codes, per_tile(s), per_tile(m)], dim=2).contiguous()


def _int4_mm_cpu(
    x: torch.Tensor,  # [M, K] bfloat16 (KERNEL_DTYPE), contiguous
    packed: torch.Tensor,  # [Np, K / 2] uint8, the int4 kernel's layout (Np: N rounded up to 16)
    scale_zeros: torch.Tensor,  # [K / group, Np, 2] bfloat16
    group: int,
) -> torch.Tensor:
    """One plane's product: [M, Np] bfloat16. Nothing but the kernel call: the casts, the sum of
    planes and the cut of the padded rows are the caller's (:meth:`Int4Linear.forward`), where a
    compiled graph fuses them into its own kernels."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)


# The int4 product is an opaque op for torch.compile and AOTInductor (as runtime/packed.py's
# ``yggtree::packed_linear``): inside the step graphs' nested compile region (the decoder
# layer), inductor's own lowering of ``_weight_int4pack_mm_for_cpu`` (to
# ``_weight_int4pack_mm_cpu_tensor`` with the group size as a graph constant) fails at run time
# in torch 2.13 ("group size must be a scalar"); called through this op the graphs run the same
# aten kernel eager code does. The op holds the kernel call alone: every Python-level tensor
# operation inside it would run once per layer and step outside the compiled kernels (a wrapper
# that also cast, summed and cut did). The int8
# kernel needs no such op (inductor calls it as it is). The handle must outlive the module's
# import (dropping it unregisters the op).
_LIB = torch.library.Library("yggtree", "FRAGMENT")
_LIB.define("int4_mm(Tensor x, Tensor packed, Tensor scale_zeros, int group) -> Tensor")
_LIB.impl("int4_mm", _int4_mm_cpu, "CPU")
int4_mm = torch.ops.yggtree.int4_mm


@torch.library.register_fake("yggtree::int4_mm")
def _(x, packed, scale_zeros, group):
    return x.new_empty((x.shape[0], packed.shape[0]))


class QuantLinear(nn.Module):
    """A quantized linear layer (:class:`Int8Linear`, :class:`Int4Linear`)."""

    def product(self, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """The layer's product (``min_rows``: the packed layers' signature; quantized products never pad)."""
        return self(x)


class Int8Linear(QuantLinear):
    """``F.linear`` with int8 weights and per-output-channel scales, the result in the run's dtype
    ``dtype``, on one of two kernels (runtime/packed.py ``KERNELS``; the profile measures which is
    faster on the machine, as for float products):

    - ``torch``: ``aten._weight_int8pack_mm`` on bfloat16 activations and bfloat16 scales;
    - ``tiled``: ``yggtree::tiled_mm`` (runtime/kernels.py) on the row's 16-bit activations, the
      weight in tiles of 16 output columns (:func:`int8_pairs`), summed exactly in int32 and scaled
      by the float32 scale at the end (a row's result is independent of the call's other rows);
      or, for codes given with a scale per group of input columns (a GGUF Q8_0 weight's blocks:
      :func:`gguf_int8`), each group's sum scaled and accumulated in order.

    The two are different arithmetic, so an engine and its compiled packages use one."""

    qweight: torch.Tensor  # torch: [N, K] int8; tiled: [T, K2 / 2, 32] int8 (int8_pairs: N padded to 16 T, K to even K2)
    # torch: [N] bfloat16 (KERNEL_DTYPE); tiled: [T, 16] float32, or [T, K / G, 16] per group of G inputs
    scales: torch.Tensor
    bias: torch.Tensor | None  # [N] in the run's dtype

    def __init__(self, w: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype, kernel: str = "torch",
                 codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``w`` [N, K] quantized per output channel (:func:`quantize_int8`), or ``codes``
        ``(q [N, K] int8, scale [N] or [N, K / G] float32)`` held as they are (w None): a scale
        per group of G input columns runs on the tiled kernel only."""
        super().__init__()
        q, s = quantize_int8(w) if codes is None else codes
        if s.dim() == 2 and kernel != "tiled":
            raise ValueError("int8 codes with a scale per group of inputs run on the tiled kernel only")
        self.in_features, self.out_features, self.dtype, self.kernel = q.shape[1], q.shape[0], dtype, kernel
        if kernel == "tiled":
            from .kernels import load_library
            from .packed import pack_weight

            load_library()
            # padded columns: q 0, scale 0; a scale per column is one group: [T, 1, 16] -> [T, 16]
            tiles = pack_weight(s.float() if s.dim() == 2 else s.float()[:, None], "tiled")
            q, s = int8_pairs(q), tiles if s.dim() == 2 else tiles.reshape(-1, 16)
        elif kernel != "torch":
            raise ValueError(f"kernel must be torch or tiled, got {kernel!r}")
        elif q.shape[1] % INT8_K_ALIGN:
            # (torch 2.13's kernel reads past the row otherwise: wrong sums, or a crash)
            raise YggError(f"weights int8: an input width of {q.shape[1]} is not a multiple of {INT8_K_ALIGN}, which "
                           "torch's int8 kernel needs; the tiled kernel takes it (YGGTREE_KERNEL=tiled)")
        else:
            s = s.to(KERNEL_DTYPE)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scales", s, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "tiled":
            x2 = x2.to(torch.float32).contiguous()
            y = torch.ops.yggtree.tiled_mm(x2, self.qweight, self.scales)
            if y.shape[1] != self.out_features:  # the padded output columns cut
                y = y[:, : self.out_features]
            y = y.to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(KERNEL_DTYPE), self.qweight, self.scales).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(QuantLinear):
    """``F.linear`` with 4-bit group-wise weights, one or more planes whose products are summed (a
    GGUF Q8_0 weight is two), the result in the run's dtype ``dtype``, on one of two kernels
    (runtime/packed.py ``KERNELS``, measured by the profile as for float products):

    - ``torch``: ``_weight_int4pack_mm_for_cpu`` on bfloat16 activations and bfloat16 scales and
      zeros, each plane's product cast to the run's dtype and summed in it; the output width is
      padded to a multiple of 16 with zero rows inside the kernel and cut after it;
    - ``tiled``: ``yggtree::tiled_q4_mm`` (runtime/kernels.py) on the row's 16-bit activations
      with the scales, w = s q + m per group (m = zero - 8 s; codes, s and m in one stream per tile:
      :func:`q4_blocks`; s and m held in float16 where every one is exact in it, as a GGUF's Q4_0 /
      Q4_1 blocks', else float32), each row's integer sums exact and its float steps in a fixed
      order, the planes summed in float32 and cast once.

    The two are different arithmetic, so an engine and its compiled packages use one."""

    # torch: [P, Np, K / 2] uint8, the kernel's layout; Np = N rounded up to 16;
    # tiled: [P, T, K / group, 8 group + 32 e] uint8, codes, s and m per group (q4_blocks), N padded to 16 T
    packed: torch.Tensor
    # torch: [P, K / group, Np, 2] bfloat16 (KERNEL_DTYPE); tiled: None (in ``packed``)
    scale_zeros: torch.Tensor | None
    bias: torch.Tensor | None  # [N] in the run's dtype

    def __init__(self, planes: list[Int4Codes], bias: torch.Tensor | None, dtype: torch.dtype,
                 kernel: str = "torch") -> None:
        super().__init__()
        n, k = planes[0].q.shape
        self.in_features, self.out_features, self.group, self.dtype = k, n, planes[0].group, dtype
        self.kernel = kernel
        pad = -n % N_ALIGN
        packed, sz = [], []
        if kernel == "tiled":
            from .kernels import load_library

            load_library()
            sm = [[F.pad(v, (0, 0, 0, pad)).float() for v in (c.scale, c.zero - 8 * c.scale)] for c in planes]
            # float16 where every scale and offset is exact in it (a GGUF's own blocks): a sixth less to stream
            half = all(torch.equal(v.half().float(), v) for pair in sm for v in pair)
            for c, (s, m) in zip(planes, sm):  # zero columns: q 0, s 0, m 0
                packed.append(q4_blocks(F.pad(c.q, (0, 0, 0, pad)), *((s.half(), m.half()) if half else (s, m))))
        elif kernel == "torch":
            for c in planes:
                q = F.pad(c.q.to(torch.int32), (0, 0, 0, pad), value=8)  # zero rows: (8 - 8) * 1 + 0
                packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
                s = F.pad(torch.stack([c.scale, c.zero], -1), (0, 0, 0, 0, 0, pad))  # [Np, K/g, 2]
                sz.append(s.transpose(0, 1).to(KERNEL_DTYPE).contiguous())
        else:
            raise ValueError(f"kernel must be torch or tiled, got {kernel!r}")
        self.register_buffer("packed", torch.stack(packed), persistent=False)
        self.register_buffer("scale_zeros", torch.stack(sz) if sz else None, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = None
        if self.kernel == "tiled":
            x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
            for p in range(self.packed.shape[0]):  # the planes' products, summed in float32
                yp = torch.ops.yggtree.tiled_q4_mm(x2, self.packed[p])
                y = yp if y is None else y + yp
            y = y.to(x.dtype)
        else:
            x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
            for p in range(self.packed.shape[0]):  # the planes' products, each in x's dtype, summed in it
                yp = int4_mm(x2, self.packed[p], self.scale_zeros[p], self.group).to(x.dtype)
                y = yp if y is None else y + yp
        if y.shape[1] != self.out_features:  # the padded output rows cut
            y = y[:, : self.out_features].contiguous()
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quant_layers(model: nn.Module) -> list[nn.Module]:
    """The quantized layers inside ``model``, in module order."""
    from .w4a8 import W4A8Linear

    return [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear, W4A8Linear))]


def _kernel_name(fmt: str, kernel: str = "torch") -> str:
    if fmt in ("int8", "int4") and kernel == "tiled":
        return "yggtree::tiled_mm" if fmt == "int8" else "yggtree::tiled_q4_mm"
    return {"int8": "aten._weight_int8pack_mm on bfloat16 activations", "w4a8": "yggtree::w4a8_mm"}.get(
        fmt, "aten._weight_int4pack_mm_for_cpu on bfloat16 activations")


def check_kernel(fmt: str, dtype: torch.dtype, kernel: str = "torch") -> None:
    """YggError in one line unless this torch and CPU run ``fmt``'s kernel (``int8`` or ``int4``
    on ``kernel``, ``w4a8``) in a layer of a ``dtype`` run: a 1-row product of a 16 x 32 weight."""
    from .w4a8 import W4A8Linear, q4_1_blocks

    w = torch.zeros(16, GGUF_BLOCK)
    try:
        if fmt == "int8":
            if kernel == "torch":
                getattr(torch.ops.aten, "_weight_int8pack_mm")  # absent in old torch builds
            lin = Int8Linear(w, None, dtype, kernel)
        elif fmt == "w4a8":
            lin = W4A8Linear(q4_1_blocks(w), None, dtype)  # builds the kernel (YggError if it cannot)
        else:
            if kernel == "torch":
                getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            lin = Int4Linear([quantize_int4(w, GGUF_BLOCK)], None, dtype, kernel)
        lin(torch.zeros(1, GGUF_BLOCK, dtype=dtype))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        raise YggError(f"weights {fmt}: this torch/CPU cannot run {_kernel_name(fmt, kernel)} "
                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _cat_bias(lins: list[nn.Linear]) -> torch.Tensor | None:
    if all(p.bias is None for p in lins):
        return None
    return torch.cat([p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.out_features) for p in lins])


def _replace_linears(model: nn.Module, make, own: tuple[str, ...] | None = ("lm_head",)) -> int:
    """Replace ``model``'s decoder-block linears and its own linears named in ``own`` (None: all
    of them: an EAGLE head's ``fc`` and ``reduce`` too) by ``make(name, names, linears)``
    (the new layer's name, its parts' names and linears): one
    call per fused group (q/k/v, gate/up; the parts are set to None) and one per other linear;
    ``make`` returns the new layer, or None to keep the linears (a fused group is then offered
    part by part). Returns how many linears were replaced."""
    names = {id(m): n for n, m in model.named_modules()}
    n = 0
    for block in model.layers:
        for mod_name, attr, parts in FUSED_PROJECTIONS:
            mod = getattr(block, mod_name, None)
            lins = [getattr(mod, k, None) for k in parts]
            if getattr(mod, attr, False) is not None or not all(type(p) is nn.Linear for p in lins):
                continue
            layer = make(f"{names[id(mod)]}.{attr}", [names[id(p)] for p in lins], lins)
            if layer is None:
                continue
            setattr(mod, attr, layer)
            for k in parts:
                setattr(mod, k, None)
            n += len(lins)
    for mod in [*(m for block in model.layers for m in block.modules()), model]:
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear and (mod is not model or own is None or child_name in own):
                layer = make(names[id(child)], [names[id(child)]], [child])
                if layer is not None:
                    setattr(mod, child_name, layer)
                    n += 1
    return n


def quantize_linears(model: nn.Module, fmt: str, group: int | None = None,
                     raw: dict[str, tuple[str, torch.Tensor]] | None = None, kernel: str = "torch",
                     packed: dict | None = None) -> int:
    """Replace the ``nn.Linear`` layers of ``model.layers`` and its ``lm_head`` (under w4a8 all its
    own linears: an EAGLE head's ``fc`` and ``reduce`` too) by quantized ones in ``fmt`` (``int8``, ``int4`` with ``group``, ``gguf-native`` from ``raw``: state-dict name
    -> (GGML type, bytes), :func:`yggtree.runtime.loading.gguf_raw_weights`; ``w4a8``: the
    blocks of ``raw`` where it has them, Q4_1 otherwise, runtime/w4a8.py); q/k/v and gate/up
    become one layer each (w4a8: ``packed``, layer name -> ``w4a8.PackedBlocks``, gives the
    layers a cache kept, :func:`yggtree.runtime.w4a8.packed_of`). Returns how many linears were replaced. GGUF tensors stored as float
    stay ``nn.Linear`` under gguf-native. ``kernel`` is the int8 and 4-bit layers' product kernel
    (:class:`Int8Linear`, :class:`Int4Linear`).
    YggError (one line) for what cannot run: see the module docs."""
    from .w4a8 import W4A8Linear, cat_blocks, gguf_blocks, q4_1_blocks

    if fmt not in ("int8", "int4", "gguf-native", "w4a8"):
        raise YggError(f"not a quantized weight format: {fmt!r}")
    if fmt == "gguf-native" and raw is None:
        raise YggError("weights gguf-native need a GGUF model (use int8, int4 or w4a8)")
    dtype = model.embed_tokens.weight.dtype if hasattr(model, "embed_tokens") else next(model.parameters()).dtype
    if next(model.parameters()).device.type != "cpu":
        raise YggError(f"weights {fmt} run on the CPU only (torch's weight-only kernels)")
    check_kernel(fmt if fmt in ("int8", "w4a8") else "int4", dtype, kernel)

    def stored(name: str) -> tuple[str, torch.Tensor | None]:  # the GGUF tensor of a linear
        key = name + ".weight"
        if key == "lm_head.weight" and key not in raw:
            key = "embed_tokens.weight"  # tied
        return raw.get(key, ("?", None))

    def planes_of(name: str) -> list[Int4Codes] | None:  # gguf-native: the file's blocks
        kind, data = stored(name)
        if kind in ("F32", "F16", "BF16"):
            return None  # stays float
        if data is None:
            raise YggError(f"weights gguf-native: the GGUF file has no tensor for {name}.weight")
        return gguf_codes(kind, data, name + ".weight")

    def blocks_of(name: str, lin: nn.Linear):  # w4a8: the file's blocks, else Q4_1
        kind, data = stored(name) if raw is not None else ("F32", None)
        if data is None or kind in ("F32", "F16", "BF16"):
            return q4_1_blocks(lin.weight)
        return gguf_blocks(kind, data, name + ".weight")

    def make(name: str, names: list[str], lins: list[nn.Linear]) -> nn.Module | None:
        bias = _cat_bias(lins)
        if fmt == "w4a8":
            if lins[0].in_features % GGUF_BLOCK:
                raise YggError(f"weights w4a8: the input width {lins[0].in_features} of {name} is not a "
                               f"multiple of {GGUF_BLOCK}")
            if packed is not None:
                if name not in packed:
                    raise YggError(f"weights w4a8: the packed layers lack {name}")
                return W4A8Linear(None, bias, dtype, packed=packed[name])
            return W4A8Linear(cat_blocks([blocks_of(n, p) for n, p in zip(names, lins)]), bias, dtype)
        if raw is not None:
            eights = [gguf_int8(*stored(n)) for n in names] if kernel == "tiled" else [None]
            if None not in eights:  # Q8_0 on the tiled kernel: one int8 stream, a scale per block
                return Int8Linear(None, bias, dtype, kernel, codes=tuple(torch.cat(t) for t in zip(*eights)))
            planes = [planes_of(n) for n in names]
            if None in planes or len({len(p) for p in planes}) != 1:
                return None  # float, or a mixed group: each part on its own
            cat = [Int4Codes(*(torch.cat([getattr(p[i], f) for p in planes]) for f in ("q", "scale", "zero")))
                   for i in range(len(planes[0]))]
            return Int4Linear(cat, bias, dtype, kernel)
        w = torch.cat([p.weight.detach() for p in lins])
        if fmt == "int8":
            return Int8Linear(w, bias, dtype, kernel)
        if w.shape[1] % group:
            raise YggError(f"weights int4@{group}: the group size does not divide the input width "
                           f"{w.shape[1]} of {name} (choose a group size dividing it)")
        return Int4Linear([quantize_int4(w, group)], bias, dtype, kernel)

    # w4a8 takes every linear of a model (an EAGLE head's fc and reduce, read every drafted step
    # and cold after each verify, as a quarter of the bytes); the others, the blocks' and the LM
    # head (input widths a group size may not divide stay float there)
    n = _replace_linears(model, make, None if fmt == "w4a8" else ("lm_head",))
    if fmt == "w4a8" or kernel == "tiled":  # products on our library: its row-by-row attention and norm too
        from .kernels import use_library

        use_library(model)
    return n


def check_batch_invariant(model: nn.Module, rows: int, what: str = "target") -> None:
    """YggError (one line) unless every quantized layer kind of ``model`` (one per distinct shape)
    computes each row of a ``rows``-row product bitwise as its one-row product: what makes a
    verified tree node's logits the ones a plain step computes."""
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for layer in quant_layers(model):
        key = (type(layer), layer.in_features, layer.out_features, tuple(b.shape for b in layer.buffers()))
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(rows, layer.in_features, generator=gen).to(layer.dtype)
        with torch.no_grad():
            y = layer(x)
            for i in range(rows):
                if not torch.equal(y[i : i + 1], layer(x[i : i + 1])):
                    raise YggError(
                        f"the {type(layer).__name__} kernel of the {what} is not batch-invariant on this "
                        f"CPU (row {i} of a {rows}-row product differs from its 1-row product): "
                        "speculation would not be exact; decode plainly or use float weights")
