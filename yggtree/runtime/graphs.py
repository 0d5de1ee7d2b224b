"""Static graphs of one model: compile per decoder block, warm up every width, then freeze.

Two scopes of compilation (both fullgraph, static shapes):

- ``step`` (the default for a :class:`~yggtree.runtime.model.Transformer`): each step function of
  :mod:`yggtree.runtime.steps` -- embedding, every decoder layer, final norm, LM head -- is one
  graph per (input width, context bucket). The decoder layers are a ``nested_compile_region``
  (see ``model._block``), so dynamo traces and inductor compiles one layer per graph and the
  graph calls it once per layer: compile time stays that of one block while a decode step enters
  Python once instead of once per layer (measured faster per step than ``block`` scope).
- ``block`` (regional): each decoder block is compiled once and the one graph per input width is
  shared by all layers (dynamo lifts parameters and buffers to graph inputs); the glue runs as
  eager ops. Used for modules that are not Transformers (the EAGLE head).

After :meth:`Graphs.warm_up` every shape the engine can request has a graph; decoding then runs
under ``torch.compiler.set_stance("fail_on_recompile")`` so a shape that slipped through is an
error, never a silent compile in the decode loop.

Thread counts. Dynamo guards every graph on the calling thread's intra-op thread count (its
global-state guard holds ``num_threads``), and inductor bakes the count into the CPU kernels it
generates. A graph built at one count is therefore a recompile at another, and the wrong kernel
besides: graphs are built at the count they will run at (``warm_up(..., threads=T)`` sets the
calling thread's count for the build), and the widths built are tracked per count
(:meth:`Graphs.widths_at`). Graphs that do not depend on the count (eager code, AOTInductor
packages) keep one set of widths under the key 0. The engine builds the target's (and the
drafter's) graphs at its plan's count, and the overlap worker builds the drafter's speculation
graphs on its own thread at its own count.

A compiled plan replaces dynamo altogether: its blocks run AOTInductor packages loaded from
``compile/<plan>/`` (:mod:`yggtree.runtime.aoti`, installed before the engine is built). Warm-up
then only checks that every (width, context bucket) has a package; nothing is traced or compiled
in the process, and a missing shape is a YggError.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import YggError
from . import steps
from .aoti import PackageSet, cpu_config, half_precision, static_blocks, step_packages
from .model import Transformer

MODES = ("reference", "performance")
# dynamo's recompile limits while :meth:`Graphs.build` compiles (one graph per width and bucket
# is the design, not a runaway recompile)
BUILD_LIMITS = dict(recompile_limit=256, accumulated_recompile_limit=1 << 20)
SCOPES = ("step", "block")
BACKENDS = ("inductor-cpu", "eager", "cuda", "npu")


def check_backend(backend: str) -> None:
    """Refuse a backend whose runtime is missing on this machine, saying what to install."""
    if backend not in BACKENDS:
        raise YggError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "cuda" and not torch.cuda.is_available():
        raise YggError("backend 'cuda' needs an NVIDIA GPU and a CUDA build of torch (see README)")
    if backend == "npu":
        try:
            import torch_npu  # noqa: F401
            import torchair  # noqa: F401
        except ImportError:
            raise YggError(
                "backend 'npu' needs Ascend's torch_npu and torchair: pip install torch-npu torchair"
            ) from None


@dataclass
class Graphs:
    """A model plus its compiled step functions (step scope) or blocks (block scope).
    ``compile_s`` accumulates warm-up time; ``built`` is the one record of what was built:
    (kind, thread count) -> input widths (kind ``step``: tree steps, and blocks in block scope;
    ``prefill``: step scope's prefill chunks; thread count 0: graphs that do not depend on it)."""

    model: Transformer
    mode: str
    built: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    compile_s: float = 0.0
    backend: str = "inductor-cpu"  # performance mode only; see compile_options
    scope: str = "step"  # performance mode: "step" (whole step functions) or "block" (regional)
    _fns: dict = field(default_factory=dict, repr=False)  # step scope: name -> compiled function
    _armed: bool = field(default=False, repr=False)  # the compiler wrappers are set (_arm)
    # (cache slots, call width) -> call_buckets: a walk over the model's layers, not once a step
    _buckets: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise YggError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.scope not in SCOPES:
            raise YggError(f"unknown graph scope {self.scope!r} (choose from {', '.join(SCOPES)})")

    def _arm(self) -> None:
        """Wrap the blocks (block scope) or the step functions (step scope) in ``torch.compile``,
        once, at the first build or call: blocks that run AOTInductor packages by then (installed
        after __init__) never import the compiler, a second and a half of every start."""
        if self._armed:
            return
        self._armed = True
        opts = compile_options(self.backend, half_precision(self.model)) if self.mode == "performance" else None
        if opts is not None and static_blocks(self.model) is None:  # "eager" gives None: no graphs
            if self.scope == "block":
                for block in self.model.layers:
                    block.compile(**opts)
            else:
                self._fns = {
                    "masked_step": torch.compile(steps.masked_step, **opts),
                    "prefill_chunk": torch.compile(steps.prefill_chunk, **opts),
                }

    def threads_key(self, threads: int | None = None) -> int:
        """The thread count graphs built at ``threads`` (None or 0: the calling thread's) are
        kept under: the count for dynamo graphs, 0 for eager code, AOTInductor packages and
        a shape recorder (which may be installed after __init__), which do not depend on it."""
        if not self.compiled or static_blocks(self.model) is not None:
            return 0
        return threads or torch.get_num_threads()

    def widths_at(self, threads: int | None = None, kind: str = "step") -> set[int]:
        """Input widths with a graph usable at ``threads`` (None: the calling thread's count)."""
        return set(self.built.get((kind, self.threads_key(threads)), ()))

    @property
    def widths(self) -> set[int]:
        """Input widths with a graph usable at the calling thread's count."""
        return self.widths_at()

    @property
    def prefill_widths(self) -> set[int]:
        """Step scope: prefill chunks with a graph usable at the calling thread's count."""
        return self.widths_at(kind="prefill")

    def reset(self) -> None:
        """Forget every width built (the cache was reallocated: every shape must be built again)."""
        self.built.clear()
        self._buckets.clear()

    def build(self, widths, run, threads: int | None = None, kind: str = "step") -> list[int]:
        """Call ``run(w)`` -- a call of width ``w`` that builds its graphs -- for every width of
        ``widths`` not built yet at ``threads`` (None: the calling thread's count), with the
        calling thread set to that count, grad off and compiles allowed; record them and add the
        time to ``compile_s``. Returns the widths built now."""
        self._arm()
        key = self.threads_key(threads)
        have = self.built.setdefault((kind, key), set())
        todo = sorted(set(widths) - have)
        if not todo:
            return todo
        t0 = time.perf_counter()
        # dynamo counts every compile of a code object over the process's life and refuses the one
        # past accumulated_recompile_limit (256): a long-lived process that builds many engines
        # (tuning trials, test suites) would reach it
        limits = (torch._dynamo.config.patch(**BUILD_LIMITS) if self.compiled and static_blocks(self.model) is None
                  else contextlib.nullcontext())
        try:
            with torch.no_grad(), limits, at_threads(key):
                for w in todo:
                    run(w)
                    have.add(w)
        finally:
            self.compile_s += time.perf_counter() - t0
        return todo

    def _compiled_fns(self) -> dict:
        """The step scope's compiled functions, or {} (eager code, block scope, or blocks that
        run AOTInductor packages or a shape recorder, which may be installed after __init__)."""
        if static_blocks(self.model) is not None:
            return {}
        self._arm()
        return self._fns

    def tree_step(self, tokens, depth, node, anc, committed, capture=(), n_ctx=None):
        """:func:`steps.tree_step` on this model (in step scope: the mask is built eagerly, the
        rest is one compiled graph per (W, n_ctx); with AOTInductor packages: the shape's
        whole-step package if it has one, else the block packages)."""
        whole = step_packages(self.model)
        slots = n_ctx or self.model.cache_slots
        if whole is not None and whole.serves(tokens.shape[0], slots, anc, capture):
            return whole(tokens, depth, node, anc, committed, capture, slots)
        run = self._compiled_fns().get("masked_step")
        return steps.tree_step(self.model, tokens, depth, node, anc, committed, capture, n_ctx, run)

    def prefill_chunk(self, *args):
        """:func:`steps.prefill_chunk` on this model (its compiled graph in step scope)."""
        return self._compiled_fns().get("prefill_chunk", steps.prefill_chunk)(self.model, *args)

    @property
    def compiled(self) -> bool:
        return self.mode == "performance" and self.backend != "eager"

    def buckets(self, width: int | None = None) -> list[int]:
        """The context buckets of a call of ``width`` rows on the current cache
        (:func:`call_buckets`; None: a call whose attention reads its bucket). Kept per cache size
        and width: how the layers compute attention is set before any graph is built."""
        key = (self.model.cache_slots, width)
        got = self._buckets.get(key)
        if got is None:
            got = self._buckets[key] = call_buckets(self.model, width)
        return got

    def bucket(self, need: int, width: int | None = None) -> int:
        """The smallest context bucket holding ``need`` slots for a call of ``width`` rows
        (host-side int, no sync)."""
        return next(b for b in self.buckets(width) if b >= need)

    def warm_up(
        self, widths: list[int], capture: tuple[int, ...] = (), prefill: int | None = None,
        threads: int | None = None,
    ) -> None:
        """Build the graph of every (width, context bucket) not built yet at ``threads`` intra-op
        threads (None: the calling thread's count; the build sets the calling thread to it):
        ``tree_step`` at each of ``widths`` and ``prefill_chunk`` at width ``prefill``, both
        capturing ``capture`` (block scope: one block graph per width serves both). Writes
        scratch data into the cache, so call it before a prefill, never between decode steps."""
        widths = list(widths)
        step_scope = bool(self._compiled_fns())
        if prefill is not None and not step_scope:
            widths.append(prefill)
        if not self.compiled:  # eager code needs no warm-up
            self.built.setdefault(("step", 0), set()).update(widths)
            return
        if isinstance(static_blocks(self.model), PackageSet):  # loaded packages: check only
            whole = step_packages(self.model)
            served = set(whole.runners) if whole is not None else set()  # (W, C) a whole-step package runs
            self.build(widths, lambda w: self._require_packages([w], set() if w == prefill else served), threads)
            return
        dev = self.model.embed_tokens.weight.device
        zero = torch.zeros((), dtype=torch.int64, device=dev)

        def step(w: int) -> None:
            ar = torch.arange(w, device=dev)
            anc = ar[None, :] <= ar[:, None]
            for n_ctx in self.buckets(w):
                if n_ctx >= w:
                    self.tree_step(ar, ar, ar, anc, zero, capture, n_ctx)

        def chunk(w: int) -> None:
            tokens = torch.zeros(1, w, dtype=torch.int64, device=dev)
            for n_ctx in self.buckets(w):  # attention over a 64-row chunk is not free: keep buckets
                if n_ctx >= w:  # (one bucket for all: every chunk would attend over the longest context)
                    self.prefill_chunk(tokens, zero, zero + w, capture, n_ctx)

        self.build(widths, step, threads)
        if prefill is not None and step_scope:
            self.build([prefill], chunk, threads, kind="prefill")

    def _require_packages(self, widths: list[int], served: set[tuple[int, int]] = frozenset()) -> None:
        """YggError unless every (width, bucket) of ``widths`` has a loaded block package or is
        in ``served`` (the tree steps a whole-step package runs: no block package is built for
        them)."""
        packages = static_blocks(self.model)
        if self.model.cache_slots != packages.n_slots:
            raise YggError(
                f"the compiled graphs are for a {packages.n_slots}-slot KV cache, this engine has "
                f"{self.model.cache_slots}: build the engine from its plan"
            )
        runners = self.model.layers[0].forward.runners  # every layer has the same kind
        have = sorted({w for w, _ in runners})
        for w in widths:
            for c in self.buckets(w):
                if c >= w and (w, c) not in runners and (w, c) not in served:
                    raise YggError(
                        f"width {w} is not in the compiled set {have} (context {c}); add it to "
                        "the plan and recompile (yggtree compile --force if the plan lists it)"
                    )

    def frozen(self, threaded: bool = False):
        """Context for the decode loop: compiled mode may not compile anything new.

        Every shape the loop can request was built by :meth:`warm_up`, so dynamo only needs the
        guards that tell those graphs apart (``skip_guard_eval_unsafe``): full guard evaluation
        at every block call costs several percent of a decode step on a CPU.

        ``threaded``: compiled code runs on two Python threads at once (the overlap plan's
        drafter worker beside the decoding thread). Then every guard is evaluated: with the
        unsafe stance, calls from the worker thread miss graphs they have (torch 2.13, "Recompilation
        triggered with skip_guard_eval_unsafe stance") once a garbage collection lands inside a
        lookup -- measured: with ``gc.set_threshold(1)`` the EAGLE worker failed after 6-20
        requests under the unsafe stance and ran 168 without a miss under full guards
        (``tests/test_overlap.py``). The stance is process-wide, so both
        threads pay for full guards while it is held.

        Graphs of one shape built at several thread counts are safe under this stance (checked
        with torch 2.13, ``tests/test_graph_threads.py``): it evaluates each cache entry's
        "diff guard root" instead of its full guard tree, and that root is a clone of the full
        root manager (``GuardManagerWrapper.populate_diff_guard_manager`` ->
        ``root.clone_manager``) which keeps the root's own leaf guards, GLOBAL_STATE among them
        (``___check_global_state()``: grad mode, autocast, default dtype, ``num_threads``, ...);
        what it drops are the managers below the root off the "diff guard sources" (tensor
        inputs and sources whose guards once failed). So the unsafe
        stance runs the entry built at the calling thread's count, and a count with no graph
        is a "Recompilation triggered" error, never another count's graph. One Graphs object
        may therefore hold several counts; the engine builds each at the count it runs at."""
        if self.compiled and static_blocks(self.model) is None:
            return torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=not threaded)
        return contextlib.nullcontext()


