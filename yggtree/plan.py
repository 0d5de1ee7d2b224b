"""Plans: the YAML file that fixes every static shape of a deployment, and its compiled artifacts.

A plan names its inputs (target, drafter, profile, predictor) and the finite set of shapes the
engine may use: the prefill chunk, the draft widths W_d, the verify widths W_v and D_max.
``yggtree compile plan.yaml`` builds one graph per shape into ``compile/<name>/``; a run with the
plan loads those graphs and never compiles in the decode loop.

Example (``yggtree/plans/default.yaml``)::

    name: default
    target: default          # the embedded SmolLM2-135M-Instruct
    drafter: default         # the shipped EAGLE head; self | a path | null (plain decoding)
    dtype: float32
    backend: inductor-cpu
    max_context: 1024
    prefill_chunk: 64
    draft_widths: [1, 2, 4, 8]
    d_max: 6
    top_k: 4
    verify_widths: [4, 8, 16, 32]
    sampling: {temperature: 0.0, top_p: 1.0, max_new_tokens: 128}
    stages: sequential

Schema (every key but ``name`` and ``target`` is optional; unknown keys are errors):

============== ================ ============== ==================================================
key            type             default        meaning
============== ================ ============== ==================================================
version        int              1              plan format version (only 1 exists)
name           str              (required)     ``[A-Za-z0-9._-]+``; artifacts go to compile/<name>/
target         str              (required)     ``default`` | HF directory | .gguf file
drafter        str | null       null           ``default`` | ``self`` | path | null = plain
dtype          str              float32        float32 | bfloat16 (activations)
weights        str | absent     (dtype)        float32 | bfloat16 | int8 | int4 | int4@G |
                                               gguf-native | w4a8: the decoder-block linears'
                                               and LM heads' format (runtime/quant.py,
                                               runtime/w4a8.py); absent: float
                                               weights in dtype (yggtree.shapes.weight_format)
kv_cache       str | absent     (dtype)        float16 | bfloat16: the target's KV cache in 16
                                               bits under float32 activations (half the reads
                                               of attention at long contexts; changes output
                                               as a format does);
                                               absent: in dtype (yggtree.shapes.kv_cache_dtype)
backend        str              inductor-cpu   inductor-cpu | eager | cuda | npu
max_context    int >= 2         1024           prompt + generated tokens (static KV cache)
prefill_chunk  int >= 1         64             static prefill width C
draft_widths   list[int >= 1]   [4]            compiled drafter step widths W_d
d_max          int >= 1         4              most drafter calls per step D_max
top_k          int >= 1         4              children proposed per fed node
verify_widths  list[int >= 1]   [16]           compiled target verify widths W_v; each
                                               <= 1 + d_max * max(draft_widths)
lookup         int >= 0         0              lookup nodes per step (prompt/history lookup
                                               candidates, runtime/lookup.py); <= max W_v
sampling       mapping          see below      run defaults, overridable per request
  .temperature float >= 0       0.0            0 = greedy
  .top_p       float in (0, 1]  1.0
  .max_new_tokens int >= 1      128            < max_context
profile        path | null      null           hardware profile JSON (must exist); also sets
                                               the padding of short packed products
                                               (:func:`plan_min_rows`)
predictor      path | null      null           depth predictor (must exist)
calibration    path | null      null           acceptance calibration (must exist)
stages         str              sequential     execution plan: sequential | ahead | overlap, with an
                                               optional thread split (@T, @T+D), or auto: the
                                               compile-time plan search's choice (runtime/schedule.py)
============== ================ ============== ==================================================

Relative paths (target, drafter, profile, predictor, calibration) are relative to the plan
file's directory; :func:`load_plan` stores them absolute and :func:`save_plan` writes them
relative to the new file, so a copied plan still names the same files. No location enters a
plan's identity (:meth:`Plan.hash`, :meth:`Plan.graph_hash`): a compiled directory moved (with the
files its plan names, or alone when they are not beside it) stays usable.

The artifacts of a compiled plan live in one directory (``compile/<name>/``)::

    manifest.json      the plan and its hash, model fingerprints, torch/python versions and a
                       hash of yggtree's runtime sources, backend, dtype, the padding of short
                       packed products (``packed_min_rows``), every graph (shapes, compile
                       seconds, sha256), size on disk; paths relative to the directory
    plan.yaml          the plan as compiled (paths rewritten relative to this directory)
    graphs/            one AOTInductor package per block shape (block-<kind>-w<W>-c<C>.pt2)
                       and per plain-step context bucket (step-<key>-w1-c<C>.pt2)

:func:`check_artifacts` lists why a directory's artifacts do not match a plan (empty: usable).
This module is light (no torch import at load time) so the CLI can validate a plan instantly.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import YggError
from .files import file_sha256, read_json
from .runtime.schedule import PLANS, split_name
from .shapes import (
    DEFAULT_DRAFT_DEPTH, DEFAULT_DRAFT_WIDTH, DEFAULT_MAX_CONTEXT, DEFAULT_PREFILL_CHUNK,
    DEFAULT_TOP_K, DEFAULT_VERIFY_WIDTH, MAX_TEMPERATURE, MIN_TEMPERATURE, TreeParams, check_sizes,
    kv_cache_dtype,
    measured_prefetch,
    weight_format,
)

PLAN_VERSION = 1
BACKENDS = ("inductor-cpu", "eager", "cuda", "npu")  # same as runtime.graphs.BACKENDS
DTYPES = ("float32", "bfloat16")
STAGE_PLANS = tuple(n for n in PLANS if n != "plain")  # execution plans a plan may record
PATH_KEYS = ("profile", "predictor", "calibration")
MODEL_KEYS = ("target", "drafter")
NON_PATH_MODELS = {"target": ("default",), "drafter": ("default", "self")}
MANIFEST = "manifest.json"
PLAN_COPY = "plan.yaml"
MANIFEST_FORMAT = 2  # 2: AOTInductor packages (1 was an inductor cache read through dynamo)
CACHE_SUBDIR = "graphs"  # AOTInductor packages (one .pt2 per block shape)
DEFAULT_PLAN = Path(__file__).parent / "plans" / "default.yaml"
# the trained EAGLE head for the embedded default target (yggtree distill; see its manifest.json)
DEFAULT_DRAFTER_DIR = Path(__file__).resolve().parent / "assets" / "drafters" / "smollm2-135m-eagle"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Sampling:
    """Sampling defaults of a plan (a request may override them)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128


