"""Model preparation: an engine's target and drafter, loaded and made ready for graphs.

:func:`prepare_models` is the one place that decides how the models of an engine spec
(``runtime/build.py`` ``EngineSpec``) are prepared, for everything that runs them: ``build_engine``
(and through it the profiler and the calibration) and ``yggtree compile``, whose packages hold what
it decided (packed weights, padding, attention formulation, KV cache dtype) as constants. In order:

1. the target, on the spec's device, and (where asked or needed) its tokenizer;
2. the KV cache dtype (before any cache exists: caches are allocated in it);
3. the drafter (``self``, a standalone LM, an EAGLE head), refused if its vocabulary differs;
4. the weight format (runtime/quant.py), then packed weights for the product kernel for what stays
   float (runtime/packed.py), short products padded to ``min_rows`` rows;
5. for an engine verifying trees, that padding raised where it is not batch-invariant here;
6. the attention formulation (``set_attention_rows``) the engine computes with, the drafter's too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import YggError
from ..shapes import check_sizes, kv_cache_dtype, weight_format
from .artifacts import DEFAULT_DRAFTER_DIR
from .drafters import Drafter, LMDrafter, check_pair
from .loading import load_model, load_tokenizer, resolve_model
from .model import Transformer, native_attention, set_attention_rows, set_kv_dtype
from .packed import pack_linears
from .schedule import resolve_plan

FLOAT_FORMATS = ("float32", "bfloat16")  # weight formats that quantize nothing


@dataclass(frozen=True)
class Prepared:
    """The models :func:`prepare_models` made ready."""

    target: Transformer
    drafter: Drafter | None  # None: plain decoding (or lookup-only)
    tokenizer: object | None  # the target's; None where not asked for and not needed
    min_rows: int | None  # the padding the packed products run at (None: nothing packed)


def prepare_models(spec, tokenizer: bool = True) -> Prepared:
    """The target and drafter of ``spec`` (an ``EngineSpec``) prepared as the module docstring
    lists, after refusing impossible sizes, formats and kernels before anything loads
    (:func:`check_spec`). ``tokenizer=False`` loads the target's tokenizer only where the
    drafter's vocabulary check needs it (a drafter other than ``self``). Call it before any
    graph, cache or compiled package is made for the models."""
    fmt = check_spec(spec)
    if fmt not in FLOAT_FORMATS:  # ... and a kernel this torch/CPU does not run
        import torch

        from .quant import check_kernel

        check_kernel("int8" if fmt == "int8" else "int4", getattr(torch, spec.dtype), spec.kernel)
    src = resolve_model(spec.model)
    target = load_model(src, spec.dtype).to(spec.device)
    set_kv_dtype(target, kv_cache_dtype(spec.kv_cache, spec.dtype))
    tok = load_tokenizer(src) if tokenizer or spec.drafter not in (None, "self") else None
    drafter = load_drafter(spec, target, tok) if spec.drafter else None
    if spec.pack:  # oneDNN- or tiled-packed block weights on a CPU (runtime/packed.py)
        pack_models(target, drafter, spec.min_rows, spec.weights, src, spec.drafter, spec.kernel, spec.drafter_weights)
    else:
        quantize_models(target, drafter, spec.weights, src, spec.drafter, spec.kernel, spec.drafter_weights)
    from .packed import min_rows_of, packed_layers

    verifies = drafter is not None or spec.lookup > 0  # a tree to verify: drafted or looked up
    rows = engine_padding(spec, target) if verifies else min_rows_of(target)
    if drafter is not None and rows is not None and min_rows_of(drafter.graphs.model) not in (None, rows):
        # the drafter's products at the target's padding, as pack_models pads both in an engine
        # built with it (a compiled plan's: its packages hold the padding, their keys name it)
        for layer in packed_layers(drafter.graphs.model):
            layer.min_rows = rows
    if drafter is not None:
        drafter_attention(drafter.graphs.model, target)
    set_attention_rows(target, spec.prefill_chunk)
    if drafter is not None:
        drafter_rows(drafter.graphs.model, spec.prefill_chunk)
    return Prepared(target, drafter, tok, rows)


def drafter_attention(model, target) -> None:
    """A drafter ``model`` whose layers run the library's attention runs the ``target``'s kernel for
    tree rows: each was chosen on its own KV cache's dtype (runtime/attention_choice.py), and a
    compiled plan records one kernel, the target's, with which its engine loads both models'
    packages."""
    if native_attention(target) and native_attention(model):
        from .attention_choice import set_native_attention

        set_native_attention([model], native_attention(target))


def drafter_rows(model, prefill_chunk: int) -> None:
    """A drafter's calls up to a prefill chunk compute attention row by row, as the target's do,
    where its layers run the library's row attention (``native_rows``): that kernel reads only
    each row's visible slots, where the grouped products read the whole context bucket (a draft
    call of 2 rows, the head's D_max + 1, a catch-up's prefill chunk: docs/results.md section 18). A
    drafter's rows need no invariance (its proposals are verified): elsewhere the grouped products
    stay, faster there."""
    if native_attention(model) is not None:
        set_attention_rows(model, prefill_chunk)


def check_spec(spec) -> str:
    """Refuse, before anything loads, impossible sizes and trees and an unknown weight format or
    group size or KV cache dtype; returns the format's name."""
    check_sizes(spec.max_context, spec.prefill_chunk, spec.tree if spec.drafter else None)
    kv_cache_dtype(spec.kv_cache, spec.dtype)
    fmt, _ = weight_format(spec.weights, spec.dtype)
    if spec.drafter_weights is not None and spec.drafter:
        dfmt, _ = weight_format(spec.drafter_weights, spec.dtype)
        if spec.drafter == "self" and dfmt != fmt:
            raise YggError(f"drafter 'self' is the target's own weights: it cannot run in {dfmt} beside a {fmt} target")
    return fmt


