"""Our CPU kernel library: the C++ ops in ``runtime/csrc``, built once per machine and torch version.

- ``yggtree::w4a8_mm`` (``csrc/w4a8.cpp``): the ``w4a8`` format's blocks on int8 activations
  (runtime/w4a8.py).
- ``yggtree::rows_attention`` (``csrc/rows_attention.cpp``): row-by-row attention over the visible
  slots; ``yggtree::tree_attention`` the same rows, bit for bit, from one pass over each KV head's
  cache for all of them (runtime/model.py's ``Attention.native_rows``). Which of the two runs a
  call of several rows is measured per machine (``runtime/attention_choice.py``): the shared pass
  wins where the query vectors fit the registers and loses where they spill.
- how far ahead their products prefetch their weights (``csrc/prefetch.cpp``): two distances, into
  the first- and the second-level cache, measured per machine with the product kernel
  (:data:`PREFETCH_CHOICES`), set while an engine decodes (:func:`prefetch`).
- their parallel loops (``csrc/loops.cpp``): on OpenMP, or on the library's own spinning thread
  pool inside :func:`loop_pool` (a step whose only parallel regions are the library's: it costs
  less to start and join a region where the CPUs sit far apart).
- ``yggtree::tiled_mm`` (``csrc/tiled_mm.cpp``): float32, bfloat16 or int8 weights in tiles of 16
  output columns, each row computed on its own (runtime/packed.py's ``tiled`` product kernel);
  ``yggtree::tiled_q4_mm`` the same for 4-bit group-wise codes (runtime/quant.py's int4 and
  gguf-native layers on the tiled kernel).
- ``yggtree::rms_norm`` (``csrc/rms_norm.cpp``): a model's final RMS norm in one call, each row on its
  own (runtime/model.py's ``RMSNorm.native``: :func:`use_library_norm`).

``torch.utils.cpp_extension`` builds them into ``$XDG_CACHE_HOME/yggtree/kernels`` on first use
(a directory per source hash, instruction set, flags and torch version) and registers the ops; later
processes load the file a build of theirs loaded whole without asking the build system again;
AOTInductor packages call their C shims directly (:func:`aoti_shims`). Every source is written on
``csrc/simd.h``'s 16-lane vectors and compiled for one instruction set, the best this CPU runs
(:data:`ISAS`, in order: AVX-512 with VNNI, AVX-512, AVX2 with AVX-VNNI, AVX2; each with FMA and
F16C); ``YGGTREE_KERNEL_ISA`` names another the CPU runs (tests run every variant the CPU can).
Packed weights are the same on every set. A CPU without AVX2, FMA and F16C, or a machine without a
C++ compiler and ninja: :func:`load_library` raises YggError in one line, and the callers refuse or
fall back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

from ..errors import YggError
from ..files import write_text_atomic
from ..shapes import PREFETCH_CHOICES, prefetch_name, prefetch_setting  # noqa: F401 (the library's settings)

__all__ = ["SOURCES", "SHIMS", "ISAS", "cpu_flags", "isa", "runnable_isas", "library_missing", "library_usable", "library_built", "load_library", "aoti_shims", "runs_attention", "kv_dtype",
           "use_library", "use_rows_attention", "use_library_norm", "attention_ahead", "loop_pool", "prefetch", "prefetch_now", "attention_prefetch", "prefetch_setting", "prefetch_name", "PREFETCH_CHOICES"]

# the longest compiles first (ninja starts them in this order): the attention kernels' many instantiations,
# then ops.cpp, the one source that parses torch's headers (csrc/kernels.h)
SOURCES = tuple(Path(__file__).with_name("csrc") / n
                for n in ("rows_attention.cpp", "ops.cpp", "tiled_mm.cpp", "w4a8.cpp", "loops.cpp", "prefetch.cpp",
                          "rms_norm.cpp"))
# included by the sources: part of the build's key
HEADERS = tuple(Path(__file__).with_name("csrc") / n for n in ("kernels.h", "loops.h", "prefetch.h", "simd.h"))
# the attention kernels' head dims (csrc/rows_attention.cpp): each is compiled as its own set of
# functions (a few seconds of the build each); a model of another head dim runs torch's attention
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
# -fopenmp: at::parallel_for is an OpenMP loop compiled into the kernels (without it the loop runs
# on one thread); the build links the libgomp torch already loaded (same soname), so torch's
# thread count governs it
CFLAGS = ("-O3", "-fopenmp", f"-DYGGTREE_HEAD_CHUNKS={','.join(str(d // 16) for d in HEAD_DIMS)}")
LDFLAGS = ("-fopenmp",)
# the instruction sets the library is built for, best first: name -> (/proc/cpuinfo flags it needs,
# the compiler's flags for them); csrc/simd.h implements each
ISAS = {
    "avx512-vnni": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"),
                    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c")),
    "avx512": (("avx512f", "avx512bw", "avx512vl", "fma", "f16c"),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c")),
    "avx2-vnni": (("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
}
# what the least of them needs (/proc/cpuinfo names)
LIBRARY_FLAGS = ISAS["avx2"][0]
ISA_ENV = "YGGTREE_KERNEL_ISA"  # names the instruction set to build for instead of the best this CPU runs
# the ops' C shims as AOTInductor declares them in a package (the csrc files define them)
SHIMS = {
    "w4a8_mm": "AOTITorchError aoti_torch_cpu_w4a8_mm(AtenTensorHandle x, AtenTensorHandle blocks, AtenTensorHandle* ret0)",
    "rows_attention": "AOTITorchError aoti_torch_cpu_rows_attention(AtenTensorHandle q, AtenTensorHandle k, "
                      "AtenTensorHandle v, AtenTensorHandle head, AtenTensorHandle window, AtenTensorHandle* ret0)",
    "tree_attention": "AOTITorchError aoti_torch_cpu_tree_attention(AtenTensorHandle q, AtenTensorHandle k, "
                      "AtenTensorHandle v, AtenTensorHandle head, AtenTensorHandle window, AtenTensorHandle* ret0)",
    "tiled_mm": "AOTITorchError aoti_torch_cpu_tiled_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle scale, "
                "AtenTensorHandle* ret0)",
    "tiled_q4_mm": "AOTITorchError aoti_torch_cpu_tiled_q4_mm(AtenTensorHandle x, AtenTensorHandle blocks, "
                   "AtenTensorHandle* ret0)",
}
TILE = 16  # output columns per tile of the w4a8 and tiled kernels


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    from .cpuinfo import cpu_flags as flags

    return set(flags())


def library_missing() -> list[str]:
    """The CPU flags the library needs that this CPU lacks (empty: it can run here)."""
    have = cpu_flags()
    return [f for f in LIBRARY_FLAGS if f not in have]


def runnable_isas() -> list[str]:
    """The instruction sets of :data:`ISAS` this CPU runs, best first."""
    have = cpu_flags()
    return [name for name, (flags, _) in ISAS.items() if all(f in have for f in flags)]


def isa() -> str:
    """The instruction set the library is built for here: ``$YGGTREE_KERNEL_ISA`` where set, else
    the best this CPU runs; YggError in one line where there is none (or the named one cannot run)."""
    runs = runnable_isas()
    named = os.environ.get(ISA_ENV, "")
    if named:
        if named not in ISAS:
            raise YggError(f"{ISA_ENV}={named} is not one of {', '.join(ISAS)}")
        if named not in runs:
            lacks = [f for f in ISAS[named][0] if f not in cpu_flags()]
            raise YggError(f"{ISA_ENV}={named}: this CPU lacks {', '.join(lacks)}")
        return named
    if not runs:
        raise YggError(f"this CPU lacks {', '.join(library_missing())}, which yggtree's CPU kernels need "
                       "(AVX2 with FMA and F16C, or AVX-512)")
    return runs[0]


@contextlib.contextmanager
def build_lock(build: Path):
    """Hold the build directory ``build`` against other processes of ours while its library is
    built or loaded. torch's own guard is a ``lock`` file that a build killed midway (Ctrl-C, a
    killed job) leaves behind, and every later run then waits for it forever, silently; this one
    is an OS lock (``flock``), released when its process ends however it ends, and whoever holds
    it removes such a leftover file first (no build of ours can be under way)."""
    import fcntl

    with open(build / "build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def library_dir() -> Path:
    """The build directory of the library for this CPU's instruction set, flags and sources."""
    from ..files import cache_root

    chosen = isa()
    cflags = CFLAGS + ISAS[chosen][1]
    # keyed by where the sources are too: ninja records their paths, so two checkouts sharing one
    # build directory would rebuild it over each other at every load
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)
                         + " ".join(cflags + LDFLAGS).encode() + str(SOURCES[0].parent).encode()).hexdigest()[:12]
    return cache_root() / "kernels" / f"yggtree-{chosen}-{key}-torch{torch.__version__}"


