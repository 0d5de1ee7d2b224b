"""The decode loop: prefill, then plain decoding or tree speculation, streaming tokens.

One speculation step (DESIGN section 2)::

    head   drafter sees the root (the last emitted token)        -> top-k children
    draft  D x (EGT select W_d nodes, drafter step over them)     -> tree of 1 + D*W_d nodes
    prune  keep the W_v best nodes (a connected subtree)          -> verify tree
    verify target over the W_v nodes, tree mask                   -> logits at every node
    accept greedy or lossless sampling                            -> accepted path + bonus
    commit move the accepted path's KV to contiguous slots (target and drafter)

The tree shape may change every step: a :class:`~yggtree.runtime.policy.StepPolicy` picks
(D, W_d) before drafting and W_v after it, among the compiled widths; the caches are sized for
the envelope (D_max, largest W_d, largest W_v). Without a policy every step uses ``cfg.tree``.
"""

from __future__ import annotations

import functools
import operator
import threading
import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import YggError
from . import steps
from .accept import filter_probs, greedy_accept, sample_accept, truncate
from .drafters import Drafter
from .egt import egt_expand, egt_feed_inputs, egt_init, egt_select
from .lookup import LookupCalibration, LookupIndex, Proposal, propose
from .merge import SOURCE_DRAFTER, SOURCE_LOOKUP, SOURCE_NAMES, merge_lookup, root_tree
from .graphs import Graphs
from .model import Transformer
from .policy import FixedPolicy, StepChoice, StepPolicy, StepRecord
from .prune import prune_topk, subtree
from .tree import ancestor_mask, check_invariants

STAGES = ("head", "draft", "prune", "verify", "accept", "commit", "policy", "resync", "lookup")

# Bounds on sizes and values a user chooses (flags, plans, API calls), checked before anything is
# allocated or compiled: past them a run would only be slower or noisier, never better.
MAX_TEMPERATURE = 10.0  # at 10 the default model's next-token distribution is already near uniform
MIN_TEMPERATURE = 0.01  # below it (but not 0) logits / T overflow to inf: use 0 for greedy
MAX_DRAFT_DEPTH = 32  # D: drafter calls per step
MAX_DRAFT_WIDTH = 64  # W_d: nodes fed per drafter call
MAX_VERIFY_WIDTH = 256  # W_v: nodes the target verifies per step
MAX_TOP_K = 64  # children proposed per fed node
MAX_SEED = 2**63 - 1