@contextlib.contextmanager
def at_threads(n: int):
    """The calling thread's intra-op thread count set to ``n`` inside the block (0: left as
    it is), restored after it (``torch.set_num_threads`` is per thread with ATen's OpenMP
    back end: runtime/overlap.py)."""
    before = torch.get_num_threads()
    if n and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def reads_visible_slots(model, width: int) -> bool:
    """Whether every attention layer of ``model`` computes a call of ``width`` rows row by row on
    the kernel library (``Attention.native_rows``, up to ``invariant_rows`` rows): csrc/rows_attention.cpp
    reads only each row's visible slots, so the call costs the same at any context bucket."""
    from .model import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return bool(layers) and all(m.native_rows and width <= m.invariant_rows for m in layers)


def call_buckets(model, width: int | None) -> list[int]:
    """The context buckets a call of ``width`` rows of ``model`` runs at: :func:`context_buckets`
    of its cache, or the whole cache alone where the call reads only the visible slots
    (:func:`reads_visible_slots`: a smaller bucket saves nothing, and each would be one more
    graph to build). None: bucketed."""
    if width is not None and reads_visible_slots(model, width):
        return [model.cache_slots]
    return context_buckets(model.cache_slots)


def context_buckets(n_slots: int, smallest: int = 256) -> list[int]:
    """Static context sizes attention may read: powers of two from ``smallest`` below
    ``n_slots``, then ``n_slots``. Each is one graph per input width; attention over a short
    context then reads a short cache instead of the whole preallocated one."""
    out, b = [], smallest
    while b * 5 // 4 < n_slots:  # a bucket within 25% of S would only add graphs
        out.append(b)
        b *= 2
    return out + [n_slots]