def library_built() -> bool:
    """Whether the library of these sources is built for this CPU's instruction set (a load then
    compiles nothing)."""
    return (library_dir() / "yggtree_kernels.so").is_file()


@functools.cache
def load_library() -> None:
    """Build (first use on this machine and torch) and load the kernel library; YggError in one
    line where it cannot run here. Where the cache cannot be written (read-only, not a
    directory) the library is built in a temporary directory, removed once loaded, with one
    stderr line: the run goes on, uncached."""
    import tempfile

    build = library_dir()
    try:
        build.mkdir(parents=True, exist_ok=True)
        open(build / "build.lock", "a").close()
    except OSError as e:
        sys.stderr.write(f"yggtree: the kernel cache {build} cannot be written ({e.strerror or e}): the kernel "
                         "library is built in a temporary directory, not kept\n")
        with tempfile.TemporaryDirectory(prefix="yggtree-kernels-") as tmp:
            _build_and_load(Path(tmp))
        return
    _build_and_load(build)


LOADED = "loaded"  # in a build directory: the library's size and mtime when a build of ours last loaded it whole


def _stamp(so: Path) -> str:
    st = so.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _load_stamped(build: Path, so: Path) -> bool:
    """Load the library built in ``build`` without asking the build system (importing torch's cpp_extension,
    which imports setuptools, and a ninja run, at every run's start) where a build of ours loaded this very
    file whole; False where it must go through the build (none yet, or the file differs from the one that
    loaded). A file that matches but does not load (damaged since) is removed, so the build makes it again."""
    try:
        if (build / LOADED).read_text() != _stamp(so):
            return False
    except OSError:
        return False
    try:
        torch.ops.load_library(str(so))
    except OSError:
        so.unlink(missing_ok=True)
        (build / LOADED).unlink(missing_ok=True)
        return False
    return True


