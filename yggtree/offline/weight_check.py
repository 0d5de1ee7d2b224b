"""Which weight formats can run for a plan's models on this machine, and why not.

Each candidate is probed with runtime/quant.py's own checks before a tune searches it:
``check_kernel`` (this torch/CPU runs the weight-only kernel for the dtype) and
``check_batch_invariant`` on one probe layer per input width of the models (``rows`` = the widest
verify); ``int4@G`` needs G to divide every input width of the models it quantizes, ``gguf-native``
(and ``w4a8`` of a GGUF target) a GGUF target whose block tensors are Q4_0, Q4_1 or Q8_0 (or
float)."""

from __future__ import annotations

from ..errors import YggError
from ..shapes import weight_format

__all__ = ["weight_problem", "weight_problems", "GGUF_NATIVE_TYPES"]

GGUF_NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F32", "F16", "BF16")  # runtime/quant.py's blocks, or float


def _quantized_configs(base) -> list:
    """The ModelConfigs of the models a quantized format replaces linears of: the target, and a
    standalone LM drafter (an EAGLE head keeps float weights; ``self`` is the target)."""
    from ..runtime.prepare import drafter_feeds_leaves
    from ..runtime.loading import load_config, resolve_model

    cfgs = [load_config(resolve_model(base.target))]
    if base.drafter not in (None, "self") and drafter_feeds_leaves(base):
        cfgs.append(load_config(resolve_model(base.drafter)))
    return cfgs


def _input_widths(cfgs) -> list[int]:
    """Every input width K of the models' quantized products (q/k/v, gate/up and the head read
    the hidden size, o the heads, down the MLP)."""
    return sorted({k for c in cfgs for k in (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size)})


def _gguf_problem(base, kernel: str = "the int4 kernel runs", need_gguf: bool = True) -> str | None:
    """Why ``base``'s target has no blocks ``kernel`` reads (not a GGUF file, when ``need_gguf``;
    K-quant blocks); None when it has, or is no GGUF file and need not be."""
    from ..runtime.loading import resolve_model

    src = resolve_model(base.target)
    if src.kind != "gguf":
        return f"the target {src.path.name} is not a GGUF file" if need_gguf else None
    from ..runtime.gguf_file import read_gguf

    try:
        kinds = {t.kind.name for t in read_gguf(src.path).tensors if len(t.shape) == 2}
    except YggError as e:
        return str(e)
    other = sorted(kinds - set(GGUF_NATIVE_TYPES))
    return f"the target stores {', '.join(other)} blocks ({kernel} Q4_0, Q4_1, Q8_0)" if other else None


def weight_problem(fmt: str, base, rows: int) -> str | None:
    """Why ``fmt`` (canonical) cannot run for ``base``'s models on this machine (None: it can):
    quant.check_kernel, the group against the models' input widths, a GGUF target's block types
    for gguf-native, and quant.check_batch_invariant on one probe layer per input width with
    ``rows`` rows."""
    import torch

    from ..runtime.quant import Int4Linear, Int8Linear, check_batch_invariant, check_kernel, quantize_int4
    from ..runtime.w4a8 import W4A8Linear, q4_1_blocks

    name, group = weight_format(fmt, base.dtype)
    if name == base.dtype:
        return None  # float weights in the activations' dtype: the packed products
    try:
        if name == "gguf-native":
            why = _gguf_problem(base)
            if why is not None:
                return why
            group = 32  # quant.GGUF_BLOCK: the file's blocks run on the int4 kernel
        if name == "w4a8":
            why = _gguf_problem(base, "the w4a8 kernel reads", need_gguf=False)
            if why is not None:
                return why
            group = 32  # w4a8.BLOCK
        dtype = getattr(torch, base.dtype)
        check_kernel(name if name in ("int8", "w4a8") else "int4", dtype)
        widths = _input_widths(_quantized_configs(base))
        bad = [k for k in widths if group and k % group]
        if bad:
            return f"group {group} does not divide the input width {bad[0]} of the model"
        gen = torch.Generator().manual_seed(0)
        probes = []
        for k in widths:
            w = torch.randn(32, k, generator=gen)
            probes.append(Int8Linear(w, None, dtype) if name == "int8"
                          else W4A8Linear(q4_1_blocks(w), None, dtype) if name == "w4a8"
                          else Int4Linear([quantize_int4(w, group)], None, dtype))
        check_batch_invariant(torch.nn.ModuleList(probes), max(rows, 2), "probe layers")
    except YggError as e:
        return str(e)
    return None


def weight_problems(base, formats, rows: int) -> dict[str, str]:
    """Every format of ``formats`` that cannot run here, with why (:func:`weight_problem`)."""
    out = {}
    for fmt in formats:
        why = weight_problem(fmt, base, rows)
        if why is not None:
            out[fmt] = why
    return out
