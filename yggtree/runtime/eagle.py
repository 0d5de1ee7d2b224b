"""A feature-conditioned drafter (EAGLE-1 style) behind the method-neutral ``Drafter`` interface.

The drafter reads the target's hidden states. Its input at draft position ``p`` is the pair
``(t_{p+1}, f_p)``: the token at target position ``p+1`` and the target's feature at ``p`` (by
default the output of the target's last decoder layer). One fused input, N decoder layers
(``num_layers``, 1 by default), a vocabulary projection::

    x        = fc(cat(embed(t_{p+1}), f_p))          Linear 2H -> H (bias)
    f̂_{p+1}  = Block_N(... Block_1(x))              Llama decoder layers, each with its own KV cache
    q(t_{p+2}) = softmax(lm_head(norm(f̂_{p+1})))     over the draft vocabulary (V_d ids)

``f̂_{p+1}`` is the drafter's own guess of the target's feature at ``p+1``; inside a draft tree a
node's token is paired with its *parent's* predicted feature. With several target layers their
features are concatenated and reduced to H by a bias-free Linear first (as EAGLE-3 does).

Slot layout (batch 1). The pair whose token sits at target position ``s`` lives in the drafter's
caches (every layer's, as in the target) at slot ``s`` with RoPE position ``s - 1``; slot 0 (token 0 has no preceding feature) is
never written nor attended, the last slot ``S-1`` is scratch. So tree node ``j`` sits at slot
``committed + j`` exactly as in the target, and the root (``t_L`` paired with ``f_{L-1}``) at
slot ``L``::

    target positions  0    1    2   ...  L-1    L (root)   L+1 ...  (tree)
    drafter slot           1    2   ...  L-1    L          L+j
    drafter pair          (t1,f0)(t2,f1) ...    (tL,f_{L-1}) (t_j, f̂_parent(j))

Feature alignment (the EAGLE recompute). Drafting writes the tree's entries with *predicted*
features. After acceptance of ``a`` draft tokens at root position ``L`` the true features
``f_L .. f_{L+a}`` are known (the verify pass captured them), so :meth:`EagleDrafter.commit`
stores the pending pairs ``(t_{L+i+1}, f_{L+i})`` for ``i = 0..a``; the last token is the bonus,
which arrives as the next root. The next :meth:`EagleDrafter.head` feeds all of them in one call
of fixed width ``D_max + 1`` (padded rows go to the scratch slot and see only it), overwriting
slots ``L+1 .. L+a+1`` with entries computed from true features. Hence commit moves no KV at all:
every accepted slot is rewritten, and the drafted entries beyond are unreachable by the mask.

Static shapes: head has width ``D_max + 1``, a step has width ``W_d``, prefill the chunk width
``C``; the accepted count is a tensor and only ever used through masks and gathers (no host sync).

Whole calls. A head or draft call is a function of tensors (:func:`head_call`, :func:`step_call`:
mask, embedding, fc, the layers, norm, LM head, top-k). A compiled plan holds each as one
AOTInductor package per width (runtime/aoti.py, "Drafter-call packages"), which the drafter runs
once installed (``calls``); eagerly, the same functions run op by op around the blocks' packages
(most of a one-row call's time).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import YggError
from ..files import read_json
from .drafters import Snapshot, TopK, ahead_layout, put_back, take_path, take_snapshot
from .eagle_config import CONFIG_FILE, WEIGHTS_FILE, EagleConfig, check_vocab_map
from .graphs import Graphs
from .kv_cache import KVCache, KVStore
from .loading import read_safetensors
from .model import Block, RMSNorm, Transformer, embedding, rope_table, row_window, rows_path
from .steps import tree_mask

__all__ = ["EagleNet", "EagleDrafter", "save_eagle", "load_eagle"]



# ----------------------------------------------------------------------------- the network


class EagleNet(nn.Module):
    """fc + ``num_layers`` decoder layers + norm + LM head over the draft vocabulary, with a static
    KV cache per layer.

    ``layers`` is a ModuleList as in :class:`~yggtree.runtime.model.Transformer`, so
    :class:`~yggtree.runtime.graphs.Graphs` compiles the blocks regionally exactly as it does the
    target's blocks.
    """

    def __init__(self, cfg: EagleConfig, shared_embed: nn.Embedding | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        if cfg.shares_embedding:
            if shared_embed is None:
                raise ValueError("EagleNet: shares_embedding needs the target's embed_tokens")
            # a plain attribute, not a submodule: no copy, and not part of the head's state dict
            self.__dict__["shared_embed"] = shared_embed
        else:
            self.embed_tokens = embedding(cfg.vocab_size, h)
        n_feat = len(cfg.target_layers)
        if n_feat > 1:
            self.reduce = nn.Linear(n_feat * cfg.target_hidden_size, h, bias=False)
        if cfg.input_norm:
            # SmolLM2's features carry a few outlier dimensions (mean |f| ~500 against a median
            # ~17): normalising both inputs keeps them from swamping fc, and makes the head's
            # own predicted feature (fed back at depth >= 1) scale-free
            self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.feat_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(Block(cfg.layer_config()) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # draft id -> target id; persistent, saved with the weights. Built on the meta device (to
        # load weights over it) an empty stand-in: a meta arange would import torch's reference ops
        n = cfg.draft_vocab_size
        meta = torch.get_default_device().type == "meta"
        self.register_buffer("draft_vocab", torch.empty(n, dtype=torch.int64) if meta else torch.arange(n),
                             persistent=True)
        self.register_buffer("rope", torch.zeros(0, cfg.head_dim // 2, 2), persistent=False)
        self.cache_slots = 0

    @property
    def embed_weight(self) -> torch.Tensor:
        if self.cfg.shares_embedding:
            return self.__dict__["shared_embed"].weight
        return self.embed_tokens.weight

    def setup_cache(self, n_slots: int) -> None:
        p = self.norm.weight  # (a float parameter in every weight format; fc may be quantized)
        lc = self.cfg.layer_config()
        self.kv = KVStore.zeros(len(self.layers), 1, lc.num_kv_heads, n_slots, lc.head_dim, p.dtype, p.device)
        self.kv.attach(self.layers)
        self.rope = rope_table(lc, n_slots).to(p.device)
        self.cache_slots = n_slots

    def caches(self) -> list[KVCache]:
        return [b.self_attn.cache for b in self.layers]

    def fuse_target(self, feats: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Target features (one [..., H_t] per target layer) -> the head's features [..., H]."""
        self.check_features(feats)
        return self.fuse_joined(feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1))

    def check_features(self, feats: tuple[torch.Tensor, ...]) -> None:
        """YggError unless ``feats`` holds one tensor per target layer the head reads."""
        if len(feats) != len(self.cfg.target_layers):
            raise YggError(
                f"EAGLE drafter reads {len(self.cfg.target_layers)} target layers, got {len(feats)}"
            )

    def fuse_joined(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`fuse_target` of the target layers' features side by side, x [..., n H_t] -> [..., H]."""
        n = len(self.cfg.target_layers)
        if n == 1:
            return x
        if self.cfg.input_norm:  # parameter-free per-layer RMS scaling before the reduction
            per = x.view(*x.shape[:-1], n, -1)  # [..., n, H_t]: each layer's own scale, in one pass
            x = (per * torch.rsqrt(per.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)).view(x.shape)
        return self.reduce(x)

    def fuse_input(self, e: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """fc(cat(embedding, feature)) [..., H], both normalised first when ``input_norm``."""
        feat = feat.to(e.dtype)
        if self.cfg.input_norm:
            e, feat = self.embed_norm(e), self.feat_norm(feat)
        return self.fc(torch.cat([e, feat], dim=-1))

    def forward(
        self,
        tokens: torch.Tensor,  # [W] int64 target ids t_{p+1}
        feat: torch.Tensor,  # [W, H] features f_p (true or predicted)
        positions: torch.Tensor,  # [W] int64 RoPE positions p
        slots: torch.Tensor,  # [W] int64 cache slots to write
        mask: torch.Tensor,  # [W, S] bool
        embed: torch.Tensor | None = None,  # [V, H] the shared embedding as an input (None: its own)
    ) -> torch.Tensor:
        """The last layer's output f̂_{p+1} [W, H] (before the final norm). ``embed`` stands in
        for the shared embedding where it is a graph input (a drafter-call package's)."""
        cs = self.rope[positions[None]]  # [1, W, D/2, 2]
        cos, sin = cs[..., 0].unsqueeze(2), cs[..., 1].unsqueeze(2)
        e = F.embedding(tokens, self.embed_weight if embed is None else embed)  # [W, H]
        x = self.fuse_input(e, feat)[None]  # [1, W, H]
        slots, mask = slots[None], mask[None]
        if rows_path(self.layers[0].self_attn.invariant_rows, *slots.shape):
            # the rows' context split once, as the target's decoder does: its blocks take the same
            # inputs, so a block package serves either model
            window, mask = row_window(mask)
            slots = torch.cat([slots[..., None], window], -1)  # [1, W, 1 + T]
        for block in self.layers:
            x = block(x, cos, sin, slots, mask)
        return x[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_d] float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden)).float()

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that is stored in model.safetensors (the shared embedding is not)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


