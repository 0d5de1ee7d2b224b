"""Drafters: the method-neutral interface the decode loop talks to, and its implementations.

The loop (see engine.py) drives a drafter through one speculation step like this::

    head(root, committed, feats)        -> top-k children of the root        (1 input)
    step(tokens, depth, node, anc, ...) -> top-k children of W_d tree nodes  (W_d inputs) x D
    commit(src, dst, ...)               -> keep the accepted path, drop the rest

Tree node j of the step's draft tree lives in the drafter's cache at slot ``committed + j``
(the root is node 0), exactly as in the target's cache, so committing the accepted path is the
same static gather on both sides. A drafter that reads target hidden states declares the layers
in ``target_layers``; the loop then passes the target's features for the committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import YggError
from . import steps
from .graphs import Graphs
from .model import Transformer
from .tree import Tree


@dataclass(frozen=True)
class TopK:
    """The drafter's proposal for each fed node."""

    token: torch.Tensor  # [W, k] int64, top-k next tokens (best first)
    logp: torch.Tensor  # [W, k] float32, their drafter log-probabilities


class Drafter(Protocol):
    """What the decode loop needs from any drafter."""

    vocab_size: int
    target_layers: tuple[int, ...]  # target hidden states it reads (empty: none)
    # True: ``commit`` needs the drafter's own state (KV) of every drafted node, so the engine
    # feeds the last level too; False: the last level's feed is skipped, its proposals (the
    # children of the last level) are never picked, so a D-deep tree costs the head + D - 1 steps
    feeds_leaves: bool
    # the most tokens a resumed catch-up may leave to the next head call (``defer``; 0: none)
    absorbs: int

    def setup(self, n_slots: int, widths: list[int], prefill_chunk: int, threads: int | None = None) -> None:
        """Allocate state for ``n_slots`` cache slots and build graphs for these input widths
        and the prefill chunk, at ``threads`` intra-op threads (None: the calling thread's)."""

    def warm_up(self, widths: list[int], threads: int | None = None) -> None:
        """Build the graphs of these input widths (and of the head) at ``threads`` intra-op
        threads (None: the calling thread's count) after :meth:`setup`; compiled graphs are
        guarded on the count they were built at. The overlap worker calls it on its own thread
        for the speculation job's widths."""

    def prefill(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int = 0) -> None:
        """Absorb the prompt ([n] int64; feats: target layers [n, H] each, or ()).

        ``start`` > 0 resumes: the drafter already holds ``prompt[:start]`` from an earlier
        prefill or drafted step (the engine passes the root position of its last drafted step
        when it re-syncs after plain steps); implementations may redo some positions before it."""

    def defer(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int) -> None:
        """``prefill(prompt, feats, start)``'s catch-up left to the next :meth:`head` call, which
        takes the ``n - start`` (<= ``absorbs``) tokens in with the root; only where ``absorbs`` > 0."""

    def absorb(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int, k: int) -> None:
        """``prefill(prompt, feats, start)``'s catch-up in head calls of ``absorbs`` + 1 tokens
        each (top-k ``k``, unused), the rest left to the next :meth:`head` call as :meth:`defer`
        leaves it; only where ``absorbs`` > 0."""

    def head(self, root: torch.Tensor, committed: torch.Tensor, k: int) -> TopK:
        """Feed the root (last emitted token, [] int64) at position ``committed``: [1, k]."""

    def step(
        self,
        tokens: torch.Tensor,  # [W] int64
        depth: torch.Tensor,  # [W] int64
        node: torch.Tensor,  # [W] int64 tree node index
        parent: torch.Tensor,  # [W] int64 tree node index of each input's parent (root: 0)
        anc: torch.Tensor,  # [W, N] bool visibility over the tree
        committed: torch.Tensor,  # [] int64
        k: int,
    ) -> TopK:
        """Feed W tree nodes at once and return the top-k children of each."""

    def commit(
        self,
        src: torch.Tensor,  # [D] int64 cache slots of the accepted draft nodes (padded)
        dst: torch.Tensor,  # [D] int64 their committed slots
        path_tokens: torch.Tensor,  # [D+1] int64 root, accepted tokens, then padding
        n_accepted: torch.Tensor,  # [] int64 accepted draft tokens (0..D)
        feats: tuple[torch.Tensor, ...],  # target layers at the path nodes, each [D+1, H]
    ) -> None:
        """Keep the accepted path (slot ``src[i]`` -> ``dst[i]``) and drop the rest of the tree.

        Called only when decoding continues; the next ``head`` gets the bonus token as root."""

    def ahead(
        self,
        tree: Tree,  # the verified tree (W nodes, root 0 at slot ``committed``, locally indexed)
        anc: torch.Tensor,  # [W, W] bool ancestor-or-self mask of ``tree``
        bonus: torch.Tensor,  # [W] int64 the target's choice at every node (the bonus if it is the leaf)
        feats: tuple[torch.Tensor, ...],  # target layers at every node, each [W, H]
        room: int,  # head rows go to slots committed + room + v (room > the deepest path)
        committed: torch.Tensor,  # [] int64
        k: int,
    ) -> None:
        """Ahead-of-time tail and head draft in one call of static width 2W: every verified
        node's own entry at slot ``committed + v`` (the tail), and for every node the next
        step's head as if it were the accepted leaf with ``bonus[v]`` as the next root, at slot
        ``committed + room + v``. :meth:`take` returns the accepted leaf's proposals."""

    def take(
        self,
        path: torch.Tensor,  # [D] int64 local nodes of the accepted draft tokens (padded)
        n_accepted: torch.Tensor,  # [] int64
        room: int,
        committed: torch.Tensor,  # [] int64
        k: int,
    ) -> TopK:
        """After :meth:`ahead`: keep the accepted path's tail entries (slot ``committed +
        path[i]`` -> ``committed + 1 + i``) and the accepted leaf's head row (-> the next root's
        slot ``committed + 1 + n_accepted``); the rest is dropped. Returns the next step's head
        ([1, k], the leaf's head row): it is picked up, not called."""

    def snapshot(self, lo: int, hi: int) -> "Snapshot":
        """Copies of the state a speculation may overwrite: cache slots ``lo..hi-1`` and any
        per-step state (the overlap plan's worker takes it before :meth:`speculate`)."""

    def restore(self, snap: "Snapshot") -> None:
        """Put back what :meth:`snapshot` copied (a speculation that was not used)."""

    def speculate(
        self,
        tokens: torch.Tensor,  # [n+1] int64 the guessed path's tokens, root first
        nodes: torch.Tensor,  # [n+1] int64 their drafted-tree nodes (slots committed + node)
        n: int,  # guessed accepted tokens
        committed: torch.Tensor,  # [] int64 this step's root position
        k: int,
    ) -> TopK:
        """From the drafter's own state alone (no target features: the target is verifying),
        leave the drafter as a commit of the guessed path would, with the path's leaf (position
        ``committed + n``) as the last token it holds, ready for ``head(bonus, committed + n +
        1)``; return the leaf's top-k ([1, k]), from which the bonus is guessed."""

    def frozen(self, threaded: bool = False):
        """Context manager for the decode loop (no compiles allowed in compiled mode);
        ``threaded``: the drafter runs on a worker thread beside the decoding thread
        (:meth:`Graphs.frozen`)."""