@dataclass(frozen=True)
class Plan:
    """A validated plan. Build it with :func:`load_plan` or :func:`validate_plan`.

    Path-valued fields (``target``/``drafter`` unless a keyword, ``profile``, ``predictor``,
    ``calibration``) hold absolute paths. ``source`` is the file it was read from (not part of
    the plan's identity or hash).
    """

    name: str
    target: str
    drafter: str | None = None
    dtype: str = "float32"
    weights: str | None = None  # a quantized format (int8, int4@G, gguf-native, w4a8); None: float in dtype
    kv_cache: str | None = None  # the target's KV cache dtype (float16, bfloat16); None: dtype
    backend: str = "inductor-cpu"
    max_context: int = DEFAULT_MAX_CONTEXT
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    draft_widths: tuple[int, ...] = (DEFAULT_DRAFT_WIDTH,)
    d_max: int = DEFAULT_DRAFT_DEPTH
    top_k: int = DEFAULT_TOP_K
    verify_widths: tuple[int, ...] = (DEFAULT_VERIFY_WIDTH,)
    lookup: int = 0
    sampling: Sampling = Sampling()
    profile: str | None = None
    predictor: str | None = None
    calibration: str | None = None
    stages: str = "sequential"
    version: int = PLAN_VERSION
    source: Path | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ shapes

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def max_tree(self) -> int:
        """Nodes of the largest drafted tree: 1 + D_max * max(W_d)."""
        return 1 + self.d_max * max(self.draft_widths)

    @property
    def target_widths(self) -> tuple[int, ...]:
        """Input widths of the target's graphs: {prefill_chunk, 1} plus every W_v if speculative."""
        ws = {self.prefill_chunk, 1}
        if self.speculative:
            ws |= set(self.verify_widths)
        return tuple(sorted(ws))

    @property
    def step_widths(self) -> tuple[int, ...]:
        """Tree-step widths of the target compiled whole (runtime/aoti.py, "Step packages"): the
        plain step (1) and, if speculative, every W_v."""
        return tuple(sorted({1, *(self.verify_widths if self.speculative else ())}))

    def tree_params(
        self,
        draft_width: int | None = None,
        verify_width: int | None = None,
        draft_depth: int | None = None,
    ):
        """A :class:`~yggtree.shapes.TreeParams` for one choice of widths from the plan.

        ``None`` picks the largest compiled width (and ``d_max``). A width outside the compiled set
        is refused: ``width X is not in the plan's compiled set {...}``.
        """
        if not self.speculative:
            raise YggError(f"plan {self.name!r} has no drafter (plain decoding): no tree widths")
        wd = max(self.draft_widths) if draft_width is None else draft_width
        wv = max(self.verify_widths) if verify_width is None else verify_width
        d = self.d_max if draft_depth is None else draft_depth
        _check_in_set("draft", wd, self.draft_widths)
        _check_in_set("verify", wv, self.verify_widths)
        if not 1 <= d <= self.d_max:
            raise YggError(f"draft depth {d} is outside the plan's 1..d_max ({self.d_max})")
        tp = TreeParams(draft_width=wd, draft_depth=d, verify_width=wv, top_k=self.top_k)
        tp.validate()
        return tp

    # ------------------------------------------------------------------ serialisation

    def to_dict(self, relative_to: str | Path | None = None) -> dict[str, Any]:
        """Plain data in schema order; paths made relative to ``relative_to`` when given."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "source":
                continue
            v = getattr(self, f.name)
            if (f.name, v) == ("lookup", 0) or (f.name in OPTIONAL_GRAPH_FIELDS and v is None):
                continue  # plans without them keep the identity (hash) they had before they existed
            if isinstance(v, Sampling):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            elif isinstance(v, tuple):
                v = list(v)
            elif relative_to is not None and _is_path_field(f.name, v):
                v = os.path.relpath(v, Path(relative_to).resolve())
            out[f.name] = v
        return out

    def hash(self) -> str:
        """sha256 of the canonical plan: its identity, which no location enters (a model path
        counts as ``"path"``: the compile manifest's fingerprints identify model files; a profile,
        predictor or calibration counts by the sha256 of its content), so a plan moved together
        with its files keeps it."""
        d = _located(self.to_dict())
        for k in PATH_KEYS:
            if d[k] is not None:
                d[k] = "sha256:" + content_sha256(Path(d[k])) if Path(d[k]).exists() else "missing"
        text = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def graph_hash(self) -> str:
        """sha256 of the fields the compiled graphs depend on (:data:`GRAPH_FIELDS`): a plan that
        changes only its sampling defaults, profile, predictor, calibration or stage plan keeps
        its compiled artifacts, unless the new profile pads short packed products differently
        (:func:`plan_min_rows`, compared by :func:`check_artifacts`)."""
        return graph_hash_of(self.to_dict())


# the plan fields that decide which graphs exist and what they compute; the optional ones count
# only where set (plans without them keep the hash they had before the field existed)
GRAPH_FIELDS = ("version", "name", "target", "drafter", "dtype", "backend", "max_context",
                "prefill_chunk", "draft_widths", "d_max", "top_k", "verify_widths")
OPTIONAL_GRAPH_FIELDS = ("weights", "kv_cache")


def graph_hash_of(plan_dict: Any) -> str | None:
    """:meth:`Plan.graph_hash` of a ``Plan.to_dict()`` with absolute or relative paths (a
    manifest stores it relative to its directory); None if malformed."""
    if not isinstance(plan_dict, dict) or any(k not in plan_dict for k in GRAPH_FIELDS):
        return None
    d = _located({k: plan_dict[k] for k in GRAPH_FIELDS})
    for key in OPTIONAL_GRAPH_FIELDS:
        if plan_dict.get(key) is not None:
            d[key] = plan_dict[key]
    text = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _located(plan_dict: dict) -> dict:
    """``plan_dict`` with every model path replaced by ``"path"`` (keywords kept)."""
    return {k: "path" if k in MODEL_KEYS and _is_path_field(k, v) else v for k, v in plan_dict.items()}


def content_sha256(p: Path) -> str:
    """Hex sha256 of a file's bytes, or of a directory's top-level files (names and contents)."""
    if not p.is_dir():
        return file_sha256(p)
    files = sorted(f for f in p.iterdir() if f.is_file())
    return hashlib.sha256("".join(f"{f.name}\0{file_sha256(f)}\n" for f in files).encode()).hexdigest()


# ----------------------------------------------------------------------------- packed padding

PADDING_KEY = "packed_padding"  # a profile's measurement of padded short packed products
# the padding of a profile without that key: until profiles measured it, every packed product of
# fewer rows ran padded to this many (a constant of the runtime then), so such a profile's
# latency curves hold for it
LEGACY_MIN_ROWS = 4


def profile_min_rows(path: str | Path) -> int:
    """The ``min_rows`` (see :mod:`yggtree.runtime.packed`) the profile at ``path`` chose for its
    machine: ``packed_padding.min_rows``, or :data:`LEGACY_MIN_ROWS` for a profile older than
    that field. YggError if the file is unreadable or the value invalid."""
    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    if pad is None:
        return LEGACY_MIN_ROWS
    v = pad.get("min_rows") if isinstance(pad, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise YggError(f"profile {path}: '{PADDING_KEY}.min_rows' must be an integer >= 1, got {v!r} "
                       "(measure it again: yggtree profile --force)")
    return v


def profile_kernel(path: str | Path) -> str:
    """The product kernel of packed layers (runtime/packed.py ``KERNELS``) the profile at ``path``
    measured fastest on its machine: ``packed_padding.kernel``, ``"torch"`` for a profile older
    than that field. YggError if the file is unreadable or the value unknown."""
    from .runtime.packed import KERNELS

    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    v = pad.get("kernel", "torch") if isinstance(pad, dict) else "torch"
    if v not in KERNELS:
        raise YggError(f"profile {path}: '{PADDING_KEY}.kernel' must be one of {', '.join(KERNELS)}, got {v!r} "
                       "(measure it again: yggtree profile --force)")
    return v


def profile_invariance(path: str | Path) -> tuple[int, tuple[int, ...]] | None:
    """(threads, widths) at which the profile at ``path`` found its chosen padding batch-invariant
    (``packed_padding.invariant`` at ``packed_padding.widths``, in the profile's thread count), or
    None when it did not record that (older profiles) or found it not invariant."""
    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    if not isinstance(pad, dict) or not isinstance(pad.get("invariant"), dict):
        return None
    threads = (d.get("hardware") or {}).get("threads")
    chosen = "tiled" if pad.get("kernel") == "tiled" else str(pad.get("min_rows"))
    if pad["invariant"].get(chosen) is not True or not isinstance(threads, int):
        return None
    return threads, tuple(int(w) for w in pad.get("widths", ()))


def plan_min_rows(plan: Plan) -> int:
    """How many rows the packed products of ``plan``'s engine run with at least
    (:func:`plan_padding`)."""
    return _measured(plan)["min_rows"]


def plan_kernel(plan: Plan) -> str:
    """The product kernel of ``plan``'s packed layers (:func:`plan_padding`)."""
    return _measured(plan)["kernel"]


def plan_prefetch(plan: Plan) -> tuple[int, int] | None:
    """How far ahead the kernel library's products of ``plan``'s engine prefetch their weights,
    ``(near, far)`` bytes (:func:`plan_padding`; None: the library's default)."""
    return measured_prefetch(_measured(plan).get("prefetch"))


def profile_prefetch(path: str | Path) -> tuple[int, int] | None:
    """The prefetch setting, ``(near, far)`` bytes, the kernel library's products streamed their
    weights fastest at on the profile's machine (``packed_padding.prefetch``; runtime/kernels.py
    ``prefetch``; one distance in profiles before the second level: ``(distance, 0)``), None
    where it was not measured (a profile older than that field, or no product of the library).
    YggError if the value is invalid."""
    d = read_json(path, "profile")
    pad = d.get(PADDING_KEY) if isinstance(d, dict) else None
    return measured_prefetch(pad.get("prefetch") if isinstance(pad, dict) else None,
                             f"profile {path}: '{PADDING_KEY}.prefetch'", "measure it again: yggtree profile --force")


def plan_padding(plan: Plan) -> dict | None:
    """``{"kernel", "min_rows", "prefetch"}`` of ``plan``'s products: its profile's measurement
    (:func:`profile_kernel`, :func:`profile_min_rows`, :func:`profile_prefetch`); for a plan
    without a profile, this machine's (:func:`cached_padding`), None where it was not measured.
    ``prefetch`` may be None or absent: the kernel library's default setting."""
    if plan.profile is None:
        return cached_padding(plan)
    return {"kernel": profile_kernel(plan.profile), "min_rows": profile_min_rows(plan.profile),
            "prefetch": profile_prefetch(plan.profile)}


def _measured(plan: Plan) -> dict:
    """:func:`plan_padding`, YggError where it was not measured (``yggtree compile`` measures it)."""
    pad = plan_padding(plan)
    if pad is None:
        from .runtime.kernel_cache import plan_threads_widths

        raise YggError(f"plan {plan.name!r} has no profile and its product kernel was not measured on this "
                       f"machine at {plan_threads_widths(plan)[0]} thread(s): `yggtree compile` measures it")
    return pad


def cached_padding(plan: Plan) -> dict | None:
    """For a plan without a profile: its product kernel and padding as measured on this machine
    at the plan's threads and widths and cached (``yggtree.measure.kernel_choice.measure_plan``, which
    ``yggtree compile`` and the commands running a plan call first; read with
    ``runtime/kernel_cache.py``), or None where it was not; oneDNN unpadded for a backend that
    packs nothing (eager: reference mode; accelerators)."""
    if plan.backend != "inductor-cpu":
        return {"kernel": "torch", "min_rows": 1}
    from .runtime.kernel_cache import cached_choice, plan_threads_widths
    from .runtime.loading import resolve_model

    threads, widths = plan_threads_widths(plan)
    return cached_choice(resolve_model(plan.target), plan.dtype, plan.weights, widths, threads)[0]


def _check_in_set(kind: str, w: int, compiled: tuple[int, ...]) -> None:
    if w not in compiled:
        shown = "{" + ", ".join(str(x) for x in sorted(compiled)) + "}"
        raise YggError(f"{kind} width {w} is not in the plan's compiled set {shown}")


def _is_path_field(name: str, v: Any) -> bool:
    if v is None:
        return False
    if name in MODEL_KEYS:
        return v not in NON_PATH_MODELS[name]
    return name in PATH_KEYS


# ----------------------------------------------------------------------------- validation


def _where(key: str, origin: str) -> str:
    return f"{origin}: key {key!r}"


@dataclass(frozen=True)
class _Fields:
    """Typed readers of one mapping of a plan (the plan, or its ``sampling`` with ``prefix``
    "sampling."): each returns a key's value, or its default when absent, and refuses a bad one
    with a YggError naming the key and ``origin`` (the file)."""

    d: dict
    origin: str
    prefix: str = ""

    def where(self, key: str) -> str:
        return _where(self.prefix + key, self.origin)

    def only(self, known: set[str]) -> None:
        for k in self.d:
            if k not in known:
                raise YggError(f"{self.origin}: unknown key {self.prefix + k!r} "
                               f"(known: {', '.join(sorted(known))})")

    def integer(self, key: str, default: int, lo: int = 1) -> int:
        v = self.d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise YggError(f"{self.where(key)} must be an integer, got {v!r}")
        if v < lo:
            raise YggError(f"{self.where(key)} must be >= {lo}, got {v}")
        return v

    def number(self, key: str, default: float) -> float:
        v = self.d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise YggError(f"{self.where(key)} must be a number, got {v!r}")
        return float(v)

    def string(self, key: str, default: str | None, choices=None) -> str:
        v = self.d.get(key, default)
        if v is None:
            raise YggError(f"{self.where(key)} is required")
        if not isinstance(v, str) or not v:
            raise YggError(f"{self.where(key)} must be a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise YggError(f"{self.where(key)}: unknown value {v!r} (choose from {', '.join(choices)})")
        return v

    def widths(self, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
        v = self.d.get(key, list(default))
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        if not isinstance(v, list) or not v:
            raise YggError(f"{self.where(key)} must be a non-empty list of integers, got {v!r}")
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int):
                raise YggError(f"{self.where(key)} must hold integers, got {x!r}")
            if x < 1:
                raise YggError(f"{self.where(key)}: widths must be >= 1, got {x}")
        if len(set(v)) != len(v):
            raise YggError(f"{self.where(key)} lists a width twice: {v}")
        return tuple(sorted(v))

    def path(self, key: str, base: Path, keywords: tuple[str, ...] = (), must_exist: bool = True) -> str | None:
        """An existing file's normalised path (relative to ``base``; with ``must_exist`` False, a
        file that may not exist yet), a keyword, or None."""
        v = self.d.get(key)
        if v is None or v in keywords:
            return v
        if not isinstance(v, str) or not v:
            raise YggError(f"{self.where(key)} must be a path string or null, got {v!r}")
        p = Path(v).expanduser()
        if not p.is_absolute():
            p = base / p
        p = Path(os.path.normpath(p))
        if must_exist and not p.exists():
            raise YggError(f"{self.where(key)}: file not found: {p}")
        return str(p)


def _stages(v: str, origin: str) -> str:
    """``auto`` (the compile-time plan search's choice) or a named execution plan with an optional
    thread split (``ahead``, ``overlap@1+1``); the split is checked against the cores at run time."""
    if v == "auto":
        return v
    try:
        name, _, _ = split_name(v)
    except YggError as e:
        raise YggError(f"{_where('stages', origin)}: {e}") from None
    if name not in STAGE_PLANS:
        raise YggError(f"{_where('stages', origin)}: unknown value {v!r} (choose from auto, "
                       f"{', '.join(STAGE_PLANS)}, optionally with @T or @T+D)")
    return v


def _weights(v: Any, dtype: str, target: str, origin: str) -> str | None:
    """A plan's ``weights`` in canonical form: None for float weights in ``dtype`` (the default),
    ``int4@G`` with its group size spelled out; gguf-native only for a GGUF target."""
    try:
        fmt, group = weight_format(v, dtype)
    except YggError as e:
        raise YggError(f"{_where('weights', origin)}: {e}") from None
    if fmt == "gguf-native" and target != "default" and not target.lower().endswith(".gguf"):
        raise YggError(f"{_where('weights', origin)}: gguf-native needs a GGUF target, {target} is not "
                       "one (use int8 or int4)")
    if fmt == dtype:
        return None
    return f"{fmt}@{group}" if fmt == "int4" else fmt


def _models(f: _Fields, base: Path) -> dict[str, Any]:
    """``name``, ``target`` and ``drafter`` (a keyword or an existing path, relative to ``base``)."""
    name = f.string("name", None)
    if not _NAME_RE.match(name):
        raise YggError(f"{f.where('name')} must match [A-Za-z0-9][A-Za-z0-9._-]* (it names a directory), got {name!r}")
    f.string("target", None)
    drafter = f.d.get("drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise YggError(f"{f.where('drafter')} must be default, self, a path or null, got {drafter!r}")
    return {"name": name, "target": f.path("target", base, NON_PATH_MODELS["target"]),
            "drafter": f.path("drafter", base, NON_PATH_MODELS["drafter"])}


def _shapes(f: _Fields, speculative: bool) -> dict[str, Any]:
    """The graph shapes: context, prefill chunk, draft and verify widths, depth, top-k and the lookup
    nodes, each within the limits every run checks (refused here, before anything is compiled)."""
    s = {"max_context": f.integer("max_context", DEFAULT_MAX_CONTEXT, lo=2),
         "prefill_chunk": f.integer("prefill_chunk", DEFAULT_PREFILL_CHUNK),
         "draft_widths": f.widths("draft_widths", (DEFAULT_DRAFT_WIDTH,)),
         "d_max": f.integer("d_max", DEFAULT_DRAFT_DEPTH),
         "top_k": f.integer("top_k", DEFAULT_TOP_K),
         "verify_widths": f.widths("verify_widths", (DEFAULT_VERIFY_WIDTH,))}
    d_max, w_d = s["d_max"], max(s["draft_widths"])
    try:
        check_sizes(s["max_context"], s["prefill_chunk"],
                    TreeParams(w_d, d_max, 1, s["top_k"]) if speculative else None)
    except YggError as e:
        raise YggError(f"{f.origin}: {e}") from None
    cap = 1 + d_max * w_d
    for w in s["verify_widths"]:
        if w > cap:
            raise YggError(f"{f.where('verify_widths')}: W_v {w} exceeds the largest drafted tree "
                           f"1 + d_max * max(draft_widths) = 1 + {d_max} * {w_d} = {cap}")
    lookup = s["lookup"] = f.integer("lookup", 0, lo=0)
    if lookup > max(s["verify_widths"]):
        raise YggError(f"{f.where('lookup')}: {lookup} exceeds the largest verify width {max(s['verify_widths'])}")
    if lookup and not speculative:
        raise YggError(f"{f.where('lookup')}: a plan without a drafter compiles no verify widths "
                       "(lookup-only decoding: yggtree run --drafter none --lookup N)")
    return s


def _sampling(raw: dict, origin: str, max_context: int) -> Sampling:
    s = raw.get("sampling", {})
    if s is None:
        s = {}
    if not isinstance(s, dict):
        raise YggError(f"{_where('sampling', origin)} must be a mapping, got {s!r}")
    f = _Fields(s, origin, "sampling.")
    f.only({x.name for x in fields(Sampling)})
    temperature = f.number("temperature", 0.0)
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise YggError(f"{f.where('temperature')} must be 0 or in "
                       f"{MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, got {temperature}")
    top_p = f.number("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise YggError(f"{f.where('top_p')} must be in (0, 1], got {top_p}")
    max_new = f.integer("max_new_tokens", 128)
    if max_new >= max_context:
        raise YggError(f"{f.where('max_new_tokens')} ({max_new}) must be below max_context ({max_context})")
    return Sampling(temperature, top_p, max_new)


def validate_plan(raw: Any, base: str | Path = ".", origin: str = "plan", unwritten: tuple[str, ...] = ()) -> Plan:
    """Check plain data against the schema; relative paths resolve against ``base``. The files
    of the ``unwritten`` keys (of PATH_KEYS) need not exist yet: the command loading the plan
    writes them (``yggtree profile`` its profile).

    Raises :class:`YggError` naming the bad key (``origin`` is the file, for the message)."""
    if not isinstance(raw, dict):
        raise YggError(f"{origin}: a plan must be a YAML mapping, got {type(raw).__name__}")
    base = Path(base).resolve()
    f = _Fields(raw, origin)
    f.only({x.name for x in fields(Plan)} - {"source"})
    version = f.integer("version", PLAN_VERSION)
    if version != PLAN_VERSION:
        raise YggError(f"{f.where('version')}: unsupported plan version {version} (this yggtree reads {PLAN_VERSION})")
    models = _models(f, base)
    dtype = f.string("dtype", "float32", DTYPES)
    weights = _weights(raw.get("weights"), dtype, models["target"], origin)
    try:
        kv_cache = kv_cache_dtype(raw.get("kv_cache"), dtype)
    except YggError as e:
        raise YggError(f"{_where('kv_cache', origin)}: {e}") from None
    backend = f.string("backend", "inductor-cpu", BACKENDS)
    shapes = _shapes(f, models["drafter"] is not None)
    return Plan(**models, dtype=dtype, weights=weights, kv_cache=kv_cache, backend=backend, **shapes,
                sampling=_sampling(raw, origin, shapes["max_context"]),
                **{k: f.path(k, base, must_exist=k not in unwritten) for k in PATH_KEYS},
                stages=_stages(f.string("stages", "sequential"), origin), version=version)


def load_plan(path: str | Path, unwritten: tuple[str, ...] = ()) -> Plan:
    """Read and validate a plan file; relative paths in it are relative to its directory
    (``unwritten``: see :func:`validate_plan`)."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise YggError(f"plan file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise YggError(f"cannot read plan {p}: {e}") from None
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise YggError(f"plan {p} is not valid YAML: {msg}") from None
    plan = validate_plan(raw, p.resolve().parent, str(p), unwritten)
    return replace(plan, source=p.resolve())


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` as YAML at ``path`` (paths relative to its directory). Returns the path."""
    import yaml

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(plan.to_dict(relative_to=p.parent), sort_keys=False, default_flow_style=None)
    from .files import write_text_atomic

    return write_text_atomic(p, f"# yggtree plan (schema: yggtree/plan.py)\n{body}")


def default_plan() -> Plan:
    """The shipped plan for the embedded pair (``yggtree/plans/default.yaml``)."""
    return load_plan(DEFAULT_PLAN)


def tuned_plan_dirs() -> tuple[Path, ...]:
    """Where tuned plans are looked for: the user's data directory
    (``$XDG_DATA_HOME/yggtree/profiles``, by default ``~/.local/share/yggtree/profiles``), then,
    when yggtree runs from a source checkout, the checkout's ``profiles/``."""
    from .files import data_root

    dirs = [data_root() / "profiles"]
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        dirs.append(checkout / "profiles")
    return tuple(dirs)


def find_tuned_plan(dtype: str, device: dict, search: tuple[Path, ...] | None = None,
                    compile_root: str | Path = "compile", say=None) -> tuple[Path | None, Path | None]:
    """Plans tuned for this device: ``(ready, uncompiled)``, or None for either.

    A tuned plan is a plan YAML for the embedded pair (target and drafter ``default``) with float
    weights and its cache in ``dtype`` (no ``weights`` format, no ``kv_cache``: a quantized plan or
    a 16-bit cache computes another model, so it is never taken unasked) naming a profile
    measured on ``device`` (``{"kind", "name", "identity"}`` as from
    ``yggtree.runtime.device.detect_device``) and a calibration. ``ready``: of the plans whose
    compiled artifacts are usable (or that need none), the one whose profile measured the fastest
    plain step (ties and plans without that point: the first by directory, then file name);
    ``uncompiled``: the first that would be, once compiled. The directories are ``search``
    (default :func:`tuned_plan_dirs`). Unreadable files are skipped: this only looks for
    something better than the default plan. A plan whose profile was measured on a device of the
    same name but another identity (``runtime/device.py``: another CPU model or stepping, other
    features or cores, or no identity recorded) is not taken either: when nothing is found,
    ``say(line)`` is told so once, naming what differs."""
    from .runtime.device import device_difference

    ready, waiting, namesakes = [], None, []
    for d in tuned_plan_dirs() if search is None else search:
        for f in sorted(Path(d).glob("*.yaml")) if Path(d).is_dir() else ():
            try:
                plan = load_plan(f)
                if (plan.target, plan.drafter, plan.dtype, plan.weights, plan.kv_cache) != (
                        "default", "default", dtype, None, None):
                    continue
                if plan.profile is None or plan.calibration is None:
                    continue
                profile = json.loads(Path(plan.profile).read_text())
                hw = profile.get("hardware", {})
            except (YggError, OSError, ValueError, AttributeError):
                continue
            differs = device_difference(hw, device)
            if differs is not None:
                named = isinstance(hw, dict) and (hw.get("device"), hw.get("device_name"))
                if named == (device["kind"], device["name"]):
                    namesakes.append((f, differs))
                continue
            if plan.backend == "eager" or not check_artifacts(plan, artifact_dir(plan, compile_root)):
                ready.append((_plain_step_ms(profile), len(ready), f))
            elif waiting is None:
                waiting = f
    if namesakes and not ready and waiting is None and say is not None:
        more = f" (and {len(namesakes) - 1} more plan(s) like it)" if len(namesakes) > 1 else ""
        say(f"not using tuned plan {namesakes[0][0]}{more}: {namesakes[0][1]}")
    return (min(ready)[2] if ready else None), waiting


def _plain_step_ms(profile: dict) -> float:
    """A profile's plain step: its width-1 verify point at the shortest context (inf if none)."""
    points = profile.get("points") if isinstance(profile, dict) else None
    plain = [(p.get("context", 0), p.get("median_ms")) for p in points or ()
             if isinstance(p, dict) and p.get("kind") == "verify" and p.get("width") == 1]
    plain = [(c, ms) for c, ms in plain if isinstance(c, int) and isinstance(ms, (int, float))]
    return float(min(plain)[1]) if plain else float("inf")


# ----------------------------------------------------------------------------- artifacts


def artifact_dir(plan: Plan, compile_root: str | Path = "compile") -> Path:
    """Where ``plan``'s artifacts live: ``<compile_root>/<name>/``, except that a plan read from
    a compiled copy (``compile/<name>/plan.yaml`` next to a manifest) uses its own directory."""
    src = plan.source
    if src is not None and src.name == PLAN_COPY and src.parent.name == plan.name:
        if (src.parent / MANIFEST).is_file():
            return src.parent
    return Path(compile_root) / plan.name


def cache_dir(art_dir: str | Path) -> Path:
    """The directory of compiled graph packages inside an artifact directory."""
    return Path(art_dir) / CACHE_SUBDIR


def _file_print(p: Path, role: str) -> dict:
    st = p.stat()
    d = {"role": role, "path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if p.name == "config.json" or (p.suffix in (".json", ".yaml") and st.st_size < (1 << 20)):
        d["sha256"] = file_sha256(p)
    return d


def _resolve_model_path(role: str, name: str | None) -> Path | None:
    """The file or directory behind a plan's target/drafter (None: nothing on disk to track)."""
    if name is None or name == "self":
        return None
    if name == "default":
        if role == "target":
            from .runtime.loading import default_model_path  # imports torch; only here

            return default_model_path()
        return DEFAULT_DRAFTER_DIR  # the shipped default drafter
    return Path(name)


def _documentation(path: str | Path) -> bool:
    """A model directory's documentation (``*.md``): no model file (editing it changes no weight)."""
    return Path(path).suffix == ".md"


def model_fingerprints(plan: Plan) -> list[dict]:
    """Size and mtime (plus sha256 of small config files) of every model file the plan uses.

    A directory (HF checkpoint, EAGLE head) contributes every regular file at its top level but
    its documentation (``*.md``: a README edited after the compile changes no weight)."""
    out = []
    for role in MODEL_KEYS:
        p = _resolve_model_path(role, getattr(plan, role))
        if p is None:
            continue
        if not p.exists():
            out.append({"role": role, "path": str(p), "missing": True})
        elif p.is_dir():
            out += [_file_print(f, role) for f in sorted(p.iterdir()) if f.is_file() and not _documentation(f)]
        else:
            out.append(_file_print(p, role))
    return out


# the runtime sources compiled graphs are traced from (decoder block, KV cache, the export
# wrapper); the rest of the runtime only decides which shapes are called, and a shape without a
# graph is refused loudly at warm-up
# packed.py, quant.py and w4a8.py: the custom ops and the quantized layers the packages call
# (csrc/w4a8.cpp is not traced: packages call the op, which the process loads); steps.py: the
# step functions a whole-step package inlines
GRAPH_SOURCES = ("aoti.py", "eagle.py", "kernels.py", "kv_cache.py", "model.py", "packed.py", "quant.py", "steps.py",
                 "w4a8.py")


def runtime_code_hash() -> str:
    """sha256 (16 hex digits) of the runtime sources the compiled graphs are traced from."""
    h = hashlib.sha256()
    for name in GRAPH_SOURCES:
        f = Path(__file__).parent / "runtime" / name
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def versions() -> dict:
    """What compiled graphs depend on besides the plan and the models."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "yggtree_runtime": runtime_code_hash(),
    }


def read_manifest(art_dir: str | Path) -> dict | None:
    """The manifest in ``art_dir``, or None if absent; YggError if unreadable."""
    p = Path(art_dir) / MANIFEST
    if not p.is_file():
        return None
    m = read_json(p, "manifest")
    if not isinstance(m, dict):
        raise YggError(f"manifest {p} is not a JSON object")
    return m


def check_artifacts(plan: Plan, compile_dir: str | Path) -> list[str]:
    """Reasons the artifacts in ``compile_dir`` (an artifact directory, e.g. ``compile/<name>``)
    are missing or stale for ``plan``; an empty list means they match."""
    d = Path(compile_dir)
    try:
        m = read_manifest(d)
    except YggError as e:
        return [str(e)]
    if m is None:
        return [f"no compiled artifacts: {d / MANIFEST} is missing"]
    reasons = []
    if m.get("format") != MANIFEST_FORMAT:
        reasons.append(
            f"the artifacts in {d} have format {m.get('format')}, this yggtree writes {MANIFEST_FORMAT}"
        )
    if graph_hash_of(m.get("plan")) != plan.graph_hash():
        what = _plan_diff(m.get("plan"), plan.to_dict(relative_to=d), GRAPH_FIELDS + OPTIONAL_GRAPH_FIELDS)
        reasons.append(f"the plan changed since it was compiled into {d}" + (f" ({what})" if what else ""))
    now = versions()
    for k, v in now.items():
        was = m.get("versions", {}).get(k)
        if was != v:
            what = "yggtree runtime code" if k == "yggtree_runtime" else f"{k} version"
            reasons.append(f"{what} changed: compiled with {was}, running {v}")
    if plan.backend != "eager":  # the packages' code is built for one device (runtime/device.py)
        from .runtime.device import detect_device, device_difference

        differs = device_difference(m.get("device"), detect_device())
        if differs is not None:
            reasons.append(f"the packages in {d} were not built on this machine: {differs}")
    if plan.backend != "eager":  # the packages hold the padding of their packed products
        source = "the plan's profile" if plan.profile is not None else "this machine's measurement"
        try:
            pad = plan_padding(plan)
        except YggError as e:
            reasons.append(str(e))
        else:  # without a profile and without a measurement here: the packages' own choice stands
            rows, kernel = ((pad["min_rows"], pad["kernel"]) if pad
                            else (m.get("packed_min_rows"), m.get("packed_kernel", "torch")))
            if m.get("packed_min_rows") != rows and m.get("packed_min_rows_raised_from") != rows:
                reasons.append(f"the padding of short packed products changed: compiled with min_rows "
                               f"{m.get('packed_min_rows')}, {source} says {rows}")
            if m.get("packed_kernel", "torch") != kernel:
                reasons.append(f"the product kernel changed: compiled with {m.get('packed_kernel', 'torch')}, "
                               f"{source} says {kernel}")
        from .runtime.model import attention_formulation

        want = attention_formulation(plan.prefill_chunk)  # the packages hold the formulation
        if m.get("attention") != want:
            def say(f) -> str:
                if not isinstance(f, dict) or set(f) != set(want):
                    return "an earlier one"
                return f"row by row up to {f['rows_up_to']} rows, logical window {f['logical_window']}"

            reasons.append(f"the attention formulation changed: compiled with {say(m.get('attention'))}, an "
                           f"engine of this plan uses {say(want)}")
    # a model file is known by its role and name (the manifest records its path relative to its
    # directory, which changes when either moves); its size, mtime and checksum identify it
    was_prints = {(f["role"], Path(f["path"]).name): f for f in m.get("models", [])
                  if not _documentation(f["path"])}  # earlier compiles recorded documentation too
    now_prints = {(f["role"], Path(f["path"]).name): f for f in model_fingerprints(plan)}
    for key, f in now_prints.items():
        old = was_prints.get(key)
        if f.get("missing"):
            reasons.append(f"{key[0]} model file is missing: {f['path']}")
        elif old is None:
            reasons.append(f"{key[0]} model file was not part of the compile: {f['path']}")
        elif any(old.get(x) != f.get(x) for x in ("size", "mtime_ns", "sha256")):
            reasons.append(f"{key[0]} model file changed since the compile: {f['path']}")
    for key in was_prints.keys() - now_prints.keys():
        reasons.append(f"{key[0]} model file of the compile is no longer used: {key[1]}")
    if plan.backend not in ("eager",) and m.get("graphs"):
        cd = cache_dir(d)
        gone = sorted({g.get("file", "?") for g in m["graphs"]} - {p.name for p in cd.glob("*.pt2")})
        if gone:
            reasons.append(f"{len(gone)} compiled graph file(s) missing in {cd} (e.g. {gone[0]})")
        sums = {g.get("file", "?"): g.get("sha256") for g in m["graphs"]}
        for name in sorted(sums.keys() - set(gone)):  # a truncated or altered package is refused
            if sums[name] is None:
                reasons.append(f"compiled graph file {cd / name} has no checksum in the manifest")
                break
            if file_sha256(cd / name) != sums[name]:
                reasons.append(f"compiled graph file {cd / name} is corrupted (its sha256 differs "
                               "from the manifest's)")
    return reasons


def _plan_diff(old: Any, new: dict, only: tuple[str, ...] | None = None) -> str:
    if not isinstance(old, dict):
        return ""
    keys = [k for k in new if old.get(k) != new[k]] + [k for k in old if k not in new]
    if only is not None:
        keys = [k for k in keys if k in only]
    return "changed: " + ", ".join(keys) if keys else ""
