"""The product kernel and the padding of short packed products, as ``yggtree profile`` measures them
before its curves (:mod:`yggtree.runtime.packed`): one row through every packed float or int8
product of the target (one plain step's products) on torch's kernel unpadded and padded to 2, 4 and
8 rows, and on our tiled kernel at every prefetch setting, the variants interleaved; each checked
for batch invariance at the plan's widths; the fastest invariant one is the profile's
``packed_padding``. Also what the cached kernel choice of engines without a profile times
(:mod:`yggtree.measure.kernel_choice`)."""

from __future__ import annotations

import statistics

from ..errors import YggError
from ..shapes import prefetch_name, prefetch_setting
from .timing import time_rounds

PADDING_ROWS = (1, 2, 4, 8)  # the min_rows compared (1: no padding)


def kernel_layers(model) -> list:
    """The layers of ``model`` whose product kernel the profile chooses, in module order: its
    packed float layers (runtime/packed.py) and its int8 and 4-bit ones (runtime/quant.py
    ``Int8Linear``, ``Int4Linear``; int4 and gguf-native)."""
    from ..runtime.packed import packed_layers
    from ..runtime.quant import Int4Linear, Int8Linear

    packed = {id(m) for m in packed_layers(model)}
    return [m for m in model.modules() if id(m) in packed or isinstance(m, (Int8Linear, Int4Linear))]


def time_padding(model, candidates: tuple[int, ...] = PADDING_ROWS, warmup: int = 2,
                 repeats: int = 9, widths: tuple[int, ...] = (1,), tiled=None) -> dict:
    """One row through every packed or int8 product of ``model`` (:func:`kernel_layers`: one plain
    step's products, in module order), timed for each ``min_rows`` of ``candidates``,
    and, given ``tiled`` (the same model packed for the ``tiled`` kernel), through its products
    as the candidate ``"tiled"`` at every prefetch setting of the kernel library
    (runtime/kernels.py ``PREFETCH_CHOICES``; the fastest is the candidate's time). Rounds of one call per variant
    (:func:`yggtree.offline.timing.time_rounds`) so drifting load hits all of them alike;
    ``warmup`` rounds, then ``repeats`` timed. Each candidate is also checked for batch invariance
    at ``widths`` (the row counts the plan's engine runs: 1 and its verify widths;
    :func:`yggtree.runtime.packed.padding_is_invariant`, at the current thread count).
    Returns the profile's ``packed_padding``: the fastest invariant candidate by median (ties:
    oneDNN, then the fewer rows; if no candidate is invariant, the smallest invariant padding) as
    ``kernel`` and ``min_rows`` (1 for the tiled kernel), the medians and the invariance of each
    candidate; with the tiled kernel, ``prefetch``: its fastest setting (``[near, far]`` bytes),
    and the medians by setting (``prefetch_ms``). YggError if nothing is invariant."""
    import torch

    from ..runtime.kernels import PREFETCH_CHOICES, prefetch
    from ..runtime.packed import invariant_min_rows, packed_layers, padding_is_invariant

    layers = kernel_layers(model)
    if not layers:  # nothing packed (another device or dtype): nothing to pad
        none = {"kernel": "torch", "min_rows": 1, "products": 0, "median_ms": {}}
        return none | time_prefetch(model, warmup, repeats)  # a w4a8 model: its products' prefetch
    if not packed_layers(model):  # quantized layers only: torch's kernels are never padded
        candidates = (1,)
    widths = tuple(sorted({1, *widths}))
    invariant = {str(r): padding_is_invariant(model, r, widths) for r in candidates}
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, m.in_features, generator=g).to(dtype) for m in layers]
    variants = {str(r): (layers, r, None) for r in candidates}
    if tiled is not None:
        invariant["tiled"] = padding_is_invariant(tiled, 1, widths)  # a prefetch changes no result
        variants.update({f"tiled@{prefetch_name(d)}": (kernel_layers(tiled), 1, d) for d in PREFETCH_CHOICES})

    def step(key: str) -> None:
        products, rows, setting = variants[key]
        with prefetch(setting):
            for x, m in zip(xs, products):
                m.product(x, rows)

    with torch.no_grad():  # in rounds (timing.time_rounds), as the grid and the stage forms
        samples = time_rounds({k: (lambda k=k: step(k)) for k in variants}, warmup, repeats)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    by_setting = {d: medians.pop(f"tiled@{prefetch_name(d)}") for d in PREFETCH_CHOICES} if tiled is not None else {}
    if by_setting:  # the tiled candidate at its fastest setting
        fastest = fastest_prefetch(by_setting)
        setting = tuple(fastest["prefetch"])
        medians["tiled"] = by_setting[setting]
        variants = ({k: v for k, v in variants.items() if "@" not in k}
                    | {"tiled": variants[f"tiled@{prefetch_name(setting)}"]})
    ok = [k for k in variants if invariant[k]]
    order = {k: i for i, k in enumerate(variants)}  # oneDNN's paddings first, fewer rows first
    best = min(ok, key=lambda k: (medians[k], order[k])) if ok else invariant_min_rows(model, widths)
    if best is None:
        raise YggError(f"packed products are not batch-invariant on this CPU at {torch.get_num_threads()} "
                       f"thread(s) at any padding up to {max(widths)} rows: speculation would not be exact")
    kernel, rows = ("tiled", 1) if best == "tiled" else ("torch", int(best))
    out = {"kernel": kernel, "min_rows": rows, "products": len(layers), "warmup": warmup, "repeats": repeats,
           "median_ms": {k: round(medians[k], 4) for k in variants},
           "invariant": invariant, "widths": list(widths)}
    return out | fastest if kernel == "tiled" else out