# ----------------------------------------------------------------------------- backends and caches
# (added for plans / ``yggtree compile``: compile options per backend and the on-disk cache scope)


def compile_options(backend: str, half: bool = False) -> dict | None:
    """``torch.compile`` keyword arguments of one block for ``backend``; None for ``eager``.

    - ``inductor-cpu``: fullgraph, static shapes (the tested path), without inductor's per-call
      size/stride asserts (a Python check on every graph input and every extern-kernel output,
      a measurable share of a decode step); for a ``half``-precision model
      every fused intermediate rounded as the unfused ops round it (``aoti.cpu_config``, as the
      packages: otherwise the graph at one step width rounds otherwise than at another, and
      bfloat16 speculation left plain decoding on 5 of 20 prompts).
    - ``cuda``: the same plus ``mode="reduce-overhead"`` (inductor with CUDA graphs).
    - ``npu``: torchair's graph-mode backend (torch_npu + torchair, imported lazily).

    The cuda and npu paths cannot run on a CPU-only machine and are unverified here.
    """
    check_backend(backend)
    static = dict(fullgraph=True, dynamic=False)
    if backend == "eager":
        return None
    if backend == "cuda":
        return dict(static, mode="reduce-overhead")
    if backend == "npu":
        import torchair

        return dict(static, backend=torchair.get_npu_backend(compiler_config=torchair.CompilerConfig()))
    return dict(static, options=cpu_config(half))


