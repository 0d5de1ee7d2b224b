"""The engine: a target (+ optional drafter) with static caches and graphs, and its decode loop.

One speculation step (docs/design.md section 2) is :func:`~yggtree.runtime.stages.speculate_step`:
draft, prune, verify, accept, commit, in order, with the optional stages of the engine's
execution plan (``runtime/schedule.py``). The tree shape may change every step: a
:class:`~yggtree.runtime.policy.StepPolicy` picks (D, W_d) before drafting and W_v after it,
inside the engine's :class:`~yggtree.shapes.Envelope` (the compiled widths and D_max, fixed when
the engine is built). Without a policy every step uses ``cfg.tree``. Plain decoding is the same
step over the root alone (verify, accept, commit).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import YggError
from ..shapes import (  # noqa: F401  (re-exported: the engine's public names)
    DEFAULT_MAX_CONTEXT, DEFAULT_PREFILL_CHUNK, MAX_DRAFT_DEPTH, MAX_DRAFT_WIDTH, MAX_SEED,
    MAX_TEMPERATURE, MAX_TOP_K, MAX_VERIFY_WIDTH, MIN_TEMPERATURE, Envelope, SamplingParams,
    TreeParams, check_sizes, int_value,
)
from .accept import argmax as greedy, truncate
from .drafters import Drafter
from .graphs import Graphs
from .lookup import LookupCalibration, LookupIndex
from .model import Transformer, set_attention_rows
from .overlap import make_worker
from .policy import FixedPolicy, StepChoice, StepPolicy, StepRecord
from .schedule import ExecutionPlan, StageTimer, resolve_plan
from .stages import Request, Step, choose_token, speculate_step
from .static_lookup import StaticTable


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "performance"  # reference (eager, checks) | performance (compiled)
    max_context: int = DEFAULT_MAX_CONTEXT  # prompt + generated tokens
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    tree: TreeParams | None = None  # None: plain decoding; else the shape used without a policy
    # the compiled width sets a step policy may choose from (each also includes cfg.tree's own
    # value; W_v = 1 is always available): caches and graphs are built for all of it
    draft_widths: tuple[int, ...] = ()  # compiled W_d choices
    verify_widths: tuple[int, ...] = ()  # compiled W_v choices
    d_max: int = 0  # most drafter calls per step (0: cfg.tree.draft_depth)
    # model-free candidates from the request's own text (lookup.py): at most this many lookup
    # nodes join each step's tree (0: none); with no drafter, every step is lookup-only or plain
    lookup: int = 0
    lookup_calibration: str | None = None  # lookup calibration JSON (None: the shipped one)
    # where the request's own text offers no lookup candidates, continuations from a table of the
    # target's own writing (runtime/static_lookup.py; None: none; only a table built from this target)
    static_lookup: str | None = None
    stages: str = "sequential"  # execution plan (runtime/schedule.py): sequential | ahead | overlap
    threads: int = 0  # intra-op threads while decoding (0: the process setting)
    # the kernel library's loops on its own thread pool of ``threads`` while a sequential plan
    # decodes, the decoding thread at one OpenMP thread (kernels.loop_pool): for compiled packages
    # whose only parallel loops are the library's (``yggtree compile`` measures and records it)
    loop_pool: bool = False
    # the pool splits each loop by its threads' measured speeds (False: equally; csrc/loops.cpp)
    loop_balance: bool = True
    # (near, far) bytes the kernel library's products prefetch their weights ahead into the first-
    # and second-level cache while this engine decodes (kernels.prefetch; None: the library's
    # default); measured per machine with the product kernel
    prefetch: tuple[int, int] | None = None
    # KV cache slots (0: max_context + the tree's reserve + a scratch slot); a compiled plan's
    # plain engine keeps the slot count its packages were compiled for
    n_slots: int = 0


@dataclass
class Result:
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length"
    stats: dict = field(default_factory=dict)


def _serialised(method):
    """Run ``method`` under its engine's lock (see ``Engine.generate``)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def check_engine(target: Transformer, cfg: EngineConfig, drafter: Drafter | None) -> None:
    """YggError naming the problem unless ``cfg`` and the models fit each other."""
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
    if cfg.tree is not None and drafter is not None and drafter.vocab_size != target.cfg.vocab_size:
        raise YggError(
            f"drafter vocabulary ({drafter.vocab_size}) differs from the target's "
            f"({target.cfg.vocab_size})"
        )


