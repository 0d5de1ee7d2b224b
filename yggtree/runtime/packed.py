"""oneDNN-packed linear layers for the CPU: wide verification at the price of one token.

A speculative step verifies W tokens with the same weight matrices a plain step multiplies one
token by, so on a memory-bound device it should cost about the same. With ``F.linear`` it did
not on the CPUs measured so far: for a few to 16 rows the BLAS picks kernels that are far from
memory-bound, while oneDNN with its weights reordered once into its blocked layout streams them
at every M (``scripts/bench_packed.py`` measures both). Where the
packed kernel is *batch-invariant* (row i of an M-row product bitwise the one-row product of row
i), verifying a tree computes every node exactly as a plain step would compute it; that depends
on the shape, the padding and the CPU (below, and tests/test_packed.py).

:func:`pack_linears` swaps every ``nn.Linear`` inside a model's decoder blocks (and its LM head) for a
:class:`PackedLinear` that keeps the original weight (state dict, tying, checks) and adds the
packed copy as a non-persistent buffer (so packed models hold their block weights twice). The
product runs through the custom op ``yggtree::packed_linear``, which torch.compile and
AOTInductor treat as an opaque call taking the packed tensor as an ordinary input, so one graph
still serves every layer (regional compilation lifts weights to graph inputs).

Short products can run padded: with ``min_rows`` > 1 a product of fewer rows is computed on that
many (zero rows appended, dropped from the result), which on some CPUs reaches a faster oneDNN
kernel and on others is slower. Which value is best is a property of the machine: ``yggtree
profile`` measures it and records it in the profile (``packed_padding``), and a plan's engine
packs its layers with its profile's value (:func:`yggtree.runtime.padding.plan_min_rows`); 1 is no padding.
The value is each packed layer's attribute, passed to the op as an argument, so compiled graphs
and AOTInductor packages hold it as a constant (:func:`yggtree.runtime.aoti.block_key` names it).

Two product kernels, chosen per machine by measurement (``yggtree profile`` times both on the
model's own products and records the faster in the profile's ``packed_padding.kernel``; a plan's
engine and its compiled packages use it, :func:`yggtree.runtime.padding.plan_kernel`):

- ``torch``: torch's own kernel, here oneDNN with the weight reordered once into its blocked
  layout, run through ``mkldnn._linear_pointwise`` (the op ``yggtree::packed_linear``; for
  int8 weights, runtime/quant.py, ``aten._weight_int8pack_mm``);
- ``tiled``: the weight in tiles of 16 output columns, [T, in, 16], run through our kernel
  ``yggtree::tiled_mm`` (runtime/kernels.py, ``csrc/tiled_mm.cpp``): float32 accumulation in a
  fixed order per row, so batch-invariant by construction at any padding and thread count (no
  padding is needed), and a plain contiguous stream a step reads at the memory's speed. It needs
  a CPU our kernel library runs on (AVX2 or AVX-512); bfloat16 weights are widened exactly, the
  activations go in as float32 (exact from bfloat16) and the result is rounded to the run's
  dtype (int8 weights run on 16-bit integer activations instead, scaled per output column at
  the end: runtime/quant.py).

Batch invariance is not a property of the op everywhere, and padding can change bits: oneDNN
may run a one-row product on another kernel than an M-row one, so that a product rounds
otherwise at one row than inside a product of several rows, while padded it is invariant.
:func:`padding_is_invariant` checks a padding on a model's own
layer shapes at the thread count it is called at, and :func:`invariant_min_rows` finds the
smallest invariant one: the profile only chooses invariant paddings, and a speculative engine
raises its padding to an invariant one at start (:func:`yggtree.runtime.build.build_engine`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .model import FUSED_PROJECTIONS

__all__ = ["KERNELS", "packed_linear", "tiled_linear", "pack_weight", "PackedLinear", "PackedConcat", "can_pack", "pack_linears",
           "packed_layers", "min_rows_of", "kernel_of", "padding_is_invariant", "invariant_min_rows"]

KERNELS = ("torch", "tiled")  # the product kernels of packed layers (module docstring)
TILE = 16  # output columns per tile of the tiled layout (csrc/tiled_mm.cpp)


def _packed_linear_cpu(
    x: torch.Tensor,  # [..., in]
    packed: torch.Tensor,  # oneDNN-reordered [out, in] weight (torch.ops.mkldnn._reorder_linear_weight)
    out_features: int,  # out (the packed tensor is opaque: the output width is passed along)
    bias: torch.Tensor | None = None,  # [out]
    min_rows: int = 1,  # products of fewer rows run padded with zero rows to this many (1: never)
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by oneDNN from ``packed``: [..., out]. oneDNN
    flattens and restores the leading dimensions itself. A product of fewer than ``min_rows``
    rows runs on ``min_rows`` rows, the real ones followed by zero rows that are dropped from the
    result (bitwise what they were unpadded only where the kernel is batch-invariant, see
    :func:`padding_is_invariant`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows < min_rows:
        pad = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, min_rows - rows))
        y = torch.ops.mkldnn._linear_pointwise.default(pad, packed, bias, "none", [], "")
        return y[:rows].reshape(*x.shape[:-1], out_features)
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


# A plain library definition rather than ``torch.library.custom_op``: the op is called ~120-200
# times per decode step, and custom_op's Python wrapping costs several times what a kernel
# registered straight on the dispatch keys adds to the oneDNN call. The handle must outlive the
# module's import (dropping it unregisters the op).
_LIB = torch.library.Library("yggtree", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None, int min_rows=1) -> Tensor")
for _key in ("CPU", "MkldnnCPU"):  # ``packed`` is an mkldnn tensor, the rest are dense CPU tensors
    _LIB.impl("packed_linear", _packed_linear_cpu, _key)
packed_linear = torch.ops.yggtree.packed_linear


@torch.library.register_fake("yggtree::packed_linear")
def _(x, packed, out_features, bias=None, min_rows=1):
    return x.new_empty((*x.shape[:-1], out_features))


def tiled_linear(
    x: torch.Tensor,  # [..., in]
    tiles: torch.Tensor,  # [T, in, 16]: the weight's output columns in tiles of 16 (_pack), N padded
    out_features: int,  # out <= 16 T
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by ``yggtree::tiled_mm`` from ``tiles``: [..., out],
    in ``x``'s dtype (the kernel takes and returns float32; the bias is added in ``x``'s dtype)."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    y = torch.ops.yggtree.tiled_mm(x2, tiles, x2.new_empty(0))
    if y.shape[1] != out_features:  # the padded output columns cut
        y = y[:, :out_features]
    y = y.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def pack_weight(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """The layout ``kernel`` reads a [out, in] weight in: oneDNN's blocked layout (an mkldnn
    tensor), or tiles of 16 output columns [T, in, 16] (zero columns pad out to 16 T)."""
    w = weight.detach()
    if kernel == "torch":
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, -n % TILE))
    return w.view(-1, TILE, k).permute(0, 2, 1).contiguous()


def _check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return kernel


def _check_min_rows(min_rows: int) -> int:
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
        raise ValueError(f"min_rows must be an integer >= 1, got {min_rows!r}")
    return min_rows


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose product runs on a packed copy of its weight, in the layout of its
    kernel (:data:`KERNELS`: oneDNN's, or the tiled kernel's tiles)."""

    packed: torch.Tensor  # ``weight`` in the kernel's layout: oneDNN's (an mkldnn tensor) or [T, in, 16] tiles
    min_rows: int = 1  # products of fewer rows run padded to this many (1: no padding)
    kernel: str = "torch"  # KERNELS

    @classmethod
    def of(cls, lin: nn.Linear, min_rows: int = 1, kernel: str = "torch") -> "PackedLinear":
        with torch.device("meta"):
            out = cls(lin.in_features, lin.out_features, bias=lin.bias is not None)
        out.weight = lin.weight  # shared, not copied
        out.bias = lin.bias
        out.kernel = _check_kernel(kernel)
        out.register_buffer("packed", pack_weight(lin.weight, kernel), persistent=False)
        out.min_rows = _check_min_rows(min_rows)
        return out

    def product(self, x: torch.Tensor, min_rows: int) -> torch.Tensor:
        """The layer's product padded to ``min_rows`` (the tiled kernel never pads)."""
        if self.kernel == "tiled":
            return tiled_linear(x, self.packed, self.out_features, self.bias)
        return packed_linear(x, self.packed, self.out_features, self.bias, min_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.min_rows)