def _load_or_build(build: Path) -> bool:
    """Load the library of ``build`` (its lock held), built there first where it is not; True where the
    file a build of ours loaded whole was loaded directly."""
    so = build / "yggtree_kernels.so"
    if _load_stamped(build, so):
        return True
    from torch.utils import cpp_extension

    (build / LOADED).unlink(missing_ok=True)
    cpp_extension.load(name="yggtree_kernels", sources=[str(f) for f in SOURCES],
                       extra_cflags=list(CFLAGS + ISAS[isa()][1]), extra_ldflags=list(LDFLAGS),
                       build_directory=str(build), is_python_module=False, verbose=False)
    with contextlib.suppress(OSError):  # loaded: without the record the next run asks the build again
        write_text_atomic(build / LOADED, _stamp(so))
    return False


def _build_and_load(build: Path) -> None:
    """Build the library for this CPU's instruction set in ``build`` (unless built there) and load it."""
    try:
        with build_lock(build):
            _load_or_build(build)
    except (RuntimeError, OSError, ImportError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)
        raise YggError(f"building the kernel library in {build} failed ({first}); it needs a C++ compiler "
                       "and ninja") from None
    # global symbols: AOTInductor packages compiled with the ops' C shims (aoti_shims) resolve
    # aoti_torch_cpu_<op> in this library when they are loaded
    ctypes.CDLL(str(build / "yggtree_kernels.so"), mode=os.RTLD_GLOBAL)
    torch.library.register_fake("yggtree::w4a8_mm")(_w4a8_mm_fake)
    torch.library.register_fake("yggtree::rows_attention")(_rows_attention_fake)
    torch.library.register_fake("yggtree::tree_attention")(_rows_attention_fake)
    torch.library.register_fake("yggtree::tiled_mm")(_tiled_mm_fake)
    torch.library.register_fake("yggtree::tiled_q4_mm")(_tiled_q4_mm_fake)
    torch.library.register_fake("yggtree::rms_norm")(_rms_norm_fake)


