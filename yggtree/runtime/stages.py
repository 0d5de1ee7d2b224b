"""The stages of one decode step, each a function of the engine, the request and the step.

A stage reads the products of earlier stages from the :class:`Step` and writes its own there
(its inputs and outputs are declared in :data:`yggtree.runtime.schedule.NEEDS`); the scheduler
runs an execution plan's stages in order, timing each with one stage timer. A stage with nothing
to do this step (no drafting on a plain step, no lookup index) returns at once::

    lookup   propose lookup candidates from the request's text            -> prop
    choose   the policy's (D, W_d) (sees the lookup candidates first)      -> d, wd
    resync   re-absorb into the drafter what plain steps skipped           (drafter state)
    head     the drafter's top-k at the root (or the ahead-of-time pick-up) -> head
    refine   the policy's second look at (D, W_d), given the head          -> d, wd
    draft    D levels of EGT select + drafter step                        -> tree
    merge    the lookup chains join the tree                               -> tree, src
    size     the policy's W_v for this tree                                -> wv
    prune    keep the W_v best nodes (a connected subtree), tree mask      -> vtree, anc
    verify   the target over the verified tree                             -> logits, caps
    accept   the target's choice at every node, the accepted walk, emit    -> acc, new
    ahead    the drafter over every verified node + a head row under each  (drafter state)
    fork     the next step's head and draft start on the drafter's worker  -> pending
    join     the worker's draft is kept if the guessed path was accepted    -> hit (drafter state)
    commit   the accepted path to contiguous slots (target, drafter)       (caches)

A plain step (D = 0, nothing looked up) is the same machinery over the root alone: only verify,
accept and commit do anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import YggError
from ..shapes import SamplingParams
from . import steps
from .accept import Accepted, argmax, filter_probs, sample_choices, truncate, walk
from .drafters import TopK
from .egt import draft_tree
from .lookup import LookupIndex, Proposal, propose
from .merge import SOURCE_DRAFTER, SOURCE_LOOKUP, SOURCE_NAMES, merge_lookup, root_tree
from .overlap import Speculation, fits, guess_path, speculate
from .policy import StepChoice, StepPolicy
from .prune import prune_lists, prune_topk, subtree
from .tree import Tree, ancestor_mask, check_invariants


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
    """One step's products, written by the stages in plan order."""

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
    acc: Accepted | None = None
    n_acc: int = 0
    path_src: list[int] = field(default_factory=list)  # who proposed each accepted node
    new: list[int] = field(default_factory=list)  # tokens emitted this step
    reason: str | None = None  # "stop" | "length" once decoding ends
    room: int = 0  # > 0: the ahead call ran, its head rows at slots L + room + v
    pending: object = None  # the worker's job under way (a Future of a Speculation)
    hit: bool = False  # the worker's guess was accepted: it committed the path in the drafter

    @property
    def drafted(self) -> bool:
        return self.d > 0

    @property
    def plain(self) -> bool:
        return self.vtree is None


def choose_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's next token from logits [V]: argmax, or one multinomial draw."""
    if params.temperature == 0:
        return int(argmax(logits))
    probs = filter_probs(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probs, 1, generator=gen))


# ----------------------------------------------------------------------------- stages


def lookup(eng, req: Request, st: Step) -> None:
    if req.index is not None:
        st.prop = propose(req.index, eng.lookup_calib, eng.cfg.lookup, eng.lookup_depth)


def choose(eng, req: Request, st: Step) -> None:
    behind = 0 if req.synced or eng.drafter is None else req.committed - req.sync_from
    req.policy.see_catch_up(behind, req.params.max_new_tokens - len(req.out))
    req.policy.see_lookup(st.prop, req.committed)
    c = req.policy.choose_draft(req.h_root, req.committed)
    eng.envelope.check_draft(c.draft_depth, c.draft_width)
    st.d, st.wd = c.draft_depth, c.draft_width


def resync(eng, req: Request, st: Step) -> None:
    """Absorb into the drafter the committed sequence from ``sync_from`` (it holds what is
    below), when plain or lookup-only steps left it behind."""
    if not st.drafted or req.synced:
        return
    seq = torch.tensor(list(req.prompt_ids) + req.out[:-1], dtype=torch.int64)
    eng.drafter.prefill(seq, tuple(buf[: req.committed] for buf in eng.feat_buf), req.sync_from)
    req.counters["resyncs"] += 1
    req.synced, req.ahead_head = True, None