class PackedConcat(nn.Module):
    """Linear layers that read the same input (q/k/v, gate/up) as ONE packed product over their
    weights stacked by rows: ``forward(x)`` is ``cat([lin(x) for lin in parts], -1)``.

    One product instead of three (or two) saves the per-call cost of the op and of oneDNN (about
    90 calls per decode step of the default model; ``scripts/ab_fusion.py`` measures it). The parts
    keep their own weights (state dict, checks); this module holds only the packed stack, so
    packing still costs one extra copy of the weights. Short products are padded to
    ``min_rows``, as for :class:`PackedLinear`."""

    packed: torch.Tensor  # cat([p.weight for p in parts]) [sum(sizes), in] in the kernel's layout (PackedLinear)
    bias: torch.Tensor | None  # [sum(sizes)], zeros for parts without one; None if none has one

    def __init__(self, parts: list[nn.Linear], min_rows: int = 1, kernel: str = "torch") -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("PackedConcat parts must share their input width")
        self.min_rows = _check_min_rows(min_rows)
        self.kernel = _check_kernel(kernel)
        self.in_features = parts[0].in_features
        self.sizes = tuple(p.out_features for p in parts)
        self.out_features = sum(self.sizes)
        self.register_buffer("packed", pack_weight(torch.cat([p.weight.detach() for p in parts]), kernel), persistent=False)
        bias = None
        if any(p.bias is not None for p in parts):
            w = parts[0].weight
            bias = torch.cat([p.bias.detach() if p.bias is not None else w.new_zeros(p.out_features)
                              for p in parts])
        self.register_buffer("bias", bias, persistent=False)

    product = PackedLinear.product

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., sum(sizes)]
        return self.product(x, self.min_rows)


