"""Assemble an Engine from user-level names: model path, drafter spec, dtype, tree shape."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import YggError
from ..plan import (DEFAULT_DRAFTER_DIR, cache_dir, plan_kernel, plan_min_rows,  # noqa: F401  (re-exported)
                    plan_prefetch, profile_invariance, read_manifest)
from ..shapes import (DEFAULT_MAX_CONTEXT, DEFAULT_PREFILL_CHUNK, TreeParams, check_sizes, kv_cache_dtype,
                      measured_prefetch, weight_format)
from .drafters import LMDrafter, check_pair
from .engine import Engine, EngineConfig
from .graphs import check_backend
from .hugepages import move_to_huge_pages
from .kv_cache import KVCache
from .loading import load_model, load_tokenizer, resolve_model
from .model import attention_rows, set_invariant_rows, set_kv_dtype
from .packed import pack_linears
from .policy import FixedPolicy
from .schedule import resolve_plan


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build an engine (the CLI's flags, a plan's fields)."""

    model: str = "default"  # "default" | HF directory | .gguf file
    drafter: str | None = None  # None (plain) | "self" | HF directory | .gguf | EAGLE head dir
    dtype: str = "float32"
    mode: str = "performance"
    max_context: int = DEFAULT_MAX_CONTEXT
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    tree: TreeParams = TreeParams()
    # a plan's compiled width sets (the envelope a step policy chooses from; empty: tree's own)
    draft_widths: tuple[int, ...] = ()
    verify_widths: tuple[int, ...] = ()
    pack: bool = True  # oneDNN-packed linear layers where the device supports them
    # packed products of fewer rows run padded to this many (1: none); a plan's profile measures it
    min_rows: int = 1
    # the packed layers' product kernel (runtime/packed.py KERNELS); a plan's profile measures it
    kernel: str = "torch"
    # (near, far) bytes the kernel library's products prefetch their weights ahead into the first-
    # and second-level cache (runtime/kernels.py prefetch; None: the library's default); measured
    # with the kernel
    prefetch: tuple[int, int] | None = None
    # (threads, widths) at which the plan's profile found min_rows batch-invariant (None: unchecked)
    padding_checked: tuple[int, tuple[int, ...]] | None = None
    lookup: int = 0  # lookup nodes per step (EngineConfig.lookup); > 0 without a drafter: lookup-only
    stages: str = "sequential"  # execution plan (EngineConfig.stages)
    threads: int = 0  # intra-op threads while decoding (0: the process setting)
    loop_pool: bool = False  # the kernel library's loops on its own pool while decoding (EngineConfig.loop_pool)
    weights: str | None = None  # weight format (runtime/quant.py); None: float weights in dtype
    kv_cache: str | None = None  # the target's KV cache dtype (yggtree.shapes.kv_cache_dtype); None: dtype
    n_slots: int = 0  # KV cache slots (EngineConfig.n_slots; 0: derived)

    @classmethod
    def from_plan(cls, plan, mode: str | None = None, tree: TreeParams | None = None,
                  stages: str = "auto", threads: int = 0, min_rows: int | None = None,
                  kernel: str | None = None, prefetch: tuple[int, int] | None = None) -> "EngineSpec":
        """The spec of an engine for ``plan`` (a :class:`yggtree.plan.Plan`).

        ``tree`` defaults to the plan's envelope (largest W_d, D_max, largest W_v): it sizes the
        caches so that every width of the plan fits, and :func:`warm_plan` then builds the rest.
        ``mode`` defaults to performance, or reference for the eager backend. ``min_rows``
        defaults to the padding the plan's profile measured (:func:`yggtree.plan.plan_min_rows`),
        ``kernel`` defaults to the product kernel it measured fastest (:func:`yggtree.plan.plan_kernel`)
        and ``prefetch`` then to the setting measured with it (:func:`yggtree.plan.plan_prefetch`);
        a caller naming the kernel names its setting (None: the kernel library's default)."""
        check_backend(plan.backend)
        if plan.backend in ("cuda", "npu"):
            raise YggError(
                f"plan {plan.name!r}: the engine does not run backend {plan.backend!r} plans yet "
                "(only inductor-cpu and eager)"
            )
        if mode is None:
            mode = "reference" if plan.backend == "eager" else "performance"
        if tree is None:
            tree = plan.tree_params() if plan.speculative else TreeParams()
        return cls(
            model=plan.target,
            drafter=plan.drafter,
            dtype=plan.dtype,
            mode=mode,
            max_context=plan.max_context,
            prefill_chunk=plan.prefill_chunk,
            tree=tree,
            draft_widths=tuple(plan.draft_widths) if plan.speculative else (),
            verify_widths=tuple(plan.verify_widths) if plan.speculative else (),
            lookup=plan.lookup,
            stages=plan.stages if stages == "auto" else stages,
            threads=threads,
            min_rows=plan_min_rows(plan) if min_rows is None else min_rows,
            kernel=plan_kernel(plan) if kernel is None else kernel,
            prefetch=plan_prefetch(plan) if kernel is None else prefetch,
            padding_checked=profile_invariance(plan.profile) if min_rows is None and plan.profile else None,
            weights=plan.weights,
            kv_cache=plan.kv_cache,
        )


