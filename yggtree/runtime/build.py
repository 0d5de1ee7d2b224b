"""Assemble an Engine from user-level names (model path, drafter spec, dtype, tree shape) or from
a plan: its models prepared by runtime/prepare.py, its graphs built or its compiled packages
installed."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from torch import nn

from ..errors import YggError
from ..shapes import DEFAULT_MAX_CONTEXT, DEFAULT_PREFILL_CHUNK, Envelope, TreeParams, measured_prefetch
from .artifacts import cache_dir, read_manifest
from .engine import Engine, EngineConfig
from .graphs import backend_device, check_backend
from .hugepages import move_to_huge_pages
from .kv_cache import KVCache
from .padding import plan_kernel, plan_min_rows, plan_prefetch, profile_invariance
from .policy import FixedPolicy
from .prepare import prepare_models, spec_rows
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
    static_lookup: str | None = None  # the target's n-gram table (EngineConfig.static_lookup)
    stages: str = "sequential"  # execution plan (EngineConfig.stages)
    threads: int = 0  # intra-op threads while decoding (0: the process setting)
    loop_pool: bool = False  # the kernel library's loops on its own pool while decoding (EngineConfig.loop_pool)
    weights: str | None = None  # weight format (runtime/quant.py); None: float weights in dtype
    drafter_weights: str | None = None  # the drafter's weight format (Plan.drafter_weights); None: ``weights``
    kv_cache: str | None = None  # the target's KV cache dtype (yggtree.shapes.kv_cache_dtype); None: dtype
    n_slots: int = 0  # KV cache slots (EngineConfig.n_slots; 0: derived)
    # the torch device of the models (a plan's backend's: graphs.backend_device); engines run on
    # the CPU only, ``yggtree compile`` prepares a cuda or npu plan's models for their packages
    device: str = "cpu"

    @classmethod
    def from_plan(cls, plan, mode: str | None = None, stages: str = "auto", threads: int = 0,
                  min_rows: int | None = None, kernel: str | None = None,
                  prefetch: tuple[int, int] | None = None) -> "EngineSpec":
        """The spec of an engine for ``plan`` (a :class:`yggtree.plan.Plan`: a plan file's, or the
        one a run's flags make in memory).

        Its tree is the plan's envelope (largest W_d, D_max, largest W_v): it sizes the caches so
        that every width of the plan fits, and :func:`warm_plan` then builds the rest.
        ``mode`` defaults to performance, or reference for the eager backend; ``stages`` other
        than auto replaces the plan's. ``min_rows`` defaults to the padding the plan's profile
        measured (:func:`padding.plan_min_rows`), ``kernel`` to the product kernel it measured
        fastest (:func:`padding.plan_kernel`) and ``prefetch`` then to the setting measured with
        it (:func:`padding.plan_prefetch`); a caller naming the kernel names its setting (None:
        the kernel library's default)."""
        check_backend(plan.backend)
        if mode is None:
            mode = "reference" if plan.backend == "eager" else "performance"
        verifies = plan.verifies  # a drafter, or lookup nodes alone
        return cls(
            model=plan.target,
            drafter=plan.drafter,
            dtype=plan.dtype,
            mode=mode,
            max_context=plan.max_context,
            prefill_chunk=plan.prefill_chunk,
            tree=plan.tree_params() if verifies else TreeParams(),
            draft_widths=tuple(plan.draft_widths) if verifies else (),
            verify_widths=tuple(plan.verify_widths) if verifies else (),
            lookup=plan.lookup,
            static_lookup=shipped_table(plan.target),
            stages=plan.stages if stages == "auto" else stages,
            threads=threads,
            min_rows=plan_min_rows(plan) if min_rows is None else min_rows,
            kernel=plan_kernel(plan) if kernel is None else kernel,
            prefetch=plan_prefetch(plan) if kernel is None else prefetch,
            padding_checked=profile_invariance(plan.profile) if min_rows is None and plan.profile else None,
            weights=plan.weights,
            drafter_weights=plan.drafter_weights,
            kv_cache=plan.kv_cache,
            device=backend_device(plan.backend),
        )

    @property
    def verifies(self) -> bool:
        """Whether its engine verifies trees: drafted, or of lookup nodes alone."""
        return self.drafter is not None or self.lookup > 0

    def config(self) -> EngineConfig:
        """The engine's part of the spec: every field of :class:`EngineConfig` this spec holds,
        passed by name; an engine verifying no tree decodes plainly (no tree, no widths)."""
        cfg = {f.name: getattr(self, f.name) for f in fields(EngineConfig) if f.name in _SPEC_FIELDS}
        if not self.verifies:
            cfg.update(tree=None, draft_widths=(), verify_widths=())
        return EngineConfig(**cfg)


_SPEC_FIELDS = frozenset(f.name for f in fields(EngineSpec))


def build_engine(spec: EngineSpec, prepare=None, reserve=None):
    """Load and prepare the target, its tokenizer and the drafter (:func:`prepare_models`); build
    and warm up the engine.

    ``prepare(target, drafter)``, when given, runs after the models are prepared and before the
    engine is built (``build_plan_engine`` installs the plan's compiled graphs there); ``reserve``
    (runtime/reserve.py) is the weights' arena faulted in ahead, where it fits. A
    speculative engine's quantized products are checked batch-invariant after it."""
    if spec.device != "cpu":
        raise YggError(f"the engine does not run models on {spec.device} yet (only inductor-cpu and eager "
                       "plans): a cuda or npu plan can be compiled, not run")
    models = prepare_models(spec)
    target, drafter, tokenizer = models.target, models.drafter, models.tokenizer
    # every weight the steps stream in one arena of 2 MiB pages (runtime/hugepages.py), before
    # anything keeps references to them (the packages' input lists); a reference engine (eager,
    # checks on: a run's stopgap while its machine's plan builds, traces) decodes the weights as
    # loaded: faulting a float32 model's arena into fresh memory took seconds of a first run
    if spec.mode == "performance":
        models_moved = [target, *([drafter.graphs.model] if drafter is not None else [])]
        move_to_huge_pages(models_moved, skip=(KVCache, nn.Embedding), reserve=reserve)
    if prepare is not None:
        prepare(target, drafter)
    if spec.verifies:  # quantized kernels must be batch-invariant for speculation to be exact
        from .quant import check_batch_invariant

        check_batch_invariant(target, max(spec_rows(spec)[1]))
    cfg = spec.config()
    eos = tuple(target.cfg.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    return Engine(target, cfg, drafter, eos), tokenizer


# ----------------------------------------------------------------------------- plans
# (added for plans / ``yggtree compile``: an engine with every width of a plan built)


def shipped_table(target: str) -> str | None:
    """The static lookup table an engine of ``target`` takes (runtime/static_lookup.py): the one
    shipped, built from the embedded model's own answers, for the embedded model (``default``)
    where it is installed; None for any other model (its token ids are another vocabulary's)."""
    from .static_lookup import DEFAULT_TABLE

    return str(DEFAULT_TABLE) if target == "default" and DEFAULT_TABLE.is_file() else None


def plan_slots(plan) -> int:
    """KV cache slots of an engine built from ``EngineSpec.from_plan(plan)`` (its envelope's
    :meth:`~yggtree.shapes.Envelope.slots`), which every compiled graph's shapes depend on."""
    tree = plan.tree_params() if plan.verifies else None
    return Envelope.of(tree, plan.draft_widths, plan.verify_widths).slots(plan.max_context)


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
                      speculate: bool = True, prefetch: tuple[int, int] | None = None, measure=None,
                      reserve=None):
    """Engine and tokenizer for ``plan`` with every plan width built: the one way from a plan (a
    plan file's, the quick start's, or the one a run's flags make in memory) to an engine. With ``artifacts`` (the
    plan's artifact directory, see ``yggtree.compiled.artifact_dir``; check it first with
    ``yggtree.compiled.check_artifacts``) and performance mode, the blocks of the target and the
    drafter run the plan's AOTInductor packages: nothing is traced or compiled in this process.
    Without ``artifacts`` a performance engine compiles its graphs with dynamo (slow start).
    ``min_rows`` and ``kernel`` override the padding of short packed products and their kernel
    the plan's profile measured; ``prefetch`` goes with ``kernel`` (EngineSpec.from_plan); a plan
    without a profile takes all three from its packages' manifest. A performance engine on
    ``artifacts`` takes what decoding measured on them (their manifest): where the library's loops
    run (:func:`loops_on_pool`), and the library's default prefetch where its measured one decoded
    slower (:func:`confirmed_prefetch`).
    A speculative engine raises a padding that is not batch-invariant on this CPU
    (:func:`invariant_padding`); packages hold the padding they were compiled with, so with
    ``artifacts`` an engine padding otherwise (raised or overridden) is refused in one line
    naming the packages: profile again and recompile.

    ``speculate=False``: plain decoding on the plan's target graphs, with no drafter loaded and
    no feature kept for one (``yggtree run --plan P --no-speculate``); the cache keeps the plan's
    slot count and the packages' padding, so the same packages serve it.

    ``measure(spec)``, when given, has the last say on the spec's product kernel and padding
    before the models load (a run's flags: ``yggtree.measure.kernel_choice.measured_spec``
    measures them for this engine's threads and widths on this machine). ``reserve``: see
    :func:`build_engine`."""
    m = (read_manifest(Path(artifacts)) or {}) if artifacts is not None else {}  # the packages' records, read once
    if stages == "auto" and plan.stages == "auto" and artifacts is not None:
        stages = searched_stages(artifacts)
    if artifacts is not None and plan.profile is None and plan.backend == "inductor-cpu":
        # no profile: the packages hold the kernel and padding measured when they were compiled
        if kernel is None:
            kernel, prefetch = m.get("packed_kernel", "torch"), manifest_prefetch(m, artifacts)
        min_rows = m.get("packed_min_rows", 1) if min_rows is None else min_rows
    spec = EngineSpec.from_plan(plan, mode, stages=stages, threads=threads, min_rows=min_rows, kernel=kernel,
                                prefetch=prefetch)
    if measure is not None:
        spec = measure(spec)
    if artifacts is not None and spec.mode == "performance":  # what decoding measured on the packages
        spec = replace(spec, loop_pool=loops_on_pool(m), prefetch=confirmed_prefetch(m, spec.prefetch))
    if not speculate:
        rows = spec.min_rows
        if artifacts is not None and min_rows is None:  # the packages' own padding
            rows = m.get("packed_min_rows") or rows
        spec = replace(spec, drafter=None, lookup=0, min_rows=rows, n_slots=plan_slots(plan))
    prepare = None
    if artifacts is not None and spec.mode == "performance" and plan.backend == "inductor-cpu":
        prepare = _package_installer(Path(artifacts))
    engine, tokenizer = build_engine(spec, prepare, reserve)
    warm_plan(engine, plan)
    return engine, tokenizer


def loops_on_pool(manifest: dict) -> bool:
    """Whether a plan's packages run the kernel library's loops on its pool: ``yggtree compile``
    measured it faster on this machine (the manifest's ``loops``), which it measures only where
    every package's own loops are serial (aoti.loops_serial)."""
    return (manifest.get("loops") or {}).get("choice") == "pool"


def confirmed_prefetch(manifest: dict, setting: tuple[int, int] | None) -> tuple[int, int] | None:
    """The prefetch setting an engine about to take ``setting`` (its plan's measurement) runs at
    on packages with ``manifest``: the library's default (None) where decoding judged this very
    setting slower than the default (the manifest's ``prefetch``, measure/prefetch_choice.py) or
    the compile was told to take it (``YGGTREE_PREFETCH=default``), else ``setting`` (pure)."""
    record = manifest.get("prefetch")
    if setting is None or not isinstance(record, dict) or record.get("choice") != "default":
        return setting
    if "setting" not in record:  # YGGTREE_PREFETCH=default at the compile: whatever was measured
        return None
    return None if list(record["setting"] or ()) == list(setting) else setting


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
        from .attention_choice import set_native_attention

        set_native_attention([target, *([drafter.graphs.model] if drafter is not None else [])],
                             manifest.get("attention_kernel"))  # the packages' (their names hold it)
        install_packages(target, packages)
        target.package_root = cache_dir(art)  # where batch packages go (runtime/batch_packages.py)
        if step_capture is not None:
            install_step_packages(target, packages, step_capture)
        if drafter is not None:
            install_packages(drafter.graphs.model, packages)
            if call is not None:  # an EAGLE head's whole calls, with the constants they were compiled for
                install_drafter_calls(drafter, packages, call["top_k"], call["nodes"])

    return prepare
