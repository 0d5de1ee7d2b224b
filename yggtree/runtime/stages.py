"""One decode step: :func:`speculate_step` runs draft, prune, verify, accept and commit in order,
on one page; the functions below it are the parts it calls.

A step writes its products to a :class:`Step` (what the trace, the step record and the later parts
read) and advances the request's decoding state, a :class:`Request`. The execution plan
(runtime/schedule.py) adds to the sequential step the ahead-of-time tail and head draft (``ahead``)
or the next step's draft on the drafter's worker while the target verifies (``fork`` and ``join``,
runtime/overlap.py). Each stage runs under the one stage timer, by its name in
:data:`~yggtree.runtime.schedule.STAGES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import YggError
from ..shapes import SamplingParams
from . import steps
from .accept import Accepted, argmax, filter_probs, sample_choices, sample_tokens, truncate, walk
from .drafters import TopK
from .egt import draft_tree
from .lookup import LookupIndex, Proposal, propose
from .merge import SOURCE_DRAFTER, SOURCE_LOOKUP, SOURCE_NAMES, merge_lookup, root_tree
from .overlap import Speculation, fits, guess_path, speculate
from .policy import StepChoice, StepPolicy
from .prune import prune_for_verify
from .schedule import StageTimer
from .static_lookup import propose_static
from .tree import Tree, check_invariants


@dataclass
class Request:
    """One generate call's decoding state (mutable: the stages advance it)."""

    prompt_ids: list[int]
    params: SamplingParams
    gen: torch.Generator
    policy: StepPolicy
    out: list[int]  # emitted tokens so far
    committed: int  # tokens in the target's cache (prompt + out[:-1]); the root's position
    h_root: torch.Tensor  # [H] target final hidden state whose logits produced the root
    index: LookupIndex | None  # lookup candidates' source (None: no lookup)
    on_tokens: Callable[[list[int]], None] | None = None
    synced: bool = True  # the drafter holds everything below sync_from
    sync_from: int = 0
    ahead_head: TopK | None = None  # [1, k] the next root's head, picked up at the commit
    spec: Speculation | None = None  # the next step's tree, drafted on the worker (a used guess)
    keep_feats: bool = False  # keep target features of committed tokens (for resyncs)
    counters: dict = field(default_factory=lambda: {
        "verify_calls": 0, "draft_calls": 0, "accepted_tokens": 0, "accept_hist": [],
        "plain_steps": 0, "resyncs": 0, "lookup_steps": 0, "ahead_calls": 0,
        "spec_steps": 0, "spec_hits": 0, "spec_ms": 0.0,
        "by_source": {name: 0 for name in SOURCE_NAMES},
    })


@dataclass
class Step:
    """One step's products, in the order :func:`speculate_step` writes them."""

    root: torch.Tensor  # [] int64 the last emitted token
    L: torch.Tensor  # [] int64 committed length (the root's slot and position)
    prop: Proposal = field(default_factory=Proposal)
    d: int = 0  # D: drafter calls this step (0: no drafting)
    wd: int = 0  # W_d
    head: TopK | None = None  # [1, k] the drafter's proposal at the root
    tree: Tree | None = None  # the drafted (and merged) tree, N slots
    src: torch.Tensor | None = None  # [N] int64 who proposed each tree node (merge.SOURCE_*)
    wv: int = 1  # W_v
    kept: torch.Tensor | None = None  # [W_v] int64 tree nodes verified
    kept_valid: torch.Tensor | None = None  # [W_v] bool
    vtree: Tree | None = None  # the verified tree, W_v slots (None: the root alone)
    anc: torch.Tensor | None = None  # [W_v, W_v] bool ancestor-or-self mask of vtree
    dw: int = 0  # depth bound of the verified tree (the walk and the commit cover it)
    logits: torch.Tensor | None = None  # [W_v, V] float32 target logits at every verified node
    hidden: torch.Tensor | None = None  # [W_v, H] target final hidden states
    caps: tuple[torch.Tensor, ...] = ()  # captured target layers, each [W_v, H]
    bonus: torch.Tensor | None = None  # [W_v] int64 the target's choice at every verified node
    acc: Accepted | None = None  # the walk: path [dw + 1] int64 verified-tree nodes, root first
    n_acc: int = 0  # accepted draft tokens
    path_src: list[int] = field(default_factory=list)  # who proposed each accepted node
    new: list[int] = field(default_factory=list)  # tokens emitted this step
    reason: str | None = None  # "stop" | "length" once decoding ends
    room: int = 0  # > 0: the ahead call ran, its head rows at slots L + room + v
    hit: bool = False  # the worker's guess was accepted: it committed the path in the drafter

    @property
    def drafted(self) -> bool:
        return self.d > 0

    @property
    def plain(self) -> bool:
        return self.vtree is None


