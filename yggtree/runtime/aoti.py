"""AOTInductor packages of decoder blocks: compiled ahead of time, loaded at run time with no dynamo.

One package per (block kind, input width W, context C). A block kind is the block's class and the
shapes and dtypes of its weights and KV cache (:func:`block_key`), so every layer of a model --
and a self-drafter's copy of it -- shares one package per shape: the package takes the layer's
weights and KV cache as inputs and writes the cache in place (an exported input mutation).

    block inputs   x [1, W, H], cos [1, W, 1, D/2] f32, sin [1, W, 1, D/2] f32, slots [1, W] i64,
                   mask [1, W, C] bool, then the cache kv [2, 1, Hkv, S, D] (mutated), then the
                   weights in ``named_parameters`` order, then the buffers (the oneDNN-packed
                   weights of a packed model, see :mod:`yggtree.runtime.packed`)
    block output   [1, W, H]

Compile side (``yggtree compile``): :class:`ShapeRecorder` runs the engine's usual warm-up
eagerly and records every (kind, W, C) a block is called with; :func:`compile_package` exports
and compiles each. Run side: :func:`install_packages` makes every block of a model call its
packages (:class:`PackagedForward`); a shape with no package is a YggError, never a compile.
Activation inputs are made contiguous at the call (a no-op for the target, whose inputs already
are), because a package assumes the strides it was compiled for.

Step packages. Per-block packages keep compile time that of one block, but a decode step then
enters 30 packages and runs the glue (embedding, RoPE rows, mask, final norm, head) as eager ops,
a measured share of a step. So the target's tree steps (``Plan.step_widths``:
the plain step and every W_v of a speculative plan) are also compiled whole, once per context
bucket: :func:`steps.tree_step`
up to the final norm with every layer inlined (one package per (model, W, C),
``step-<key>-w<W>-c<C>.pt2``)

    step inputs    tokens [W] i64, depth [W] i64, node [W] i64, anc [W, W] bool, committed [] i64,
                   then the 30 layers' caches kv [2, 1, Hkv, S, D] (mutated), then the model's
                   weights and buffers (:func:`model_tensors`)
    step outputs   x [1, W, H], the last layer's output before the final norm, then the captured
                   layers (each [W, H])

:class:`StepPackages` runs it in place of :meth:`Graphs.tree_step <yggtree.runtime.graphs.Graphs.tree_step>`'s
block path and then the final norm and the head eagerly (:func:`steps.finish_step`), as the block
path does. So it computes the block path's step bitwise (on the default model, every step tried
in every format): a verified node's logits are the plain step's, whichever path each ran. Fused
into the graph, the final norm would reduce in another order than the eager one (the last bits
of the logits differed on a few steps in twelve); and a bfloat16 model's blocks, fused into one
graph, would keep intermediates in float32 that the block packages round, were its packages not
compiled to round them as the unfused ops do (:func:`package_config`). The block packages of the
same widths stay: a drafter sharing the target's blocks runs them, and a tree step whose ancestor
matrix is not square (a drafter step of a self-drafter) cannot run a whole step.

Drafter-call packages. An EAGLE drafter's head and draft calls (:func:`yggtree.runtime.eagle.head_call`,
:func:`~yggtree.runtime.eagle.step_call`: mask, embedding, fc, its layers, norm, LM head, top-k)
are compiled whole too, one package per call kind and width at the cache's size
(``head-<key>-w<D+1>-c<S>.pt2``, ``draft-<key>-w<W_d>-c<S>.pt2``; the top-k is compiled in).
Eagerly those calls ran ~20 small ops around the block package. Their numerics only shape the
proposals: the target's verify decides every token, so speculation stays exact whatever they round.

    head inputs    root [] i64, committed [] i64, pend_tok [D+1] i64, pend_feat [D+1, H],
                   pend_raw [D+1, n H_t], pend_true [D+1] bool, pend_n [] i64, then node_feat [N, H]
                   (row 0 written)
    draft inputs   tokens, depth, node, parent [W] i64, anc [W, N] bool, committed [] i64,
                   then node_feat [N, H] (the fed rows written)
    both, then     the shared embedding [V, H] (when the head shares the target's), the layers'
                   caches (mutated), the head's weights and buffers (:func:`model_tensors`)
    outputs        top-k target ids [W, k] i64, their log-probabilities [W, k] f32
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import YggError
from . import packed as _packed  # registers yggtree::packed_linear, which packages call
from . import quant as _quant  # noqa: F401  registers yggtree::int4_mm, which quantized blocks' packages call
from .aoti_cxx import lean_build

# inductor settings of CPU graphs, torch.compile'd and AOTInductor-packaged alike: no per-call
# size/stride asserts (Python checks of every input and extern-kernel output; see graphs.compile_options)
# realize_reads_threshold 0: a value several kernels read is computed once and stored. Inductor's
# default recomputes a cheap one (few reads, few ops) inside each reader: a step's attention masks
# and row windows ([W, C] each, read by every layer's attention) were rebuilt in half the layers of
# a 1038-slot whole step, ~8% of a W = 8 step (and ~7% of a 256-slot one elsewhere). Storing changes no
# value: float32 is stored as computed, and half precision rounds every intermediate anyway
# (cpu_config's emulate_precision_casts).
INDUCTOR_CPU_CONFIG = {"size_asserts": False, "realize_reads_threshold": 0}


def half_precision(module: nn.Module) -> bool:
    """Whether ``module`` holds bfloat16 or float16 parameters (a half-precision model or block)."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in module.parameters())