@functools.cache
def library_usable() -> bool:
    """Whether the kernel library loads here (built now where it was not yet). Where it cannot
    (a CPU without AVX2, no compiler, a failing build) one stderr line says why and that products
    run on torch's kernels instead: what can fall back does (the tiled kernel's formats); what
    needs the library (w4a8) is refused by :func:`load_library`'s own line."""
    try:
        load_library()
    except YggError as e:
        sys.stderr.write(f"yggtree: {e}; products run on torch's kernels instead\n")
        return False
    return True


@contextlib.contextmanager
def loop_pool(threads: int, balance: bool = True):
    """The library's parallel loops on its own pool of ``threads`` threads inside the block, the
    calling thread at one OpenMP thread (restored after). A pool's worker spins between tasks, and
    a spinning OpenMP worker on the same core would take its time slices: use it only where the
    kernels' loops are the step's only parallel regions (packages compiled with inductor's loops
    serial: aoti.loops_serial). ``balance``: each loop split by the threads' measured speeds (else
    equally; csrc/loops.cpp). ``threads`` <= 1 changes nothing. Loads the library."""
    if threads <= 1:
        yield
        return
    load_library()
    before = torch.get_num_threads()
    was = torch.ops.yggtree.loop_pool(threads, balance)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        torch.ops.yggtree.loop_pool(int(was[0]), bool(was[1]))


def prefetch_now() -> tuple[int, int]:
    """The library's products' prefetch setting now, ``(near, far)`` bytes: its default outside
    any :func:`prefetch` block. Loads the library."""
    load_library()
    near, far = torch.ops.yggtree.prefetch(-1, 0)  # near < 0: a query
    return int(near), int(far)


@contextlib.contextmanager
def prefetch(setting):
    """The library's products fetch their weights ahead by ``setting`` inside the block: ``(near,
    far)`` bytes into the first- and the second-level cache (csrc/prefetch.h; multiples of 64, 0:
    none), or one distance into the first (:func:`prefetch_setting`); the setting before restored
    after. None changes nothing (the library's default, 1024 near, no far). Loads the library."""
    if setting is None:
        yield
        return
    near, far = prefetch_setting(setting)
    load_library()
    was = torch.ops.yggtree.prefetch(near, far)
    try:
        yield
    finally:
        torch.ops.yggtree.prefetch(*was)


@contextlib.contextmanager
def attention_prefetch(slots: int | None):
    """The library's attentions fetch K and V rows ``slots`` ahead inside the block (csrc/prefetch.h;
    0: none), the setting before restored after; None changes nothing. Loads the library."""
    if slots is None:
        yield
        return
    load_library()
    was = torch.ops.yggtree.attention_prefetch(slots)
    try:
        yield
    finally:
        torch.ops.yggtree.attention_prefetch(was)


def aoti_shims() -> dict:
    """``aot_inductor.custom_ops_to_c_shims`` for packages calling the library's ops: they call
    the kernels' C shims directly (``csrc/``) rather than through AOTInductor's proxy executor,
    which boxes every call's arguments (a cost at every call). Loads the library (its ops must exist to
    be named)."""
    load_library()
    return {getattr(torch.ops.yggtree, name).default: [decl] for name, decl in SHIMS.items()}