def choose_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's next token from logits [V]: argmax, or one draw (one uniform through the
    inverse of the CDF, as a verified node's: torch.multinomial is far slower over a vocabulary)."""
    if params.temperature == 0:
        return int(argmax(logits))
    probs = filter_probs(logits, params.temperature, params.top_p)
    return int(sample_tokens(probs, torch.rand((), generator=gen, device=probs.device)))


def speculate_step(eng, req: Request, st: Step, clock: StageTimer) -> None:
    """One decode step of ``eng.plan``: draft a tree from the root, prune it to W_v nodes, verify
    them with the target, accept the target's choices down the tree, commit the accepted path.
    A plain step (D = 0, nothing looked up; every step of an engine without a drafter or lookup)
    verifies, accepts and commits the root alone. ``clock(name)`` times each stage."""
    plan_step(eng, req, st, clock)
    pending = None
    if st.drafted and eng.plan.overlap:
        with clock("fork"):  # the next step's head and draft start on the drafter's worker
            pending = fork(eng, req, st)
    with clock("verify"):  # logits [W_v, V] float32, hidden [W_v, H], caps: each [W_v, H]
        st.logits, st.hidden, st.caps = verify(eng, req, st)
    settle_step(eng, req, st, clock, pending)


def plan_step(eng, req: Request, st: Step, clock: StageTimer) -> None:
    """The stages before the verify call: look up, choose, draft and prune (``st.vtree`` is
    then the tree to verify, None on a plain step). A batch of requests runs this for each,
    then one verify call over all their trees (runtime/batch.py)."""
    if req.index is not None:
        with clock("lookup"):  # model-free candidates from the request's own text
            st.prop = propose(req.index, eng.lookup_calib, eng.cfg.lookup, eng.lookup_depth)
            if not len(st.prop) and eng.static_table is not None:  # nothing to continue in the text
                st.prop = propose_static(eng.static_table, req.index.tokens, eng.cfg.lookup, eng.lookup_depth)
    if req.policy is not None:  # a speculative engine: D drafter calls of width W_d (D = 0: none)
        with clock("policy"):
            st.d, st.wd = choose(eng, req, st.prop)
    spec, req.spec = req.spec, None  # the overlap plan: this step's tree, drafted on the worker
    if st.drafted:
        if not req.synced:  # plain or lookup-only steps left the drafter behind
            with clock("resync"):
                resync(eng, req)
        with clock("head"):  # TopK [1, k]: the drafter's top-k after the root
            st.head = head(eng, req, st)
        with clock("policy"):  # the policy's second look at (D, W_d), given the head
            st.d, st.wd = refine(eng, req, st)
        with clock("draft"):  # EGT, D levels of W_d nodes: N = 1 + D W_d slots, token [N] int64
            st.tree = draft(eng, req, st, spec)
    # a lookup-only tree is built only where the policy priced it above a plain step
    if len(st.prop) and (st.drafted or req.policy.takes_lookup_only()):
        with clock("lookup"):  # the lookup chains join the tree (lookup-only: hang from the root)
            logq = [req.policy.lookup_logq(p) for p in st.prop.edge]
            tree = st.tree if st.drafted else root_tree(st.root)
            st.tree, st.src = merge_lookup(tree, st.prop, logq, eng.cfg.lookup)  # src [N] int64
    if st.tree is not None:
        with clock("policy"):  # W_v: the nodes to verify
            st.wv = size(eng, req, st)
    if st.drafted or st.wv > 1:
        with clock("prune"):  # the W_v best nodes, a connected subtree, and its tree mask
            st.dw = max(st.d, st.prop.max_depth)  # depth bound of the verified tree
            # kept [W_v] int64 tree nodes, kept_valid [W_v] bool, vtree W_v slots, anc [W_v, W_v] bool
            st.kept, st.kept_valid, st.vtree, st.anc = prune(eng, req, st)