def head(eng, req: Request, st: Step) -> None:
    if not st.drafted:
        return
    req.sync_from = req.committed  # this step's root: the drafter will hold everything below it
    if req.ahead_head is not None:  # picked up from the previous step's ahead call
        st.head, req.ahead_head = req.ahead_head, None
    else:
        st.head = eng.drafter.head(st.root, st.L, eng.envelope.top_k)


def refine(eng, req: Request, st: Step) -> None:
    if not st.drafted:
        return
    c = req.policy.after_head(req.h_root, st.head.logp[0], StepChoice(st.d, st.wd), req.committed)
    eng.envelope.check_draft(c.draft_depth, c.draft_width)
    if c.draft_depth == 0:
        raise YggError("a policy chose a plain step after the drafter's head ran")
    st.d, st.wd = c.draft_depth, c.draft_width


def draft(eng, req: Request, st: Step) -> None:
    """D levels: EGT picks W_d nodes, the drafter proposes the top-k children of each (or the
    tree the worker drafted from an accepted guess, when the choice is the one it drafted)."""
    spec, req.spec = req.spec, None
    if not st.drafted:
        if len(st.prop):  # lookup-only: the chains hang from the root alone
            st.tree = root_tree(st.root)
        return
    if spec is not None and (spec.d, spec.wd) == (st.d, st.wd) and st.head is spec.head:
        st.tree = spec.tree
        return
    st.tree, calls = draft_tree(eng.drafter, st.root, st.head, st.d, st.wd, st.L, eng.envelope.top_k)
    req.counters["draft_calls"] += calls + 1  # + the head


def merge(eng, req: Request, st: Step) -> None:
    if len(st.prop):  # one tree: the lookup chains join the drafted nodes (or the root)
        logq = [req.policy.lookup_logq(p) for p in st.prop.edge]
        st.tree, st.src = merge_lookup(st.tree, st.prop, logq, eng.cfg.lookup)


def size(eng, req: Request, st: Step) -> None:
    if st.drafted or st.src is not None:  # a plain step verifies the root alone, unasked
        st.wv = req.policy.choose_verify(st.tree, StepChoice(st.d, st.wd), req.committed)
        eng.envelope.check_verify(st.wv)
    if not st.drafted and st.wv == 1:
        st.src = None


def prune(eng, req: Request, st: Step) -> None:
    if st.wv == 1 and not st.drafted:
        return  # a plain step
    if not st.drafted:
        req.counters["lookup_steps"] += 1
    st.dw = max(st.d, st.prop.max_depth)
    check = eng.cfg.mode == "reference"
    if check:
        check_invariants(st.tree)
    if st.tree.token.device.type == "cpu":  # the same, as lists: fewer microseconds on a CPU
        st.kept, st.kept_valid, st.vtree, st.anc = prune_lists(st.tree, st.tree.logp, st.wv, st.dw)
    else:
        st.kept, st.kept_valid = prune_topk(st.tree, st.tree.logp, st.wv)
        st.vtree = subtree(st.tree, st.kept, st.kept_valid)
        st.anc = ancestor_mask(st.vtree.parent, st.vtree.depth, st.vtree.valid, st.dw)
    if check:
        check_invariants(st.vtree)


def verify(eng, req: Request, st: Step) -> None:
    """The target over the verified tree (the root alone on a plain step)."""
    layers = eng.drafter.target_layers if eng.drafter is not None else ()
    if st.plain:
        zero = torch.zeros(1, dtype=torch.int64)
        tokens, depth, node, anc = st.root.reshape(1), zero, zero, torch.ones(1, 1, dtype=torch.bool)
    else:
        tokens, depth, node, anc = st.vtree.token, st.vtree.depth, torch.arange(st.wv), st.anc
    st.logits, st.hidden, st.caps = eng.graphs.tree_step(
        tokens, depth, node, anc, st.L, layers, eng.graphs.bucket(req.committed + st.wv)
    )
    req.counters["verify_calls"] += 1


def accept(eng, req: Request, st: Step) -> None:
    """The target's choice at every node, the walk down the tree, the emission."""
    p, c = req.params, req.counters
    if st.plain:
        emitted = [choose_token(st.logits[0], p, req.gen)]
        c["plain_steps"] += int(eng.cfg.tree is not None)
        c["accept_hist"].append(0)
    else:
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
    st.new, st.reason = truncate(emitted, eng.eos_ids, p.max_new_tokens - len(req.out))
    req.out.extend(st.new)
    if req.index is not None:
        req.index.extend(st.new)
    if req.on_tokens is not None and st.new:
        req.on_tokens(st.new)