def can_pack(model: nn.Module, kernel: str = "torch") -> bool:
    """True when the model's weights live on the CPU in a dtype ``kernel`` runs: oneDNN float32,
    or bfloat16 on a CPU with native bf16 support; the tiled kernel float32 and bfloat16 on a
    CPU where our kernel library loads (:func:`yggtree.runtime.kernels.library_usable`: built on
    first use; one stderr line where it cannot be)."""
    w = next(model.parameters())
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return False
    if _check_kernel(kernel) == "tiled":
        from .kernels import library_missing, library_usable

        return not library_missing() and library_usable()
    if not torch.backends.mkldnn.is_available():
        return False
    return w.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module, fuse: bool = True, min_rows: int = 1, kernel: str = "torch") -> int:
    """Pack the ``nn.Linear`` layers of ``model.layers`` (its decoder blocks) and the model's own
    (``lm_head``; an EAGLE head's ``fc`` and ``reduce`` too) in place for the product kernel
    ``kernel`` (:data:`KERNELS`); returns how many
    linear layers were packed (0 where :func:`can_pack` is False, or when they are packed
    already: layers packed before keep their ``min_rows`` and kernel). The tiled kernel loads
    the kernel library (built on first use) and, in a float32 or bfloat16 model, sets its
    attention layers to the library's row-by-row attention (:func:`yggtree.runtime.kernels.use_rows_attention`).
    Every packed layer pads products of fewer than ``min_rows`` rows to that many (1: none;
    see the module docstring).

    Each one becomes a :class:`PackedLinear`, except, with ``fuse``, the attention's q/k/v and the
    MLP's gate/up projections of a decoder block, which become one :class:`PackedConcat` each
    (``attn.qkv``, ``mlp.gate_up``; the block's forward uses them instead of the parts).

    The LM head matters most: it is the largest product (49152 x 576 for the default model), and
    ``F.linear`` pays most there for a few rows."""
    _check_min_rows(min_rows)
    if not can_pack(model, kernel):
        return 0
    if kernel == "tiled":  # our library's products, and its row-by-row attention and norm
        from .kernels import use_library

        use_library(model)
    n, fused_parts = 0, set()
    for block in model.layers:
        for mod_name, attr, names in FUSED_PROJECTIONS:
            mod = getattr(block, mod_name, None)
            if getattr(mod, attr, False) is None and fuse:  # a fusion hook, not yet fused
                parts = [getattr(mod, k, None) for k in names]
                if all(type(p) is nn.Linear for p in parts):
                    setattr(mod, attr, PackedConcat(parts, min_rows, kernel))
                    n += len(parts)
            if getattr(mod, attr, None) is not None:
                fused_parts.update(id(getattr(mod, k)) for k in names)
    for mod in [*(m for block in model.layers for m in block.modules()), model]:
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear and id(child) not in fused_parts:
                setattr(mod, child_name, PackedLinear.of(child, min_rows, kernel))
                n += 1
    return n