def cpu_config(half: bool) -> dict:
    """Inductor's CPU settings for a model's graphs, packages and dynamo graphs alike:
    :data:`INDUCTOR_CPU_CONFIG`, and in a ``half``-precision model every intermediate of a fused
    kernel rounded to its dtype as the unfused ops round it (``emulate_precision_casts``). Without
    it a graph rounds where its fusion happens to materialise values, so two graphs of one step
    (a whole step and its blocks, or one step width and another) differ in the last bits and a
    verified node's logits leave the plain step's at near-ties."""
    config = dict(INDUCTOR_CPU_CONFIG)
    if half:
        config["emulate_precision_casts"] = True
    return config

N_ACT = 5  # x, cos, sin, slots, mask


def block_key(block: nn.Module) -> str:
    """12 hex digits naming a block's kind: class, heads, weight shapes and dtypes, how its
    attention computes (``invariant_rows``: which widths run row by row, and so whether a call's
    slots carry the row window, :func:`yggtree.runtime.model.row_window`), and the padding of its
    packed products (``min_rows``) and their kernel, and its KV cache's dtype; the last four are constants
    of the compiled graph (a package reads and writes its cache input as the dtype it was compiled for,
    unchecked). A target's blocks and an EAGLE head's block of the same shapes thus get packages of their
    own, also where only their caches differ (a float16 target cache beside the head's float32 one). The
    cache size S is not part of it: a package set is built for one S (:attr:`PackageSet.n_slots`)."""
    att = block.self_attn
    cfg = att.cfg
    parts = [type(block).__qualname__, f"heads{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}",
             f"rows{att.invariant_rows}{att.native_rows or ''}", f"kv{att.kv_dtype or 'weights'}"]
    parts += [f"{n}{tuple(p.shape)}{p.dtype}" for n, p in block_tensors(block)]
    min_rows = _packed.min_rows_of(block)
    if min_rows is not None:
        parts.append(f"min_rows{min_rows}")
    if _packed.kernel_of(block) == "tiled":  # the other product op
        parts.append("tiled")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]


