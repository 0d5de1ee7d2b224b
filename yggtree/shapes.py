"""The static shapes of a run: limits, defaults, one step's tree shape and the compiled envelope.

Light (no torch): plans (``yggtree/plan.py``) and the engine (``runtime/engine.py``) both read it,
so neither imports the other for a shape. Every default a plan, a flag or an engine falls back to
is written here once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from .errors import YggError

# Bounds on sizes and values a user chooses (flags, plans, API calls), checked before anything is
# allocated or compiled: past them a run would only be slower or noisier, never better.
MAX_TEMPERATURE = 10.0  # at 10 the default model's next-token distribution is already near uniform
MIN_TEMPERATURE = 0.01  # below it (but not 0) logits / T overflow to inf: use 0 for greedy
MAX_DRAFT_DEPTH = 32  # D: drafter calls per step
MAX_DRAFT_WIDTH = 64  # W_d: nodes fed per drafter call
MAX_VERIFY_WIDTH = 256  # W_v: nodes the target verifies per step
MAX_BATCH = 32  # requests one engine decodes at once (runtime/batch.py, yggtree serve --max-batch)
SERVE_BATCH = 4  # yggtree serve's --max-batch by default (the machine plan builds its batch graphs)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # batch shapes of a batched verify call (and max_batch itself)
MAX_TOP_K = 64  # children proposed per fed node
MAX_SEED = 2**63 - 1

# defaults (a plan's, a flag's and an engine's)
DEFAULT_DRAFT_WIDTH = 4  # W_d
DEFAULT_DRAFT_DEPTH = 4  # D (a plan's d_max)
DEFAULT_VERIFY_WIDTH = 16  # W_v
DEFAULT_TOP_K = 4
DEFAULT_MAX_CONTEXT = 1024
DEFAULT_PREFILL_CHUNK = 64

# Weight formats of the decoder-block linears and LM heads (runtime/quant.py, runtime/w4a8.py). ``None`` (a plan
# without ``weights``, a run without --weights) is the default: float weights in the run's dtype.
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4", "gguf-native", "w4a8")
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel runs
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16")  # a target's KV cache (kv_cache_dtype)
DEFAULT_INT4_GROUP = 32  # a GGUF block: the finest group the kernel runs

# the prefetch settings the product kernel's measurement tries (offline/profile_padding.py time_padding;
# runtime/kernels.py prefetch): (near, far) bytes ahead into the first- and the second-level cache
# (csrc/prefetch.h), far 0 for none
PREFETCH_CHOICES = (tuple((near, 0) for near in (512, 1024, 2048, 4096, 8192, 16384))
                    + tuple((near, far) for far in (4096, 8192, 16384, 32768) for near in (512, 1024, 2048)))
MAX_PREFETCH = 1 << 20  # bytes (csrc/prefetch.cpp)


def prefetch_setting(value) -> tuple[int, int]:
    """A recorded prefetch setting as ``(near, far)``: a pair ``[near, far]``, or one distance
    (records before the second level: ``(distance, 0)``); ValueError naming what is wrong."""
    pair = (value, 0) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(pair, (list, tuple)) or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_PREFETCH and v % 64 == 0
                       for v in pair)):
        raise ValueError(f"a prefetch setting is [near, far] bytes, multiples of 64 up to {MAX_PREFETCH} "
                         f"(or one such distance), got {value!r}")
    return int(pair[0]), int(pair[1])


def measured_prefetch(value, where: str = "a measurement's prefetch", fix: str = "measure it again") \
        -> tuple[int, int] | None:
    """:func:`prefetch_setting` of a record's prefetch entry (a profile's, a manifest's, a cached
    choice's), None where there is none; YggError "``where``: what is wrong (``fix``)" if invalid."""
    if value is None:
        return None
    try:
        return prefetch_setting(value)
    except ValueError as e:
        raise YggError(f"{where}: {e} ({fix})") from None


def prefetch_name(setting) -> str:
    """``near/far``, how records key a setting's measurement."""
    near, far = prefetch_setting(setting)
    return f"{near}/{far}"