@dataclass(frozen=True)
class Snapshot:
    """Copies of a drafter's state that a speculation may overwrite (:meth:`Drafter.snapshot`)."""

    lo: int  # first cache slot copied
    rows: torch.Tensor  # [L, 2, B, H, hi - lo, D] the slots lo..hi-1 of every layer's keys and values
    state: tuple[torch.Tensor, ...]  # copies of the drafter's per-step tensors (their own shapes)


def take_snapshot(store, lo: int, hi: int, state: tuple[torch.Tensor, ...]) -> Snapshot:
    """Copies of slots lo..hi-1 of every layer of ``store`` (a KVStore) and of ``state``."""
    return Snapshot(lo, store.kv[:, :, :, :, lo:hi].clone(), tuple(x.clone() for x in state))


def put_back(store, snap: Snapshot, state: tuple[torch.Tensor, ...]) -> None:
    store.kv[:, :, :, :, snap.lo : snap.lo + snap.rows.shape[4]].copy_(snap.rows)
    for x, y in zip(state, snap.state):
        x.copy_(y)


def topk_logp(logits: torch.Tensor, k: int) -> TopK:
    """[W, V] logits -> top-k tokens and log-probabilities."""
    lp = torch.log_softmax(logits, dim=-1)
    val, idx = torch.topk(lp, k, dim=-1)
    return TopK(idx, val)