def block_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A block's weights as package inputs: parameters, then buffers (packed weights), without
    the KV cache (its own inputs; present or not depending on when the cache was set up)."""
    bufs = [(n, b) for n, b in block.named_buffers() if not n.startswith("self_attn.cache.")]
    return [*block.named_parameters(), *bufs]


def package_name(key: str, width: int, context: int, scope: str = "block") -> str:
    """File name of a package: ``scope`` is ``block`` (one decoder block) or ``step`` (a whole step)."""
    return f"{scope}-{key}-w{width}-c{context}.pt2"


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A model's weights as a step package's inputs: parameters (tied ones once), then buffers
    (the RoPE table, packed weights), without the layers' KV caches (inputs of their own)."""
    bufs = [(n, b) for n, b in model.named_buffers() if ".cache." not in n]
    return [*model.named_parameters(), *bufs]


def step_key(model: nn.Module, capture: tuple[int, ...]) -> str:
    """12 hex digits naming a whole-step package's model: its layers' kinds (:func:`block_key`),
    the other tensors' shapes and dtypes, and the layers whose outputs it returns."""
    parts = ["step", f"layers{len(model.layers)}", *sorted({block_key(b) for b in model.layers}),
             f"capture{tuple(capture)}"]
    # the RoPE table is sized with the cache (setup_cache), which may come after the packages are
    # installed; its size is the package set's n_slots, checked on its own
    parts += [f"{n}{tuple(t.shape)}{t.dtype}" for n, t in model_tensors(model)
              if not n.startswith("layers.") and n != "rope"]
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]


class _BlockFn(nn.Module):
    """A block as a function of its activations, KV cache and weights (what is exported)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.names = [n for n, _ in block_tensors(block)]

    def forward(self, x, cos, sin, slots, mask, kv, *weights):
        state = dict(zip(self.names, weights))
        state["self_attn.cache.kv"] = kv
        return torch.func.functional_call(self.block, state, (x, cos, sin, slots, mask))


class _TreeStep(nn.Module):
    """:func:`steps.tree_step` of a model at one context bucket up to the final norm
    (:func:`steps.masked_layers`), as a module call."""

    def __init__(self, model: nn.Module, context: int, capture: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.context, self.capture = model, context, tuple(capture)

    def forward(self, tokens, depth, node, anc, committed):
        from .steps import masked_layers, tree_mask

        mask = tree_mask(committed, anc, self.context)
        x, layers = masked_layers(self.model, torch.stack([tokens, depth, node]), mask, committed, self.capture)
        return (x, *(h[0] for h in layers))


class _StepFn(nn.Module):
    """A whole tree step as a function of its inputs, the layers' caches and the weights (what a
    step package exports)."""

    def __init__(self, model: nn.Module, context: int, capture: tuple[int, ...]) -> None:
        super().__init__()
        self.step = _TreeStep(model, context, capture)
        self.names = [n for n, _ in model_tensors(model)]
        self.n_layers = len(model.layers)

    def forward(self, tokens, depth, node, anc, committed, *rest):
        kvs, weights = rest[: self.n_layers], rest[self.n_layers:]
        state = {f"model.{n}": w for n, w in zip(self.names, weights)}
        state |= {f"model.layers.{i}.self_attn.cache.kv": kv for i, kv in enumerate(kvs)}
        return torch.func.functional_call(self.step, state, (tokens, depth, node, anc, committed))


def package_config(block: nn.Module, serial_loops: bool = False) -> dict:
    """Inductor settings of ``block``'s packages (and of its model's whole steps):
    :func:`cpu_config` (so a whole step, whose kernels fuse across the blocks, computes its block
    packages' step bitwise in half precision too); and where it calls our kernel library (w4a8
    weights, tiled products) the kernels' C shims (a direct call; AOTInductor's proxy executor
    would box every call's arguments, a cost paid at every product); ``serial_loops``: inductor's own loops
    serial (see :func:`loops_serial`)."""
    from .kernels import aoti_shims
    from .w4a8 import W4A8Linear

    config = cpu_config(half_precision(block))
    if any(isinstance(m, W4A8Linear) or getattr(m, "kernel", None) == "tiled" for m in block.modules()):
        config["aot_inductor.custom_ops_to_c_shims"] = aoti_shims()
    if serial_loops:
        config["cpp.threads"] = 1
    return config


def library_loops_only(block: nn.Module) -> bool:
    """Whether every product of ``block`` runs on our kernel library: the w4a8 format, or the
    tiled kernel's float, int8 and 4-bit layers (:func:`loops_serial` decides a plan's packages
    from it)."""
    from .model import FUSED_PROJECTIONS
    from .packed import PackedConcat
    from .quant import Int4Linear, Int8Linear
    from .w4a8 import W4A8Linear

    mods = list(block.modules())
    # the parts of a fused q/k/v or gate/up product stay as modules but are not run
    fused = {id(getattr(m, k, None)) for m in mods for _, attr, names in FUSED_PROJECTIONS
             if isinstance(getattr(m, attr, None), nn.Module) for k in names}
    products = [m for m in mods if id(m) not in fused
                and isinstance(m, (nn.Linear, PackedConcat, Int8Linear, Int4Linear, W4A8Linear))]
    return bool(products) and all(isinstance(m, W4A8Linear) or getattr(m, "kernel", None) == "tiled" for m in products)


def loops_serial(target: nn.Module, drafter_model: nn.Module | None) -> bool:
    """Whether a plan's packages are compiled with inductor's own loops serial (:func:`package_config`):
    where every product of the target and of the drafter's model (None: a plain plan) runs on the
    kernel library (:func:`library_loops_only`), so that the library's loops may run on its thread
    pool (kernels.loop_pool), which must not meet an OpenMP team (a package's OpenMP regions have
    their thread count compiled in). What inductor computes in such a step is elementwise and small:
    the SiLU-mul, the norms and rotary embedding of a few rows, a drafter's top-k over its draft
    vocabulary; serial, it costs a step nothing. Whether the pool then runs the loops is measured
    per machine (measure/loops_choice.py). Pure."""
    return library_loops_only(target) and (drafter_model is None or library_loops_only(drafter_model))


def compile_package(block: nn.Module, example: tuple[torch.Tensor, ...], path: Path,
                    serial_loops: bool = False) -> Path:
    """Export ``block`` at the shapes of ``example`` (its 5 activation inputs) and compile it into
    the AOTInductor package ``path``. The block's own cache is only read for its shape."""
    cache = block.self_attn.cache
    acts = tuple(a.contiguous() for a in example)
    args = (*acts, cache.kv.clone(), *(p.detach() for _, p in block_tensors(block)))
    return _export_and_package(_BlockFn(block), args, package_config(block, serial_loops), path)