# ----------------------------------------------------------------------------- one drafter call


def topk_of(net: EagleNet, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of logits [W, V_d] as target ids [W, k] int64 and log-probabilities [W, k]."""
    lp = torch.log_softmax(logits, dim=-1)
    val, idx = torch.topk(lp, k, dim=-1)
    return net.draft_vocab[idx], val


def prefill_first(start: int, n: int, chunk: int) -> int:
    """The first slot a prefill of ``n`` tokens resuming at slot ``start`` redoes: the start of
    the full prefill's chunk grid (pairs at slots 1, 1 + chunk, ...) holding ``start``; its calls
    are ``range(prefill_first(...), n, chunk)``."""
    return min(1 + ((max(start, 1) - 1) // chunk) * chunk, max(n - 1, 1))


def head_widths(max_depth: int) -> tuple[int, ...]:
    """The widths a head call runs at (each a static shape) for a drafter of depth ``max_depth``:
    a call takes the fewest of these rows that hold its a + 1 pending pairs (a: the tokens
    accepted at the last step, at most D_max)."""
    return tuple(sorted({w for w in (1, 2, 4) if w <= max_depth} | {max_depth + 1}))


def block_widths(widths, heads, chunk: int, served) -> list[int]:
    """The widths among ``widths`` (the prefill ``chunk`` and the draft calls') and ``heads`` (the
    head calls') whose calls run the drafter's block graphs (pure): the prefill chunk, and every
    head or draft width whose call has no whole-call package (``served``: the (kind, W) pairs that
    have one). ``yggtree compile`` builds block packages for these widths only, and the warm-up
    calls only these."""
    need = set()
    for w in set(widths) | set(heads):
        roles = ({"head"} if w in heads else set()) | ({"draft"} if w in widths and w != chunk else set())
        if w == chunk or any((r, w) not in served for r in roles):
            need.add(w)
    return sorted(need)


def head_call(
    net: EagleNet,
    root: torch.Tensor,  # [] int64 the root token t_L
    committed: torch.Tensor,  # [] int64 L
    pend_tok: torch.Tensor,  # [D+1] int64 the pending tokens t_{L-a..L-1} (first a rows)
    pend_feat: torch.Tensor,  # [D+1, H] the pending features f_{L-a-1..L-1}, where not pend_true
    pend_raw: torch.Tensor,  # [D+1, n H_t] the target layers' features side by side, where pend_true
    pend_true: torch.Tensor,  # [D+1] bool the row's feature is the target's (fused here from pend_raw)
    pend_n: torch.Tensor,  # [] int64 a, the tokens accepted at the last step
    node_feat: torch.Tensor,  # [N, H] per-node f̂ (row 0, the root's, is written)
    k: int,
    embed: torch.Tensor | None = None,  # [V, H] the shared embedding (None: the net's own)
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`EagleDrafter.head` as a function of its tensors (what a head package computes): feed
    the pending pairs at slots L-a..L in one call of width D+1 (padded rows to the scratch slot,
    seeing only it), keep the root's f̂ in ``node_feat[0]``; the top-k at the root [1, k]. The
    target's features of the tokens the last step accepted are fused here, inside the call, rather
    than eagerly at the commit, where each of their eager ops ran right after the verify's weight
    stream had left the caches cold."""
    s = net.cache_slots
    i = torch.arange(pend_tok.shape[0], device=pend_tok.device)
    valid = i <= pend_n
    tok = torch.where(i < pend_n, pend_tok, root)
    tok = torch.where(valid, tok, 0)
    slot = committed - pend_n + i  # [D+1]; row a is the root at slot L
    slots = torch.where(valid, slot, s - 1)
    pos = torch.where(valid, slot - 1, 0)
    cols = torch.arange(s, device=pend_tok.device)
    mask = torch.where(
        valid[:, None],
        (cols[None, :] >= 1) & (cols[None, :] <= slot[:, None]),
        cols[None, :] == s - 1,
    )
    feat = torch.where(pend_true[:, None], net.fuse_joined(pend_raw).to(pend_feat.dtype), pend_feat)  # [D+1, H]
    out = net(tok, feat, pos, slots, mask, embed)  # [D+1, H]
    root_h = out.index_select(0, pend_n.reshape(1))  # [1, H] f̂_L
    node_feat.index_copy_(0, torch.zeros(1, dtype=torch.int64, device=node_feat.device), root_h)
    return topk_of(net, net.logits(root_h), k)


def step_call(
    net: EagleNet,
    tokens: torch.Tensor,  # [W] int64
    depth: torch.Tensor,  # [W] int64 tree depth of each fed node
    node: torch.Tensor,  # [W] int64 tree node of each (its slot: committed + node)
    parent: torch.Tensor,  # [W] int64 each one's parent node
    anc: torch.Tensor,  # [W, N] bool ancestor-or-self rows of the fed nodes
    committed: torch.Tensor,  # [] int64
    node_feat: torch.Tensor,  # [N', H] per-node f̂ (N' >= N; the fed nodes' rows are written)
    k: int,
    embed: torch.Tensor | None = None,  # [V, H] the shared embedding (None: the net's own)
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`EagleDrafter.step` as a function of its tensors (what a draft package computes):
    node j pairs its token with its parent's f̂; the top-k of every fed node [W, k]."""
    s = net.cache_slots
    feat = node_feat.index_select(0, parent)  # [W, H]
    cols = torch.arange(s, device=anc.device)
    mask = tree_mask(committed, anc, s) & (cols[None, :] >= 1)
    out = net(tokens, feat, committed + depth - 1, committed + node, mask, embed)  # [W, H]
    node_feat.index_copy_(0, node, out)
    return topk_of(net, net.logits(out), k)


# ----------------------------------------------------------------------------- the drafter


class EagleDrafter:
    """EAGLE-style feature-conditioned drafter implementing the :class:`Drafter` protocol.

    Build one with :meth:`random` (random weights, for tests) or :func:`load_eagle`. ``max_depth``
    (D_max) bounds the engine's draft depth: the head call has the static width ``D_max + 1``.
    """

    feeds_leaves = False  # commit rewrites accepted slots from the target's true features
    # each call as a function of tensors, which yggtree compile packages (runtime/aoti.py)
    call_fns = {"head": head_call, "draft": step_call}

    def __init__(self, net: EagleNet, target: Transformer, mode: str, max_depth: int = 8) -> None:
        if max_depth < 1:
            raise YggError(f"EAGLE max_depth must be >= 1, got {max_depth}")
        net.cfg.check_target(target.cfg, Path("<EAGLE drafter>"))
        self.net = net.eval().requires_grad_(False)
        self.cfg = net.cfg
        self.vocab_size = target.cfg.vocab_size
        self.target_layers = tuple(net.cfg.target_layers)
        self.max_depth = max_depth
        self.mode = mode
        self.graphs = Graphs(net, mode, scope="block")  # regional compile of the blocks in performance mode
        self.chunk = 0
        self._state_dev = net.norm.weight.device
        self.ahead_h: torch.Tensor | None = None  # [W, H] head rows' f̂ of the last ahead call
        self.ahead_f: torch.Tensor | None = None  # [W, H] fused true features at its nodes
        self.calls = None  # the head and draft calls as packages (aoti.DrafterCalls), once installed

    # ---------------------------------------------------------------- construction

    @classmethod
    def random(
        cls,
        target: Transformer,
        mode: str,
        max_depth: int = 8,
        draft_vocab: torch.Tensor | None = None,
        seed: int = 0,
        target_layers: tuple[int, ...] | None = None,
        shares_embedding: bool = True,
        intermediate_size: int | None = None,
        input_norm: bool = False,
        num_layers: int = 1,
    ) -> "EagleDrafter":
        """A head of ``num_layers`` decoder layers with random weights shaped for ``target`` (layer
        shapes copied from it)."""
        tc = target.cfg
        layers = (tc.num_layers - 1,) if target_layers is None else tuple(target_layers)
        v_d = tc.vocab_size if draft_vocab is None else int(draft_vocab.shape[0])
        cfg = EagleConfig(
            hidden_size=tc.hidden_size,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_heads=tc.num_heads,
            num_kv_heads=tc.num_kv_heads,
            head_dim=tc.head_dim,
            target_layers=layers,
            vocab_size=tc.vocab_size,
            draft_vocab_size=v_d,
            target_hidden_size=tc.hidden_size,
            target_num_layers=tc.num_layers,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=tc.rope_theta,
            rope_scaling=tc.rope_scaling,
            shares_embedding=shares_embedding,
            input_norm=input_norm,
            num_layers=num_layers,
        )
        cfg.check_target(tc, Path("<random EAGLE drafter>"))
        w = target.embed_tokens.weight
        rng = torch.random.fork_rng(devices=[])
        with rng:
            torch.manual_seed(seed)
            net = EagleNet(cfg, target.embed_tokens if shares_embedding else None)
        net = net.to(device=w.device, dtype=w.dtype)
        if draft_vocab is not None:
            check_vocab_map(draft_vocab, v_d, tc.vocab_size, Path("<draft_vocab argument>"))
            net.draft_vocab.copy_(draft_vocab.to(torch.int64))
        return cls(net, target, mode, max_depth)

    # ---------------------------------------------------------------- Drafter protocol

    def setup(self, n_slots: int, widths: list[int], prefill_chunk: int, threads: int | None = None) -> None:
        """Allocate the cache (``n_slots`` slots, as the target) and build the graphs used:
        prefill chunk ``C``, head ``D_max + 1``, and the draft width(s) in ``widths``, at
        ``threads`` intra-op threads (None: the calling thread's count)."""
        net = self.net
        if net.cache_slots != n_slots:
            net.setup_cache(n_slots)
            self.graphs.reset()
        self.chunk = prefill_chunk
        dev, h = self._state_dev, self.cfg.hidden_size
        dtype = net.norm.weight.dtype
        d1 = self.max_depth + 1
        self.n_tree = 1 + self.max_depth * max(max(widths), 1)  # largest tree node count handled
        # pending pairs for the next head call: tokens t_{L+i+1} (i < a), features f_{L+i} (i <= a)
        self.pend_tok = torch.zeros(d1, dtype=torch.int64, device=dev)  # [D_max+1]
        self.pend_feat = torch.zeros(d1, h, dtype=dtype, device=dev)  # [D_max+1, H] where not pend_true
        # ... or the target layers' features side by side, fused in the head call (head_call)
        joined = len(self.cfg.target_layers) * self.cfg.target_hidden_size
        self.pend_raw = torch.zeros(d1, joined, dtype=dtype, device=dev)  # [D_max+1, n H_t]
        self.pend_true = torch.zeros(d1, dtype=torch.bool, device=dev)  # [D_max+1] the row's is pend_raw's
        self.pend_n = torch.zeros((), dtype=torch.int64, device=dev)  # [] a = accepted count
        self.node_feat = torch.zeros(self.n_tree, h, dtype=dtype, device=dev)  # [N, H] f̂ per node
        self.warm_up([*widths, prefill_chunk], threads)

    def warm_up(self, widths: list[int], threads: int | None = None) -> None:
        """Build the block graphs of ``widths`` and of the head calls (:attr:`head_widths`) at
        ``threads`` intra-op threads (None: the calling thread's count), each with one call into
        the scratch slot; a width whose calls all run whole-call packages (:func:`block_widths`)
        needs none."""
        if self.chunk == 0:
            raise YggError("EagleDrafter.setup() must be called before warm_up()")
        dev, s = self._state_dev, self.net.cache_slots

        def run(w: int) -> None:
            ar = torch.arange(w, device=dev)
            feat = torch.zeros(w, self.cfg.hidden_size, dtype=self.pend_feat.dtype, device=dev)
            scratch = torch.full_like(ar, s - 1)
            # contiguous like every real mask (an expanded one would guard on strides)
            mask = (torch.arange(s, device=dev)[None, :] == s - 1).repeat(w, 1)
            self.net(ar, feat, ar, scratch, mask)

        served = self.calls.served() if self.calls is not None else set()
        self.graphs.build(block_widths(widths, self.head_widths, self.chunk, served), run, threads)

    def prefill(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int = 0) -> None:
        """Pairs (t_{i+1}, f_i), i = 0..n-2, at slots 1..n-1 in chunks of ``C``; f_{n-1} pends.
        ``start``: slots below it already hold their pairs (resume on the full prefill's grid)."""
        if self.chunk == 0:
            raise YggError("EagleDrafter.setup() must be called before prefill()")
        net, c = self.net, self.chunk
        n = prompt.shape[0]
        first = prefill_first(start, n, c)
        base = first - 1  # f[j] below is the fused feature of position base + j
        f = net.fuse_target(tuple(x[base:n].to(self.pend_feat.dtype) for x in feats))  # [n - base, H]
        dev = self._state_dev
        s = net.cache_slots
        ar = torch.arange(c, device=dev)
        cols = torch.arange(s, device=dev)
        for start in range(first, n, c):  # start = slot of the chunk's first pair
            m = min(c, n - start)
            tok = torch.zeros(c, dtype=torch.int64, device=dev)
            tok[:m] = prompt[start : start + m]
            feat = torch.zeros(c, f.shape[-1], dtype=f.dtype, device=dev)
            feat[:m] = f[start - 1 - base : start - 1 - base + m]
            real = ar < m
            slot = start + ar
            slots = torch.where(real, slot, s - 1)
            pos = torch.where(real, slot - 1, 0)
            mask = torch.where(
                real[:, None],
                (cols[None, :] >= 1) & (cols[None, :] <= slot[:, None]),
                cols[None, :] == s - 1,
            )
            net(tok, feat, pos, slots, mask)
        self.pend_feat[0] = f[n - 1 - base]
        self.pend_true[0] = False
        self.pend_n.zero_()

    @property
    def absorbs(self) -> int:
        """The most tokens a catch-up may leave to the next head call (:meth:`defer`): D_max, the
        pairs its static width holds besides the root's."""
        return self.max_depth

    def defer(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int) -> None:
        """The catch-up :meth:`prefill` ``(prompt, feats, start)`` would do, left to the next head
        call: the pairs (t_j, f_{j-1}) of slots ``start``..n-1 pend (at most :attr:`absorbs` of
        them, ``start`` >= 1), so that call writes them with the root's, as it writes the tokens a
        drafted step accepted, instead of a prefill chunk's call (whose static rows cost the same
        however few are new)."""
        n = prompt.shape[0]
        m = n - start
        if not 1 <= start <= n or m > self.absorbs:
            raise YggError(f"a deferred catch-up takes 0..{self.absorbs} tokens from slot >= 1, "
                           f"got {m} from slot {start}")
        self.pend_tok[:m] = prompt[start:n].to(self.pend_tok.device)
        self._pend_true_features(tuple(x[start - 1 : n] for x in feats))  # [m + 1, H_t] each
        self.pend_n.fill_(m)

    def absorb(self, prompt: torch.Tensor, feats: tuple[torch.Tensor, ...], start: int, k: int) -> None:
        """:meth:`prefill` ``(prompt, feats, start)``'s catch-up in head calls instead of prefill
        chunks: each takes :attr:`absorbs` pending pairs and a root (the head's widest static call,
        every row of it new; its top-k unused), and the last :attr:`absorbs` tokens or fewer pend
        for the step's own head call (:meth:`defer`). Its calls grow with the tokens behind, not
        with the chunk grid's rows a resumed prefill redoes."""
        n, a = prompt.shape[0], self.absorbs
        start = max(start, 1)  # (slot 0 holds no pair)
        while n - start > a:
            end = start + a  # the pairs of slots start..end - 1 pend; the root's is slot end's
            self.defer(prompt[:end], tuple(x[:end] for x in feats), start)
            self.head(prompt[end].to(torch.int64), torch.tensor(end, dtype=torch.int64), k)
            start = end + 1
        self.defer(prompt, feats, start)

    @property
    def head_widths(self) -> tuple[int, ...]:
        return head_widths(self.max_depth)

    def head(self, root: torch.Tensor, committed: torch.Tensor, k: int) -> TopK:
        """Feed the pending pairs, the last of which is (root, f_{L-1}) at slot L, in a call of
        the fewest :attr:`head_widths` rows that hold them: [1, k]."""
        self._check_k(k)
        a = int(self.pend_n)
        w = next(w for w in self.head_widths if w > a)
        acts = (root.to(torch.int64), committed, self.pend_tok[:w], self.pend_feat[:w], self.pend_raw[:w],
                self.pend_true[:w], self.pend_n)
        run = self.calls.runner("head", w, k) if self.calls is not None else None
        if run is not None:
            return TopK(*run(acts, self.node_feat))
        return TopK(*head_call(self.net, *acts, self.node_feat, k))

    def step(self, tokens, depth, node, parent, anc, committed, k: int) -> TopK:
        """W tree nodes: node j pairs its token with its parent's predicted feature; [W, k]."""
        self._check_k(k)
        if anc.shape[1] > self.n_tree:
            raise YggError(
                f"draft tree of {anc.shape[1]} nodes exceeds the EAGLE drafter's "
                f"{self.n_tree} (max_depth {self.max_depth}); raise max_depth"
            )
        run = self.calls.runner("draft", tokens.shape[0], k, anc.shape[1]) if self.calls is not None else None
        if run is not None:
            return TopK(*run((tokens, depth, node, parent, anc, committed), self.node_feat))
        return TopK(*step_call(self.net, tokens, depth, node, parent, anc, committed, self.node_feat, k))

    def commit(self, src, dst, path_tokens, n_accepted, feats) -> None:
        """Store the accepted tokens and the true features f_L..f_{L+a} for the next head call
        (which fuses them: head_call).

        No KV moves (``src``/``dst`` are unused): the next head rewrites every accepted slot from
        true features, and the drafted entries beyond it are outside the committed prefix."""
        d = path_tokens.shape[0] - 1
        if d > self.max_depth:
            raise YggError(
                f"draft depth {d} exceeds the EAGLE drafter's max_depth {self.max_depth}"
            )
        self.pend_tok[:d] = path_tokens[1:]
        self._pend_true_features(feats)
        self.pend_n.copy_(n_accepted)

    def _pend_true_features(self, feats: tuple[torch.Tensor, ...]) -> None:
        """The target's features of the first pending rows (one [r, H_t] per target layer), side by
        side, for the head call to fuse."""
        self.net.check_features(feats)
        r = feats[0].shape[0]
        torch.cat([x.to(self.pend_raw.dtype) for x in feats], dim=-1, out=self.pend_raw[:r])
        self.pend_true[:r] = True

    def ahead(self, tree, anc, bonus, feats, room, committed, k: int) -> None:
        """One call of width 2W: the tail row of node v pairs its token with its parent's true
        feature (slot L + v, position L + depth - 1), the head row of node v pairs ``bonus[v]``
        with v's own true feature (slot L + room + v, position L + depth). The root's pair is
        already in the cache, so its tail row goes to the scratch slot."""
        self._check_k(k)
        net, s = self.net, self.net.cache_slots
        w = tree.token.shape[0]
        f = net.fuse_target(tuple(x.to(self.pend_feat.dtype) for x in feats))  # [W, H]
        ext, node, depth = ahead_layout(tree, anc, room)
        cols = torch.arange(s, device=anc.device)
        mask = tree_mask(committed, ext, s) & (cols[None, :] >= 1)  # [2W, S]
        first = torch.arange(2 * w, device=anc.device) == 0  # the root's tail row: scratch only
        mask = torch.where(first[:, None], cols[None, :] == s - 1, mask)
        slots = torch.where(first, s - 1, committed + node)
        pos = torch.where(first, 0, committed + depth - 1)
        tokens = torch.cat([tree.token, bonus])
        feat = torch.cat([f.index_select(0, tree.parent), f])  # [2W, H]
        out = net(tokens, feat, pos, slots, mask)  # [2W, H]
        self.ahead_h, self.ahead_f = out[w:], f  # [W, H] each: head rows' f̂, true features

    def take(self, path, n_accepted, room, committed, k: int) -> TopK:
        """Keep the accepted tail and the leaf's head row; the state is then that of a commit
        with nothing pending (a head call at the next root would recompute the same row). The
        LM head runs on the leaf's row alone, as in a head call."""
        self._check_k(k)
        take_path(self.net.kv, path, n_accepted, room, committed)
        leaf = path[-1:]
        root_h = self.ahead_h.index_select(0, leaf)  # [1, H]
        self.node_feat[0] = root_h[0]
        self.pend_feat[0] = self.ahead_f.index_select(0, leaf)[0]
        self.pend_true[0] = False
        self.pend_n.zero_()
        return self._topk(self.net.logits(root_h), k)

    def _state(self) -> tuple[torch.Tensor, ...]:
        return (self.pend_tok, self.pend_feat, self.pend_raw, self.pend_true, self.pend_n, self.node_feat)

    def snapshot(self, lo: int, hi: int) -> Snapshot:
        return take_snapshot(self.net.kv, lo, hi, self._state())

    def restore(self, snap: Snapshot) -> None:
        put_back(self.net.kv, snap, self._state())

    def speculate(self, tokens, nodes, n: int, committed, k: int) -> TopK:
        """The target's features of the guessed path do not exist yet (it is verifying), so the
        path's pairs take the drafter's own predictions f̂ at its nodes: one head call (width
        D_max + 1) over slots L+1..L+n gives the leaf's f̂ and top-k; the leaf's f̂ then pends
        for the next head. (On a used guess these rows keep predicted features where a sequential
        commit would rewrite them from true ones: other proposals later, the same output.)"""
        self._check_k(k)
        if n:  # (n = 0: the root's entry and f̂ exist from this step's head)
            self.pend_tok[: n - 1] = tokens[1:n]
            self.pend_feat[:n] = self.node_feat.index_select(0, nodes[:n])
            self.pend_true[:n] = False
            self.pend_n.fill_(n - 1)
            self.head(tokens[n], committed + n, k)  # sets node_feat[0] = the leaf's f̂
        leaf_h = self.node_feat[:1].clone()
        self.pend_feat[0] = leaf_h[0]
        self.pend_true[0] = False
        self.pend_n.zero_()
        return self._topk(self.net.logits(leaf_h), k)

    def frozen(self, threaded: bool = False):
        return self.graphs.frozen(threaded)

    # ---------------------------------------------------------------- helpers

    def _check_k(self, k: int) -> None:
        if not 1 <= k <= self.cfg.draft_vocab_size:
            raise YggError(
                f"top-k {k} is outside 1..{self.cfg.draft_vocab_size} (the draft vocabulary)"
            )

    def _topk(self, logits: torch.Tensor, k: int) -> TopK:
        return TopK(*topk_of(self.net, logits, k))


# ----------------------------------------------------------------------------- files


def save_eagle(drafter: EagleDrafter, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (weights + the ``draft_vocab`` map)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / CONFIG_FILE).write_text(json.dumps(drafter.cfg.to_json(), indent=2) + "\n")
    state = {k: v.cpu() for k, v in drafter.net.head_state_dict().items()}
    save_file(state, str(p / WEIGHTS_FILE), metadata={"format": "pt", "kind": "eagle"})


def load_eagle(
    path: str | Path, target: Transformer, mode: str, max_depth: int = 8
) -> EagleDrafter:
    """Load an EAGLE head for ``target``; refuse (YggError naming the file) anything that does not
    fit: hidden size, target fingerprint, layer indices, vocabulary map, missing or bad tensors."""
    p = Path(path)
    cfg_path, w_path = p / CONFIG_FILE, p / WEIGHTS_FILE
    if not cfg_path.is_file():
        raise YggError(f"not an EAGLE drafter directory: {cfg_path} is missing")
    cfg = EagleConfig.from_json(read_json(cfg_path), cfg_path)
    cfg.check_target(target.cfg, cfg_path)
    state = read_safetensors(w_path, "EAGLE weights")
    w = target.embed_tokens.weight
    with torch.device("meta"):
        net = EagleNet(cfg, target.embed_tokens if cfg.shares_embedding else None)
    want = {k: v for k, v in net.state_dict().items()}
    missing = sorted(set(want) - set(state))
    if missing:
        raise YggError(f"{w_path}: missing tensors {', '.join(missing)}")
    extra = sorted(set(state) - set(want))
    if extra:
        raise YggError(f"{w_path}: unexpected tensors {', '.join(extra)}")
    for k, v in want.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise YggError(
                f"{w_path}: tensor {k} has shape {list(state[k].shape)}, expected {list(v.shape)}"
            )
    check_vocab_map(state["draft_vocab"], cfg.draft_vocab_size, cfg.vocab_size, w_path)
    cast = {
        k: (v.to(torch.int64) if k == "draft_vocab" else v.to(w.dtype)).to(w.device)
        for k, v in state.items()
    }
    net.load_state_dict(cast, strict=True, assign=True)
    net.rope = torch.zeros(0, cfg.head_dim // 2, 2, device=w.device)
    return EagleDrafter(net, target, mode, max_depth)