def _eagle_head_dir(name: str) -> Path | None:
    """The EAGLE head directory a drafter name stands for ("default": the shipped one), None for
    a standalone LM ("self", or a model path / GGUF / HF directory)."""
    if name == "default":
        return DEFAULT_DRAFTER_DIR
    if name == "self":
        return None
    from .eagle import is_eagle_dir

    path = Path(name).expanduser()
    return path if path.is_dir() and is_eagle_dir(path) else None


def load_drafter(spec: EngineSpec, target, tokenizer):
    """The drafter named by ``spec.drafter`` for ``target``; refuses mismatched vocabularies."""
    name = spec.drafter
    if name == "self":
        return LMDrafter(target.shared_copy(), spec.mode)
    head = _eagle_head_dir(name)
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


def drafter_feeds_leaves(plan) -> bool:
    """``Drafter.feeds_leaves`` of the drafter class ``plan`` names, without loading it."""
    if plan.drafter is None or _eagle_head_dir(plan.drafter) is None:
        return LMDrafter.feeds_leaves
    from .eagle import EagleDrafter

    return EagleDrafter.feeds_leaves


def quantize_models(target, drafter, weights: str | None, src, drafter_name: str | None = None,
                    kernel: str = "torch") -> None:
    """The weight format ``weights`` (runtime/quant.py; None: float, nothing to do) for the
    target (loaded from ``src``) and the drafter's model. Under ``gguf-native`` a drafter gets
    its GGUF's own blocks (``self``: the target's; a standalone GGUF model: its file's); an EAGLE
    head or an HF drafter has none and keeps float weights. Under ``w4a8`` every model's linears
    become blocks: a GGUF's own where it has them, Q4_1 from float otherwise (an EAGLE head).
    ``kernel``: the int8 layers' product kernel (runtime/quant.py ``Int8Linear``)."""
    from .loading import cached_w4a8_layers, gguf_raw_weights
    from .quant import quantize_linears

    fmt, group = weight_format(weights, str(target.embed_tokens.weight.dtype).removeprefix("torch."))
    if fmt in ("float32", "bfloat16"):
        return
    gguf = fmt in ("gguf-native", "w4a8")  # formats that run a GGUF's own blocks
    raw, layers = None, None
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
        raw = gguf_raw_weights(src, target.cfg) if fmt == "gguf-native" or (gguf and src.kind == "gguf") else None
        quantize_linears(target, fmt, group, raw, kernel)
    if drafter is None:
        return
    model = drafter.graphs.model
    if not gguf:
        quantize_linears(model, fmt, group, kernel=kernel)
        return
    if drafter_name == "self" and layers is not None:  # the target's own packed layers
        quantize_linears(model, fmt, group, packed=layers)
        return
    raw_d = None  # the drafter's own GGUF blocks, where it has a GGUF file
    if drafter_name == "self":
        raw_d = raw
    elif _eagle_head_dir(drafter_name) is None and resolve_model(drafter_name).kind == "gguf":
        raw_d = gguf_raw_weights(resolve_model(drafter_name), model.cfg)
    if raw_d is not None or fmt == "w4a8":
        quantize_linears(model, fmt, group, raw_d)