def compile_step_package(model: nn.Module, width: int, context: int, capture: tuple[int, ...],
                         path: Path, serial_loops: bool = False) -> Path:
    """Export ``model``'s whole tree step of ``width`` inputs at context bucket ``context``
    (capturing ``capture``) and compile it into the AOTInductor package ``path``. The model's
    blocks must run their own forward (no packages or recorder installed)."""
    ar = torch.arange(width)
    anc = ar[None, :] <= ar[:, None]
    kvs = [b.self_attn.cache.kv.clone() for b in model.layers]
    # three distinct tensors: export reads inputs that alias each other as one (the graph would
    # take the tokens for the depths)
    args = (ar.clone(), ar.clone(), ar.clone(), anc, torch.zeros((), dtype=torch.int64), *kvs,
            *(t.detach() for _, t in model_tensors(model)))
    return _export_and_package(_StepFn(model, context, capture), args,
                               package_config(model.layers[0], serial_loops), path)


def _export_and_package(fn: nn.Module, args: tuple, config: dict, path: Path) -> Path:
    # the packed (mkldnn) buffers reach the graph as inputs; while exporting, the modules' own
    # slots hold empty dense stand-ins, which export can copy (it cannot copy mkldnn tensors)
    opaque = [(m, n, b) for m in fn.modules() for n, b in m._buffers.items()
              if b is not None and b.is_mkldnn]
    try:
        for m, n, b in opaque:
            m._buffers[n] = torch.empty(0, dtype=b.dtype)
        with torch.no_grad():
            ep = torch.export.export(fn, args, strict=False)
            with lean_build():
                out = torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=config)
    finally:
        for m, n, b in opaque:
            m._buffers[n] = b
    return Path(out)