def settle_step(eng, req: Request, st: Step, clock: StageTimer, pending=None) -> None:
    """The stages after the verify call (``st.logits``, ``st.hidden`` and ``st.caps`` set):
    accept, emit, the ahead call and the worker's join where the plan has them, commit."""
    with clock("accept"):  # bonus [W_v] int64 the target's choice at each node, acc.path [dw + 1]
        emitted = accept(eng, req, st)  # the accepted tokens and the bonus token
        st.new, st.reason = truncate(emitted, eng.eos_ids, req.params.max_new_tokens - len(req.out))
        emit(req, st.new)
    if st.drafted and st.reason is None and eng.plan.ahead:
        with clock("ahead"):  # the drafter over every verified node + a head row under each
            st.room = ahead(eng, req, st)
    if pending is not None:
        with clock("join"):  # the worker's draft is kept if the guessed path was accepted
            st.hit = join(eng, req, st, pending)
    with clock("commit"):  # the accepted path to contiguous cache slots (target and drafter)
        commit(eng, req, st)


# ----------------------------------------------------------------------------- the parts


def choose(eng, req: Request, prop: Proposal) -> tuple[int, int]:
    """The policy's (D, W_d) before drafting (it sees the lookup candidates first)."""
    req.policy.see_catch_up(catch_up_behind(eng, req), req.params.max_new_tokens - len(req.out))
    req.policy.see_lookup(prop, req.committed)
    c = req.policy.choose_draft(req.h_root, req.committed)
    eng.envelope.check_draft(c.draft_depth, c.draft_width)
    return c.draft_depth, c.draft_width


def deferred(eng, req: Request) -> bool:
    """Whether the drafter's catch-up before the coming drafted step is left to its head call
    (a resume of at most ``absorbs`` tokens: Drafter.defer)."""
    return 0 < req.sync_from and req.committed - req.sync_from <= eng.drafter.absorbs


def catch_up_behind(eng, req: Request) -> int:
    """Tokens the drafter's catch-up calls must absorb before the coming drafted step (0: it is
    in step, or its head call takes them in): what the policy prices."""
    if req.synced or eng.drafter is None or deferred(eng, req):
        return 0
    return req.committed - req.sync_from


def resync(eng, req: Request) -> None:
    """Absorb into the drafter the committed sequence from ``sync_from`` (it holds what is
    below), when plain or lookup-only steps left it behind: a few tokens behind, in its next head
    call; else in prefill chunks, or in head calls where the policy prices those lower."""
    seq = torch.tensor(list(req.prompt_ids) + req.out[:-1], dtype=torch.int64)
    feats = tuple(buf[: req.committed] for buf in eng.feat_buf)
    if deferred(eng, req):
        eng.drafter.defer(seq, feats, req.sync_from)
    elif eng.drafter.absorbs and req.policy.catch_up_by_heads(req.committed - req.sync_from, req.committed):
        eng.drafter.absorb(seq, feats, req.sync_from, eng.envelope.top_k)
    else:
        eng.drafter.prefill(seq, feats, req.sync_from)
    req.counters["resyncs"] += 1
    req.synced, req.ahead_head = True, None


def head(eng, req: Request, st: Step) -> TopK:
    """The drafter's top-k at the root: picked up from the previous step (its ahead call or the
    worker's draft), else a head call."""
    req.sync_from = req.committed  # this step's root: the drafter will hold everything below it
    picked, req.ahead_head = req.ahead_head, None
    return picked if picked is not None else eng.drafter.head(st.root, st.L, eng.envelope.top_k)


def refine(eng, req: Request, st: Step) -> tuple[int, int]:
    """The policy's second look at (D, W_d), given the head."""
    c = req.policy.after_head(req.h_root, st.head.logp[0], StepChoice(st.d, st.wd), req.committed)
    eng.envelope.check_draft(c.draft_depth, c.draft_width)
    if c.draft_depth == 0:
        raise YggError("a policy chose a plain step after the drafter's head ran")
    return c.draft_depth, c.draft_width