# ----------------------------------------------------------------------------- drafters


def eagle_head_dir(name: str) -> Path | None:
    """The EAGLE head directory a drafter name stands for ("default": the shipped one), None for
    a standalone LM ("self", or a model path / GGUF / HF directory)."""
    if name == "default":
        return DEFAULT_DRAFTER_DIR
    if name == "self":
        return None
    from .eagle_config import is_eagle_dir

    path = Path(name).expanduser()
    return path if path.is_dir() and is_eagle_dir(path) else None


def drafter_feeds_leaves(plan) -> bool:
    """``Drafter.feeds_leaves`` of the drafter class ``plan`` names, without loading it."""
    if plan.drafter is None or eagle_head_dir(plan.drafter) is None:
        return LMDrafter.feeds_leaves
    from .eagle import EagleDrafter

    return EagleDrafter.feeds_leaves


def drafter_absorbs(plan) -> int:
    """``Drafter.absorbs`` of the drafter ``plan`` names, without loading it: an EAGLE head's
    D_max (the plan's ``d_max``), else 0."""
    if plan.drafter is None or eagle_head_dir(plan.drafter) is None:
        return LMDrafter.absorbs
    return int(plan.d_max)


def load_drafter(spec, target, tokenizer):
    """The drafter named by ``spec.drafter`` for ``target``; refuses mismatched vocabularies."""
    name = spec.drafter
    if name == "self":
        return LMDrafter(target.shared_copy(), spec.mode)
    head = eagle_head_dir(name)
    if name == "default":
        # the shipped EAGLE head was trained for the embedded default target only
        from .loading import default_model_path

        is_default = spec.model == "default"
        if not is_default:
            try:
                is_default = Path(spec.model).expanduser().resolve() == default_model_path().resolve()
            except (OSError, YggError):
                is_default = False
        if not is_default:
            raise YggError(
                f"no default drafter exists for {spec.model} (the shipped one is for the embedded "
                "default model); train one with `yggtree distill --model <target>` and pass its "
                "directory, or use --drafter self / --no-speculate"
            )
    if head is not None:  # the feature-conditioned head
        from .eagle import load_eagle

        return load_eagle(head, target, spec.mode, max_depth=spec.tree.draft_depth)
    src = resolve_model(name)
    model = load_model(src, spec.dtype)
    check_pair(target.cfg.vocab_size, model.cfg.vocab_size, tokenizer, load_tokenizer(src),
               str(Path(name).expanduser()))
    return LMDrafter(model, spec.mode)


# ----------------------------------------------------------------------------- weights