def check_prompt(prompt_ids, params: SamplingParams, max_context: int, vocab: int) -> list[int]:
    """The prompt as a list of ints; YggError naming the problem otherwise."""
    if not isinstance(params, SamplingParams):
        raise YggError(f"params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise YggError(
            f"the prompt must be a list of token ids (ints), got {type(prompt_ids).__name__} "
            "(encode text with yggtree.runtime.loading.encode_prompt)"
        )
    prompt_ids = [int_value("prompt token id", t) for t in prompt_ids]
    if not prompt_ids:
        raise YggError("the prompt is empty")
    n = len(prompt_ids)
    if n >= max_context:
        raise YggError(f"the prompt has {n} tokens, the context window is {max_context}")
    if n + params.max_new_tokens > max_context:
        raise YggError(
            f"prompt ({n} tokens) + max-new-tokens ({params.max_new_tokens}) exceeds the "
            f"context window ({max_context}); lower max-new-tokens or raise max-context"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise YggError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return prompt_ids


def prefill(graphs: Graphs, prompt: torch.Tensor, chunk: int, layers: tuple[int, ...]
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Chunked prefill of the target. Returns last logits [V], the last token's final hidden
    state [H] and captured layers [n, H]."""
    n = prompt.shape[0]
    feats: list[list[torch.Tensor]] = [[] for _ in layers]
    logits = last = None
    for start in range(0, n, chunk):
        part = prompt[start : start + chunk]
        buf = torch.zeros(chunk, dtype=torch.int64)
        buf[: part.shape[0]] = part
        logits, hidden, caps = graphs.prefill_chunk(
            buf[None], torch.tensor(start), torch.tensor(part.shape[0]), layers,
            graphs.bucket(start + chunk, chunk),
        )
        for f, x in zip(feats, caps):
            f.append(x[0, : part.shape[0]])
        last = hidden[0, part.shape[0] - 1]
    return logits[0], last, tuple(torch.cat(f) for f in feats)


def step_stats(n: int, total: float, ttft: float, c: dict, stage: dict, d: int, speculative: bool,
               compile_s: float, plan: ExecutionPlan, lookup: bool) -> dict:
    """A request's stats: throughput, latency, calls, acceptance and per-stage times."""
    verify = max(c["verify_calls"], 1)
    s = {
        "new_tokens": n,
        "tokens_per_s": n / total,
        "decode_tokens_per_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": (total - ttft) / (n - 1) * 1e3 if n > 1 else 0.0,
        "total_ms": total * 1e3,
        "compile_s": compile_s,
        "verify_calls": c["verify_calls"],
        "stages": plan.name,
        "threads": plan.threads or torch.get_num_threads(),
        "draft_threads": plan.draft_threads,
        "plan": plan.label,  # the stage plan with its thread split, as --stages takes it
    }
    if speculative:
        hist = c["accept_hist"]
        s.update(
            draft_calls=c["draft_calls"],
            plain_steps=c["plain_steps"],
            resyncs=c["resyncs"],
            ahead_calls=c["ahead_calls"],
            speculation={"steps": c["spec_steps"], "hits": c["spec_hits"],
                         "worker_ms": round(c["spec_ms"], 3)},
            accepted_tokens=c["accepted_tokens"],
            aal=(c["accepted_tokens"] + c["verify_calls"]) / verify,
            accept_by_position=[sum(1 for a in hist if a >= i) / verify for i in range(1, d + 1)],
            stage_ms={k: v * 1e3 for k, v in stage.items()},
        )
        if lookup:  # accepted draft tokens by who proposed them
            s.update(lookup_steps=c["lookup_steps"], accepted_by_source=dict(c["by_source"]))
    return s


def step_trace(st: Step, committed: int, n: int, stage_ms: dict) -> dict:
    """One JSON-ready record of the ``n``-th step, rooted at position ``committed``."""
    if st.plain:
        return {"step": n, "committed": committed, "plain": True, "emitted": st.new,
                "finish": st.reason, "stage_ms": stage_ms}
    t = st.tree
    return {
        "step": n,
        "committed": committed,
        "root": int(st.root),
        "choice": {"draft_depth": st.d, "draft_width": st.wd, "verify_width": st.wv},
        "tree": {
            "token": t.token.tolist(),
            "parent": t.parent.tolist(),
            "depth": t.depth.tolist(),
            "valid": t.valid.tolist(),
            "logp": [round(x, 4) if x > float("-inf") else None for x in t.logp.tolist()],
        },
        "kept": st.kept.tolist(),
        "kept_valid": st.kept_valid.tolist(),
        "accepted_path": st.acc.path.tolist(),
        # lookup candidates: how many, the match they continue, each slot's source
        "lookup": {"nodes": len(st.prop), "match": st.prop.match,
                   "source": st.src.tolist() if st.src is not None else None},
        "n_accepted": st.n_acc,
        "emitted": st.new,
        "finish": st.reason,
        "stage_ms": stage_ms,
    }


def step_record(st: Step, committed: int, h_root: torch.Tensor, stage_ms: dict, argmax: bool) -> StepRecord:
    """The :class:`StepRecord` of a finished step rooted at ``committed`` (``h_root``: the
    target's hidden state that produced the root)."""
    choice = StepChoice(st.d, st.wd)
    if st.plain:
        return StepRecord(h_root.float(), committed, choice, 1, 0, stage_ms)
    return StepRecord(
        h_root.float(), committed, choice, st.wv, st.n_acc, stage_ms, st.tree, st.kept,
        st.kept_valid, greedy(st.logits) if argmax else None,
    )


class Engine:
    """Target (+ optional drafter) with static caches and graphs, ready to generate."""

    def __init__(self, target: Transformer, cfg: EngineConfig, drafter: Drafter | None = None,
                 eos_ids: tuple[int, ...] = ()) -> None:
        check_engine(target, cfg, drafter)
        # one attention formulation for plain steps and every verify width narrower than a prefill
        # chunk: row by row, so a verified node's logits are bitwise a plain step's (before any graph;
        # runtime/prepare.py sets it already for the models it prepares, compiled packages' included)
        set_attention_rows(target, cfg.prefill_chunk)
        self.target, self.drafter, self.eos_ids = target, drafter, tuple(eos_ids)
        self.envelope = Envelope.of(cfg.tree, cfg.draft_widths, cfg.verify_widths, cfg.d_max)
        self.plan = resolve_plan(cfg.stages, cfg.tree is not None, threads=cfg.threads)
        self.worker = None  # the drafter's worker (overlap plans), made once the drafter is set
        self._lock = threading.Lock()  # one generate at a time: caches and graphs are shared state
        self._ahead: dict[int, int | None] = {}  # threads -> this machine's attention fetch (attention_choice)
        self.graphs = Graphs(target, cfg.mode)
        need = self.envelope.slots(cfg.max_context)
        if cfg.n_slots and cfg.n_slots < need:
            raise YggError(f"{cfg.n_slots} cache slots cannot hold max-context {cfg.max_context} and this tree "
                           f"({need} needed)")
        self.n_slots = cfg.n_slots or need
        self.cfg, self.lookup_calib, self.static_table = cfg, None, None
        self.set_lookup(cfg.lookup)
        target.setup_cache(1, self.n_slots)
        self.feat_buf: tuple[torch.Tensor, ...] = ()  # per drafter layer [n_slots, H]
        if drafter is not None:
            drafter.setup(self.n_slots, self.drafter_widths(self.plan), cfg.prefill_chunk,
                          threads=self.plan_threads(self.plan))
            w = target.embed_tokens.weight
            self.feat_buf = tuple(torch.zeros(self.n_slots, target.cfg.hidden_size, dtype=w.dtype,
                                              device=w.device) for _ in drafter.target_layers)
        self._build(self.plan)
        self.worker = self._worker(self.plan, None)

    def plan_threads(self, plan: ExecutionPlan) -> int:
        """The intra-op thread count ``plan`` decodes at on the decoding thread (its ``threads``;
        0: the calling thread's count now)."""
        return plan.threads or torch.get_num_threads()

    @contextlib.contextmanager
    def library(self, threads: int):
        """The kernel library's settings while this engine decodes at ``threads``: its products'
        prefetch setting (``cfg.prefetch``; kernels.prefetch), and its parallel loops on its own
        thread pool (kernels.loop_pool) where ``cfg.loop_pool`` and the plan is sequential (an
        overlap plan's drafter worker calls kernels beside the decoding thread, on its own OpenMP
        threads), else on OpenMP; where its target runs the library's attention, how far ahead that
        fetches the cache's rows (this machine's choice, kernels.attention_ahead). All restored after."""
        from .kernels import attention_ahead, attention_prefetch, loop_pool, prefetch

        if threads not in self._ahead:
            self._ahead[threads] = attention_ahead(self.target, threads)
        with prefetch(self.cfg.prefetch), attention_prefetch(self._ahead[threads]), \
                (loop_pool(threads, self.cfg.loop_balance) if self.cfg.loop_pool and self.worker is None
                 else contextlib.nullcontext()):
            yield

    def _build(self, plan: ExecutionPlan) -> None:
        """Build every graph the decoding thread runs under ``plan`` that is not built yet, at
        the count it runs at (:meth:`plan_threads`): the target's at every verify width and the
        prefill chunk, the drafter's at :meth:`drafter_widths`. Compiled graphs are guarded on
        the thread count they were built at (graphs.py); with AOTInductor packages or eager
        code this only checks. The worker's graphs are built by :meth:`_worker`."""
        threads = self.plan_threads(plan)
        capture = self.drafter.target_layers if self.drafter is not None else ()
        self.graphs.warm_up([1, *self.envelope.verify_widths], capture, prefill=self.cfg.prefill_chunk,
                            threads=threads)
        if self.drafter is not None:
            self.drafter.warm_up(self.drafter_widths(plan), threads=threads)

    def drafter_widths(self, plan: ExecutionPlan) -> list[int]:
        """Drafter input widths ``plan`` runs: its prefill chunk, the head (1), every W_d, and
        with the ahead stage twice every W_v (each verified node and a head row under it)."""
        env = self.envelope
        ahead = [2 * w for w in env.verify_widths] if plan.ahead else []
        return sorted({self.cfg.prefill_chunk, 1, *env.draft_widths, *ahead})

    def set_lookup(self, n: int) -> None:
        """At most ``n`` lookup nodes per step from now on (0: none); YggError when ``n`` is
        negative, larger than the largest verify width, or the engine cannot speculate."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise YggError(f"lookup must be an integer >= 0, got {n!r}")
        if n > 0 and self.cfg.tree is None:
            raise YggError("lookup nodes need a speculative engine (tree parameters)")
        if n > max(self.envelope.verify_widths):
            raise YggError(f"lookup {n} exceeds the verify width ({max(self.envelope.verify_widths)})")
        if n > 0 and self.lookup_calib is None:
            path = self.cfg.lookup_calibration
            self.lookup_calib = LookupCalibration.load(path) if path else LookupCalibration.load()
        if n > 0 and self.cfg.static_lookup and self.static_table is None:
            self.static_table = StaticTable.load(self.cfg.static_lookup)
        self.cfg = replace(self.cfg, lookup=n)

    @property
    def lookup_depth(self) -> int:
        """Deepest lookup chain: D_max (the acceptance walk, the commit and an EAGLE drafter's
        pending pairs are sized for it)."""
        d = self.envelope.d_max
        return min(d, getattr(self.drafter, "max_depth", d))

    @property
    def compile_s(self) -> float:
        extra = getattr(getattr(self.drafter, "graphs", None), "compile_s", 0.0)
        return self.graphs.compile_s + extra

    def use_plan(self, stages: str, threads: int | None = None) -> ExecutionPlan:
        """Run ``stages`` (``sequential``, ``ahead`` or ``overlap``) with ``threads`` intra-op
        threads (None: unchanged) from now on; the graphs it needs at its thread counts (the
        target's and the drafter's at ``threads``, the worker's at its own) are built now.
        Returns the execution plan."""
        threads = self.plan.threads if threads is None else threads
        plan = resolve_plan(stages, self.cfg.tree is not None, threads=threads)
        if self.drafter is not None:
            self.drafter.setup(self.n_slots, self.drafter_widths(plan), self.cfg.prefill_chunk,
                               threads=self.plan_threads(plan))
        self._build(plan)
        self.worker = self._worker(plan, self.worker)
        self.plan = plan
        return plan

    def _worker(self, plan: ExecutionPlan, old):
        """The worker ``plan`` runs the drafter's stages on (None: it runs none); ``old`` is
        kept when it has the plan's thread budget, else closed. A new worker builds the
        drafter's graphs of the speculation job (head and every W_d) on its own thread, at its
        own thread count, before it takes a job."""
        want = plan.draft_threads if plan.overlap and self.drafter is not None else 0
        if old is not None and old.threads == want:
            return old
        if old is not None:
            old.close()
        if not want:
            return None
        worker = make_worker(want, self.target.embed_tokens.weight.device)
        try:
            worker.result(worker.submit(self.drafter.warm_up, [1, *self.envelope.draft_widths]))
        except BaseException:
            worker.close()
            raise
        return worker

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
        speculative = self.cfg.tree is not None
        if (policy is not None or on_step is not None) and not speculative:
            raise YggError("a step policy or on_step callback needs a speculative engine (a drafter)")
        if policy is not None and not isinstance(policy, StepPolicy):
            raise YggError(f"a step policy must subclass yggtree.runtime.policy.StepPolicy, "
                           f"got {type(policy).__name__}")
        prompt_ids = check_prompt(prompt_ids, params, self.cfg.max_context, self.target.cfg.vocab_size)
        if policy is None and speculative:
            policy = self._fixed_policy()
        if policy is not None:
            policy.start_request()  # a learning policy hears where one request's text ends
        self._build(self.plan)  # built unless the plan takes the process's count and it changed
        gen = torch.Generator().manual_seed(params.seed)
        timer = StageTimer()
        t0 = time.perf_counter()
        threads = self.plan_threads(self.plan)
        n_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            threaded = self.worker is not None and self.worker.threaded
            with torch.no_grad(), self.graphs.frozen(threaded), self.library(threads):
                prompt = torch.tensor(prompt_ids, dtype=torch.int64)
                layers = self.drafter.target_layers if self.drafter is not None else ()
                logits, h_root, feats = prefill(self.graphs, prompt, self.cfg.prefill_chunk, layers)
                first = choose_token(logits, params, gen)
                ttft = time.perf_counter() - t0
                out, reason = truncate([first], self.eos_ids, params.max_new_tokens)
                if on_tokens:
                    on_tokens(out)
                req = Request(list(prompt_ids), params, gen, policy, out, len(prompt_ids), h_root,
                              self._lookup_index(prompt_ids, out), on_tokens, sync_from=len(prompt_ids),
                              keep_feats=self._keeps_features(policy))
                if reason is None:
                    for buf, x in zip(self.feat_buf, feats):
                        buf[: x.shape[0]] = x
                    with self.drafter.frozen(threaded) if self.drafter else contextlib.nullcontext():
                        if self.drafter is not None and self._may_skip_drafting(policy):
                            # absorbed at the first drafted step (the resync stage, from slot 0): a
                            # request the policy decodes in plain steps never pays the drafter's prefill
                            req.synced, req.sync_from = False, 0
                        elif self.drafter is not None:
                            self.drafter.prefill(prompt, feats)
                        reason = self.decode(req, timer, trace, on_step)
        finally:
            torch.set_num_threads(n_threads)
        total = time.perf_counter() - t0
        d = (policy.choice.draft_depth if isinstance(policy, FixedPolicy) else self.envelope.d_max) if speculative else 0
        stats = step_stats(len(out), total, ttft, req.counters, timer.total, d, speculative,
                           self.compile_s, self.plan, self.cfg.lookup > 0)
        return Result(out, list(prompt_ids), reason, stats)

    def decode(self, req: Request, timer: StageTimer, trace=None, on_step=None) -> str:
        """The decode loop: one :func:`~yggtree.runtime.stages.speculate_step` per step until a
        finish."""
        report = [fn for fn in (on_step, req.policy.observe if req.policy else None) if fn is not None]
        try:
            while True:
                st = Step(torch.tensor(req.out[-1]), torch.tensor(req.committed))
                h_root, committed = req.h_root, req.committed
                timer.new_step()
                speculate_step(self, req, st, timer)
                if report:
                    rec = step_record(st, committed, h_root, timer.step_ms(), on_step is not None)
                    for fn in report:
                        fn(rec)
                if trace:
                    trace(step_trace(st, committed, req.counters["verify_calls"], timer.step_ms()))
                if st.reason is not None:
                    return st.reason
        finally:
            if self.worker is not None:  # a step that failed between fork and join
                self.worker.drain()

    def _fixed_policy(self) -> FixedPolicy:
        """``cfg.tree`` every step (lookup-only speculation when there is no drafter)."""
        tp = self.cfg.tree
        self.envelope.check_tree(tp if self.drafter is not None else replace(tp, draft_depth=0))
        if self.drafter is None:
            return FixedPolicy(StepChoice(0, tp.draft_width), tp.verify_width)
        return FixedPolicy.of(tp)

    @staticmethod
    def _may_skip_drafting(policy: StepPolicy | None) -> bool:
        """Whether ``policy`` may choose plain steps (any policy but a fixed tree)."""
        if policy is None:
            return False
        return not (isinstance(policy, FixedPolicy) and policy.choice.draft_depth > 0)

    def _keeps_features(self, policy: StepPolicy | None) -> bool:
        """Whether plain or lookup-only steps may leave the drafter behind (it then resyncs from
        the target features of the committed tokens, kept for it)."""
        if policy is None:
            return False
        return self.cfg.lookup > 0 or self._may_skip_drafting(policy)

    def _lookup_index(self, prompt_ids: list[int], out: list[int]) -> LookupIndex | None:
        if not self.cfg.lookup:
            return None
        index = LookupIndex()
        index.extend(list(prompt_ids) + out)
        return index