def fastest_prefetch(medians: dict[tuple[int, int], float]) -> dict:
    """``{"prefetch": [near, far] of the least median (ties: the nearer far, then near),
    "prefetch_ms": the medians by setting ("near/far")}`` from medians (ms) by prefetch setting."""
    near, far = min(medians, key=lambda d: (medians[d], d[1], d[0]))
    return {"prefetch": [near, far], "prefetch_ms": {prefetch_name(d): round(ms, 4) for d, ms in medians.items()}}


def time_prefetch(model, warmup: int = 2, repeats: int = 9) -> dict:
    """One row through every w4a8 product of ``model`` (runtime/w4a8.py: the kernel library's,
    with nothing to choose or pad) at every prefetch setting of the library (runtime/kernels.py
    ``PREFETCH_CHOICES``), in rounds: ``{"prefetch": fastest [near, far], "prefetch_ms": medians}``,
    or ``{}`` for a model without such products."""
    import torch

    from ..runtime.kernels import PREFETCH_CHOICES, prefetch
    from ..runtime.w4a8 import W4A8Linear

    layers = [m for m in model.modules() if isinstance(m, W4A8Linear)]
    if not layers:
        return {}
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, m.in_features, generator=g) for m in layers]

    def step(setting: tuple[int, int]) -> None:
        with prefetch(setting):
            for x, m in zip(xs, layers):
                m(x)

    with torch.no_grad():
        samples = time_rounds({d: (lambda d=d: step(d)) for d in PREFETCH_CHOICES}, warmup, repeats)
    return fastest_prefetch({d: statistics.median(v) for d, v in samples.items()})


def measure_padding(plan, threads: int, warmup: int = 2, repeats: int = 9) -> dict:
    """:func:`time_padding` on ``plan``'s target, loaded in the plan's weight format and packed
    here, in ``threads`` threads (a plan for an accelerator packs nothing, nor do quantized
    layers: no padding)."""
    import torch

    from ..runtime.loading import resolve_model

    if plan.backend not in ("inductor-cpu", "eager"):
        return {"kernel": "torch", "min_rows": 1, "products": 0, "median_ms": {}}
    torch.set_num_threads(threads)
    return model_padding(resolve_model(plan.target), plan.dtype, plan.weights, (1, *plan.verify_widths),
                         warmup, repeats)


def model_padding(src, dtype: str, weights: str | None, widths: tuple[int, ...], warmup: int = 2,
                  repeats: int = 9) -> dict:
    """:func:`time_padding` on the model ``src`` (a ModelSource) loaded in ``dtype`` and weight
    format ``weights`` and packed here for each product kernel this CPU runs, at the current
    thread count, for an engine running ``widths`` rows (a quantized model packs only what stays
    float), as an engine prepares it (runtime/prepare.py)."""
    from dataclasses import replace

    from ..runtime.build import EngineSpec
    from ..runtime.packed import can_pack
    from ..runtime.prepare import prepare_models

    spec = EngineSpec(model=str(src.path), dtype=dtype, weights=weights)
    model = prepare_models(spec, tokenizer=False).target
    tiled = None
    if can_pack(model, "tiled"):  # the same model on the tiled kernel, timed beside it
        tiled = prepare_models(replace(spec, kernel="tiled"), tokenizer=False).target
    return time_padding(model, warmup=warmup, repeats=repeats, widths=widths, tiled=tiled)


def prefetch_words(setting) -> str:
    """A prefetch setting in words: "1024 bytes ahead (and 16384 into the second-level cache)"."""
    near, far = prefetch_setting(setting)
    return f"{near} bytes ahead" + (f" (and {far} into the second-level cache)" if far else "")


def padding_line(padding: dict) -> str:
    """One line saying what the padding measurement found."""
    ahead = f"; weights prefetched {prefetch_words(padding['prefetch'])}" if padding.get("prefetch") else ""
    if not padding["products"]:
        return "no packed products: no padding" + ahead
    inv = padding.get("invariant", {})  # absent in profiles made before it was checked
    times = ", ".join(f"{r}: {ms:.2f}" + (" not batch-invariant" if inv.get(r) is False else "")
                      for r, ms in padding["median_ms"].items())
    chosen = "the tiled kernel" if padding.get("kernel") == "tiled" else f"oneDNN, min_rows {padding['min_rows']}"
    return f"{padding['products']} packed products of one row, median ms by rows run ({times}): {chosen}{ahead}"
