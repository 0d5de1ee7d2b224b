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
drafter_weights str | absent    (weights)      the drafter's weight format, any ``weights``
                                               value (float32 or bfloat16: float weights):
                                               a float target with a 4-bit drafter drafts at
                                               a fraction of its float cost and verifies at
                                               full precision (output unchanged: it is the
                                               target's); absent: the target's format. Not
                                               with ``drafter: self`` (one model's weights)
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
                                               (runtime/padding.py ``plan_min_rows``)
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

Beside this module: the profile's padding of packed products (runtime/padding.py), a compiled
plan's directory and the identities its manifest records (runtime/artifacts.py), whether it
matches a plan (compiled.py) and the plans tuned for this machine (tuned.py).
This module is light (no torch import at load time) so the CLI can validate a plan instantly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import YggError
from .files import file_sha256
from .runtime.schedule import PLANS, split_name
from .shapes import (
    DEFAULT_DRAFT_DEPTH, DEFAULT_DRAFT_WIDTH, DEFAULT_MAX_CONTEXT, DEFAULT_PREFILL_CHUNK,
    DEFAULT_TOP_K, DEFAULT_VERIFY_WIDTH, MAX_TEMPERATURE, MIN_TEMPERATURE, TreeParams, check_sizes,
    kv_cache_dtype,
    weight_format,
)

PLAN_VERSION = 1
BACKENDS = ("inductor-cpu", "eager", "cuda", "npu")  # same as runtime.graphs.BACKENDS
DTYPES = ("float32", "bfloat16")
PATH_KEYS = ("profile", "predictor", "calibration")
MODEL_KEYS = ("target", "drafter")
NON_PATH_MODELS = {"target": ("default",), "drafter": ("default", "self")}
DEFAULT_PLAN = Path(__file__).parent / "plans" / "default.yaml"
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
    drafter_weights: str | None = None  # the drafter's format (a float dtype included); None: as ``weights``
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
    def verifies(self) -> bool:
        """Whether its engine verifies trees: drafted, or of lookup nodes alone (a run's flags
        ``--drafter none --lookup N``: :func:`validate_plan` ``lookup_only``)."""
        return self.speculative or self.lookup > 0

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
        if not self.verifies:
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
        (:func:`yggtree.runtime.padding.plan_min_rows`, compared by
        :func:`yggtree.compiled.check_artifacts`)."""
        return graph_hash_of(self.to_dict())


# the plan fields that decide which graphs exist and what they compute; the optional ones count
# only where set (plans without them keep the hash they had before the field existed)
GRAPH_FIELDS = ("version", "name", "target", "drafter", "dtype", "backend", "max_context",
                "prefill_chunk", "draft_widths", "d_max", "top_k", "verify_widths")
OPTIONAL_GRAPH_FIELDS = ("weights", "drafter_weights", "kv_cache")


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
    if name not in PLANS:
        raise YggError(f"{_where('stages', origin)}: unknown value {v!r} (choose from auto, "
                       f"{', '.join(PLANS)}, optionally with @T or @T+D)")
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


def _drafter_weights(v: Any, dtype: str, drafter: str | None, weights: str | None, origin: str) -> str | None:
    """A plan's ``drafter_weights`` in canonical form: None where absent or the target's own format
    (the default), else the format (``int4@G`` spelled out; a float dtype named as such);
    refused without a drafter, with ``drafter: self`` (the target's own weights) and where the
    drafter has no GGUF blocks for gguf-native."""
    if v is None:
        return None
    where = _where("drafter_weights", origin)
    if drafter is None:
        raise YggError(f"{where}: the plan has no drafter")
    try:
        fmt, group = weight_format(v, dtype)
    except YggError as e:
        raise YggError(f"{where}: {e}") from None
    canonical = f"{fmt}@{group}" if fmt == "int4" else fmt
    if canonical == (weights or dtype):
        return None
    if drafter == "self":
        raise YggError(f"{where}: drafter 'self' is the target's own weights, in the target's format "
                       f"({weights or dtype})")
    if fmt == "gguf-native" and not drafter.lower().endswith(".gguf"):
        raise YggError(f"{where}: gguf-native needs a GGUF drafter, {drafter} is not one (use w4a8, int8 or int4)")
    return canonical


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


def _shapes(f: _Fields, speculative: bool, lookup_only: bool = False) -> dict[str, Any]:
    """The graph shapes: context, prefill chunk, draft and verify widths, depth, top-k and the lookup
    nodes, each within the limits every run checks (refused here, before anything is compiled);
    lookup nodes without a drafter only where ``lookup_only``."""
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
    if lookup and not speculative and not lookup_only:
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


def validate_plan(raw: Any, base: str | Path = ".", origin: str = "plan", unwritten: tuple[str, ...] = (),
                  lookup_only: bool = False) -> Plan:
    """Check plain data against the schema; relative paths resolve against ``base``. The files
    of the ``unwritten`` keys (of PATH_KEYS) need not exist yet: the command loading the plan
    writes them (``yggtree profile`` its profile). ``lookup_only``: ``lookup`` may be set without
    a drafter (the plan a run's flags ``--drafter none --lookup N`` make in memory, whose graphs
    are built when it runs; ``yggtree compile`` compiles no verify widths without a drafter).

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
    drafter_weights = _drafter_weights(raw.get("drafter_weights"), dtype, models["drafter"], weights, origin)
    try:
        kv_cache = kv_cache_dtype(raw.get("kv_cache"), dtype)
    except YggError as e:
        raise YggError(f"{_where('kv_cache', origin)}: {e}") from None
    backend = f.string("backend", "inductor-cpu", BACKENDS)
    shapes = _shapes(f, models["drafter"] is not None, lookup_only)
    return Plan(**models, dtype=dtype, weights=weights, drafter_weights=drafter_weights, kv_cache=kv_cache,
                backend=backend, **shapes,
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
        # libyaml's parser where PyYAML has it (the same documents; a run reads a dozen plans on its way)
        raw = yaml.load(p.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
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