def draft(eng, req: Request, st: Step, spec: Speculation | None) -> Tree:
    """D levels: EGT picks W_d nodes, the drafter proposes the top-k children of each (or the
    tree the worker drafted from an accepted guess, when the choice is the one it drafted)."""
    if spec is not None and (spec.d, spec.wd) == (st.d, st.wd) and st.head is spec.head:
        return spec.tree
    tree, calls = draft_tree(eng.drafter, st.root, st.head, st.d, st.wd, st.L, eng.envelope.top_k)
    req.counters["draft_calls"] += calls + 1  # + the head
    return tree


def size(eng, req: Request, st: Step) -> int:
    """The policy's W_v for this tree."""
    wv = req.policy.choose_verify(st.tree, StepChoice(st.d, st.wd), req.committed)
    eng.envelope.check_verify(wv)
    return wv


def prune(eng, req: Request, st: Step) -> tuple[torch.Tensor, torch.Tensor, Tree, torch.Tensor]:
    """The W_v best nodes of the tree (a connected subtree): their tree nodes, validity, the
    verified tree and its ancestor-or-self mask."""
    if not st.drafted:
        req.counters["lookup_steps"] += 1
    check = eng.cfg.mode == "reference"
    if check:
        check_invariants(st.tree)
    kept, kept_valid, vtree, anc = prune_for_verify(st.tree, st.tree.logp, st.wv, st.dw)
    if check:
        check_invariants(vtree)
    return kept, kept_valid, vtree, anc


def fork(eng, req: Request, st: Step):
    """Start drafting the next step on the drafter's worker, from the verified path the drafter
    scores highest (runtime/overlap.py); the target verifies meanwhile. Returns the job (a Future
    of a Speculation; None when the speculation would not fit the cache)."""
    guess = guess_path(st.vtree, st.kept, st.src)
    if not fits(req.committed, guess.n, st.d, st.wd, eng.n_slots):
        return None
    return eng.worker.submit(speculate, eng.drafter, guess, st.L, st.d, st.wd, eng.envelope.top_k,
                             eng.n_slots)