def int_value(name: str, v) -> int:
    """``v`` as an int (bools and floats refused: a float token id is a bug, not a token)."""
    if isinstance(v, bool):
        raise YggError(f"{name} must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise YggError(f"{name} must be an integer, got {type(v).__name__} {v!r}") from None


@dataclass(frozen=True)
class TreeParams:
    """Static tree shape of one speculation step."""

    draft_width: int = DEFAULT_DRAFT_WIDTH  # W_d: nodes fed to the drafter per draft call
    draft_depth: int = DEFAULT_DRAFT_DEPTH  # D: draft calls per step
    verify_width: int = DEFAULT_VERIFY_WIDTH  # W_v: nodes the target verifies (root included)
    top_k: int = DEFAULT_TOP_K  # children proposed per fed node

    @property
    def tree_size(self) -> int:
        return 1 + self.draft_width * self.draft_depth

    def validate(self, max_context: int | None = None) -> None:
        """YggError naming the limit unless the shape is possible (and, given ``max_context``,
        the drafted tree fits in the context)."""
        limits = {"draft_width": MAX_DRAFT_WIDTH, "draft_depth": MAX_DRAFT_DEPTH,
                  "verify_width": MAX_VERIFY_WIDTH, "top_k": MAX_TOP_K}
        for name, hi in limits.items():
            v = int_value(name.replace("_", "-"), getattr(self, name))
            if v < 1:
                raise YggError(f"{name.replace('_', '-')} must be >= 1, got {v}")
            if v > hi:
                raise YggError(f"{name.replace('_', '-')} {v} exceeds the limit of {hi}")
        if max_context is not None and self.tree_size >= max_context:
            raise YggError(
                f"the drafted tree (1 + draft-width {self.draft_width} x draft-depth "
                f"{self.draft_depth} = {self.tree_size} nodes) does not fit in the context "
                f"window ({max_context})"
            )
        if self.verify_width > self.tree_size:
            raise YggError(
                f"verify-width {self.verify_width} exceeds the drafted tree "
                f"(1 + draft-width {self.draft_width} x draft-depth {self.draft_depth} "
                f"= {self.tree_size} nodes)"
            )


def parse_tree(text: str, flag: str) -> TreeParams:
    """``"W_d,D,W_v,k"`` (the value of a command's ``flag``) -> TreeParams, validated; YggError in
    one line otherwise."""
    try:
        wd, d, wv, k = (int(x) for x in text.split(","))
    except ValueError:
        raise YggError(f"{flag} wants four integers W_d,D,W_v,k, got {text!r}") from None
    tp = TreeParams(draft_width=wd, draft_depth=d, verify_width=wv, top_k=k)
    tp.validate()
    return tp


@dataclass(frozen=True)
class Envelope:
    """Every tree shape an engine can run: the compiled width sets and D_max. Built once from
    the default tree and a plan's widths (:meth:`of`) and never changed; caches and graphs are
    sized for it, and a step policy chooses inside it."""

    draft_widths: tuple[int, ...]  # compiled W_d choices, ascending (empty: no drafter calls)
    verify_widths: tuple[int, ...]  # compiled W_v choices, ascending, 1 (a plain step) included
    d_max: int  # most drafter calls per step (0: no tree)
    top_k: int  # children proposed per fed node (0: no tree)

    @classmethod
    def of(cls, tree: TreeParams | None, draft_widths=(), verify_widths=(), d_max: int = 0) -> "Envelope":
        """The envelope of ``tree`` (None: plain decoding) widened by a plan's width sets."""
        if tree is None:
            return cls((), (1,), 0, 0)
        env = cls(
            tuple(sorted({tree.draft_width, *draft_widths})),
            tuple(sorted({1, tree.verify_width, *verify_widths})),
            max(tree.draft_depth, d_max),
            tree.top_k,
        )
        bad = [w for w in env.draft_widths + env.verify_widths if w < 1]
        if bad:
            raise YggError(f"tree widths must be >= 1, got {bad[0]}")
        return env

    @property
    def speculative(self) -> bool:
        return self.top_k > 0

    @property
    def max_tree(self) -> int:
        """Nodes of the largest drafted tree."""
        return 1 + self.d_max * max(self.draft_widths, default=0)

    def reserve(self) -> int:
        """Cache slots past the context a step may write: the largest drafted or verified tree
        (the ahead-of-time drafter call uses free slots past it when the context leaves room)."""
        if not self.speculative:
            return 1
        return max(self.max_tree, max(self.verify_widths))

    def slots(self, max_context: int) -> int:
        """KV cache slots of an engine of this envelope: ``max_context``, the :meth:`reserve` past
        it and a scratch slot."""
        return max_context + self.reserve() + 1

    def check_draft(self, d: int, wd: int) -> None:
        if not 0 <= d <= self.d_max:
            raise YggError(f"policy chose draft depth {d}, outside the engine's 0..{self.d_max}")
        if d > 0 and wd not in self.draft_widths:
            raise YggError(
                f"policy chose draft width {wd}, not in the compiled set {list(self.draft_widths)}"
            )

    def check_verify(self, wv: int) -> None:
        if wv not in self.verify_widths:
            raise YggError(
                f"policy chose verify width {wv}, not in the compiled set {list(self.verify_widths)}"
            )

    def check_tree(self, tp: TreeParams) -> None:
        """YggError unless ``tp`` is a choice inside the envelope."""
        self.check_draft(tp.draft_depth, tp.draft_width)
        self.check_verify(tp.verify_width)


def check_sizes(max_context: int, prefill_chunk: int, tree: TreeParams | None = None) -> None:
    """YggError naming the limit unless the static sizes fit each other: every size a user picks
    (context, prefill chunk, D, W_d, W_v, top-k, tree size) is checked here before a cache is
    allocated or a graph compiled."""
    max_context = int_value("max-context", max_context)
    prefill_chunk = int_value("prefill-chunk", prefill_chunk)
    if max_context < 2:
        raise YggError(f"max-context must be >= 2, got {max_context}")
    if not 1 <= prefill_chunk <= max_context:
        raise YggError(f"prefill-chunk must be in 1..max-context ({max_context}), got {prefill_chunk}")
    if tree is not None:
        tree.validate(max_context)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if int_value("max-new-tokens", self.max_new_tokens) < 1:
            raise YggError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise YggError(f"{name.replace('_', '-')} must be a number, got {v!r}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise YggError(f"temperature must be 0 (greedy) or in {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, "
                           f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise YggError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= int_value("seed", self.seed) <= MAX_SEED:
            raise YggError(f"seed must be in 0..2**63-1, got {self.seed}")


def weight_format(weights: str | None, dtype: str) -> tuple[str, int | None]:
    """(format, int4 group size or None) of ``weights`` (a plan's field, a ``--weights`` flag)
    for activations in ``dtype``: ``int4@G`` is 4-bit with groups of G input columns (plain
    ``int4``: :data:`DEFAULT_INT4_GROUP`); None means float weights in ``dtype``. YggError in one
    line for an unknown format, a group size the kernel does not run, or float weights in another
    dtype than the activations (float products run in one dtype)."""
    if weights is None:
        return dtype, None
    if not isinstance(weights, str):
        raise YggError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    name, at, group = weights.partition("@")
    if name not in WEIGHT_FORMATS:
        raise YggError(f"unknown weight format {weights!r} (choose from {', '.join(WEIGHT_FORMATS)}, "
                       "int4@G for G in " + ", ".join(map(str, INT4_GROUPS)) + ")")
    if at:
        if name != "int4":
            raise YggError(f"weight format {weights!r}: only int4 takes a group size (int4@G)")
        if not group.isdigit() or int(group) not in INT4_GROUPS:
            raise YggError(f"weight format {weights!r}: the CPU int4 kernel runs groups of "
                           f"{', '.join(map(str, INT4_GROUPS))} columns, not {group!r}")
        return name, int(group)
    if name in ("float32", "bfloat16") and name != dtype:
        raise YggError(f"weights {name} with dtype {dtype}: float weights run in the activations' "
                       f"dtype (use dtype {name}, or a quantized format)")
    if name == dtype:
        return dtype, None
    return name, DEFAULT_INT4_GROUP if name == "int4" else None


def kv_cache_dtype(kv_cache: str | None, dtype: str) -> str | None:
    """The canonical KV cache setting (a plan's ``kv_cache``, a ``--kv-cache`` flag) for
    activations in ``dtype``: None for a cache in ``dtype`` (the default), else a 16-bit float
    under float32 activations (keys and values rounded once as they are stored; attention reads
    them as float32). YggError in one line for an unknown name or a cache wider than, or
    different from, bfloat16 activations."""
    if kv_cache is None or kv_cache == dtype:
        return None
    if kv_cache not in KV_CACHE_DTYPES:
        raise YggError(f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache!r}")
    if dtype != "float32":
        raise YggError(f"KV cache {kv_cache} with dtype {dtype}: a {dtype} model keeps its cache in {dtype} "
                       "(16-bit caches are for float32 activations)")
    return kv_cache


def batch_bucket(n: int, max_batch: int) -> int:
    """The smallest batch shape holding ``n`` rows: a bucket of :data:`BATCH_BUCKETS`, or ``max_batch``."""
    return next((b for b in BATCH_BUCKETS if n <= b < max_batch), max_batch)