def quantize_models(target, drafter, weights: str | None, src, drafter_name: str | None = None,
                    kernel: str = "torch", drafter_weights: str | None = None) -> None:
    """The weight format ``weights`` (runtime/quant.py; None: float, nothing to do) for the
    target (loaded from ``src``), and ``drafter_weights`` (None: ``weights``) for the drafter's
    model. Under ``gguf-native`` a drafter gets its GGUF's own blocks (``self``: the target's; a
    standalone GGUF model: its file's); an EAGLE head or an HF drafter has none and keeps float
    weights. Under ``w4a8`` every model's linears become blocks: a GGUF's own where it has them,
    Q4_1 from float otherwise (an EAGLE head). ``kernel``: the int8 layers' product kernel
    (runtime/quant.py ``Int8Linear``)."""
    from .loading import cached_w4a8_layers, gguf_raw_weights
    from .quant import quantize_linears

    dtype = str(target.embed_tokens.weight.dtype).removeprefix("torch.")
    fmt, group = weight_format(weights, dtype)
    raw, layers = None, None
    if fmt not in FLOAT_FORMATS:
        if fmt == "w4a8" and src.kind == "gguf":  # the file's blocks in the kernel's layout, packed once per machine
            from .w4a8 import packed_of

            def build() -> dict:
                nonlocal raw
                raw = gguf_raw_weights(src, target.cfg)
                quantize_linears(target, fmt, group, raw, kernel)
                return packed_of(target)

            layers = cached_w4a8_layers(src, build)
            if raw is None:  # read from the cache
                quantize_linears(target, fmt, group, kernel=kernel, packed=layers)
        else:
            raw = gguf_raw_weights(src, target.cfg) if fmt in ("gguf-native", "w4a8") and (
                fmt == "gguf-native" or src.kind == "gguf") else None
            quantize_linears(target, fmt, group, raw, kernel)
    if drafter is None:
        return
    if drafter_weights is not None:
        fmt, group = weight_format(drafter_weights, dtype)
    if fmt in FLOAT_FORMATS:
        return
    model = drafter.graphs.model
    if fmt not in ("gguf-native", "w4a8"):  # formats quantized from float weights
        quantize_linears(model, fmt, group, kernel=kernel)
        return
    if drafter_name == "self" and layers is not None:  # the target's own packed layers
        quantize_linears(model, fmt, group, packed=layers)
        return
    raw_d = None  # the drafter's own GGUF blocks, where it has a GGUF file
    if drafter_name == "self":
        raw_d = raw
    elif eagle_head_dir(drafter_name) is None and resolve_model(drafter_name).kind == "gguf":
        raw_d = gguf_raw_weights(resolve_model(drafter_name), model.cfg)
    if raw_d is not None or fmt == "w4a8":
        quantize_linears(model, fmt, group, raw_d)


def pack_models(target, drafter=None, min_rows: int = 1, weights: str | None = None, src=None,
                drafter_name: str | None = None, kernel: str = "torch", drafter_weights: str | None = None) -> None:
    """The weight formats ``weights`` and ``drafter_weights`` (:func:`quantize_models`), then packed
    weights for the product kernel ``kernel`` (runtime/packed.py) for what stays float, for a
    target and its drafter's model; packed products of fewer than ``min_rows`` rows run padded to
    that many."""
    quantize_models(target, drafter, weights, src, drafter_name, kernel, drafter_weights)
    pack_linears(target, min_rows=min_rows, kernel=kernel)
    if drafter is not None:
        pack_linears(drafter.graphs.model, min_rows=min_rows, kernel=kernel)


# ----------------------------------------------------------------------------- padding


def invariant_padding(target, widths: tuple[int, ...], threads: int = 0) -> int | None:
    """Make the target's packed products batch-invariant at ``widths`` (the row counts a
    speculative engine runs them at: 1 and its verify widths), checked at ``threads`` intra-op
    threads (0: the process's count), the count the engine decodes at: keep their padding
    (``min_rows``) if it is invariant, else raise it to the smallest invariant one and say so in
    one line on stderr (slower perhaps, exact); YggError if no padding up to the widest width
    is. Returns the padding (None: nothing packed). Call it before any graph or compiled
    package is made for the target: they hold the padding as a constant."""
    import torch

    from .packed import invariant_min_rows, min_rows_of, packed_layers

    rows = min_rows_of(target)
    if rows is None:
        return None
    n = torch.get_num_threads()
    threads = threads or n
    torch.set_num_threads(threads)
    try:
        found = invariant_min_rows(target, widths, start=rows)
    finally:
        torch.set_num_threads(n)
    if found is None:
        raise YggError(f"the target's packed products are not batch-invariant on this CPU at {threads} "
                       f"thread(s) at any padding from {rows} to {max(widths)} rows: speculation would not "
                       "be exact; decode plainly")
    if found != rows:
        sys.stderr.write(f"yggtree: packed products padded to {rows} row(s) are not batch-invariant on this "
                         f"CPU at {threads} thread(s) (widths {sorted(set(widths))}): padding them to "
                         f"{found} rows, which are (exact speculation, perhaps slower)\n")
        for layer in packed_layers(target):
            layer.min_rows = found
    return found


def engine_padding(spec, target) -> int | None:
    """The padding a speculating engine of ``spec`` runs ``target``'s packed products at: their
    own where the profile's invariance check covers the engine's threads and widths, else checked
    now and raised where not batch-invariant (:func:`invariant_padding`)."""
    from .packed import min_rows_of

    threads, widths = spec_rows(spec)
    checked = spec.padding_checked  # the profile's check stands where it covers this engine
    if checked is not None and checked[0] == threads and set(widths) <= set(checked[1]):
        return min_rows_of(target)
    return invariant_padding(target, widths, threads)


def spec_rows(spec) -> tuple[int, tuple[int, ...]]:
    """The thread count an engine of ``spec`` decodes at and the row counts its products run at
    (1, and with a tree to verify, drafted or looked up, its verify widths)."""
    import torch

    threads = resolve_plan(spec.stages, spec.verifies, threads=spec.threads).threads or torch.get_num_threads()
    return threads, ((1, *spec.verify_widths, spec.tree.verify_width) if spec.verifies else (1,))