def verify(eng, req: Request, st: Step) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The target over the verified tree (the root alone on a plain step)."""
    layers = eng.drafter.target_layers if eng.drafter is not None else ()
    if st.plain:
        zero = torch.zeros(1, dtype=torch.int64)
        tokens, depth, node, anc = st.root.reshape(1), zero, zero, torch.ones(1, 1, dtype=torch.bool)
    else:
        tokens, depth, node, anc = st.vtree.token, st.vtree.depth, torch.arange(st.wv), st.anc
    bucket = eng.graphs.bucket(req.committed + st.wv, st.wv)
    out = eng.graphs.tree_step(tokens, depth, node, anc, st.L, layers, bucket)
    req.counters["verify_calls"] += 1
    return out


def accept(eng, req: Request, st: Step) -> list[int]:
    """The target's choice at every node and the walk down the tree: the accepted tokens and the
    bonus token (the target's own at the root on a plain step)."""
    p, c = req.params, req.counters
    if st.plain:
        c["plain_steps"] += int(eng.cfg.tree is not None)
        c["accept_hist"].append(0)
        return [choose_token(st.logits[0], p, req.gen)]
    if p.temperature == 0:
        st.bonus = argmax(st.logits)
    else:  # one independent draw per node (accept.sample_accept's choices)
        st.bonus = sample_choices(st.logits, p.temperature, p.top_p, req.gen)
    st.acc = walk(st.vtree, st.bonus, max_depth=st.dw)
    emitted = st.acc.emitted()
    st.n_acc = len(emitted) - 1
    c["accepted_tokens"] += st.n_acc
    c["accept_hist"].append(st.n_acc)
    path = st.acc.path[1 : st.n_acc + 1]
    st.path_src = st.src[st.kept[path]].tolist() if st.src is not None else [SOURCE_DRAFTER] * st.n_acc
    for x in st.path_src:
        c["by_source"][SOURCE_NAMES[x]] += 1
    return emitted


def emit(req: Request, new: list[int]) -> None:
    """The request's output (and lookup index) grows by ``new``; its callback hears them."""
    req.out.extend(new)
    if req.index is not None:
        req.index.extend(new)
    if req.on_tokens is not None and new:
        req.on_tokens(new)


def ahead(eng, req: Request, st: Step) -> int:
    """Ahead-of-time tail and head draft: the drafter over every verified node (tree-masked,
    one static-shape call) and a head row under each, so the next step's head is picked up at
    commit. Returns the room (the head rows at slots L + room + v); 0 when the context leaves
    none (the head then runs as a call next step)."""
    room = max(st.wv, st.dw + 1)
    if req.committed + room + st.wv > eng.n_slots - 1:
        return 0
    eng.drafter.ahead(st.vtree, st.anc, st.bonus, st.caps, room, st.L, eng.envelope.top_k)
    req.counters["ahead_calls"] += 1
    return room


def join(eng, req: Request, st: Step, pending) -> bool:
    """Wait for the worker; keep its draft if the acceptance returned the guessed path and bonus
    (True), else put the drafter's state back (the commit and the next draft then run in sequence)."""
    spec = eng.worker.result(pending)
    c = req.counters
    c["spec_steps"] += 1
    c["draft_calls"] += spec.calls
    c["spec_ms"] += spec.worker_ms
    if st.reason is None and spec.matches(st.acc.path.tolist(), st.n_acc, st.new[-1]):
        c["spec_hits"] += 1
        req.spec, req.ahead_head = spec, spec.head
        return True
    eng.drafter.restore(spec.snapshot)
    return False


def commit(eng, req: Request, st: Step) -> None:
    """Move the accepted path's KV to contiguous slots (target and drafter), keep features; the
    request's root moves past the emitted tokens."""
    if st.plain:
        req.synced = False  # a plain step: the drafter did not see its token
        for buf, x in zip(eng.feat_buf, st.caps):
            buf[req.committed] = x[0]
    elif st.reason is None:
        path = st.acc.path[1:]  # [dw] int64 verified-tree nodes of the accepted tokens (padded)
        dst = st.L + torch.arange(1, st.dw + 1)  # [dw] int64 their contiguous slots
        steps.commit(eng.target, st.L + path[: st.n_acc], dst[: st.n_acc])
        feats = tuple(x[st.acc.path] for x in st.caps)  # each [dw + 1, H]
        commit_drafter(eng, req, st, path, dst, feats)
        if req.keep_feats:
            rows = st.L + torch.arange(st.dw + 1)
            for buf, x in zip(eng.feat_buf, feats):
                buf.index_copy_(0, rows, x)
    if not st.drafted:
        req.ahead_head = None  # the drafter fell behind: its next head runs as a call
    req.h_root = st.hidden[st.acc.path[st.n_acc]] if st.acc is not None else st.hidden[0]
    req.committed += 1 + st.n_acc


def commit_drafter(eng, req: Request, st: Step, path: torch.Tensor, dst: torch.Tensor,
                   feats: tuple[torch.Tensor, ...]) -> None:
    """The drafter's side of the commit: the accepted path's rows to ``dst`` [dw] int64."""
    if st.room:  # the ahead call holds every verified node: keep the path and the leaf's head
        req.ahead_head = eng.drafter.take(path, st.acc.n_accepted, st.room, st.L, eng.envelope.top_k)
    elif st.hit:
        pass  # the worker committed the guessed path inside the drafter
    elif st.drafted:
        # a lookup-only node has no drafter state: its move is a no-op, and a drafter whose
        # commit keeps its own KV catches up from it before its next step
        g = st.kept[path]
        own = st.src[g] != SOURCE_LOOKUP if st.src is not None else torch.ones_like(g, dtype=torch.bool)
        eng.drafter.commit(torch.where(own, st.L + g, dst), dst, st.vtree.token[st.acc.path],
                           st.acc.n_accepted, feats)
        if eng.drafter.feeds_leaves and SOURCE_LOOKUP in st.path_src:
            req.synced, req.sync_from = False, req.committed + 1 + st.path_src.index(SOURCE_LOOKUP)
    else:
        req.synced = False  # a lookup-only step: the drafter did not see these tokens