def _int_value(name: str, v) -> int:
    """``v`` as an int (bools and floats refused: a float token id is a bug, not a token)."""
    if isinstance(v, bool):
        raise YggError(f"{name} must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise YggError(f"{name} must be an integer, got {type(v).__name__} {v!r}") from None


def check_sizes(max_context: int, prefill_chunk: int, tree: "TreeParams | None" = None) -> None:
    """YggError naming the limit unless the static sizes fit each other: every size a user picks
    (context, prefill chunk, D, W_d, W_v, top-k, tree size) is checked here before a cache is
    allocated or a graph compiled."""
    max_context = _int_value("max-context", max_context)
    prefill_chunk = _int_value("prefill-chunk", prefill_chunk)
    if max_context < 2:
        raise YggError(f"max-context must be >= 2, got {max_context}")
    if not 1 <= prefill_chunk <= max_context:
        raise YggError(f"prefill-chunk must be in 1..max-context ({max_context}), got {prefill_chunk}")
    if tree is not None:
        tree.validate(max_context)


def _serialised(method):
    """Run ``method`` under its engine's lock (see ``Engine.generate``)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if _int_value("max-new-tokens", self.max_new_tokens) < 1:
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
        if not 0 <= _int_value("seed", self.seed) <= MAX_SEED:
            raise YggError(f"seed must be in 0..2**63-1, got {self.seed}")


@dataclass(frozen=True)
class TreeParams:
    """Static tree shape of one speculation step."""

    draft_width: int = 4  # W_d: nodes fed to the drafter per draft call
    draft_depth: int = 4  # D: draft calls per step
    verify_width: int = 16  # W_v: nodes the target verifies (root included)
    top_k: int = 4  # children proposed per fed node

    @property
    def tree_size(self) -> int:
        return 1 + self.draft_width * self.draft_depth

    def validate(self, max_context: int | None = None) -> None:
        """YggError naming the limit unless the shape is possible (and, given ``max_context``,
        the drafted tree fits in the context)."""
        limits = {"draft_width": MAX_DRAFT_WIDTH, "draft_depth": MAX_DRAFT_DEPTH,
                  "verify_width": MAX_VERIFY_WIDTH, "top_k": MAX_TOP_K}
        for name, hi in limits.items():
            v = _int_value(name.replace("_", "-"), getattr(self, name))
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


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "performance"  # reference (eager, checks) | performance (compiled)
    max_context: int = 1024  # prompt + generated tokens
    prefill_chunk: int = 64
    tree: TreeParams | None = None  # None: plain decoding; else the shape used without a policy
    # the envelope a step policy may choose from (each also includes cfg.tree's own value;
    # W_v = 1 is always available): caches and graphs are built for all of it
    draft_widths: tuple[int, ...] = ()  # compiled W_d choices
    verify_widths: tuple[int, ...] = ()  # compiled W_v choices
    d_max: int = 0  # most drafter calls per step (0: cfg.tree.draft_depth)
    # model-free candidates from the request's own text (lookup.py): at most this many lookup
    # nodes join each step's tree (0: none); with no drafter, every step is lookup-only or plain
    lookup: int = 0
    lookup_calibration: str | None = None  # lookup calibration JSON (None: the shipped one)


@dataclass
class Result:
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length"
    stats: dict = field(default_factory=dict)


class Engine:
    """Target (+ optional drafter) with static caches and graphs, ready to generate."""

    def __init__(
        self,
        target: Transformer,
        cfg: EngineConfig,
        drafter: Drafter | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        check_sizes(cfg.max_context, cfg.prefill_chunk, cfg.tree)
        if cfg.tree is not None and cfg.tree.top_k > target.cfg.vocab_size:
            raise YggError(f"top-k {cfg.tree.top_k} exceeds the vocabulary ({target.cfg.vocab_size})")
        if cfg.max_context > target.cfg.max_position_embeddings:
            raise YggError(
                f"max-context {cfg.max_context} exceeds the model's context window "
                f"({target.cfg.max_position_embeddings})"
            )
        lookup_only = drafter is None and cfg.lookup > 0
        if (cfg.tree is None) != (drafter is None) and not (lookup_only and cfg.tree is not None):
            raise YggError("speculation needs tree parameters and a drafter (or lookup nodes)")
        if cfg.tree is not None:
            cfg.tree.validate()
            if drafter is not None and drafter.vocab_size != target.cfg.vocab_size:
                raise YggError(
                    f"drafter vocabulary ({drafter.vocab_size}) differs from the target's "
                    f"({target.cfg.vocab_size})"
                )
        self.cfg = cfg
        self.target = target
        self._lock = threading.Lock()  # one generate at a time: caches and graphs are shared state
        self.drafter = drafter
        self.eos_ids = tuple(eos_ids)
        self.graphs = Graphs(target, cfg.mode)
        tree = cfg.tree
        if tree is not None:
            self.draft_widths = tuple(sorted({tree.draft_width, *cfg.draft_widths}))
            self.verify_widths = tuple(sorted({1, tree.verify_width, *cfg.verify_widths}))
            self.d_max = max(tree.draft_depth, cfg.d_max)
            bad = [w for w in self.draft_widths + self.verify_widths if w < 1]
            if bad:
                raise YggError(f"tree widths must be >= 1, got {bad[0]}")
            reserve = max(max(self.verify_widths), 1 + self.d_max * max(self.draft_widths))
        else:
            self.draft_widths, self.verify_widths, self.d_max = (), (1,), 0
            reserve = 1
        self.n_slots = cfg.max_context + reserve + 1  # + scratch slot
        self.lookup_calib: LookupCalibration | None = None
        self.set_lookup(cfg.lookup)
        target.setup_cache(1, self.n_slots)
        capture = drafter.target_layers if drafter is not None else ()
        self.graphs.warm_up([1, *self.verify_widths], capture, prefill=cfg.prefill_chunk)
        self._feat_buf: tuple[torch.Tensor, ...] = ()  # per drafter layer [n_slots, H]
        if drafter is not None:
            drafter.setup(self.n_slots, [cfg.prefill_chunk, 1, *self.draft_widths], cfg.prefill_chunk)
            w = target.embed_tokens.weight
            self._feat_buf = tuple(
                torch.zeros(self.n_slots, target.cfg.hidden_size, dtype=w.dtype, device=w.device)
                for _ in drafter.target_layers
            )

    def set_lookup(self, n: int) -> None:
        """At most ``n`` lookup nodes per step from now on (0: none); YggError when ``n`` is
        negative, larger than the largest verify width, or the engine cannot speculate."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise YggError(f"lookup must be an integer >= 0, got {n!r}")
        if n > 0 and self.cfg.tree is None:
            raise YggError("lookup nodes need a speculative engine (tree parameters)")
        if n > max(self.verify_widths):
            raise YggError(f"lookup {n} exceeds the verify width ({max(self.verify_widths)})")
        if n > 0 and self.lookup_calib is None:
            path = self.cfg.lookup_calibration
            self.lookup_calib = LookupCalibration.load(path) if path else LookupCalibration.load()
        self.cfg = replace(self.cfg, lookup=n)

    @property
    def lookup_depth(self) -> int:
        """Deepest lookup chain: D_max (the acceptance walk, the commit and an EAGLE drafter's
        pending pairs are sized for it)."""
        return min(self.d_max, getattr(self.drafter, "max_depth", self.d_max))

    @property
    def compile_s(self) -> float:
        extra = getattr(getattr(self.drafter, "graphs", None), "compile_s", 0.0)
        return self.graphs.compile_s + extra

    # ------------------------------------------------------------------ helpers

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints; YggError naming the problem otherwise."""
        if not isinstance(params, SamplingParams):
            raise YggError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
            raise YggError(
                f"the prompt must be a list of token ids (ints), got {type(prompt_ids).__name__} "
                "(encode text with yggtree.runtime.loading.encode_prompt)"
            )
        prompt_ids = [_int_value("prompt token id", t) for t in prompt_ids]
        if not prompt_ids:
            raise YggError("the prompt is empty")
        n, cap = len(prompt_ids), self.cfg.max_context
        if n >= cap:
            raise YggError(f"the prompt has {n} tokens, the context window is {cap}")
        if n + params.max_new_tokens > cap:
            raise YggError(
                f"prompt ({n} tokens) + max-new-tokens ({params.max_new_tokens}) exceeds the "
                f"context window ({cap}); lower max-new-tokens or raise max-context"
            )
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise YggError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return prompt_ids

    def _prefill(
        self, prompt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Chunked prefill of the target. Returns last logits [V], the last token's final hidden
        state [H] and captured layers [n, H]."""
        c = self.cfg.prefill_chunk
        n = prompt.shape[0]
        layers = self.drafter.target_layers if self.drafter is not None else ()
        feats: list[list[torch.Tensor]] = [[] for _ in layers]
        logits = hidden = None
        for start in range(0, n, c):
            part = prompt[start : start + c]
            buf = torch.zeros(c, dtype=torch.int64)
            buf[: part.shape[0]] = part
            logits, hidden, caps = self.graphs.prefill_chunk(
                buf[None],
                torch.tensor(start),
                torch.tensor(part.shape[0]),
                layers,
                self.graphs.bucket(start + c),
            )
            for f, x in zip(feats, caps):
                f.append(x[0, : part.shape[0]])
            last = hidden[0, part.shape[0] - 1]
        return logits[0], last, tuple(torch.cat(f) for f in feats)

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        if params.temperature == 0:
            return int(logits.argmax())
        probs = filter_probs(logits, params.temperature, params.top_p)
        return int(torch.multinomial(probs, 1, generator=gen))

    # ------------------------------------------------------------------ generation

    @_serialised
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        on_tokens: Callable[[list[int]], None] | None = None,
        trace: Callable[[dict], None] | None = None,
        policy: StepPolicy | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> Result:
        """Decode up to ``params.max_new_tokens`` tokens; ``on_tokens`` receives each emission.

        ``trace`` (reference mode) receives one JSON-ready record per decode step: the drafted
        tree, the kept nodes, the accepted path, the emitted tokens and the stage times.
        ``policy`` chooses (D, W_d, W_v) every speculation step (None: ``cfg.tree`` every step);
        ``on_step`` receives a :class:`StepRecord` per speculation step.

        Thread-safe: concurrent calls on one engine run one after another (a per-engine lock;
        the caches and graphs are the engine's), each with its own result."""
        if trace is not None and self.cfg.mode != "reference":
            raise YggError("step traces are written in reference mode only (--mode reference)")
        if (policy is not None or on_step is not None) and self.cfg.tree is None:
            raise YggError("a step policy or on_step callback needs a speculative engine (a drafter)")
        prompt_ids = self._check_prompt(prompt_ids, params)
        if (start := getattr(policy, "start_request", None)) is not None:
            start()  # a learning policy hears where one request's text ends and the next begins
        gen = torch.Generator().manual_seed(params.seed)
        stats = {name: 0.0 for name in STAGES}
        t0 = time.perf_counter()
        with torch.no_grad(), self.graphs.frozen():
            prompt = torch.tensor(prompt_ids, dtype=torch.int64)
            logits, h_root, feats = self._prefill(prompt)
            first = self._choose(logits, params, gen)
            ttft = time.perf_counter() - t0
            out, reason = truncate([first], self.eos_ids, params.max_new_tokens)
            if on_tokens:
                on_tokens(out)
            counters = {
                "verify_calls": 0, "draft_calls": 0, "accepted_tokens": 0, "accept_hist": [],
                "plain_steps": 0, "resyncs": 0, "lookup_steps": 0,
                "by_source": {name: 0 for name in SOURCE_NAMES},
            }
            if reason is None:
                if self.cfg.tree is None:
                    reason = self._plain_loop(
                        out, len(prompt_ids), params, gen, on_tokens, counters, trace
                    )
                else:
                    for buf, x in zip(self._feat_buf, feats):
                        buf[: x.shape[0]] = x
                    with self.drafter.frozen() if self.drafter else contextlib.nullcontext():
                        if self.drafter is not None:
                            self.drafter.prefill(prompt, feats)
                        reason = self._spec_loop(
                            out, prompt_ids, params, gen, on_tokens, counters, stats, trace,
                            policy, on_step, h_root,
                        )
        total = time.perf_counter() - t0
        n = len(out)
        d = self.d_max if policy is not None else (self.cfg.tree.draft_depth if self.cfg.tree else 0)
        stats = self._stats(n, total, ttft, counters, stats, d)
        return Result(out, list(prompt_ids), reason, stats)

    def _stats(self, n: int, total: float, ttft: float, c: dict, stage: dict, d: int) -> dict:
        verify = max(c["verify_calls"], 1)
        s = {
            "new_tokens": n,
            "tokens_per_s": n / total,
            "decode_tokens_per_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0,
            "ttft_ms": ttft * 1e3,
            "tpot_ms": (total - ttft) / (n - 1) * 1e3 if n > 1 else 0.0,
            "total_ms": total * 1e3,
            "compile_s": self.compile_s,
            "verify_calls": c["verify_calls"],
        }
        if self.cfg.tree is not None:
            hist = c["accept_hist"]
            s.update(
                draft_calls=c["draft_calls"],
                plain_steps=c["plain_steps"],
                resyncs=c["resyncs"],
                accepted_tokens=c["accepted_tokens"],
                aal=(c["accepted_tokens"] + c["verify_calls"]) / verify,
                accept_by_position=[
                    sum(1 for a in hist if a >= i) / verify for i in range(1, d + 1)
                ],
                stage_ms={k: v * 1e3 for k, v in stage.items()},
            )
            if self.cfg.lookup > 0:  # accepted draft tokens by who proposed them
                s.update(lookup_steps=c["lookup_steps"], accepted_by_source=dict(c["by_source"]))
        return s

    def _plain_loop(self, out, n_prompt, params, gen, on_tokens, counters, trace) -> str:
        zero = torch.zeros(1, dtype=torch.int64)
        anc = torch.ones(1, 1, dtype=torch.bool)
        committed = n_prompt
        while True:
            root = torch.tensor([out[-1]])
            logits, _, _ = self.graphs.tree_step(
                root, zero, zero, anc, torch.tensor(committed), (),
                self.graphs.bucket(committed + 1),
            )
            counters["verify_calls"] += 1
            committed += 1
            new, reason = truncate(
                [self._choose(logits[0], params, gen)], self.eos_ids, params.max_new_tokens - len(out)
            )
            out.extend(new)
            if on_tokens and new:
                on_tokens(new)
            if trace:
                trace({"step": counters["verify_calls"], "committed": committed - 1, "emitted": new})
            if reason is not None:
                return reason

    def _check_fixed(self, tp: TreeParams) -> None:
        """``cfg.tree`` (set by the caller, e.g. ``use_widths``) must fit the caches."""
        room = self.n_slots - self.cfg.max_context - 1
        if tp.draft_depth > self.d_max or max(tp.tree_size, tp.verify_width) > room:
            raise YggError(
                f"tree {tp} does not fit this engine's envelope (d_max {self.d_max}, "
                f"{room} tree slots)"
            )

    def _check_choice(self, choice: StepChoice) -> tuple[int, int]:
        d, wd = choice.draft_depth, choice.draft_width
        if not 0 <= d <= self.d_max:
            raise YggError(f"policy chose draft depth {d}, outside the engine's 0..{self.d_max}")
        if d > 0 and wd not in self.draft_widths:
            raise YggError(
                f"policy chose draft width {wd}, not in the compiled set {list(self.draft_widths)}"
            )
        return d, wd

    def _check_verify(self, wv: int) -> None:
        if wv not in self.verify_widths:
            raise YggError(
                f"policy chose verify width {wv}, not in the compiled set {list(self.verify_widths)}"
            )

    def _resync(self, prompt_ids: list[int], out: list[int], committed: int, start: int) -> None:
        """Absorb into the drafter what plain steps skipped: the committed sequence from ``start``
        (the root position of the last drafted step, or the prompt length), which the drafter
        already holds below."""
        seq = torch.tensor(list(prompt_ids) + out[:-1], dtype=torch.int64)
        assert seq.shape[0] == committed
        self.drafter.prefill(seq, tuple(buf[:committed] for buf in self._feat_buf), start)

    def _spec_loop(
        self, out, prompt_ids, params, gen, on_tokens, counters, stage, trace, policy, on_step, h_root
    ) -> str:
        drafter = self.drafter
        check = self.cfg.mode == "reference"
        k = self.cfg.tree.top_k
        committed = len(prompt_ids)
        layers = drafter.target_layers if drafter is not None else ()
        budget = self.cfg.lookup
        # plain and lookup-only steps leave the drafter behind: keep features to resync it
        keep_feats = policy is not None or budget > 0
        checked = policy is not None  # cfg.tree is checked once (use_widths may set it)
        if policy is None:
            self._check_fixed(self.cfg.tree)
            policy = FixedPolicy.of(self.cfg.tree)
            if drafter is None:  # lookup-only speculation: no drafter calls, ever
                policy = FixedPolicy(StepChoice(0, self.cfg.tree.draft_width), self.cfg.tree.verify_width)
        index = LookupIndex() if budget else None
        if index is not None:
            index.extend(list(prompt_ids) + out)
        see_lookup = getattr(policy, "see_lookup", None)  # a policy pricing lookup candidates
        # a lookup edge's acceptance p on the drafter's scale (the policy's calibration inverted;
        # without one, the drafter's probability is taken as its acceptance)
        lookup_logq = getattr(policy, "lookup_logq", None) or (lambda p: math.log(max(p, 1e-9)))
        # who hears of each finished step: the caller, and a policy learning from its steps
        report = [fn for fn in (on_step, getattr(policy, "observe", None)) if fn is not None]
        after_head = getattr(policy, "after_head", None)
        synced, sync_from = True, committed  # the drafter holds everything below sync_from
        zero = torch.zeros(1, dtype=torch.int64)
        anc1 = torch.ones(1, 1, dtype=torch.bool)
        while True:
            t = time.perf_counter()
            L = torch.tensor(committed)
            root = torch.tensor(out[-1])
            prop = Proposal()
            if index is not None:
                prop = propose(index, self.lookup_calib, budget, self.lookup_depth)
            t_lk = time.perf_counter()
            if see_lookup is not None:
                see_lookup(prop, committed)
            choice = policy.choose_draft(h_root, committed)
            d, wd = self._check_choice(choice) if checked else (choice.draft_depth, choice.draft_width)
            times = {name: 0.0 for name in STAGES}
            tp = time.perf_counter()
            times["policy"], times["lookup"] = tp - t_lk, t_lk - t
            src = lookup_tree = None
            if d == 0 and len(prop):  # lookup-only, if the policy verifies more than the root
                lookup_tree, src = merge_lookup(root_tree(root), prop, [lookup_logq(p) for p in prop.edge], budget)
                tl = time.perf_counter()
                wv = policy.choose_verify(lookup_tree, StepChoice(0, wd), committed)
                if checked:
                    self._check_verify(wv)
                if wv == 1:
                    lookup_tree = src = None
                tq = time.perf_counter()
                times["lookup"] += tl - tp
                times["policy"] += tq - tl
                tp = tq
            if d == 0 and lookup_tree is None:  # plain step: the target verifies the root alone, the drafter rests
                logits, hidden, caps = self.graphs.tree_step(
                    root.reshape(1), zero, zero, anc1, L, layers,
                    self.graphs.bucket(committed + 1),
                )
                counters["verify_calls"] += 1
                counters["plain_steps"] += 1
                counters["accept_hist"].append(0)
                for buf, x in zip(self._feat_buf, caps):
                    buf[committed] = x[0]
                t4 = time.perf_counter()
                new, reason = truncate(
                    [self._choose(logits[0], params, gen)], self.eos_ids,
                    params.max_new_tokens - len(out),
                )
                out.extend(new)
                if index is not None:
                    index.extend(new)
                if on_tokens and new:
                    on_tokens(new)
                synced = False
                h_next = hidden[0]
                times["verify"], times["accept"] = t4 - tp, time.perf_counter() - t4
                for name, v in times.items():
                    stage[name] += v
                if report:
                    rec = StepRecord(
                        h_root.float(), committed, StepChoice(0, wd), 1, 0,
                        {n: v * 1e3 for n, v in times.items()},
                    )
                    for fn in report:
                        fn(rec)
                if trace:
                    trace({"step": counters["verify_calls"], "committed": committed,
                           "plain": True, "emitted": new, "finish": reason,
                           "stage_ms": {n: v * 1e3 for n, v in times.items()}})
                committed += 1
                h_root = h_next
                if reason is not None:
                    return reason
                continue
            if d > 0:
                if not synced:
                    self._resync(prompt_ids, out, committed, sync_from)
                    counters["resyncs"] += 1
                    synced = True
                    tr = time.perf_counter()
                    times["resync"] = tr - tp
                    tp = tr
                sync_from = committed  # this step's root: the drafter will hold everything below it
                head = drafter.head(root, L, k)
                t1 = time.perf_counter()
                if after_head is not None:  # the head's confidence may change the depth and width
                    choice = after_head(h_root, head.logp[0], StepChoice(d, wd), committed)
                    d, wd = self._check_choice(choice)
                    if d == 0:
                        raise YggError("a policy chose a plain step after the drafter's head ran")
                    th = time.perf_counter()
                    times["policy"] += th - t1
                    tp, t1 = tp + (th - t1), th  # the head stage stays the head call alone
                state = egt_init(root, head.token[0], head.logp[0], d, wd)
                for s in range(d):
                    state, fed = egt_select(state, s)
                    if s == d - 1 and not drafter.feeds_leaves:
                        break  # the children of the last level would never be picked
                    tokens, pos, rows = egt_feed_inputs(state, fed, L)
                    top = drafter.step(tokens, pos - L, fed, state.tree.parent[fed], rows, L, k)
                    state = egt_expand(state, fed, top.token, top.logp)
                counters["draft_calls"] += d + int(drafter.feeds_leaves)
                t2 = time.perf_counter()
                tree = state.tree
                if len(prop):  # one tree: the lookup chains join the drafted nodes
                    tree, src = merge_lookup(tree, prop, [lookup_logq(p) for p in prop.edge], budget)
                    tm = time.perf_counter()
                    times["lookup"] += tm - t2
                    t2 = tm
                wv = policy.choose_verify(tree, StepChoice(d, wd), committed)
                if checked:
                    self._check_verify(wv)
            else:  # lookup-only: the tree and W_v are chosen, the drafter rests
                tree, t1, t2 = lookup_tree, tp, tp
                counters["lookup_steps"] += 1
            tq = time.perf_counter()
            dw = max(d, prop.max_depth)  # depth of the tree: the walk and the commit cover it
            if check:
                check_invariants(tree)
            kept, kept_valid = prune_topk(tree, tree.logp, wv)
            vtree = subtree(tree, kept, kept_valid)
            anc = ancestor_mask(vtree.parent, vtree.depth, vtree.valid, dw)
            if check:
                check_invariants(vtree)
            t3 = time.perf_counter()
            node = torch.arange(wv)
            logits, hidden, caps = self.graphs.tree_step(
                vtree.token, vtree.depth, node, anc, L, layers,
                self.graphs.bucket(committed + wv),
            )
            counters["verify_calls"] += 1
            t4 = time.perf_counter()
            if params.temperature == 0:
                acc = greedy_accept(vtree, logits, max_depth=dw)
            else:
                acc = sample_accept(vtree, logits, params.temperature, params.top_p, gen, max_depth=dw)
            emitted = acc.emitted()
            n_acc = len(emitted) - 1
            counters["accepted_tokens"] += n_acc
            counters["accept_hist"].append(n_acc)
            # who proposed each accepted node (merged nodes: both)
            path_src = src[kept[acc.path[1 : n_acc + 1]]].tolist() if src is not None else [SOURCE_DRAFTER] * n_acc
            for x in path_src:
                counters["by_source"][SOURCE_NAMES[x]] += 1
            new, reason = truncate(emitted, self.eos_ids, params.max_new_tokens - len(out))
            out.extend(new)
            if index is not None:
                index.extend(new)
            if on_tokens and new:
                on_tokens(new)
            t5 = time.perf_counter()
            if reason is None:
                path = acc.path[1:]  # [dw] local verify-tree nodes of the accepted tokens (padded)
                dst_off = torch.arange(1, dw + 1)
                steps.commit(self.target, L + path, L + dst_off)
                feats = tuple(x[acc.path] for x in caps)
                if d > 0:
                    # a lookup-only node has no drafter state: its move is a no-op, and a drafter
                    # whose commit keeps its own KV catches up from it before its next step
                    g = kept[path]
                    own = src[g] != SOURCE_LOOKUP if src is not None else torch.ones_like(g, dtype=torch.bool)
                    drafter.commit(
                        torch.where(own, L + g, L + dst_off), L + dst_off, vtree.token[acc.path],
                        acc.n_accepted, feats,
                    )
                    if drafter.feeds_leaves and SOURCE_LOOKUP in path_src:
                        synced, sync_from = False, committed + 1 + path_src.index(SOURCE_LOOKUP)
                else:
                    synced = False  # a lookup-only step: the drafter did not see these tokens
                if keep_feats:
                    rows = L + torch.arange(dw + 1)
                    for buf, x in zip(self._feat_buf, feats):
                        buf.index_copy_(0, rows, x)
            t6 = time.perf_counter()
            times["policy"] += tq - t2
            for name, a, b in zip(STAGES, (tp, t1, tq, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                times[name] += b - a
            for name, v in times.items():
                stage[name] += v
            times = {name: v * 1e3 for name, v in times.items()}
            h_next = hidden[acc.path[n_acc]]
            if report:
                rec = StepRecord(
                    h_root.float(), committed, StepChoice(d, wd), wv, n_acc, times,
                    tree, kept, kept_valid, logits.argmax(dim=-1) if on_step else None,
                )
                for fn in report:
                    fn(rec)
            if trace:
                trace(
                    {
                        "step": counters["verify_calls"],
                        "committed": committed,
                        "root": int(root),
                        "choice": {"draft_depth": d, "draft_width": wd, "verify_width": wv},
                        "tree": {
                            "token": tree.token.tolist(),
                            "parent": tree.parent.tolist(),
                            "depth": tree.depth.tolist(),
                            "valid": tree.valid.tolist(),
                            "logp": [round(x, 4) if x > float("-inf") else None for x in tree.logp.tolist()],
                        },
                        "kept": kept.tolist(),
                        "kept_valid": kept_valid.tolist(),
                        "accepted_path": acc.path.tolist(),
                        # lookup candidates: how many, the match they continue, each slot's source
                        "lookup": {"nodes": len(prop), "match": prop.match,
                                   "source": src.tolist() if src is not None else None},
                        "n_accepted": n_acc,
                        "emitted": new,
                        "finish": reason,
                        "stage_ms": times,
                    }
                )
            if reason is not None:
                return reason
            committed += 1 + n_acc
            h_root = h_next