# ----------------------------------------------------------------------------- compile side


class ShapeRecorder:
    """Installed on a model's blocks while ``yggtree compile`` warms an engine up: every block
    call runs eagerly and records its (kind, W, C) with example activations."""

    def __init__(self) -> None:
        self.examples: dict[tuple[str, int, int], tuple[torch.Tensor, ...]] = {}
        self.blocks: dict[str, nn.Module] = {}  # one block of each kind (to export)
        self.seen: list[tuple[str, int, int]] = []  # shapes called since the last take()

    def forward_of(self, block: nn.Module):
        orig, key0 = block.forward, block_key(block)

        def forward(x, cos, sin, slots, mask):
            key = (key0, int(x.shape[1]), int(mask.shape[-1]))
            if key not in self.examples:
                self.examples[key] = tuple(t.detach().clone() for t in (x, cos, sin, slots, mask))
                self.blocks.setdefault(key0, block)
            if key not in self.seen:
                self.seen.append(key)
            return orig(x, cos, sin, slots, mask)

        return forward

    def take(self) -> list[tuple[str, int, int]]:
        out, self.seen = self.seen, []
        return out


# ----------------------------------------------------------------------------- run side


EXTRACT_DIR = "extract"  # under the cache: a directory per process for AOTInductor's extracted packages


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def extracting_here():
    """AOTInductor extracts every package it loads into a directory of its own under ``$TMPDIR`` and removes it
    when the loader is freed; a process killed before then leaves it behind (2-3 MB a package, in /tmp, for
    good). Inside this block ``$TMPDIR`` is this process's directory under the cache (``<cache>/extract/<pid>``)
    and the directories of processes no longer alive are removed first. Where the cache cannot be written,
    nothing changes (the packages extract to the system's temporary directory)."""
    from ..files import cache_root

    root = cache_root() / EXTRACT_DIR
    mine = root / str(os.getpid())
    try:
        mine.mkdir(parents=True, exist_ok=True)
        for d in root.iterdir():
            if d.name.isdigit() and d != mine and not _alive(int(d.name)):
                shutil.rmtree(d, ignore_errors=True)
    except OSError:
        yield
        return
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(mine)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before


def load_runner(path: Path, what: str):
    """AOTInductor's runner of the package at ``path`` (inside :func:`extracting_here`); YggError in one
    line naming ``what`` where it does not load."""
    from torch._C._aoti import AOTIModelPackageLoader

    try:
        return AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise YggError(f"cannot load {what} {path}: {first}") from None


@dataclass(frozen=True)
class PackageSet:
    """Loaded packages: (block key, W, C) -> AOTI model runner, all for a cache of ``n_slots``."""

    runners: dict  # (str, int, int) -> torch._C._aoti.AOTIModelPackageLoader
    n_slots: int

    @classmethod
    def load(cls, root: Path, entries: list[tuple], n_slots: int,
             sha256: dict[str, str | None] | None = None) -> "PackageSet":
        """Load the packages of ``entries``, each (key, W, C) for a block package or (key, W, C,
        scope); with ``sha256`` (file name -> the manifest's checksum) a package whose bytes
        differ is refused before AOTInductor reads it."""
        from ..files import file_sha256

        runners = {}
        with extracting_here():
            for key, w, c, *scope in entries:
                scope = scope[0] if scope else "block"
                path = Path(root) / package_name(key, w, c, scope)
                if not path.is_file():
                    raise YggError(f"compiled graph {path} is missing: recompile the plan (yggtree compile --force)")
                if sha256 is not None and file_sha256(path) != sha256.get(path.name):
                    raise YggError(f"compiled graph {path} is corrupted (its sha256 differs from the "
                                   "manifest's): recompile the plan (yggtree compile, or run --compile-missing)")
                runners[(key, w, c)] = load_runner(path, "compiled graph")
        return cls(runners, n_slots)

    def shapes(self, key: str) -> list[tuple[int, int]]:
        return sorted((w, c) for (k, w, c) in self.runners if k == key)


