"""What ``yggtree distill`` trains and validates on: batches of teacher pairs (:class:`Batch`), the
EAGLE head's unrolled training forward (:func:`unrolled_forward`), the target's frozen head on the
draft vocabulary (:class:`TargetHead`) and the losses (:func:`step_losses`): soft cross-entropy
against the target's next-token distribution and a smooth-L1 regression of its next feature, for
each unrolled draft step.

The pair/slot layout the unrolled forward follows (pairs ``(t_{p+1}, f_p)``, the keys a depth-``k``
draft node attends to) is set out in yggtree/offline/distill.py's docstring, with the pipeline.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.model import apply_rope
from .distill_config import DistillConfig
from .teacher_data import FeatureLayout, TeacherData


def unrolled_forward(net, tok: torch.Tensor, feat: torch.Tensor, steps: int, rope: torch.Tensor) -> list[torch.Tensor]:
    """The head over pairs ``p = 0..T-1`` (tok [B, T] = t_{p+1}, feat [B, T, L*H] = f_p of the
    head's L target layers side by side), unrolled.

    Returns ``steps`` outputs [B, T, H] (the last decoder layer's); output ``k`` at pair ``p`` is
    what a depth-``k`` draft node at pair ``p`` computes at run time (k = 0: the causal pass over
    true features). Every decoder layer sees its own keys/values of the earlier steps, as each
    layer's cache holds them at run time.
    """
    bsz, t, _ = feat.shape
    x_feat = net.fuse_target(feat.split(net.cfg.target_hidden_size, dim=-1))  # [B, T, H]
    cs = rope[:t]
    cos, sin = cs[None, :, None, :, 0], cs[None, :, None, :, 1]  # [1, T, 1, D/2]
    e = F.embedding(tok, net.embed_weight)
    p = torch.arange(t, device=tok.device)
    kv: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in net.layers]  # per layer
    outs: list[torch.Tensor] = []
    for k in range(steps):
        if k > 0:
            prev = outs[-1]
            x_feat = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        # mask [T, (k+1) T]: step-0 keys of pairs <= p-k, step-j key of pair p-k+j
        parts = [p[None, :] <= (p - k)[:, None]]
        for j in range(1, k + 1):
            parts.append(p[None, :] == (p - k + j)[:, None])
        mask = torch.cat(parts, dim=1)
        x = net.fuse_input(e, x_feat)
        for block, (keys, vals) in zip(net.layers, kv):
            x = unrolled_block(block, x, cos, sin, mask, keys, vals)
        outs.append(x)
    return outs


def unrolled_block(
    block,
    x: torch.Tensor,  # [B, T, H] this step's input of the layer
    cos: torch.Tensor,  # [1, T, 1, D/2]
    sin: torch.Tensor,  # [1, T, 1, D/2]
    mask: torch.Tensor,  # [T, (k+1) T] bool over the layer's keys of steps 0..k
    keys: list[torch.Tensor],  # the layer's keys of steps 0..k-1, each [B, Hkv, T, D]; this step's is appended
    vals: list[torch.Tensor],  # the same for values
) -> torch.Tensor:
    """One decoder layer of :func:`unrolled_forward` at step k: [B, T, H]. The attention numerics
    follow runtime/model.py's Attention (float32 scores, GQA grouping)."""
    attn = block.self_attn
    acfg = attn.cfg
    bsz, t, _ = x.shape
    hq, hkv, d = acfg.num_heads, acfg.num_kv_heads, acfg.head_dim
    g = hq // hkv
    h = block.input_layernorm(x)
    q = apply_rope(attn.q_proj(h).view(bsz, t, hq, d), cos, sin).transpose(1, 2)
    keys.append(apply_rope(attn.k_proj(h).view(bsz, t, hkv, d), cos, sin).transpose(1, 2))
    vals.append(attn.v_proj(h).view(bsz, t, hkv, d).transpose(1, 2))
    kall = torch.cat(keys, dim=2).repeat_interleave(g, dim=1)  # [B, Hq, (k+1)T, D]
    vall = torch.cat(vals, dim=2).repeat_interleave(g, dim=1)
    scores = torch.matmul(q, kall.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vall.dtype)
    o = torch.matmul(probs, vall).transpose(1, 2).reshape(bsz, t, hq * d)
    x = x + attn.o_proj(o)
    return x + block.mlp(block.post_attention_layernorm(x))


@dataclass
class Batch:
    tok: torch.Tensor  # [B, T] int64 t_{p+1}
    feat: torch.Tensor  # [B, T, L*H] float32 f_p, the head's L input layers side by side
    nxt_feat: torch.Tensor  # [B, T, H] float32 f_{p+1} of the target's last layer
    valid: torch.Tensor  # [B, T] bool: pair p and its targets exist
    greedy: torch.Tensor  # [B, T] bool: t_{p+2} is the target's argmax at p+1 (inside answers)
    weight: torch.Tensor  # [B, T] float32 loss weight: 1 in answers, prompt_weight in prompts, 0 pad


def make_batch(
    data: TeacherData, idx: list[int], max_len: int, layout: FeatureLayout, prompt_weight: float = 1.0
) -> Batch:
    seqs = [data.seq(i) for i in idx]
    n = max(min(len(t), max_len + 1) for t, _ in seqs) - 1
    b = len(idx)
    tok = torch.zeros(b, n, dtype=torch.int64)
    feat = torch.zeros(b, n, len(layout.inputs) * layout.hidden)
    nxt = torch.zeros(b, n, layout.hidden)
    valid = torch.zeros(b, n, dtype=torch.bool)
    greedy = torch.zeros(b, n, dtype=torch.bool)
    ans = torch.zeros(b, n, dtype=torch.bool)
    for r, (i, (t, f)) in enumerate(zip(idx, seqs)):
        t, f = t[: max_len + 1], f[: max_len + 1].float()
        m = len(t) - 1
        tok[r, :m] = t[1:]
        feat[r, :m] = layout.head_input(f[:-1])
        nxt[r, :m] = layout.last_layer(f[1:])
        valid[r, :m] = True
        # pair p predicts t_{p+2}: greedy when the target chose it greedily; full weight when the
        # target wrote it (an answer), prompt_weight for given text
        role = data.roles(i)[: max_len + 1].long()
        nxt_role = torch.cat([role[2:], role[-1:]])[:m] if m > 0 else role[:0]
        greedy[r, : max(m - 1, 0)] = (nxt_role == 1)[: max(m - 1, 0)]
        ans[r, :m] = nxt_role > 0
    weight = torch.where(ans, 1.0, prompt_weight) * valid
    return Batch(tok, feat, nxt, valid, greedy, weight)


@dataclass(frozen=True)
class TargetHead:
    """The target's final norm and LM head rows on the draft vocabulary (frozen)."""

    norm_weight: torch.Tensor  # [H]
    eps: float
    w_draft: torch.Tensor  # [V_d, H]
    w_full: torch.Tensor  # [V, H]

    def normed(self, f: torch.Tensor) -> torch.Tensor:
        ff = f.float()
        return self.norm_weight * (ff * torch.rsqrt(ff.pow(2).mean(-1, keepdim=True) + self.eps))

    def draft_logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.normed(f) @ self.w_draft.T


def train_autocast(cfg: DistillConfig):
    """bfloat16 matmuls in the head's forward (faster on CPUs with AVX-512 BF16); losses, the
    target's distribution and the optimizer stay float32."""
    if cfg.train_autocast == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reg_space(f: torch.Tensor, dim_std: torch.Tensor) -> torch.Tensor:
    """The space of the feature regression: RMS-normalised, then each dimension divided by its
    spread over the data, so SmolLM2's few outlier dimensions do not dominate the loss (and the
    scale, which the head's input norm ignores, does not count)."""
    ff = f.float()
    return ff * torch.rsqrt(ff.pow(2).mean(-1, keepdim=True) + 1e-6) / dim_std


def feature_dim_std(feats: torch.Tensor) -> torch.Tensor:
    """[H] per-dimension std of the RMS-normalised features (a fixed sample of rows)."""
    sample = feats[:: max(1, feats.shape[0] // 20000)].float()
    rn = sample * torch.rsqrt(sample.pow(2).mean(-1, keepdim=True) + 1e-6)
    return rn.std(0).clamp(min=1e-3)


def step_losses(net, th: TargetHead, outs, batch: Batch, feat_scale: torch.Tensor, cfg: DistillConfig):
    """Weighted loss and per-step metrics (soft CE, KL, regression, top-1 agreement)."""
    with torch.no_grad():
        lp_t = torch.log_softmax(th.draft_logits(batch.nxt_feat), dim=-1)  # [B, T, V_d]
        p_t = lp_t.exp()
        ent = -(p_t * lp_t).sum(-1)
        arg_t = lp_t.argmax(-1)
    total = 0.0
    wsum = 0.0
    metrics = []
    t = batch.tok.shape[1]
    pidx = torch.arange(t)
    for k, out in enumerate(outs):
        m = batch.valid & (pidx[None, :] >= k)
        mf = m.float() * batch.weight
        denom = mf.sum().clamp(min=1)
        with train_autocast(cfg):
            logits = net.logits(out)
        lq = torch.log_softmax(logits.float(), dim=-1)
        ce = -(p_t * lq).sum(-1)
        reg = F.smooth_l1_loss(
            reg_space(out, feat_scale), reg_space(batch.nxt_feat, feat_scale), reduction="none"
        ).mean(-1)
        ce_m = (ce * mf).sum() / denom
        reg_m = (reg * mf).sum() / denom
        w = cfg.unroll_decay**k
        total = total + w * (cfg.ce_weight * ce_m + cfg.reg_weight * reg_m)
        wsum += w
        with torch.no_grad():
            kl = ((ce - ent) * mf).sum() / denom
            top1 = ((lq.argmax(-1) == arg_t).float() * mf).sum() / denom
        metrics.append({"ce": float(ce_m.detach()), "kl": float(kl), "reg": float(reg_m.detach()), "top1": float(top1)})
    return total / wsum, metrics