def packed_layers(model: nn.Module) -> list[nn.Module]:
    """The packed layers (:class:`PackedLinear`, :class:`PackedConcat`) inside ``model``, in
    module order: for a packed decoder, one per product of a step."""
    return [m for m in model.modules() if isinstance(m, (PackedLinear, PackedConcat))]


def _one_setting(model: nn.Module, name: str):
    """The value of the setting ``name`` (``min_rows``, ``kernel``) on every packed layer of
    ``model`` (None when none is packed); ValueError if they differ (:func:`pack_linears` gives
    one model one value of each)."""
    values = {getattr(m, name) for m in packed_layers(model)}
    if len(values) > 1:
        raise ValueError(f"packed layers with different {name} {sorted(values)}")
    return values.pop() if values else None


def min_rows_of(model: nn.Module) -> int | None:
    """The ``min_rows`` of ``model``'s packed layers (:func:`_one_setting`)."""
    return _one_setting(model, "min_rows")


def kernel_of(model: nn.Module) -> str | None:
    """The product kernel of ``model``'s packed layers (:func:`_one_setting`)."""
    return _one_setting(model, "kernel")


MAX_SAMPLE_ROWS = 512  # rows a batch-invariance check draws per layer at most (narrow layers)


def padding_is_invariant(model: nn.Module, min_rows: int, widths: Iterable[int], samples: int = 1 << 18) -> bool:
    """True when every packed product of ``model`` (one layer per distinct shape, dtype and
    bias), padded to ``min_rows``, computes each row of an M-row product bitwise as the product
    of that row alone (itself padded to ``min_rows``), for every M in ``widths`` (the row counts
    the products run at; 1, a plain step, is always one), at the current thread count.

    Products of fewer than ``min_rows`` rows run on ``min_rows`` rows, so the row counts that
    reach oneDNN are ``R = max(M, min_rows)``; each R is run on consecutive blocks of R random
    rows (every row position, the other rows random rather than zero) and compared row by row
    with the padded one-row products of the same rows. A kernel that rounds otherwise may differ
    in only a few outputs of a row (bfloat16 outputs at 1536 -> 576 on one CPU: about 1 in
    8000), so each R is checked on at least ``samples`` outputs (rows times the layer's width;
    at most :data:`MAX_SAMPLE_ROWS` rows, or the widest R). A width not in ``widths`` is not
    checked."""
    rows = sorted({max(int(m), _check_min_rows(min_rows)) for m in (1, *widths)})
    layers = {}
    for layer in packed_layers(model):
        layers.setdefault((layer.in_features, layer.out_features, layer.packed.dtype, layer.bias is None, layer.kernel), layer)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers.values():
            def product(x, layer=layer):
                return layer.product(x, min_rows)

            n = max(rows[-1], min(-(-samples // layer.out_features), MAX_SAMPLE_ROWS))
            x = torch.randn(n, layer.in_features, generator=gen).to(layer.packed.dtype)
            one = torch.cat([product(x[i : i + 1]) for i in range(n)])
            for r in rows[1:] if rows[0] == 1 else rows:  # R = 1 is the one-row product itself
                for i in range(0, n, r):
                    i = min(i, n - r)
                    if not torch.equal(product(x[i : i + r]), one[i : i + r]):
                        return False
    return True


def invariant_min_rows(model: nn.Module, widths: Iterable[int], start: int = 1) -> int | None:
    """The smallest padding >= ``start`` at which ``model``'s packed products are batch-invariant
    at ``widths`` (:func:`padding_is_invariant`, at the current thread count), or None when none
    up to the largest width is (padded to it, every product runs on that many rows)."""
    widths = tuple(widths)
    top = max(start, *widths, 1)
    return next((m for m in range(start, top + 1) if padding_is_invariant(model, m, widths)), None)