class PackagedForward:
    """A block's forward that runs its compiled package for the call's (W, C)."""

    def __init__(self, block: nn.Module, packages: PackageSet) -> None:
        self.block = block
        self.key = block_key(block)
        self.weights = [p for _, p in block_tensors(block)]
        self.runners = {(w, c): r for (k, w, c), r in packages.runners.items() if k == self.key}
        if not self.runners:
            raise YggError(f"no compiled graph matches this model's blocks (kind {self.key}); recompile the plan")

    def __call__(self, x, cos, sin, slots, mask):
        runner = self.runners.get((x.shape[1], mask.shape[-1]))
        if runner is None:
            have = sorted({w for w, _ in self.runners})
            raise YggError(
                f"no compiled graph for block input width {x.shape[1]} at context {mask.shape[-1]} "
                f"(compiled widths: {have}); add the width to the plan and recompile"
            )
        cache = self.block.self_attn.cache
        acts = (x.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous(), mask.contiguous())
        return runner.run([*acts, cache.kv, *self.weights])[0]


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.layers)


def install_recorder(model: nn.Module, recorder: ShapeRecorder) -> None:
    """Record (and run eagerly) every block call of ``model`` (see :class:`ShapeRecorder`)."""
    for block in blocks_of(model):
        _uncompile(block)
        block.forward = recorder.forward_of(block)
    model.static_blocks = recorder


def install_packages(model: nn.Module, packages: PackageSet) -> None:
    """Make every block of ``model`` run its compiled packages (no dynamo, no compile)."""
    for block in blocks_of(model):
        _uncompile(block)
        block.forward = PackagedForward(block, packages)
    model.static_blocks = packages


class StepPackages:
    """A model's whole-step packages: (W, C) -> runner, for steps capturing ``capture``."""

    def __init__(self, model: nn.Module, packages: PackageSet, capture: tuple[int, ...]) -> None:
        key = step_key(model, capture)
        self.runners = {(w, c): r for (k, w, c), r in packages.runners.items() if k == key}
        if not self.runners:
            raise YggError(f"no compiled whole-step graph matches this model (kind {key}); recompile the plan")
        self.model, self.capture = model, tuple(capture)
        self._store, self._inputs = None, []

    def serves(self, width: int, context: int, anc: torch.Tensor, capture: tuple[int, ...]) -> bool:
        """Whether a tree step of ``width`` inputs at bucket ``context`` runs here: a package for
        the shape, a square ancestor matrix, and no layer asked for that it does not return."""
        return ((width, context) in self.runners and anc.shape == (width, width)
                and tuple(capture) in ((), self.capture))

    def __call__(self, tokens, depth, node, anc, committed, capture, context):
        if self._store is not self.model.kv:  # the cache (and the RoPE table) were (re)allocated
            self._store = self.model.kv
            self._inputs = [*(b.self_attn.cache.kv for b in self.model.layers),
                            *(t for _, t in model_tensors(self.model))]
        from .steps import finish_step

        ins = [t.contiguous() for t in (tokens, depth, node, anc, committed)]
        x, *layers = self.runners[(tokens.shape[0], context)].run([*ins, *self._inputs])
        logits, hidden = finish_step(self.model, x)  # eagerly, as the block path does
        return logits, hidden, tuple(layers) if capture else ()


DRAFTER_CALLS = {"head": 7, "draft": 6}  # call kind -> its activation inputs (before node_feat)


