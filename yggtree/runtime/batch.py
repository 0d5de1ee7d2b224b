"""Continuous batching: B request slots over one engine's target, advanced one step at a time.

The target's KV cache holds ``max_batch`` request rows of static shape ([L, 2, B, H, S, D]); each
running request owns one row and keeps its committed sequence in slots ``0..L_i - 1`` of it, as a
batch-1 engine does. :meth:`BatchDecoder.step` advances every running request by one step:

1. at most one prefill chunk, of the oldest request still prefilling (on its own row; the others
   keep decoding while a long prompt is absorbed chunk by chunk);
2. every decoding request's stages before verify (lookup, choice, draft, prune: its own tree, on
   its own drafter state), :func:`~yggtree.runtime.stages.plan_step`;
3. one verify call of the target over all of them: a [b, W] batch, b the smallest batch bucket
   holding the running rows and W the widest tree of the step (narrower trees and empty rows
   padded: their rows write the scratch slot and read slot 0), each row attending over its own
   cache row and its own tree (the tree mask of its request);
4. every request's accept, emit and commit, :func:`~yggtree.runtime.stages.settle_step`.

Requests join and leave between steps. A leaving request's row is refilled by the last running
row (its committed slots copied), so the running rows are always ``0..n-1`` and the verify call
runs at one of a few batch shapes.

Lossless per request: a request's tokens are exactly those :meth:`Engine.generate` gives it alone.
Its prefill chunks are the ones generate runs (batch 1, on a view of its row); its drafter runs
on its own state (swapped in and out with the drafter's ``snapshot``/``restore``); its sampling
draws come from its own generator in generate's order; and the batched verify computes every row
as the batch-1 call does: attention row by row (``model.row_window``, the formulation a batch-1
engine uses for every width below the prefill chunk) and products whose rows do not depend on the
other rows of the call (checked on the model's own layers when the decoder is built,
:func:`check_rows_invariant`). tests/test_batch.py compares every request of a concurrency sweep
with its decoding alone.

The decoder runs the engine's eager modules (reference mode, or a performance engine on the
eager backend), or on a compiled engine (AOTInductor packages, built for its batch-1 cache) its
batch packages (runtime/batch_packages.py: the block at every batch bucket and step width, over
the ``max_batch``-row cache), which its blocks run from then on; the glue around them (embedding,
row windows, final norm, LM head) stays eager, as in the engine's block path.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import YggError
from ..shapes import MAX_BATCH, SamplingParams, batch_bucket
from .accept import truncate
from .batch_objective import BatchObjective
from .batch_packages import BatchPackages
from .drafters import Snapshot
from .engine import Engine, check_prompt, step_record
from .kv_cache import KVStore
from .model import FUSED_PROJECTIONS, Transformer, attention_rows, row_window, run_layer
from .policy import FixedPolicy, StepChoice, StepPolicy
from .schedule import StageTimer
from .stages import Request, Step, choose_token, plan_step, settle_step, speculate_step
from .steps import tree_mask


@dataclass(frozen=True)
class Emitted:
    """What one step did for one request: the tokens it emitted (maybe none: a prefill chunk
    that was not the last), its finish (``stop``: EOS, ``length``) or the error that ended it."""

    key: object
    tokens: list[int]
    finish: str | None = None
    error: Exception | None = None
    drafted: bool = False  # the step verified a drafted tree
    verify_width: int = 1  # W_v of the step (1: the root alone)
    accepted: int = 0  # drafted tokens accepted (the bonus excluded)


@dataclass
class Slot:
    """One request in the batch (mutable: the steps advance it)."""

    key: object
    row: int  # its batch row of the target's cache
    prompt: list[int]
    params: SamplingParams
    policy: StepPolicy | None  # None: a plain engine
    gen: torch.Generator
    done: int = 0  # prompt tokens prefilled
    feats: list[list[torch.Tensor]] = field(default_factory=list)  # per captured layer, [n, H] chunks
    feat_buf: tuple[torch.Tensor, ...] = ()  # per drafter layer [n_slots, H]
    drafter: Snapshot | None = None  # its drafter's state while another request's runs
    req: Request | None = None  # set once prefilled
    timer: StageTimer = field(default_factory=StageTimer)

    def extent(self) -> int:
        """Leading cache slots of its row that hold its state."""
        return self.req.committed + 1 if self.req is not None else self.done


class SlotEngine:
    """The engine as one slot's stages see it: its feature buffers instead of the engine's."""

    def __init__(self, engine: Engine, feat_buf: tuple[torch.Tensor, ...]) -> None:
        self._engine, self.feat_buf = engine, feat_buf

    def __getattr__(self, name):
        return getattr(self._engine, name)


def batch_layers(model: Transformer, tokens, positions, slots, mask, capture=()):
    """The decoder layers over a batch, attention row by row for every width (the formulation a
    batch-1 call of up to ``invariant_rows`` rows takes): the last layer's output [B, W, H] and
    the captured layers (each [B, W, H]). tokens, positions, slots [B, W] int64; mask [B, W, C] bool."""
    cs = model.rope[positions]  # [B, W, D/2, 2]
    cos, sin = cs[..., 0].unsqueeze(2).contiguous(), cs[..., 1].unsqueeze(2).contiguous()
    x = model.embed_tokens(tokens)
    window, mask = row_window(mask)
    slots = torch.cat([slots[..., None], window], -1)  # [B, W, 1 + T]
    captured = []
    for i, block in enumerate(model.layers):
        x = run_layer(block, x, cos, sin, slots, mask)
        if i in capture:
            captured.append(x)
    return x, tuple(captured)


def forward_products(model: Transformer) -> list[tuple[nn.Module, int]]:
    """Every product a forward of ``model`` runs, with its input width: each block's q/k/v (one
    fused product where packed), o_proj, gate/up (likewise) and down_proj, and the LM head."""
    cfg = model.cfg
    width = {"self_attn": cfg.hidden_size, "mlp": cfg.hidden_size}
    out = []
    for block in model.layers:
        for mod_name, hook, names in FUSED_PROJECTIONS:
            mod = getattr(block, mod_name)
            fused = getattr(mod, hook)
            out += [(fused, width[mod_name])] if fused is not None else [(getattr(mod, k), width[mod_name]) for k in names]
        out += [(block.self_attn.o_proj, cfg.num_heads * cfg.head_dim), (block.mlp.down_proj, cfg.intermediate_size)]
    return out + [(model.lm_head, cfg.hidden_size)]


def check_rows_invariant(model: Transformer, rows: int, seed: int = 0) -> None:
    """YggError (one line) unless every distinct product of ``model``'s forward gives each row of a
    ``rows``-row call bitwise as its one-row call: what makes a request's logits in a batch the
    ones it gets alone."""
    seen = set()
    gen = torch.Generator().manual_seed(seed)
    dtype = model.embed_tokens.weight.dtype
    for layer, n_in in forward_products(model):
        key = (type(layer), n_in, tuple(p.shape for p in layer.parameters()), tuple(b.shape for b in layer.buffers()))
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(rows, n_in, generator=gen).to(dtype)
        with torch.no_grad():
            y = layer(x)
            for i in range(rows):
                if not torch.equal(y[i : i + 1], layer(x[i : i + 1])):
                    raise YggError(f"the {type(layer).__name__} product of width {n_in} is not row-invariant "
                                   f"on this CPU (row {i} of {rows} differs from its 1-row product): batched "
                                   "decoding would not be exact; serve with --max-batch 1")


class BatchDecoder:
    """Up to ``max_batch`` requests decoded together on ``engine`` (which it takes over: above one
    request its target's cache is reallocated with ``max_batch`` rows, and ``engine.generate`` is
    no longer usable). ``add`` a request, ``step`` until
    its :class:`Emitted` carries a finish, ``remove`` one that is abandoned."""

    def __init__(self, engine: Engine, max_batch: int, objective: BatchObjective | None = None,
                 check_rows: bool = True, packages: BatchPackages | None = None) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or not 1 <= max_batch <= MAX_BATCH:
            raise YggError(f"max-batch must be an integer in 1..{MAX_BATCH}, got {max_batch!r}")
        if objective is not None and engine.cfg.tree is None:
            raise YggError("batch-aware trees need a speculative engine (a drafter)")
        self.engine, self.max_batch, self.objective = engine, max_batch, objective
        self.packages = None if max_batch == 1 else packages
        self.single = max_batch == 1  # one request: the engine's own cache, graphs and stage plan
        self.solo = None
        self._held: contextlib.ExitStack | None = None  # the settings held while requests run (_hold_settings)
        target = engine.target
        if self.single:
            self.full = target.kv
            self.rows, self.buckets = [target.kv], {1: target.kv}
        else:
            if engine.plan.ahead or engine.plan.overlap:
                raise YggError(f"batched decoding runs the sequential stage plan, this engine runs "
                               f"{engine.plan.name!r} (--stages sequential)")
            if engine.graphs.compiled and packages is None:
                raise YggError("batched decoding of a compiled engine needs its batched graphs "
                               "(offline/batch_build.py), or an engine in reference mode (--mode reference)")
            chunk = engine.cfg.prefill_chunk
            widest = max(engine.envelope.verify_widths)
            if widest > attention_rows(chunk):
                raise YggError(f"verify width {widest} is not below the prefill chunk ({chunk}): batched rows "
                               "would attend otherwise than alone")
            if check_rows:
                check_rows_invariant(target, max_batch * widest)
            # compiled: the engine's own batch-1 cache stays, for steps with one request decoding
            self.solo = target.kv if packages is not None else None
            target.setup_cache(max_batch, engine.n_slots)
            if packages is not None:  # the blocks run the batch packages from now on (their own on the solo cache)
                packages.install(target)
            kv = target.kv.kv  # [L, 2, B, H, S, D]
            self.full = target.kv
            self.rows = [KVStore.over(kv[:, :, r : r + 1]) for r in range(max_batch)]  # each [L, 2, 1, H, S, D]
            self.buckets = {b: KVStore.over(kv[:, :, :b]) for b in {batch_bucket(n, max_batch)
                                                                     for n in range(1, max_batch + 1)}}
        self.solo_key = None  # the request whose state is in the solo cache (not its row)
        self.drafter_owner = None  # the request whose state the drafter holds (the others: snapshots)
        self._attached = target.kv  # the store the target's layers read and write
        self.slots: list[Slot] = []  # by row
        self.layers = engine.drafter.target_layers if engine.drafter is not None else ()

    # ----------------------------------------------------------------- membership

    @property
    def running(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return self.max_batch - len(self.slots)

    def add(self, key, prompt_ids, params: SamplingParams, policy: StepPolicy | None = None) -> None:
        """A request joins (its prefill starts at the next step); YggError for a bad prompt or
        parameters, or a full batch. ``policy``: its steps' choices on a speculative engine
        (None: the engine's tree)."""
        eng = self.engine
        if not self.free:
            raise YggError(f"the batch is full ({self.max_batch} requests)")
        prompt = check_prompt(prompt_ids, params, eng.cfg.max_context, eng.target.cfg.vocab_size)
        speculative = eng.cfg.tree is not None
        if not speculative:
            if policy is not None:
                raise YggError("a step policy needs a speculative engine (a drafter)")
        elif policy is None:
            policy = eng._fixed_policy()
        elif not isinstance(policy, StepPolicy):
            raise YggError(f"a step policy must subclass StepPolicy, got {type(policy).__name__}")
        if policy is not None:
            policy.start_request()
        w = eng.target.embed_tokens.weight
        feat_buf = tuple(torch.zeros(eng.n_slots, eng.target.cfg.hidden_size, dtype=w.dtype, device=w.device)
                         for _ in eng.feat_buf)
        self.slots.append(Slot(key, len(self.slots), prompt, params, policy,
                               torch.Generator().manual_seed(params.seed), feats=[[] for _ in self.layers],
                               feat_buf=feat_buf))

    def remove(self, key) -> None:
        """The request ``key`` leaves (a no-op when it is not running): the last row takes its place."""
        i = next((i for i, s in enumerate(self.slots) if s.key == key), None)
        if i is None:
            return
        if key == self.solo_key:  # its state leaves with it
            self.solo_key = None
        if key == self.drafter_owner:
            self.drafter_owner = None
        last = self.slots.pop()
        if last.key != key:
            n = last.extent()
            self.full.kv[:, :, i, :, :n] = self.full.kv[:, :, last.row, :, :n]
            last.row = i
            self.slots[i] = last
        if not self.slots:
            self._release_settings()

    # ----------------------------------------------------------------- the step

    def step(self) -> list[Emitted]:
        """One step of every running request; finished and failed requests have left after it."""
        eng = self.engine
        out: list[Emitted] = []
        self._hold_settings()
        threaded = eng.worker is not None and eng.worker.threaded
        try:
            with (torch.no_grad(), eng.graphs.frozen(threaded),
                  eng.drafter.frozen(threaded) if eng.drafter is not None else contextlib.nullcontext()):
                filling = next((s for s in self.slots if s.req is None), None)
                if filling is not None:
                    self._guard(filling, out, self._prefill_chunk, filling)
                decoding = [s for s in self.slots if s.req is not None and s is not filling]
                if self.single:
                    for s in decoding:
                        self._guard(s, out, self._whole_step, s)
                elif self.solo is not None and len(decoding) == 1:
                    self._guard(decoding[0], out, self._solo_step, decoding[0])
                else:
                    self._unsolo()
                    self._batch_step(decoding, out)
        finally:
            for e in out:
                if e.finish is not None or e.error is not None:
                    self.remove(e.key)
            if not self.slots:
                self._release_settings()
        return out

    def _hold_settings(self) -> None:
        """The engine's decoding thread count and kernel-library settings (Engine.library), held
        from a step until the batch empties rather than taken and restored every step: entering
        them starts the library's loop pool and leaving joins it: a thread started and stopped
        every step otherwise."""
        if self._held is not None:
            return
        eng = self.engine
        threads = eng.plan_threads(eng.plan)
        held = contextlib.ExitStack()
        held.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(threads)
        held.enter_context(eng.library(threads))
        self._held = held

    def _release_settings(self) -> None:
        """Restore what :meth:`_hold_settings` changed (the batch is empty)."""
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def _batch_step(self, decoding: list[Slot], out: list[Emitted]) -> None:
        """Each request's stages up to verify, one verify call over all, each request's settle."""
        if self.objective is not None and decoding:
            self._choose(decoding)
        steps = {}
        for s in decoding:
            st = Step(torch.tensor(s.req.out[-1]), torch.tensor(s.req.committed))
            s.timer.new_step()
            if self._guard(s, out, self._plan, s, st):
                steps[s.key] = st
        ready = [s for s in decoding if s.key in steps]
        if ready:
            try:
                self._verify(ready, [steps[s.key] for s in ready])
            except Exception as e:  # noqa: BLE001 - the shared call failed: every request in it
                for s in ready:
                    out.append(Emitted(s.key, [], error=e))
                ready = []
        for s in ready:
            self._guard(s, out, self._settle, s, steps[s.key])

    def _whole_step(self, s: Slot) -> Emitted:
        """One request alone: the engine's own step (its graphs, its stage plan) and its policy's
        report, as ``Engine.decode`` runs them."""
        return self._engine_step(s, self.engine)

    def _engine_step(self, s: Slot, eng) -> Emitted:
        """:meth:`_whole_step` on ``eng`` (the engine, or its view for one slot)."""
        req = s.req
        st = Step(torch.tensor(req.out[-1]), torch.tensor(req.committed))
        h_root, committed = req.h_root, req.committed
        s.timer.new_step()
        try:
            speculate_step(eng, req, st, s.timer)
        finally:
            if eng.worker is not None:  # a step that failed between fork and join
                eng.worker.drain()
        if req.policy is not None:
            req.policy.observe(step_record(st, committed, h_root, s.timer.step_ms(), False))
        return emitted(s, st)

    def _solo_step(self, s: Slot) -> Emitted:
        """The one decoding request of a compiled decoder, alone: the engine's own step on its
        batch-1 cache (whole-step packages; its state copied there from its row first), on its
        own policy (where trees are chosen jointly, the single-request objective the joint one is
        at one request, which also prices the drafter's catch-up after batched plain steps)."""
        if self.solo_key != s.key:
            self._unsolo()
            n = s.extent()
            self.solo.kv[:, :, 0, :, :n] = self.full.kv[:, :, s.row, :, :n]
            self.solo_key = s.key
        s.req.policy = s.policy
        with self._on(s, self.solo) as view:
            return self._engine_step(s, view)

    def _unsolo(self) -> None:
        """The request in the solo cache, if any, back to its row (before a batched step)."""
        s = next((s for s in self.slots if s.key == self.solo_key), None)
        if s is not None:
            n = s.extent()
            self.full.kv[:, :, s.row, :, :n] = self.solo.kv[:, :, 0, :, :n]
        self.solo_key = None

    def _attach(self, store: KVStore) -> None:
        """The target's layers read and write ``store`` (re-attached only when it changes)."""
        if self._attached is not store:
            self.engine.target.set_store(store)
            self._attached = store

    def _guard(self, s: Slot, out: list[Emitted], fn, *args) -> bool:
        """``fn(*args)`` for one request; an exception ends that request alone (an error event)."""
        try:
            ev = fn(*args)
        except Exception as e:  # noqa: BLE001 - one request fails, the batch goes on
            out.append(Emitted(s.key, [], error=e))
            return False
        if ev is not None:
            out.append(ev)
        return True

    @contextlib.contextmanager
    def _on(self, s: Slot, store: KVStore | None = None, attach: bool = False, drafts: bool = True):
        """``s``'s row (or ``store``) as the target's cache and its state in the drafter, for its
        own stages. The layers are attached to it with ``attach`` or a ``store`` (a call of the
        target's blocks follows), else only ``target.kv`` is (the commit's store: the layers stay
        where the last call left them, re-attached by the next call that reads them). The drafter
        takes its state only where its stages may read or write it (``drafts``)."""
        if not self.single:
            if store is not None or attach:
                self._attach(store or self.rows[s.row])
            self.engine.target.kv = store or self.rows[s.row]
            if drafts and not plain_only(s.policy):
                self._drafter_for(s)  # a request in plain steps only never reads or writes it
        yield SlotEngine(self.engine, s.feat_buf)

    def _drafter_for(self, s: Slot) -> None:
        """The drafter holds ``s``'s state: swapped only when another request's is there (that one
        kept as a snapshot of its committed slots and a step's tree past them)."""
        drafter = self.engine.drafter
        if drafter is None or self.drafter_owner == s.key:
            return
        owner = next((o for o in self.slots if o.key == self.drafter_owner), None)
        if owner is not None:
            hi = min(owner.extent() + self.engine.envelope.reserve(), self.engine.n_slots)
            owner.drafter = drafter.snapshot(0, hi)
        if s.drafter is not None:
            drafter.restore(s.drafter)
            s.drafter = None  # its state is the drafter's now
        self.drafter_owner = s.key

    def _choose(self, decoding: list[Slot]) -> None:
        """Every request's tree of this step, jointly (:class:`BatchObjective`); a request with
        the plain policy (draft depth 0) takes a plain step."""
        plain = [plain_only(s.policy) for s in decoding]
        picks = self.objective.choose([s.req.committed for s in decoding], [not p for p in plain],
                                      batch_bucket(len(self.slots), self.max_batch))
        for s, (d, wd, wv) in zip(decoding, picks):
            s.req.policy = FixedPolicy(StepChoice(d, wd), wv)

    def _prefill_chunk(self, s: Slot) -> Emitted | None:
        """One chunk of ``s``'s prompt (``engine.prefill``'s chunks); after the last, its first
        token, its drafter's prefill (or its deferral) and its request state, as generate does."""
        eng, chunk = self.engine, self.engine.cfg.prefill_chunk
        with self._on(s, attach=True, drafts=False) as view:
            prompt = torch.tensor(s.prompt, dtype=torch.int64)
            start = s.done
            part = prompt[start : start + chunk]
            buf = torch.zeros(chunk, dtype=torch.int64)
            buf[: part.shape[0]] = part
            logits, hidden, caps = eng.graphs.prefill_chunk(
                buf[None], torch.tensor(start), torch.tensor(part.shape[0]), self.layers,
                eng.graphs.bucket(start + chunk, chunk))
            for f, x in zip(s.feats, caps):
                f.append(x[0, : part.shape[0]])
            s.done += part.shape[0]
            if s.done < len(s.prompt):
                return Emitted(s.key, [])
            feats = tuple(torch.cat(f) for f in s.feats)
            s.feats = []
            h_root = hidden[0, part.shape[0] - 1]
            first = choose_token(logits[0], s.params, s.gen)
            new, reason = truncate([first], eng.eos_ids, s.params.max_new_tokens)
            req = Request(list(s.prompt), s.params, s.gen, s.policy, list(new), len(s.prompt), h_root,
                          eng._lookup_index(s.prompt, new), None, sync_from=len(s.prompt),
                          keep_feats=eng._keeps_features(s.policy) or self.objective is not None)
            s.req = req
            if reason is None:
                for b, x in zip(view.feat_buf, feats):
                    b[: x.shape[0]] = x
                if eng.drafter is not None and eng._may_skip_drafting(s.policy):
                    req.synced, req.sync_from = False, 0
                elif eng.drafter is not None:
                    self._drafter_for(s)
                    eng.drafter.prefill(prompt, feats)
        return Emitted(s.key, new, reason)

    def _plan(self, s: Slot, st: Step) -> None:
        # a plain step this time (the joint objective's choice): no drafter
        with self._on(s, drafts=not plain_only(s.req.policy)) as view:
            plan_step(view, s.req, st, s.timer)

    def _settle(self, s: Slot, st: Step) -> Emitted:
        with self._on(s, drafts=st.drafted) as view:
            settle_step(view, s.req, st, s.timer)
            s.req.h_root = s.req.h_root.clone()  # not a view of this step's batch
        return emitted(s, st)

    def _verify(self, ready: list[Slot], steps: list[Step]) -> None:
        """One target call over every ready request's tree (``st.logits``, ``hidden``, ``caps``)."""
        eng, target = self.engine, self.engine.target
        b = batch_bucket(len(self.slots), self.max_batch)
        width = max(st.wv for st in steps)
        need = max(s.req.committed + st.wv for s, st in zip(ready, steps))
        n_ctx = self.packages.context(need) if self.packages is not None else eng.graphs.bucket(need)
        scratch = eng.n_slots - 1
        tokens = torch.zeros(b, width, dtype=torch.int64)
        pos = torch.zeros(b, width, dtype=torch.int64)
        slots = torch.full((b, width), scratch, dtype=torch.int64)
        mask = torch.zeros(b, width, n_ctx, dtype=torch.bool)
        mask[:, :, 0] = True  # padding rows read slot 0 (of their own row) and write the scratch slot
        for s, st in zip(ready, steps):
            r, w = s.row, st.wv
            if st.plain:
                tok, depth, anc = st.root.reshape(1), torch.zeros(1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool)
            else:
                tok, depth, anc = st.vtree.token, st.vtree.depth, st.anc
            tokens[r, :w] = tok
            pos[r, :w] = st.L + depth
            slots[r, :w] = st.L + torch.arange(w)
            mask[r, :w] = tree_mask(st.L, anc, n_ctx)
        t0 = time.perf_counter()
        if self.packages is not None:
            x, caps = self.packages.layers(target, self.buckets[b], tokens, pos, slots, mask, self.layers)
        else:
            self._attach(self.buckets[b])
            x, caps = batch_layers(target, tokens, pos, slots, mask, self.layers)
        hidden = target.norm(x)  # [b, W, H]
        logits = target.logits(hidden)  # [b, W, V]
        dt = time.perf_counter() - t0
        for s, st in zip(ready, steps):
            r, w = s.row, st.wv
            st.logits, st.hidden, st.caps = logits[r, :w], hidden[r, :w], tuple(c[r, :w] for c in caps)
            s.req.counters["verify_calls"] += 1
            s.timer.step["verify"] += dt  # the shared call's time, on every request in it
            s.timer.total["verify"] += dt


def plain_only(policy: StepPolicy | None) -> bool:
    """Whether ``policy`` takes plain steps only (draft depth 0): its steps never use the drafter."""
    return isinstance(policy, FixedPolicy) and policy.choice.draft_depth == 0


def emitted(s: Slot, st: Step) -> Emitted:
    """What a settled step ``st`` of ``s`` did."""
    return Emitted(s.key, list(st.new), st.reason, drafted=st.drafted, verify_width=st.wv, accepted=st.n_acc)


def plain_policy(engine: Engine) -> FixedPolicy:
    """Plain steps on a speculative engine: draft depth 0, the root alone verified."""
    return FixedPolicy(StepChoice(0, engine.envelope.draft_widths[0]), 1)