def pack_models(target, drafter=None, min_rows: int = 1, weights: str | None = None, src=None,
                drafter_name: str | None = None, kernel: str = "torch") -> None:
    """The weight format ``weights`` (:func:`quantize_models`), then packed weights for the
    product kernel ``kernel`` (runtime/packed.py) for what stays float, for an engine's target
    and its drafter's model, before any graph or package is built for them (``build_engine`` and
    ``yggtree compile``); packed products of fewer than ``min_rows`` rows run padded to that many."""
    quantize_models(target, drafter, weights, src, drafter_name, kernel)
    pack_linears(target, min_rows=min_rows, kernel=kernel)
    if drafter is not None:
        pack_linears(drafter.graphs.model, min_rows=min_rows, kernel=kernel)


def torch_threads() -> int:
    """The process's intra-op thread count."""
    import torch

    return torch.get_num_threads()


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


def engine_padding(spec: EngineSpec, target) -> int | None:
    """The padding a speculating engine of ``spec`` runs ``target``'s packed products at: their
    own where the profile's invariance check covers the engine's threads and widths, else checked
    now and raised where not batch-invariant (:func:`invariant_padding`). ``yggtree compile``
    calls it too, so that a plan's packages hold the padding its engine will keep."""
    from .packed import min_rows_of

    threads, widths = spec_rows(spec)
    checked = spec.padding_checked  # the profile's check stands where it covers this engine
    if checked is not None and checked[0] == threads and set(widths) <= set(checked[1]):
        return min_rows_of(target)
    return invariant_padding(target, widths, threads)


def spec_rows(spec: EngineSpec) -> tuple[int, tuple[int, ...]]:
    """The thread count an engine of ``spec`` decodes at and the row counts its products run at
    (1, and with a tree to verify, drafted or looked up, its verify widths)."""
    spec_on = spec.drafter is not None or spec.lookup > 0
    threads = resolve_plan(spec.stages, spec_on, threads=spec.threads).threads or torch_threads()
    return threads, ((1, *spec.verify_widths, spec.tree.verify_width) if spec_on else (1,))


def check_spec(spec: EngineSpec) -> str:
    """Refuse, before anything loads, impossible sizes and trees and an unknown weight format or
    group size or KV cache dtype; returns the format's name."""
    check_sizes(spec.max_context, spec.prefill_chunk, spec.tree if spec.drafter else None)
    kv_cache_dtype(spec.kv_cache, spec.dtype)
    fmt, _ = weight_format(spec.weights, spec.dtype)
    return fmt