def drafter_call_key(drafter, kind: str, k: int, nodes: int) -> str:
    """12 hex digits naming a drafter-call package's model and constants: the call kind, top-k,
    the tree nodes it takes (``nodes``: the plan's largest tree), D_max, the layers' kinds and the
    head's other tensors."""
    net = drafter.net
    parts = ["drafter-call", kind, f"k{k}", f"nodes{nodes}x{drafter.node_feat.shape[1]}{drafter.node_feat.dtype}",
             f"depth{drafter.max_depth}", f"layers{len(net.layers)}", *sorted({block_key(b) for b in net.layers})]
    parts += [f"{n}{tuple(t.shape)}{t.dtype}" for n, t in model_tensors(net)
              if not n.startswith("layers.") and n != "rope"]
    if net.cfg.shares_embedding:
        parts.append(f"embed{tuple(net.embed_weight.shape)}{net.embed_weight.dtype}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]


def _drafter_state(net: nn.Module) -> list[torch.Tensor]:
    """A drafter-call package's inputs after node_feat: the shared embedding (if any), the
    layers' caches, the head's weights and buffers."""
    embed = [net.embed_weight] if net.cfg.shares_embedding else []
    return [*embed, *(b.self_attn.cache.kv for b in net.layers), *(t for _, t in model_tensors(net))]


class _DrafterCall(nn.Module):
    """One drafter call (``kind``: head or draft; ``fn``: the drafter's function of it,
    ``call_fns[kind]``) with its top-k, as a module call."""

    def __init__(self, net: nn.Module, fn, kind: str, k: int) -> None:
        super().__init__()
        self.net, self.fn, self.kind, self.k = net, fn, kind, k

    def forward(self, *args):  # activations, node_feat[, embed]
        n = DRAFTER_CALLS[self.kind]
        embed = args[n + 1] if len(args) > n + 1 else None
        return self.fn(self.net, *args[:n], args[n], self.k, embed)


class _DrafterCallFn(nn.Module):
    """A drafter call as a function of its activations, node_feat, the shared embedding, the
    layers' caches and the head's weights (what a drafter-call package exports)."""

    def __init__(self, net: nn.Module, fn, kind: str, k: int) -> None:
        super().__init__()
        self.call = _DrafterCall(net, fn, kind, k)
        self.names = [n for n, _ in model_tensors(net)]
        self.n_in = DRAFTER_CALLS[kind] + 1 + int(net.cfg.shares_embedding)  # activations, node_feat, embed
        self.n_layers = len(net.layers)

    def forward(self, *args):
        acts, rest = args[: self.n_in], args[self.n_in:]
        kvs, weights = rest[: self.n_layers], rest[self.n_layers:]
        state = {f"net.{n}": w for n, w in zip(self.names, weights)}
        state |= {f"net.layers.{i}.self_attn.cache.kv": kv for i, kv in enumerate(kvs)}
        return torch.func.functional_call(self.call, state, acts)


def compile_drafter_call_package(drafter, kind: str, width: int, k: int, nodes: int, path: Path,
                                 serial_loops: bool = False) -> Path:
    """Export an EAGLE drafter's ``kind`` call (head: ``width`` pending rows; draft: W_d inputs)
    with top-``k`` over trees of up to ``nodes`` nodes and compile it into the AOTInductor package
    ``path``. The drafter must be set up and its blocks run their own forward."""
    net = drafter.net
    i64 = dict(dtype=torch.int64)
    if kind == "head":  # the first ``width`` pending rows (EagleDrafter.head_widths)
        acts = (torch.tensor(1, **i64), torch.tensor(2, **i64), drafter.pend_tok[:width].clone(),
                drafter.pend_feat[:width].clone(), drafter.pend_raw[:width].clone(), drafter.pend_true[:width].clone(),
                torch.tensor(0, **i64))
    else:
        ar = torch.arange(width)
        anc = torch.zeros(width, nodes, dtype=torch.bool)
        anc[:, 0] = True
        anc[ar, 1 + ar] = True
        acts = (ar.clone(), torch.ones(width, **i64), 1 + ar, torch.zeros(width, **i64), anc, torch.tensor(2, **i64))
    embed = [net.embed_weight.detach()] if net.cfg.shares_embedding else []
    args = (*acts, drafter.node_feat[:nodes].clone(), *embed, *(b.self_attn.cache.kv.clone() for b in net.layers),
            *(t.detach() for _, t in model_tensors(net)))
    fn = _DrafterCallFn(net, drafter.call_fns[kind], kind, k)
    return _export_and_package(fn, args, package_config(net.layers[0], serial_loops), path)


class DrafterCalls:
    """An EAGLE drafter's call packages for its top-k ``k`` over trees of up to ``nodes`` nodes:
    (kind, W) -> runner. Which packages serve it is decided at the call, from the drafter's
    shapes then (its setup sizes node_feat and the cache after the packages are installed)."""

    def __init__(self, drafter, packages: PackageSet, k: int, nodes: int) -> None:
        self.drafter, self.packages, self.k, self.nodes = drafter, packages, k, nodes
        self._nodes, self._store, self._inputs, self._runners = None, None, [], {}

    def _refresh(self) -> None:
        d, net = self.drafter, self.drafter.net
        if self._store is net.kv and self._nodes is d.node_feat:
            return
        self._runners = {}
        if d.node_feat.shape[0] >= self.nodes:
            for kind in DRAFTER_CALLS:
                key = drafter_call_key(d, kind, self.k, self.nodes)
                self._runners |= {(kind, w): r for (kk, w, c), r in self.packages.runners.items()
                                  if kk == key and c == net.cache_slots}
        self._store, self._nodes, self._inputs = net.kv, d.node_feat, _drafter_state(net)

    def served(self) -> set[tuple[str, int]]:
        """The (kind, W) calls a package runs (at the plan's top-k and trees up to ``nodes``)."""
        self._refresh()
        return set(self._runners)

    def runner(self, kind: str, width: int, k: int, tree: int = 1):
        """A function ``(activations, node_feat) -> (ids, logp)`` running the package of this
        call (``tree``: the draft call's tree nodes, its ancestor rows' width), or None (no
        package for it: the caller runs the call eagerly)."""
        if k != self.k or tree > self.nodes:
            return None
        self._refresh()
        run = self._runners.get((kind, width))
        if run is None:
            return None
        n = self.nodes

        def call(acts, node_feat):
            if kind == "draft":  # the ancestor rows at the package's tree width
                acts = (*acts[:4], torch.nn.functional.pad(acts[4], (0, n - acts[4].shape[1])), acts[5])
            return tuple(run.run([*(t.contiguous() for t in acts), node_feat[:n], *self._inputs]))

        return call


def install_drafter_calls(drafter, packages: PackageSet, k: int, nodes: int) -> None:
    """Make an EAGLE ``drafter``'s head and draft calls run their packages (top-``k``, trees of up
    to ``nodes`` nodes), where ``packages`` hold one for the call; other calls run eagerly."""
    drafter.calls = DrafterCalls(drafter, packages, k, nodes)


def install_step_packages(model: nn.Module, packages: PackageSet, capture: tuple[int, ...]) -> None:
    """Make ``model``'s tree steps of the shapes with a whole-step package run it
    (:meth:`Graphs.tree_step <yggtree.runtime.graphs.Graphs.tree_step>`)."""
    model.step_packages = StepPackages(model, packages, capture)


def step_packages(model: nn.Module) -> StepPackages | None:
    return getattr(model, "step_packages", None)


def static_blocks(model: nn.Module):
    """What runs ``model``'s blocks: a PackageSet, a ShapeRecorder, or None (dynamo / eager)."""
    return getattr(model, "static_blocks", None)


def _uncompile(block: nn.Module) -> None:
    # ``nn.Module.compile`` stores its wrapper here; None restores the plain call path, so the
    # instance ``forward`` set next is what runs
    block._compiled_call_impl = None