def backend_device(backend: str) -> str:
    """The torch device a backend's models and caches live on."""
    return {"cuda": "cuda", "npu": "npu"}.get(backend, "cpu")


@contextlib.contextmanager
def inductor_cache(path: str | Path):
    """Scope inductor's on-disk caches (FX graph cache, AOTAutograd cache, compiled kernels) to
    ``path`` for the duration of the block: graphs compiled inside are persisted there, and a
    later block over the same directory loads them instead of recompiling.

    Inductor reads its cache root from ``TORCHINDUCTOR_CACHE_DIR`` at every lookup, so the
    variable is set on entry and restored on exit (the process's previous value, or unset).

    One process at a time compiles into a directory (an exclusive lock on ``path/.lock``, released
    by the kernel if the holder dies): inductor writes a compiled library in place, and a second
    process compiling the same graph beside it left a truncated one that every later load refused.
    A process that finds the lock held says so in one line and waits, then loads what the first built.
    """
    import fcntl

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    root = Path(path).resolve()
    root.mkdir(parents=True, exist_ok=True)
    key = "TORCHINDUCTOR_CACHE_DIR"
    with open(root / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.stderr.write(f"yggtree: waiting for another process compiling graphs into {root}\n")
            fcntl.flock(lock, fcntl.LOCK_EX)
        before = os.environ.get(key)
        os.environ[key] = str(root)
        try:
            with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(
                enable_autograd_cache=True
            ):
                yield root
        finally:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before