def ahead(eng, req: Request, st: Step) -> None:
    """Ahead-of-time tail and head draft: the drafter over every verified node (tree-masked,
    one static-shape call) and a head row under each, so the next step's head is picked up at
    commit. Skipped when decoding ends or the context leaves no room for the head rows."""
    if not st.drafted or st.reason is not None:
        return
    room = max(st.wv, st.dw + 1)
    if req.committed + room + st.wv > eng.n_slots - 1:
        return  # near the end of the context: the head runs as a call next step
    st.room = room
    eng.drafter.ahead(st.vtree, st.anc, st.bonus, st.caps, room, st.L, eng.envelope.top_k)
    req.counters["ahead_calls"] += 1


def fork(eng, req: Request, st: Step) -> None:
    """Start drafting the next step on the drafter's worker, from the verified path the drafter
    scores highest (runtime/overlap.py); the target verifies meanwhile."""
    if not st.drafted or eng.worker is None:
        return
    guess = guess_path(st.vtree, st.kept, st.src)
    if fits(req.committed, guess.n, st.d, st.wd, eng.n_slots):
        st.pending = eng.worker.submit(speculate, eng.drafter, guess, st.L, st.d, st.wd,
                                       eng.envelope.top_k, eng.n_slots)


def join(eng, req: Request, st: Step) -> None:
    """Wait for the worker; keep its draft if the acceptance returned the guessed path and bonus,
    else put the drafter's state back (the commit and the next draft then run in sequence)."""
    if st.pending is None:
        return
    spec, st.pending = eng.worker.result(st.pending), None
    c = req.counters
    c["spec_steps"] += 1
    c["draft_calls"] += spec.calls
    c["spec_ms"] += spec.worker_ms
    if st.reason is None and spec.matches(st.acc.path.tolist(), st.n_acc, st.new[-1]):
        c["spec_hits"] += 1
        st.hit, req.spec, req.ahead_head = True, spec, spec.head
    else:
        eng.drafter.restore(spec.snapshot)


def commit(eng, req: Request, st: Step) -> None:
    """Move the accepted path's KV to contiguous slots (target and drafter), keep features."""
    if st.reason is None and not st.plain:
        path = st.acc.path[1:]  # [dw] local verify-tree nodes of the accepted tokens (padded)
        dst_off = torch.arange(1, st.dw + 1)
        steps.commit(eng.target, st.L + path, st.L + dst_off)
        feats = tuple(x[st.acc.path] for x in st.caps)
        if st.room:  # the ahead call holds every verified node: keep the path and the leaf's head
            req.ahead_head = eng.drafter.take(path, st.acc.n_accepted, st.room, st.L, eng.envelope.top_k)
        elif st.hit:
            pass  # the worker committed the guessed path inside the drafter
        elif st.drafted:
            # a lookup-only node has no drafter state: its move is a no-op, and a drafter whose
            # commit keeps its own KV catches up from it before its next step
            g = st.kept[path]
            own = st.src[g] != SOURCE_LOOKUP if st.src is not None else torch.ones_like(g, dtype=torch.bool)
            eng.drafter.commit(
                torch.where(own, st.L + g, st.L + dst_off), st.L + dst_off, st.vtree.token[st.acc.path],
                st.acc.n_accepted, feats,
            )
            if eng.drafter.feeds_leaves and SOURCE_LOOKUP in st.path_src:
                req.synced, req.sync_from = False, req.committed + 1 + st.path_src.index(SOURCE_LOOKUP)
        else:
            req.synced = False  # a lookup-only step: the drafter did not see these tokens
        if req.keep_feats:
            rows = st.L + torch.arange(st.dw + 1)
            for buf, x in zip(eng.feat_buf, feats):
                buf.index_copy_(0, rows, x)
    elif st.plain:
        req.synced = False
        for buf, x in zip(eng.feat_buf, st.caps):
            buf[req.committed] = x[0]
    if not st.drafted:
        req.ahead_head = None  # the drafter fell behind: its next head runs as a call
    n = 1 + st.n_acc
    req.h_root = st.hidden[st.acc.path[st.n_acc]] if st.acc is not None else st.hidden[0]
    req.committed += n


STAGE_FNS: dict[str, Callable[[object, Request, Step], None]] = {
    "lookup": lookup, "choose": choose, "resync": resync, "head": head, "refine": refine,
    "draft": draft, "merge": merge, "size": size, "prune": prune, "verify": verify,
    "accept": accept, "ahead": ahead, "fork": fork, "join": join, "commit": commit,
}