def build_engine(spec: EngineSpec, prepare=None):
    """Load the target, its tokenizer and the drafter; build and warm up the engine.

    ``prepare(target, drafter)``, when given, runs after loading and before the engine is built
    (``build_plan_engine`` installs the plan's compiled graphs there). A speculative engine's
    packed products are made batch-invariant first (:func:`invariant_padding`), its quantized
    ones checked after."""
    fmt = check_spec(spec)
    if fmt not in ("float32", "bfloat16"):  # ... and a kernel this torch/CPU does not run
        import torch

        from .quant import check_kernel

        check_kernel("int8" if fmt == "int8" else "int4", getattr(torch, spec.dtype), spec.kernel)
    src = resolve_model(spec.model)
    target = load_model(src, spec.dtype)
    set_kv_dtype(target, kv_cache_dtype(spec.kv_cache, spec.dtype))
    tokenizer = load_tokenizer(src)
    drafter = load_drafter(spec, target, tokenizer) if spec.drafter else None
    if spec.pack:  # oneDNN-packed block weights on a CPU (see runtime/packed.py)
        pack_models(target, drafter, spec.min_rows, spec.weights, src, spec.drafter, spec.kernel)
    else:
        quantize_models(target, drafter, spec.weights, src, spec.drafter, spec.kernel)
    spec_on = drafter is not None or spec.lookup > 0  # a tree to verify: drafted or looked up
    threads, widths = spec_rows(spec)
    if spec_on:  # packed products padded so that they are batch-invariant (before any graph)
        engine_padding(spec, target)
    # every weight in one arena of 2 MiB pages (runtime/hugepages.py), before anything keeps
    # references to them (the packages' input lists)
    move_to_huge_pages([target, *([drafter.graphs.model] if drafter is not None else [])], skip=(KVCache,))
    if prepare is not None:
        # the target's attention formulation first, as Engine sets it: packages are keyed by it
        set_invariant_rows(target, attention_rows(spec.prefill_chunk))
        prepare(target, drafter)
    if spec_on:  # quantized kernels must be batch-invariant for speculation to be exact
        from .quant import check_batch_invariant

        check_batch_invariant(target, max(widths))
    cfg = EngineConfig(
        mode=spec.mode,
        max_context=spec.max_context,
        prefill_chunk=spec.prefill_chunk,
        tree=spec.tree if spec_on else None,
        draft_widths=spec.draft_widths if spec_on else (),
        verify_widths=spec.verify_widths if spec_on else (),
        lookup=spec.lookup,
        stages=spec.stages,
        threads=spec.threads,
        loop_pool=spec.loop_pool,
        prefetch=spec.prefetch,
        n_slots=spec.n_slots,
    )
    eos = tuple(target.cfg.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    return Engine(target, cfg, drafter, eos), tokenizer


# ----------------------------------------------------------------------------- plans
# (added for plans / ``yggtree compile``: an engine with every width of a plan built)


def plan_slots(plan) -> int:
    """KV cache slots of an engine built from ``EngineSpec.from_plan(plan)``: mirrors
    ``Engine.__init__`` (max_context + reserve + scratch) for the plan's envelope tree. Every
    compiled graph's shapes depend on it, so ``yggtree compile`` builds with exactly this."""
    reserve = plan.max_tree if plan.speculative else 1
    return plan.max_context + reserve + 1


def drafter_widths(plan) -> list[int]:
    """Widths the engine asks its drafter to build (``Drafter.setup``): 1 (the head of a
    standalone LM), every W_d, and with an ahead-of-time stage plan 2 W_v for every W_v (1
    included: the ahead call); the drafter adds its own (prefill chunk, EAGLE's D_max + 1)."""
    # a plan whose stages the compile-time search picks (auto) may run the ahead call
    ahead = plan.speculative and (plan.stages == "auto" or resolve_plan(plan.stages, True).ahead)
    return sorted({1, *plan.draft_widths, *((2 * w for w in (1, *plan.verify_widths)) if ahead else ())})


def warm_plan(engine: Engine, plan) -> None:
    """Build every graph ``plan`` can need on an engine made from ``EngineSpec.from_plan(plan)``:
    the target at {prefill_chunk, 1} and every W_v, the drafter at every W_d, at the thread
    count the engine's plan decodes at. Widths already built are skipped, so this is cheap
    after the engine's own warm-up."""
    if engine.n_slots != plan_slots(plan):
        raise YggError(
            f"this engine has {engine.n_slots} cache slots, plan {plan.name!r} needs "
            f"{plan_slots(plan)}: build it with EngineSpec.from_plan(plan)"
        )
    env = engine.envelope
    if engine.drafter is not None and not (
        set(plan.draft_widths) <= set(env.draft_widths)
        and set(plan.verify_widths) <= set(env.verify_widths) and plan.d_max <= env.d_max
    ):
        raise YggError(f"this engine's envelope {env} does not hold plan {plan.name!r}'s widths: "
                       "build it with EngineSpec.from_plan(plan)")
    threads = engine.plan_threads(engine.plan)  # compiled graphs are built at the count they run at
    plain = engine.cfg.tree is None  # a plan's plain engine: its prefill chunk and one-row steps
    widths = [w for w in plan.target_widths if w in (1, plan.prefill_chunk)] if plain else list(plan.target_widths)
    engine.graphs.warm_up(widths, threads=threads)
    if engine.drafter is not None:
        widths = sorted({*drafter_widths(plan), *engine.drafter_widths(engine.plan)})
        engine.drafter.setup(engine.n_slots, widths, plan.prefill_chunk, threads=threads)


def fixed_policy(
    engine: Engine,
    plan,
    draft_width: int | None = None,
    verify_width: int | None = None,
    draft_depth: int | None = None,
) -> FixedPolicy:
    """A policy speculating with one choice of widths from the plan's compiled set every step
    (YggError naming the set otherwise); None keeps the largest. Pass it to ``generate``."""
    if engine.drafter is None:
        raise YggError(f"plan {plan.name!r} has no drafter: there are no tree widths to choose")
    tp = plan.tree_params(draft_width, verify_width, draft_depth)
    engine.envelope.check_tree(tp)
    return FixedPolicy.of(tp)


def manifest_prefetch(manifest: dict, artifacts) -> tuple[int, int] | None:
    """The prefetch setting a plan's packages were compiled with (``packed_prefetch``: ``[near,
    far]``, or one distance in manifests before the second level), None if absent; YggError naming
    the directory if it is not one."""
    return measured_prefetch(manifest.get("packed_prefetch"), f"{artifacts}: the manifest's packed_prefetch",
                             "compile the plan again")


def build_plan_engine(plan, artifacts: str | Path | None = None, mode: str | None = None,
                      stages: str = "auto", threads: int = 0, min_rows: int | None = None, kernel: str | None = None,
                      speculate: bool = True, prefetch: tuple[int, int] | None = None):
    """Engine and tokenizer for ``plan`` with every plan width built. With ``artifacts`` (the
    plan's artifact directory, see ``yggtree.plan.artifact_dir``; check it first with
    ``yggtree.plan.check_artifacts``) and performance mode, the blocks of the target and the
    drafter run the plan's AOTInductor packages: nothing is traced or compiled in this process.
    Without ``artifacts`` a performance engine compiles its graphs with dynamo (slow start).
    ``min_rows`` and ``kernel`` override the padding of short packed products and their kernel
    the plan's profile measured; ``prefetch`` goes with ``kernel`` (EngineSpec.from_plan); a plan
    without a profile takes all three from its packages' manifest.
    A speculative engine raises a padding that is not batch-invariant on this CPU
    (:func:`invariant_padding`); packages hold the padding they were compiled with, so with
    ``artifacts`` an engine padding otherwise (raised or overridden) is refused in one line
    naming the packages: profile again and recompile.

    ``speculate=False``: plain decoding on the plan's target graphs, with no drafter loaded and
    no feature kept for one (``yggtree run --plan P --no-speculate``); the cache keeps the plan's
    slot count and the packages' padding, so the same packages serve it."""
    if stages == "auto" and plan.stages == "auto" and artifacts is not None:
        stages = searched_stages(artifacts)
    if artifacts is not None and plan.profile is None and plan.backend == "inductor-cpu":
        # no profile: the packages hold the kernel and padding measured when they were compiled
        m = read_manifest(Path(artifacts)) or {}
        if kernel is None:
            kernel, prefetch = m.get("packed_kernel", "torch"), manifest_prefetch(m, artifacts)
        min_rows = m.get("packed_min_rows", 1) if min_rows is None else min_rows
    spec = EngineSpec.from_plan(plan, mode, stages=stages, threads=threads, min_rows=min_rows, kernel=kernel,
                                prefetch=prefetch)
    if artifacts is not None and spec.mode == "performance" and loops_on_pool(read_manifest(Path(artifacts)) or {}):
        spec = replace(spec, loop_pool=True)
    if not speculate:
        rows = spec.min_rows
        if artifacts is not None and min_rows is None:  # the packages' own padding
            rows = (read_manifest(Path(artifacts)) or {}).get("packed_min_rows") or rows
        spec = replace(spec, drafter=None, lookup=0, min_rows=rows, n_slots=plan_slots(plan))
    prepare = None
    if artifacts is not None and spec.mode == "performance" and plan.backend == "inductor-cpu":
        prepare = _package_installer(Path(artifacts))
    engine, tokenizer = build_engine(spec, prepare)
    warm_plan(engine, plan)
    return engine, tokenizer


def loops_on_pool(manifest: dict) -> bool:
    """Whether a plan's packages run the kernel library's loops on its pool: ``yggtree compile``
    measured it faster on this machine (the manifest's ``loops``), which it measures only where
    every package's own loops are serial (aoti.library_loops_only)."""
    return (manifest.get("loops") or {}).get("choice") == "pool"


def searched_stages(art: str | Path) -> str:
    """The execution plan ``yggtree compile``'s plan search chose (its manifest's ``stage_plan``);
    ``sequential`` when it had no data."""
    m = read_manifest(Path(art)) or {}
    chosen = (m.get("stage_plan") or {}).get("chosen")
    return chosen if isinstance(chosen, str) else "sequential"


def _package_installer(art: Path):
    """``prepare`` hook of :func:`build_engine`: load the packages listed in ``art``'s manifest
    and install them on the target's and the drafter's blocks."""
    from .aoti import DRAFTER_CALLS, PackageSet, install_drafter_calls, install_packages, install_step_packages, package_name

    manifest = read_manifest(art)
    if manifest is None:
        raise YggError(f"no compiled artifacts in {art}: run `yggtree compile` on the plan first")
    entries = sorted({(g["key"], g["width"], g["context"], g.get("scope", "block")) for g in manifest["graphs"]})
    # the target's whole-step packages (one capture per compile: the plan's drafter's layers)
    step_capture = next((tuple(g["capture"]) for g in manifest["graphs"] if g.get("scope") == "step"), None)
    call = next((g for g in manifest["graphs"] if g.get("scope") in DRAFTER_CALLS), None)  # drafter calls
    plan = manifest.get("plan") or {}
    sums = {g["file"]: g.get("sha256") for g in manifest["graphs"]}
    if plan.get("weights") == "w4a8":  # its packages call yggtree::w4a8_mm
        from .w4a8 import load_kernel

        load_kernel()
    if manifest.get("packed_kernel") == "tiled":  # ... or yggtree::tiled_mm
        from .kernels import load_library

        load_library()
    packages = PackageSet.load(cache_dir(art), entries, manifest["n_slots"], sums)

    def prepare(target, drafter) -> None:
        from .packed import kernel_of, min_rows_of

        kernel, was_kernel = kernel_of(target), manifest.get("packed_kernel", "torch")
        if kernel is not None and kernel != was_kernel:
            raise YggError(f"the compiled graphs in {cache_dir(art)} run packed products on the {was_kernel} kernel, "
                           f"this engine on {kernel}: recompile the plan (yggtree compile --force)")
        rows, was = min_rows_of(target), manifest.get("packed_min_rows")
        if rows is not None and rows != was:  # the packages hold their padding: never run them padded otherwise
            raise YggError(f"the compiled graphs in {cache_dir(art)} ({package_name(*entries[0])}, ...) pad short "
                           f"packed products to {was} rows, this engine to {rows} ({was} rows are not "
                           "batch-invariant on this CPU at this thread count, or min_rows was overridden): "
                           "profile this machine again (yggtree profile) and recompile the plan "
                           "(yggtree compile --force)")
        install_packages(target, packages)
        if step_capture is not None:
            install_step_packages(target, packages, step_capture)
        if drafter is not None:
            install_packages(drafter.graphs.model, packages)
            if call is not None:  # an EAGLE head's whole calls, with the constants they were compiled for
                install_drafter_calls(drafter, packages, call["top_k"], call["nodes"])

    return prepare