class LMDrafter:
    """A standalone causal LM sharing the target's tokenizer (Yggdrasil's setting).

    ``LMDrafter(target.shared_copy())`` is the self-drafter used by tests: the target drafting for
    itself, so every greedy draft on the kept path must be accepted.
    """

    target_layers: tuple[int, ...] = ()
    feeds_leaves = True  # commit moves the accepted nodes' KV entries, the last level's included
    absorbs = 0  # its head call takes in no catch-up (Drafter.defer)

    def __init__(self, model: Transformer, mode: str) -> None:
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        self.graphs = Graphs(model, mode)
        self.ahead_logits: torch.Tensor | None = None  # [W, V] head rows of the last ahead call

    def setup(self, n_slots: int, widths: list[int], prefill_chunk: int, threads: int | None = None) -> None:
        if self.model.cache_slots != n_slots:
            self.model.setup_cache(1, n_slots)
            self.graphs.reset()
        self.graphs.warm_up(widths, prefill=prefill_chunk, threads=threads)
        self.chunk = prefill_chunk

    def warm_up(self, widths: list[int], threads: int | None = None) -> None:
        self.graphs.warm_up(widths, threads=threads)

    def prefill(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int = 0) -> None:
        chunk = self.chunk
        n = prompt.shape[0]
        first = (start // chunk) * chunk  # the chunk grid of a full prefill: the same graphs
        for start in range(first, n, chunk):
            part = prompt[start : start + chunk]
            pad = torch.zeros(chunk, dtype=torch.int64, device=prompt.device)
            pad[: part.shape[0]] = part
            self.graphs.prefill_chunk(
                pad[None],
                torch.tensor(start),
                torch.tensor(part.shape[0]),
                (),
                self.graphs.bucket(start + chunk, chunk),
            )

    def head(self, root: torch.Tensor, committed: torch.Tensor, k: int) -> TopK:
        zero = torch.zeros(1, dtype=torch.int64, device=root.device)
        anc = torch.ones(1, 1, dtype=torch.bool, device=root.device)
        n_ctx = self.graphs.bucket(int(committed) + 1, 1)
        logits, _, _ = self.graphs.tree_step(root.reshape(1), zero, zero, anc, committed, (), n_ctx)
        return topk_logp(logits, k)

    def step(self, tokens, depth, node, parent, anc, committed, k: int) -> TopK:
        n_ctx = self.graphs.bucket(int(committed) + anc.shape[1], tokens.shape[0])
        logits, _, _ = self.graphs.tree_step(tokens, depth, node, anc, committed, (), n_ctx)
        return topk_logp(logits, k)

    def commit(self, src, dst, path_tokens, n_accepted, feats) -> None:
        steps.commit(self.model, src, dst)

    def ahead(self, tree, anc, bonus, feats, room, committed, k: int) -> TopK:
        ext, node, depth = ahead_layout(tree, anc, room)
        tokens = torch.cat([tree.token, bonus])
        n_ctx = self.graphs.bucket(int(committed) + ext.shape[1], tokens.shape[0])
        logits, _, _ = self.graphs.tree_step(tokens, depth, node, ext, committed, (), n_ctx)
        self.ahead_logits = logits[tree.token.shape[0]:]  # [W, V] the head rows' (in the graph)

    def take(self, path, n_accepted, room, committed, k: int) -> TopK:
        take_path(self.model.kv, path, n_accepted, room, committed)
        return topk_logp(self.ahead_logits.index_select(0, path[-1:]), k)

    def snapshot(self, lo: int, hi: int) -> Snapshot:
        return take_snapshot(self.model.kv, lo, hi, ())

    def restore(self, snap: Snapshot) -> None:
        put_back(self.model.kv, snap, ())

    def speculate(self, tokens, nodes, n: int, committed, k: int) -> TopK:
        """Move the path's entries to contiguous slots (as :meth:`commit`), then a head call at
        the leaf rewrites its entry (the same values) and gives its top-k."""
        if n:
            steps.commit(self.model, committed + nodes[1:], committed + torch.arange(1, n + 1, device=nodes.device))
        return self.head(tokens[n], committed + n, k)

    def frozen(self, threaded: bool = False):
        return self.graphs.frozen(threaded)


def ahead_layout(tree: Tree, anc: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ahead-of-time call's 2W rows as one tree: rows 0..W-1 the verified nodes (node v at
    tree slot v), rows W..2W-1 a head candidate under every node (at tree slot room + v, one
    level deeper, seeing its node's ancestors and itself). Returns the visibility [2W, room + W]
    bool, the tree slot [2W] int64 and the depth [2W] int64 of every row."""
    w = tree.token.shape[0]
    ar = torch.arange(w, device=anc.device)
    ext = torch.zeros(2 * w, room + w, dtype=torch.bool, device=anc.device)
    ext[:w, :w] = anc
    ext[w:, :w] = anc
    ext[w + ar, room + ar] = True
    node = torch.cat([ar, room + ar])
    depth = torch.cat([tree.depth, tree.depth + 1])
    return ext, node, depth


def take_path(store, path: torch.Tensor, n_accepted: torch.Tensor, room: int, committed: torch.Tensor) -> None:
    """Move the accepted path's entries (slot committed + path[i] -> committed + 1 + i) and then
    the leaf's head row (slot committed + room + leaf -> committed + 1 + n_accepted) in every
    layer of ``store`` (a :class:`~yggtree.runtime.kv_cache.KVStore`). ``room`` > len(path), so
    the first move never overwrites a head row."""
    dst = committed + torch.arange(1, path.shape[0] + 1, device=path.device)
    leaf = path[-1:]  # [1] (the path is padded with its last node: the leaf, or the root)
    store.move((committed + path)[None], dst[None])
    store.move((committed + room + leaf)[None], (committed + 1 + n_accepted).reshape(1, 1))


def check_pair(target_vocab: int, drafter_vocab: int, target_tok, drafter_tok, where: str) -> None:
    """Refuse a drafter whose vocabulary or tokenizer differs from the target's."""
    if target_vocab != drafter_vocab:
        raise YggError(
            f"drafter {where} has vocabulary size {drafter_vocab}, the target has {target_vocab}"
        )
    if target_tok is not None and drafter_tok is not None:
        if target_tok.get_vocab() != drafter_tok.get_vocab():
            raise YggError(f"drafter {where} uses a different tokenizer than the target")