def runs_attention(head_dim: int) -> bool:
    """Whether ``yggtree::rows_attention`` takes this head dim (:data:`HEAD_DIMS`)."""
    return head_dim in HEAD_DIMS


def use_rows_attention(model, kernel: str | None = None) -> int:
    """Have every attention layer of a float32 or bfloat16 ``model`` whose head dim the kernel
    takes compute its row-by-row attention on the library (``Attention.native_rows``: work over
    the visible slots only, instead of inductor's code over the context bucket), its calls of
    several rows by ``kernel`` (``rows`` or ``tree``, the same bits; None: this machine's choice at
    the process's thread count, ``runtime/attention_choice.py``); a model whose products run on the library (the w4a8 format,
    the tiled kernel) runs it too. Loads the library; returns how many layers it set (0 for
    another dtype)."""
    from .model import Attention

    load_library()
    if next(model.parameters()).dtype not in (torch.float32, torch.bfloat16):
        return 0
    layers = [m for m in model.modules() if isinstance(m, Attention) and runs_attention(m.cfg.head_dim)]
    if layers and kernel is None:
        from .attention_choice import attention_kernel

        c = layers[0].cfg
        kernel = attention_kernel((c.num_heads, c.num_kv_heads, c.head_dim), torch.get_num_threads(),
                                  library_dir(), kv_dtype(model))["kernel"]
    if layers and kernel not in ("rows", "tree"):
        raise YggError(f"no attention kernel {kernel!r} (rows or tree)")
    for m in layers:
        m.native_rows = kernel
    return len(layers)


def use_library(model) -> None:
    """A model whose products run on the library (the w4a8 format, the tiled kernel) computes its
    attention (:func:`use_rows_attention`) and its final norm (:func:`use_library_norm`) there too."""
    use_rows_attention(model)
    use_library_norm(model)


def use_library_norm(model) -> bool:
    """Have a float32 :class:`~yggtree.runtime.model.Transformer`'s final norm (the one eager op of
    a step after its compiled layers, before the LM head) run as the library's one call
    (``RMSNorm.native``) instead of torch's five. Every path of the model's steps then computes it
    alike, row by row (speculation stays exact). Loads the library; False (nothing set) for another
    dtype or a model without one."""
    from .model import RMSNorm, Transformer

    norm = getattr(model, "norm", None)  # (an EAGLE head's final norm runs inside its call packages)
    if not isinstance(model, Transformer) or not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32:
        return False
    load_library()
    norm.native = True
    return True


def attention_ahead(model, threads: int) -> int | None:
    """The slots ahead this machine's choice (``attention_choice.attention_kernel``) has the library's
    attentions fetch for ``model`` at ``threads`` threads; None where its layers run none of them."""
    from .attention_choice import attention_kernel
    from .model import native_attention

    if native_attention(model) is None:
        return None
    c = model.cfg
    return int(attention_kernel((c.num_heads, c.num_kv_heads, c.head_dim), threads, library_dir(),
                                kv_dtype(model)).get("ahead", 0))


def kv_dtype(model) -> torch.dtype:
    """The dtype ``model``'s attention layers keep their KV cache in (``model.set_kv_dtype``; unset:
    the float weights', whatever its quantized layers hold)."""
    from .model import Attention

    layer = next(m for m in model.modules() if isinstance(m, Attention))
    return layer.kv_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())


def _w4a8_mm_fake(x, blocks):
    return x.new_empty((x.shape[0], blocks.shape[0] * TILE))


def _rows_attention_fake(q, k, v, head, window):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2] * q.shape[3]))


def _tiled_mm_fake(x, w, scale):
    return x.new_empty((x.shape[0], w.shape[0] * TILE))


def _tiled_q4_mm_fake(x, blocks):
    return x.new_empty((x.shape[0], blocks.shape[0] * TILE))


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape)
