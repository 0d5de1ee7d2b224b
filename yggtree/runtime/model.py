"""A compact Llama-family decoder with a static KV cache (gpt-fast style).

Covers Llama, Mistral and Qwen2 (q/k/v bias): GQA, tied or untied embeddings, RoPE with the
"default", "linear", "llama3" and "yarn" scaling types. Every shape inside ``forward`` is fixed by
the shapes of its tensor arguments: nothing that varies between decode steps is a Python int, so one
input width W gives one graph.

The cache holds ``S`` slots per layer. A forward call writes the keys/values of its W tokens into the
slots it is given and lets every token attend to the cache slots its mask allows:

    tokens    [B, W]     token ids
    positions [B, W]     RoPE positions
    slots     [B, W]     cache slots to write (any slots; the caller owns the layout)
    mask      [B, W, C]  True where token w may attend to cache slot s < C (after this call's
                         writes); C <= S is a static context bucket, so attention reads only the
                         first C slots of the cache
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache, KVStore


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in HF configs ("rope_scaling" / "rope_parameters")."""

    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 * ln(factor) + 1


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    arch: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float64) and the cos/sin magnitude for ``cfg``."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs.kind == "default":
        return inv, 1.0
    if rs.kind == "linear":
        return inv / rs.factor, 1.0
    if rs.kind == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled), 1.0
    if rs.kind == "yarn":
        old = rs.original_max_position_embeddings

        def dim_for(rot: float) -> float:
            return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

        low = max(math.floor(dim_for(rs.beta_fast)), 0)
        high = min(math.ceil(dim_for(rs.beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = inv / rs.factor * (1 - extrapolation) + inv * extrapolation
        mscale = rs.attention_factor
        if mscale is None:
            mscale = 0.1 * math.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0
        return inv, mscale
    raise ValueError(f"unsupported rope scaling type {rs.kind!r}")


def rope_table(cfg: ModelConfig, n_positions: int) -> torch.Tensor:
    """cos/sin table [n_positions, head_dim // 2, 2] in float32."""
    inv, mscale = rope_inv_freq(cfg)
    angles = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return (torch.stack([angles.cos(), angles.sin()], dim=-1) * mscale).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF/Llama convention). x [B, W, H, D]; cos, sin [B, W, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # the kernel library's one call (yggtree::rms_norm, each row on its own) instead of torch's five
        # ops: set on a float32 model's final norm, which runs eagerly after a step's compiled layers
        # (runtime/kernels.py use_library_norm)
        self.native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.yggtree.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.qkv: nn.Module | None = None  # q/k/v as one product (runtime.packed.pack_linears)
        self.cache: KVCache | None = None
        # calls of at most this many query rows compute attention row by row (_rows_attention:
        # each row's result independent of the call's other rows and of where its ancestors sit);
        # wider calls use the grouped matmuls. Engines set it (set_invariant_rows, attention_rows).
        self.invariant_rows = 1
        # the row-by-row attention on our kernel library (runtime/csrc/rows_attention.cpp: work
        # over the visible slots only) instead of _rows_attention's broadcast products over the
        # context bucket: "rows" (yggtree::rows_attention) or "tree" (yggtree::tree_attention, the
        # same bits from one pass over the cache for a call's rows, where that is faster here);
        # float32 and bfloat16 models whose products run on the library set it
        # (runtime/kernels.py use_rows_attention)
        self.native_rows: str | None = None
        # the dtype its cache holds (set_kv_dtype; None: the weights'): a constant of a compiled
        # block, which takes the cache as an input of that dtype (aoti.block_key)
        self.kv_dtype: torch.dtype | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, W, hidden]
        cos: torch.Tensor,  # [B, W, 1, D/2]
        sin: torch.Tensor,  # [B, W, 1, D/2]
        slots: torch.Tensor,  # [B, W] int64, or [B, W, 1 + T] (row_window: slot, then the window)
        mask: torch.Tensor,  # [B, W, C] bool, C <= S (context bucket); with [B, W, 1 + T] slots the
        # window's first part (row_window)
    ) -> torch.Tensor:
        cfg = self.cfg
        bsz, w, _ = x.shape
        window = None
        if slots.dim() == 3:  # row_window(slots, mask) of this call
            slots, window = slots[..., 0], slots[..., 1:]
        hkv, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x).split([cfg.num_heads * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(bsz, w, cfg.num_heads, d), cos, sin)
        k = apply_rope(k.view(bsz, w, hkv, d), cos, sin)
        v = v.view(bsz, w, hkv, d)
        assert self.cache is not None, "call Transformer.setup_cache() before forward()"
        k_all, v_all = self.cache.write(slots, k, v)  # [B, S, Hkv, D]
        n_ctx = mask.shape[-1]  # static: attend over the first n_ctx slots only (context bucket)
        if window is not None or rows_path(self.invariant_rows, bsz, w):
            if window is None:
                window, mask = row_window(mask)
            rows = (_rows_attention if not self.native_rows else torch.ops.yggtree.tree_attention
                    if self.native_rows == "tree" and w > 1 else torch.ops.yggtree.rows_attention)
            return self.o_proj(rows(q, k_all[:, :n_ctx], v_all[:, :n_ctx], mask, window))
        # [B, Hkv, D, C] and [B, Hkv, C, D]: views (a 16-bit cache under float32 q: float32 copies)
        k_t = k_all[:, :n_ctx].permute(0, 2, 3, 1).to(q.dtype)
        v_c = v_all[:, :n_ctx].permute(0, 2, 1, 3).to(q.dtype)
        # Group the query heads that share a KV head so the cache is never repeated: [B, Hkv, G*W, D].
        qg = q.view(bsz, w, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, g * w, d)
        scores = torch.matmul(qg, k_t).float() * (1.0 / math.sqrt(d))
        scores = scores.view(bsz, hkv, g, w, -1).masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(bsz, hkv, g * w, -1)
        out = torch.matmul(probs, v_c)  # [B, Hkv, G*W, D]
        out = out.view(bsz, hkv, g, w, d).permute(0, 3, 1, 2, 4).reshape(bsz, w, cfg.num_heads * d)
        return self.o_proj(out)


# A query row's last LOGICAL_WINDOW visible slots, taken in logical order (see _rows_attention):
# a verified tree node whose depth is below it attends bitwise as plain decoding does.
LOGICAL_WINDOW = 32


def rows_path(invariant_rows: int, bsz: int, w: int) -> bool:
    """Whether a call of ``w`` query rows (batch ``bsz``) computes attention row by row: up to
    ``invariant_rows`` rows, in a batch of 1 or compiled (in eager with a batch the broadcast
    products would materialise [B, Hkv, G, W, C, D]: the grouped products serve)."""
    return w <= invariant_rows and (bsz == 1 or torch.compiler.is_compiling())


def row_window(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split every row's visible slots (``mask`` [B, W, C] bool) into the two parts
    :func:`_rows_attention` adds: its last T = LOGICAL_WINDOW visible slots, in slot order, as a
    window [B, W, T] int64 of slots (-1: no slot, a row that sees fewer than T), and the mask of
    the rest [B, W, C] bool. The same for every layer of a step: the model computes it once."""
    bsz, w, c = mask.shape
    t = LOGICAL_WINDOW
    rank = mask.cumsum(-1)  # [B, W, C] visible slots up to and including each slot
    first = rank[..., -1:] - t  # [B, W, 1] visible slots before the window (may be < 0)
    # window position of every visible slot past the first part; the rest go to a dropped column
    at = torch.where(mask & (rank > first), rank - 1 - first, t)  # [B, W, C]
    ar = torch.arange(c, device=mask.device).expand_as(rank)
    order = torch.zeros(bsz, w, t + 1, dtype=rank.dtype, device=mask.device).scatter_(-1, at, ar)[..., :t]
    empty = torch.arange(t, device=mask.device) < -first  # [B, W, T] positions before a short row's slots
    return torch.where(empty, -1, order), mask & (rank <= first)


def _rows_attention(
    q: torch.Tensor,  # [B, W, H, D]
    k: torch.Tensor,  # [B, C, Hkv, D] the first C cache slots (a view)
    v: torch.Tensor,  # [B, C, Hkv, D]
    head: torch.Tensor,  # [B, W, C] bool: the slots each row reads in place (row_window)
    window: torch.Tensor,  # [B, W, T] int64: the slots each row reads in its window, -1: none
) -> torch.Tensor:
    """Attention of W query rows, each computed on its own: [B, W, H*D].

    Row-invariant by construction: every reduction (the score's sum over D, softmax over C, the
    weighted sum over C) runs along one row's own axis of a broadcast elementwise product, never
    through a matmul whose kernel (blocking, microkernel, split of the reduction) a library picks
    from the number of rows. So a row's bits do not depend on W or on the other rows. Eager ATen
    reductions split work over output elements only; inductor's CPU loops likewise, except that
    it parallelises a reduction loop far longer than all output loops together (one row over a
    long context, several threads).

    Layout-invariant too. A row attends over two parts (:func:`row_window`): its first n - T
    visible slots where they are in the cache, and its last T visible slots gathered in slot order
    into a T-long window; the parts' maxima, sums and weighted sums are then added. A verified
    tree node at depth d < T sees the committed prefix and then its ancestors at tree slots with
    other nodes' slots between them (tree nodes are numbered parents first, so slot order is depth
    order); plain decoding holds the same tokens contiguous after the prefix. The first part is
    the same prefix slots for both, and the window holds the same values at the same places, so
    every vectorised sum groups the same values alike and a verified node's logits are bitwise
    those of the plain step at its position (without the window, bfloat16 speculation left
    plain output). Only the T-slot window is gathered."""
    bsz, w, h, d = q.shape
    hkv = k.shape[2]
    seen = window >= 0
    b_ix = torch.arange(bsz, device=q.device)[:, None, None]
    kw = k[b_ix, window.clamp(min=0)].permute(0, 3, 1, 2, 4)[:, :, None].float()  # [B, Hkv, 1, W, T, D]
    vw = v[b_ix, window.clamp(min=0)].permute(0, 3, 1, 2, 4)[:, :, None].float()  # [B, Hkv, 1, W, T, D]
    qg = q.view(bsz, w, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)[..., None, :].float()  # [B, Hkv, G, W, 1, D]
    kc = k.permute(0, 2, 1, 3)[:, :, None, None].float()  # [B, Hkv, 1, 1, C, D]
    vc = v.permute(0, 2, 1, 3)[:, :, None, None].float()  # [B, Hkv, 1, 1, C, D]
    scale = 1.0 / math.sqrt(d)
    s1 = ((qg * kc).sum(-1) * scale).masked_fill(~head[:, None, None], float("-inf"))  # [B, Hkv, G, W, C]
    s2 = ((qg * kw).sum(-1) * scale).masked_fill(~seen[:, None, None], float("-inf"))  # [B, Hkv, G, W, T]
    m = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True))  # a row's window is never empty
    p1, p2 = torch.exp(s1 - m), torch.exp(s2 - m)
    total = p1.sum(-1, keepdim=True) + p2.sum(-1, keepdim=True)  # [B, Hkv, G, W, 1]
    out = ((p1[..., None] * vc).sum(-2) + (p2[..., None] * vw).sum(-2)) / total  # [B, Hkv, G, W, D]
    return out.permute(0, 3, 1, 2, 4).reshape(bsz, w, h * d).to(q.dtype)


def attention_rows(prefill_chunk: int, native: bool = False) -> int:
    """How many query rows an engine's target computes row by row (``Attention.invariant_rows``):
    every call narrower than a prefill chunk, so plain steps (W = 1) and each verify width below
    the chunk round alike; the prefill chunk too where the layers run the library's row attention
    (``native``: ``Attention.native_rows``), which reads only each row's visible slots, on every
    thread, where inductor's grouped code reads the whole context bucket on one (docs/results.md
    section 18), elsewhere the grouped matmuls. Every engine of one plan on one machine, plain or speculative, computes the
    same prefill and the same steps; ``Engine`` sets it on its target and ``yggtree compile`` on the
    target whose packages it exports.

    With :func:`_rows_attention`'s logical window, a verified node's logits are bitwise those of
    the plain step at its position: tests/test_attention_invariance.py, and the real model in
    every weight format (``scripts/check_equivalence.py``). Rows cost more than the grouped matmuls at
    wide verify steps (the per-format profile prices it)."""
    return max(1, prefill_chunk if native else prefill_chunk - 1)


def attention_formulation(prefill_chunk: int) -> dict:
    """How an engine with ``prefill_chunk`` computes attention, as compiled packages record it
    (their manifest's ``attention``; compiled.check_artifacts refuses packages built otherwise):
    the rows every engine computes row by row (whether a prefill chunk does too follows from the
    layers' kernel, which the packages' device, format and code already pin)."""
    return {"rows_up_to": attention_rows(prefill_chunk), "logical_window": LOGICAL_WINDOW}


def set_kv_dtype(model: "Transformer", kv_cache: str | None) -> None:
    """Keep ``model``'s KV cache in ``kv_cache`` (a canonical ``yggtree.shapes.kv_cache_dtype``:
    None, the weights' dtype; "float16" or "bfloat16" under float32 activations). Set before
    ``setup_cache``: the cache is allocated in it, keys and values are rounded to it once as they
    are stored, and attention reads them back as float32 (an approximation of the float32 model
    that halves attention's reads; plain and speculative steps read the same stored values)."""
    dtype = None if kv_cache is None else getattr(torch, kv_cache)
    for m in model.modules():
        if isinstance(m, Attention):
            m.kv_dtype = dtype


def native_attention(model: nn.Module) -> str | None:
    """The library attention ``model``'s layers run for tree rows (``rows``, ``tree``:
    ``Attention.native_rows``), or None."""
    return next((m.native_rows for m in model.modules() if isinstance(m, Attention) and m.native_rows), None)


def set_attention_rows(model: nn.Module, prefill_chunk: int) -> None:
    """Every attention layer of ``model`` computes :func:`attention_rows` of ``prefill_chunk`` row by
    row: the prefill chunk too where its layers run the library's row attention (``native_rows``)."""
    set_invariant_rows(model, attention_rows(prefill_chunk, native_attention(model) is not None))


def set_invariant_rows(model: nn.Module, rows: int) -> None:
    """Every attention layer of ``model`` computes calls of at most ``rows`` query rows row by
    row (:func:`_rows_attention`). Set before any graph is built: compiled graphs keep it."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.invariant_rows = rows


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: nn.Module | None = None  # gate/up as one product (runtime.packed.pack_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# The projections a block's forward can run as one product (runtime.packed.pack_linears fills
# the hook): (submodule of the block, its hook attribute, the linears the hook stands in for).
FUSED_PROJECTIONS = (
    ("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up", ("gate_proj", "up_proj")),
)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def embedding(n: int, h: int) -> nn.Embedding:
    """``nn.Embedding(n, h)``; built under the meta device (a model whose weights are loaded next),
    without its random init: torch's normal_ on a meta tensor runs a Python decomposition whose
    first call imports the compiler stack, a second of every start for values thrown away."""
    w = torch.empty(n, h)
    return nn.Embedding(n, h, _weight=w) if w.is_meta else nn.Embedding(n, h)


def _run_block(block: Block, x, cos, sin, slots, mask) -> torch.Tensor:
    return block(x, cos, sin, slots, mask)


# Inside a compiled step (graphs.Graphs, "step" scope) every decoder layer is this one nested
# region: dynamo traces it once and reuses the subgraph for each layer (the layer's weights and
# cache are its inputs), so a many-layer step compiles about as fast as one block. Outside
# torch.compile it is a plain call.
_block = torch.compiler.nested_compile_region(_run_block)


def run_layer(block: Block, x, cos, sin, slots, mask) -> torch.Tensor:
    """One decoder layer of a step: the nested region :data:`_block` inside torch.compile; a plain
    call where the step is exported (AOTInductor packages), where dynamo would trace each layer's
    region on its own (a third of a 30-layer step's compile) for the same generated code."""
    if torch.compiler.is_exporting():
        return block(x, cos, sin, slots, mask)
    return _block(block, x, cos, sin, slots, mask)


@dataclass(frozen=True)
class ForwardOut:
    """What one forward call returns."""

    hidden: torch.Tensor  # [B, W, hidden] final-norm output (the LM head's input)
    layers: tuple[torch.Tensor, ...]  # each [B, W, hidden]: outputs of the requested decoder layers


class Transformer(nn.Module):
    """Llama-family decoder. Parameter names follow HF (``model.layers.N....``) minus the ``model.``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope", torch.zeros(0, cfg.head_dim // 2, 2), persistent=False)
        self.cache_slots = 0  # S; the rope table [S, D/2, 2] float32 covers positions 0..S-1

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The KV cache's dtype (set_kv_dtype, on its layers; None: the weights')."""
        return self.layers[0].self_attn.kv_dtype

    def setup_cache(self, batch_size: int, n_slots: int) -> None:
        """Allocate (or reallocate) the static KV cache: ``n_slots`` slots per layer, every
        layer's in one :class:`KVStore` (``self.kv``)."""
        p = self.embed_tokens.weight
        cfg = self.cfg
        self.set_store(KVStore.zeros(cfg.num_layers, batch_size, cfg.num_kv_heads, n_slots, cfg.head_dim,
                                     self.kv_dtype or p.dtype, p.device))
        self.rope = rope_table(cfg, n_slots).to(p.device)
        self.cache_slots = n_slots

    def set_store(self, store: KVStore) -> None:
        """Make the layers read and write ``store``'s caches."""
        self.kv = store
        store.attach(self.layers)

    def shared_copy(self) -> "Transformer":
        """A second model over the same weight tensors with its own (unallocated) cache."""
        with torch.device("meta"):
            twin = Transformer(self.cfg)
        twin.load_state_dict(self.state_dict(), strict=False, assign=True)
        if self.cfg.tie_word_embeddings:
            twin.lm_head.weight = twin.embed_tokens.weight
        twin.rope = torch.zeros(0, self.cfg.head_dim // 2, 2, device=self.embed_tokens.weight.device)
        return twin.eval().requires_grad_(False)

    def caches(self) -> list[KVCache]:
        return [b.self_attn.cache for b in self.layers]

    def forward(
        self,
        tokens: torch.Tensor,  # [B, W] int64
        positions: torch.Tensor,  # [B, W] int64
        slots: torch.Tensor,  # [B, W] int64
        mask: torch.Tensor,  # [B, W, C] bool, C <= S (context bucket)
        capture: tuple[int, ...] = (),
    ) -> ForwardOut:
        x, captured = self.decoder(tokens, positions, slots, mask, capture)
        return ForwardOut(self.norm(x), captured)

    def decoder(
        self,
        tokens: torch.Tensor,  # [B, W] int64
        positions: torch.Tensor,  # [B, W] int64
        slots: torch.Tensor,  # [B, W] int64
        mask: torch.Tensor,  # [B, W, C] bool, C <= S (context bucket)
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The forward up to the final norm: the last layer's output [B, W, hidden] and the
        captured layers' (each [B, W, hidden])."""
        cs = self.rope[positions]  # [B, W, D/2, 2]
        cos, sin = cs[..., 0].unsqueeze(2).contiguous(), cs[..., 1].unsqueeze(2).contiguous()
        x = self.embed_tokens(tokens)
        if rows_path(self.layers[0].self_attn.invariant_rows, *tokens.shape):
            # every layer's row-by-row attention reads the same split of the rows' context
            window, mask = row_window(mask)
            slots = torch.cat([slots[..., None], window], -1)  # [B, W, 1 + T]
        captured = []
        for i, block in enumerate(self.layers):
            x = run_layer(block, x, cos, sin, slots, mask)
            if i in capture:
                captured.append(x)
        return x, tuple(captured)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] float32 logits."""
        return self.lm_head(hidden).float()

    def matmul_weights(self) -> list[torch.Tensor]:
        """The 2-D weights one token's forward multiplies by, one per product as the forward runs
        them (for the matmul floor): fused projections (``qkv``, ``gate_up``) give their parts'
        weights stacked, a new tensor."""
        ws = []
        for block in self.layers:
            for mod_name, hook, names in FUSED_PROJECTIONS:
                mod = getattr(block, mod_name)
                parts = [getattr(mod, k).weight for k in names]
                ws += [torch.cat(parts)] if getattr(mod, hook) is not None else parts
            ws += [block.self_attn.o_proj.weight, block.mlp.down_proj.weight]
        return [*ws, self.lm_head.weight]
