"""Train an EAGLE-style drafter head for a target by distillation (``yggtree distill``).

Pipeline (every stage deterministic given ``--seed``; docs/design.md sections 11 and 12)::

    calibration chat prompts        data.calibration_chat_prompts (stdlib source / pydoc topics,
      (chat template)               decontaminated against the evaluation prompts)
    teacher data                    the target answers each prompt greedily (batched, static
                                    cache); the features f_p of prompt and answer (the
                                    ``--target-layers`` outputs, plus the last layer for the
                                    training targets) are captured in the same pass ->
                                    safetensors cache on disk
    draft vocabulary                the V_d most frequent target ids in the teacher data, plus
                                    every special token (<|im_end|>, ...)
    training                        the head sees pairs (t_{p+1}, f_p) and is trained to
                                      - match the target's next-token distribution restricted to
                                        the draft vocabulary (soft cross-entropy = KL + const)
                                      - regress the target's next feature f_{p+1} (smooth L1)
                                    unrolled over ``--unroll`` draft steps: step k feeds the
                                    head's own predicted features exactly as a chain of depth k
                                    does at run time (EAGLE-3's "training-time test")
    output                          config.json + model.safetensors (save_eagle), manifest.json,
                                    report/{loss.png, acceptance.png, train_log.csv,
                                    acceptance.csv}

The target's distribution is never stored: with the last-layer feature ``f`` the target's logits
are ``lm_head(norm(f))``, recomputed on the draft vocabulary for each training batch.

Teacher data cache: ``<cache-dir>/<key>/teacher.safetensors`` where ``key`` hashes the target's
weights fingerprint, the prompt texts and the generation parameters; its sha256 goes into the
manifest. A second run with the same data options reuses it (training only).

Pair/slot layout of the head (see runtime/eagle.py): pair ``p`` is ``(t_{p+1}, f_p)`` at RoPE
position ``p``; its output predicts ``f_{p+1}`` and the target's distribution at position
``p + 1`` (i.e. of ``t_{p+2}``). In the unrolled step ``k`` pair ``p`` reads the step ``k-1``
output at pair ``p-1`` instead of ``f_p`` and attends to the step-0 keys of pairs ``<= p-k`` and
to the step-``j`` key of pair ``p-k+j`` for ``j = 1..k``: the path of a depth-``k`` draft node.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import YggError, run_reporting
from ..files import atomic_path, file_sha256
from ..progress import PlainLog, stderr_progress
from .transcripts import prefill_sequences
from ..runtime.loading import read_safetensors

TEACHER_FILE = "teacher.safetensors"
TEACHER_FORMAT = 1


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class DistillConfig:
    """Every knob of one distillation run (written verbatim into the manifest)."""

    model: str = "default"
    out: str = "drafter-out"
    seed: int = 0
    # data
    prompts: int = 640  # calibration chat prompts answered by the target
    snippet_chars: int = 400  # max characters of the calibration snippet inside each prompt
    prompt_style: str = "basic"  # request templates (data.PROMPT_STYLES): basic | varied
    max_new_tokens: int = 128  # greedy answer length cap
    gen_batch: int = 16  # rows per batched generation call
    teacher_dtype: str = "bfloat16"  # dtype of the target while building teacher data
    max_seq_len: int = 640  # training window (tokens); longer sequences are cut
    val_frac: float = 0.04  # held-out sequences (validation loss, acceptance estimate)
    cache_dir: str | None = None  # teacher data cache (default ~/.cache/yggtree/distill)
    text_chars: int = 0  # raw calibration text (calibration_texts) teacher-forced, in characters
    text_batch: int = 8  # sequences per teacher-forcing forward
    # head
    draft_vocab: int = 8192
    # target layers whose outputs the head reads (negative: from the end; -1 the last). Several:
    # their features are RMS-scaled, concatenated and reduced to H (EAGLE-3's feature fusion)
    target_layers: tuple[int, ...] = (-1,)
    reduce_init: str = "last"  # several layers: start the reduction as the last layer alone (or random)
    init_from_target: bool = True  # norm + LM head rows initialised from the target's
    fc_init: str = "random"  # identity: fc passes f_p through (f_{p+1} ~ f_p), block damped
    input_norm: bool = True  # RMSNorm on the embedding and the feature before fc
    draft_layers: int = 1  # decoder layers of the head
    init_from: str | None = None  # warm start: an EAGLE head directory of this shape (and its draft vocabulary)
    # training
    epochs: float = 2.0
    batch_size: int = 4  # sequences per step
    lr: float = 6e-4
    min_lr_frac: float = 0.05
    warmup_frac: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    unroll: int = 2  # training-time-test steps
    unroll_decay: float = 0.8  # loss weight of step k: decay**k
    ce_weight: float = 1.0
    reg_weight: float = 1.0
    prompt_weight: float = 0.5  # loss weight of positions inside the prompt (answers: 1)
    feature_noise: float = 0.0  # uniform noise on the true input features, x feature std
    eval_depth: int = 6  # depth of the offline acceptance estimate
    eval_every: int = 80  # training steps between validation passes
    save_dtype: str = "bfloat16"
    train_autocast: str = "bfloat16"  # matmul dtype of the training forward (none | bfloat16)
    threads: int | None = None
    # transcript training (yggtree transcripts): shards replace the calibration prompts
    transcripts: str | None = None  # directory of train-*.safetensors (and heldout-*.safetensors)
    max_tokens: int | None = None  # use train shards in index order up to this many tokens
    heldout_seqs: int = 96  # held-out conversations in each validation pass (heldout shards)
    feature_cache: str | None = None  # default ~/.cache/yggtree/features
    # resumable training
    checkpoint_every: int = 200  # steps between checkpoints (out/checkpoint.pt)
    budget_minutes: float | None = None  # stop after this much training, checkpointed; rerun continues


# ----------------------------------------------------------------------------- helpers


def _progress():
    return stderr_progress()


_plain = PlainLog()


def target_fingerprint(model) -> str:
    """A short hash of the target's config and a sample of its weights."""
    h = hashlib.sha256(json.dumps(asdict(model.cfg), sort_keys=True, default=str).encode())
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        h.update(name.encode())
        h.update(flat[:: max(1, flat.numel() // 4096)].float().numpy().tobytes())
    return h.hexdigest()[:16]


def special_ids(tokenizer, model_cfg) -> list[int]:
    """Every special token id the draft vocabulary must contain (EOS, chat markers)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(model_cfg.eos_token_ids)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            ids.add(v)
    return sorted(i for i in ids if 0 <= i < model_cfg.vocab_size)


# ----------------------------------------------------------------------------- teacher data


@dataclass
class TeacherData:
    """Sequences concatenated: ``tokens[offsets[i]:offsets[i+1]]`` and their features."""

    tokens: torch.Tensor  # [N] int64 target ids
    feats: torch.Tensor  # [N, L*H] float16/float32: the L stored target layers' outputs, side by side
    offsets: torch.Tensor  # [n_seq + 1] int64
    role: torch.Tensor  # [N] uint8: 0 prompt / given text, 1 greedy answer, 2 sampled answer (transcripts.ROLE_*)

    @property
    def n_seq(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def seq(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.feats[a:b]

    def roles(self, i: int) -> torch.Tensor:
        return self.role[int(self.offsets[i]) : int(self.offsets[i + 1])]


def roles_from_prompt_lengths(lengths: torch.Tensor, n_prompt: torch.Tensor) -> torch.Tensor:
    """[N] uint8 roles of sequences of ``lengths`` whose first ``n_prompt`` tokens are the prompt and
    the rest a greedy answer."""
    return torch.cat([
        torch.cat([torch.zeros(int(p), dtype=torch.uint8), torch.ones(int(n) - int(p), dtype=torch.uint8)])
        for n, p in zip(lengths.tolist(), n_prompt.tolist())
    ]) if len(lengths) else torch.zeros(0, dtype=torch.uint8)


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    layers: tuple[int, ...],
) -> list[tuple[list[int], torch.Tensor, int]]:
    """Greedy answers for a batch of prompts, with the ``layers`` outputs (side by side,
    [..., len(layers) * H]) of every position.

    One static cache of batch ``B``: prompt ``b`` occupies slots ``0..n_b-1`` and its answer
    continues at ``n_b``; padded prompt tokens write to the scratch slot. Returns per prompt
    (prompt + answer tokens, features [len, H] of exactly those tokens, prompt length): the last
    answer token's feature is computed too (one extra step), so every token has its feature.
    """
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    w = int(lens.max())
    s = w + max_new_tokens + 2  # + the scratch slot
    model.setup_cache(b, s)
    toks = torch.zeros(b, w, dtype=torch.int64)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p)
    ar = torch.arange(w)
    real = ar[None, :] < lens[:, None]  # [B, W]
    slots = torch.where(real, ar[None, :], s - 1)
    pos = torch.where(real, ar[None, :], 0)
    cols = torch.arange(s)
    mask = (cols[None, None, :] <= ar[None, :, None]) & (cols[None, None, :] < lens[:, None, None])
    out = model(toks, pos, slots, mask, layers)
    f_all = torch.cat(list(out.layers), dim=-1)  # [B, W, L*H]
    feats = [[f_all[i, : lens[i]]] for i in range(b)]
    last = out.hidden[torch.arange(b), lens - 1]  # [B, H]
    nxt = model.logits(last).argmax(-1)  # [B]
    answers: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    eos = torch.tensor(sorted(eos_ids) or [-1])
    for step in range(max_new_tokens):
        active = ~done  # rows that emit ``nxt`` at this step
        for i in torch.nonzero(active).flatten().tolist():
            answers[i].append(int(nxt[i]))
        done |= active & torch.isin(nxt, eos)
        # feed the emitted tokens: their features (and the next logits)
        p = lens + step  # position = slot of the token fed now
        m = cols[None, None, :] <= p[:, None, None]
        o = model(nxt[:, None], p[:, None], p[:, None], m, layers)
        o_all = torch.cat(list(o.layers), dim=-1)  # [B, 1, L*H]
        for i in torch.nonzero(active).flatten().tolist():
            feats[i].append(o_all[i])
        if bool(done.all()):
            break
        nxt = model.logits(o.hidden[:, 0]).argmax(-1)
    return [
        (list(prompts[i]) + answers[i], torch.cat(feats[i]), len(prompts[i])) for i in range(b)
    ]


def build_teacher(
    model,
    prompt_ids: list[list[int]],
    cfg: DistillConfig,
    eos_ids: tuple[int, ...],
    layers: tuple[int, ...],
    progress,
) -> TeacherData:
    """Run the target over every prompt (batches of similar lengths, in a fixed order)."""
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    results: dict[int, tuple[list[int], torch.Tensor, int]] = {}
    task = progress.add_task("teacher data (prompts)", total=len(order))
    n_tok = 0
    t0 = time.perf_counter()
    for start in range(0, len(order), cfg.gen_batch):
        idx = order[start : start + cfg.gen_batch]
        outs = generate_batch(model, [prompt_ids[i] for i in idx], cfg.max_new_tokens, eos_ids, layers)
        for i, o in zip(idx, outs):
            results[i] = o
            n_tok += len(o[0])
        rate = n_tok / (time.perf_counter() - t0)
        desc = f"teacher data ({n_tok} tokens, {rate:.0f} tok/s)"
        progress.update(task, advance=len(idx), description=desc)
        _plain(f"{desc}: {start + len(idx)}/{len(order)} prompts")
    seqs = [results[i] for i in range(len(prompt_ids))]
    lengths = torch.tensor([len(t) for t, _, _ in seqs])
    feats = torch.cat([f for _, f, _ in seqs]).float()
    amax = float(feats.abs().max())
    store = feats.to(torch.float16) if amax < 60000 else feats  # float16 keeps 11 mantissa bits
    return TeacherData(
        tokens=torch.tensor([t for toks, _, _ in seqs for t in toks], dtype=torch.int64),
        feats=store,
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        role=roles_from_prompt_lengths(lengths, torch.tensor([n for _, _, n in seqs], dtype=torch.int64)),
    )


def teacher_force(model, seqs: list[list[int]], layers: tuple[int, ...], batch: int, progress) -> TeacherData:
    """The ``layers`` outputs (side by side) at every position of fixed texts (one causal forward per batch of
    similar lengths). No answer: every role is 0 (given text), so these positions get the
    prompt loss weight and never count as greedy answers in the acceptance estimate."""
    task = progress.add_task("teacher forcing (texts)", total=len(seqs))
    n_tok, t0 = [0], time.perf_counter()

    def on_batch(rows: int, toks: int) -> None:
        n_tok[0] += toks
        desc = f"teacher forcing ({n_tok[0]} tokens, {n_tok[0] / (time.perf_counter() - t0):.0f} tok/s)"
        progress.update(task, advance=rows, description=desc)
        _plain(desc)

    feats = prefill_sequences(model, seqs, layers, batch, on_batch)
    lengths = torch.tensor([len(t) for t in seqs], dtype=torch.int64)
    f = torch.cat(feats)
    return TeacherData(
        tokens=torch.tensor([t for q in seqs for t in q], dtype=torch.int64),
        feats=f.to(torch.float16) if float(f.abs().max()) < 60000 else f,
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        role=torch.zeros(int(lengths.sum()), dtype=torch.uint8),
    )


@dataclass(frozen=True)
class FeatureLayout:
    """Which target layers the teacher data stores, side by side, and which of them the head reads.

    The head reads ``inputs``; the training targets (the target's next-token distribution, the
    feature regression) come from the target's last layer, stored after the inputs when it is
    not one of them."""

    hidden: int  # the target's hidden size H
    inputs: tuple[int, ...]  # target layers the head reads, in its order
    stored: tuple[int, ...]  # target layers stored: ``inputs`` then the last layer if absent
    last: int  # position of the target's last layer in ``stored``

    @staticmethod
    def make(layers: tuple[int, ...], num_layers: int, hidden: int) -> "FeatureLayout":
        """``layers`` may count from the end (-1: the last); refused out of range or repeated."""
        if not layers:
            raise YggError("target-layers is empty")
        res = tuple(i if i >= 0 else num_layers + i for i in layers)
        for given, i in zip(layers, res):
            if not 0 <= i < num_layers:
                raise YggError(f"target-layer {given} is out of range for {num_layers} layers")
        if len(set(res)) != len(res):
            raise YggError(f"target-layers {list(layers)} name a layer twice")
        top = num_layers - 1
        stored = res if top in res else res + (top,)
        return FeatureLayout(hidden, res, stored, stored.index(top))

    @property
    def width(self) -> int:
        return len(self.stored) * self.hidden

    def head_input(self, f: torch.Tensor) -> torch.Tensor:
        """[..., width] stored features -> [..., len(inputs) * H] the head's input layers."""
        return f[..., : len(self.inputs) * self.hidden]

    def last_layer(self, f: torch.Tensor) -> torch.Tensor:
        """[..., width] stored features -> [..., H] the target's last layer."""
        return f[..., self.last * self.hidden : (self.last + 1) * self.hidden]


def concat_teacher(parts: list[TeacherData], feats: torch.Tensor | None = None) -> TeacherData:
    """One :class:`TeacherData` holding the sequences of ``parts`` in order. ``feats``: their
    features already side by side in one tensor (the parts are views of it), used as is."""
    parts = [d for d in parts if d.n_seq > 0]
    if len(parts) == 1 and feats is None:
        return parts[0]
    dtype = torch.float16 if all(d.feats.dtype == torch.float16 for d in parts) else torch.float32
    offs, base = [torch.zeros(1, dtype=torch.int64)], 0
    for d in parts:
        offs.append(d.offsets[1:] + base)
        base += int(d.offsets[-1])
    return TeacherData(
        tokens=torch.cat([d.tokens for d in parts]),
        feats=feats if feats is not None else torch.cat([d.feats.to(dtype) for d in parts]),
        offsets=torch.cat(offs),
        role=torch.cat([d.role for d in parts]),
    )


def calibration_text_chunks(skip: int, max_chars: int, seed: int) -> list[str]:
    """Calibration corpus chunks after the first ``skip`` (those become the chat prompts), whole
    chunks up to ``max_chars`` characters in corpus order."""
    from ..data import calibration_corpus

    out, total = [], 0
    for chunk in calibration_corpus(None, seed).chunks[skip:]:
        if total + len(chunk.text) > max_chars:
            break
        out.append(chunk.text)
        total += len(chunk.text)
    return out


def teacher_hash(data: TeacherData) -> str:
    """sha256 of the teacher tensors' bytes (the file's own bytes are not stable: safetensors
    writes its metadata map in arbitrary order)."""
    h = hashlib.sha256()
    for name in ("tokens", "feats", "offsets", "role"):
        t = getattr(data, name).contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    return h.hexdigest()


def save_teacher(data: TeacherData, path: Path, meta: dict) -> str:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(
        {
            "tokens": data.tokens.to(torch.int32).contiguous(),
            "feats": data.feats.contiguous(),
            "offsets": data.offsets.contiguous(),
            "role": data.role.contiguous(),
        },
        str(tmp),
        metadata={"format": str(TEACHER_FORMAT), "meta": json.dumps(meta, sort_keys=True)},
    )
    tmp.replace(path)
    return teacher_hash(data)


def load_teacher(path: Path, width: int) -> TeacherData:
    """``width``: the stored features' width (stored layers x hidden size)."""
    st = read_safetensors(path, "teacher data")
    for k in ("tokens", "feats", "offsets", "role"):
        if k not in st:
            raise YggError(f"teacher data {path} lacks tensor {k!r} (made by an older yggtree: delete it to rebuild)")
    data = TeacherData(st["tokens"].to(torch.int64), st["feats"], st["offsets"], st["role"].to(torch.uint8))
    if data.feats.shape != (data.tokens.shape[0], width) or int(data.offsets[-1]) != data.tokens.shape[0]:
        raise YggError(f"teacher data {path} has inconsistent shapes (features of width {width})")
    return data


# ----------------------------------------------------------------------------- vocabulary


def build_draft_vocab(tokens: torch.Tensor, vocab_size: int, size: int, specials: list[int]) -> torch.Tensor:
    """The ``size`` most frequent ids of ``tokens`` (ties: lower id first) plus ``specials``,
    sorted by id. Specials take the place of the least frequent picks."""
    if not 1 <= size <= vocab_size:
        raise YggError(f"draft vocabulary size {size} is outside 1..{vocab_size}")
    specials = sorted(set(specials))
    if len(specials) > size:
        raise YggError(f"draft vocabulary size {size} is smaller than the {len(specials)} special tokens")
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    # stable order: by count descending, then id ascending
    key = counts * (vocab_size + 1) - torch.arange(vocab_size, dtype=torch.float64)
    key[specials] = float("inf")
    top = torch.topk(key, size).indices
    return torch.sort(top).values.to(torch.int64)


def vocab_coverage(tokens: torch.Tensor, vmap: torch.Tensor, vocab_size: int) -> float:
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vmap] = True
    return float(inside[tokens].float().mean()) if tokens.numel() else 0.0


# ----------------------------------------------------------------------------- the training forward


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
    from ..runtime.model import apply_rope

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


def _autocast(cfg: DistillConfig):
    """bfloat16 matmuls in the head's forward (about 2x faster on AVX-512 BF16); losses, the
    target's distribution and the optimizer stay float32."""
    import contextlib

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
        with _autocast(cfg):
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


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    net, th: TargetHead, data: TeacherData, idx: list[int], cfg: DistillConfig, feat_scale: torch.Tensor, rope,
    layout: FeatureLayout,
) -> dict:
    """Validation losses (step 0 and the unrolled steps) and the offline chain acceptance estimate.

    Acceptance by depth ``d``: over roots ``r`` inside greedy answers (so the tokens after the root
    are exactly what a fully accepted chain would feed), the fraction where the head's top-1 at
    draft depth ``j`` (unrolled step ``j`` at pair ``r+j``) equals the target's full-vocabulary
    argmax for every ``j < d``; and the same with top-k (k = 8) for the first miss."""
    steps = max(cfg.eval_depth, cfg.unroll)
    sums = None
    n_batches = 0
    acc_hits = torch.zeros(cfg.eval_depth)
    acc_roots = 0
    topk_hits = torch.zeros(cfg.eval_depth)
    tree_hits = torch.zeros(cfg.eval_depth)
    for s in range(0, len(idx), cfg.batch_size):
        batch = make_batch(data, idx[s : s + cfg.batch_size], cfg.max_seq_len, layout)
        outs = unrolled_forward(net, batch.tok, batch.feat, steps, rope)
        _, metrics = step_losses(net, th, outs[: cfg.unroll], batch, feat_scale, cfg)
        sums = metrics if sums is None else [
            {k: a[k] + b[k] for k in a} for a, b in zip(sums, metrics)
        ]
        n_batches += 1
        # full-vocab argmax of the target at p+1
        arg_full = (th.normed(batch.nxt_feat) @ th.w_full.T).argmax(-1)  # [B, T]
        hit = []
        hitk = []
        hit4 = []
        for k in range(cfg.eval_depth):
            lq = net.logits(outs[k])
            top = net.draft_vocab[lq.topk(8, dim=-1).indices]  # [B, T, 8]
            hit.append(top[..., 0] == arg_full)
            hitk.append((top == arg_full[..., None]).any(-1))
            hit4.append((top[..., :4] == arg_full[..., None]).any(-1))
        t = batch.tok.shape[1]
        d = cfg.eval_depth
        n_roots = t - d
        if n_roots > 0:
            ok = batch.valid & batch.greedy
            root_ok = ok.unfold(1, d, 1)[:, :n_roots].all(-1)  # [B, R]: window r..r+d-1 greedy
            h1 = torch.stack([hit[j][:, j : j + n_roots] for j in range(d)])  # [d, B, R]
            hk = torch.stack([hitk[j][:, j : j + n_roots] for j in range(d)])
            h4 = torch.stack([hit4[j][:, j : j + n_roots] for j in range(d)])
            tree_hits += (torch.cumprod(h4.int(), dim=0).bool() & root_ok).flatten(1).sum(1).float()
            chain = torch.cumprod(h1.int(), dim=0).bool()  # accepted through depth j
            before = torch.cat([torch.ones_like(chain[:1]), chain[:-1]])  # reached depth j
            acc_hits += (chain & root_ok).flatten(1).sum(1).float()
            topk_hits += (before & hk & root_ok).flatten(1).sum(1).float()
            acc_roots += int(root_ok.sum())
    val = [{k: v / max(n_batches, 1) for k, v in m.items()} for m in (sums or [])]
    acc = (acc_hits / max(acc_roots, 1)).tolist()
    acck = (topk_hits / max(acc_roots, 1)).tolist()
    return {
        "val_ce": val[0]["ce"] if val else float("nan"),
        "val_kl": val[0]["kl"] if val else float("nan"),
        "val_reg": val[0]["reg"] if val else float("nan"),
        "val_top1_by_step": [m["top1"] for m in val],
        "val_kl_by_step": [m["kl"] for m in val],
        "accept_by_depth": acc,  # P(chain accepts >= d tokens), d = 1..eval_depth
        "top8_at_depth": acck,  # P(chain reached depth d-1 and the target's token is in the top 8)
        "chain_roots": acc_roots,
        "est_chain4_aal": 1.0 + sum(acc[:4]),
        # a tree holding the head's top-4 at every node of the true path, eval_depth deep (an upper
        # bound of what W_d = 4 trees of that depth accept)
        "accept_top4_tree_by_depth": (tree_hits / max(acc_roots, 1)).tolist(),
        "est_tree4_aal": 1.0 + float((tree_hits / max(acc_roots, 1)).sum()),
    }


# ----------------------------------------------------------------------------- training

CHECKPOINT_FILE = "checkpoint.pt"
# settings that may change between a run and its resumption (they do not change the result)
RESUMABLE_FIELDS = ("out", "threads", "budget_minutes", "checkpoint_every", "cache_dir", "feature_cache")


def checkpoint_identity(cfg: DistillConfig, data_sha: str) -> dict:
    """What a checkpoint must match to be resumed: every result-changing setting and the data."""
    d = {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_FIELDS}
    d["target_layers"] = list(d["target_layers"])
    if d["draft_layers"] == 1:  # the default: checkpoints written before the option still resume
        del d["draft_layers"]
    if d["init_from"] is None:  # likewise
        del d["init_from"]
    return d | {"data_sha256": data_sha}


def save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, identity: dict) -> dict | None:
    """The checkpoint at ``path`` if there is one; refused (one line) when it belongs to another run."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=False)
        assert isinstance(state, dict) and "identity" in state
    except Exception:  # noqa: BLE001 - torch.load raises many types for damaged files
        raise YggError(f"cannot read checkpoint {path}: damaged or not a yggtree distill checkpoint "
                       "(delete it to start over)") from None
    theirs = state["identity"]
    diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
    if diff:
        k = diff[0]
        raise YggError(f"checkpoint {path} belongs to another run: {k} is {theirs.get(k)!r} there, "
                       f"{identity.get(k)!r} here (use another --out, or delete the checkpoint)")
    return state


def _world() -> tuple[int, int]:
    """(rank, world size) under torchrun (gloo), else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _join_process_group() -> None:
    """Under torchrun (WORLD_SIZE > 1) join the process group: gloo on CPUs, nccl on GPUs."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _all_reduce_grads(params, world: int) -> None:
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def train(
    net, th: TargetHead, data: TeacherData, train_idx, val_idx, cfg: DistillConfig, progress, log,
    layout: FeatureLayout, ckpt: Path | None = None, identity: dict | None = None,
) -> dict:
    """AdamW + linear warm-up + cosine decay; returns the final validation metrics (empty when the
    ``budget_minutes`` ran out first: ``log["complete"]`` is False and ``ckpt`` holds the state).

    With ``ckpt``, the state (weights, optimizer, data order, random state, log) is written there
    every ``checkpoint_every`` steps and at the end; a run started with a checkpoint present
    continues from it and ends with the same weights as an uninterrupted run. Under torchrun each
    rank takes its share of every batch and the gradients are averaged (gloo)."""
    from ..runtime.model import rope_table

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    rope = rope_table(net.cfg.layer_config(), cfg.max_seq_len + 8)
    params = [p for p in net.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    steps_per_epoch = math.ceil(len(train_idx) / cfg.batch_size)
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    warm = max(1, int(cfg.warmup_frac * total))

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    # feature scale for the regression loss (scale-free smooth L1)
    feat_scale = feature_dim_std(layout.last_layer(data.feats))
    log["feat_scale"] = {"dim_std_min": float(feat_scale.min()), "dim_std_max": float(feat_scale.max())}
    rank, world = _world()
    if cfg.batch_size % world:
        raise YggError(f"batch-size {cfg.batch_size} is not a multiple of the {world} processes")
    order: list[int] = []
    step = 0
    ema = None
    trained_s = 0.0
    state = load_checkpoint(ckpt, identity or {}) if ckpt is not None else None
    if state is not None:
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, order, ema, trained_s = state["step"], state["order"], state["ema"], state["trained_s"]
        log.update(state["log"])
        _plain(f"resumed from {ckpt} at step {step}/{total}", force=True)
    rows = log.setdefault("curve", [])

    def checkpoint() -> None:
        if ckpt is not None and rank == 0:
            save_checkpoint(ckpt, {
                "identity": identity or {}, "net": net.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                "step": step, "order": order, "ema": ema, "trained_s": trained_s + time.perf_counter() - t0,
                "log": log,
            })

    task = progress.add_task("training", total=total, completed=step)
    t0 = time.perf_counter()
    budget_s = cfg.budget_minutes * 60 if cfg.budget_minutes is not None else None
    log["complete"] = step >= total
    while step < total:
        if not order:
            order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=gen).tolist()]
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        if world > 1:
            idx = idx[rank::world] or idx[:1]
        batch = make_batch(data, idx, cfg.max_seq_len, layout, cfg.prompt_weight)
        if cfg.feature_noise > 0:
            u = torch.rand(batch.feat.shape, generator=gen) * 2 - 1
            per_layer = batch.feat.unflatten(-1, (-1, layout.hidden))  # [B, T, L, H]
            rms = per_layer.pow(2).mean(-1, keepdim=True).sqrt().expand_as(per_layer).flatten(-2)
            batch.feat = batch.feat + u * (cfg.feature_noise * rms)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with _autocast(cfg):
            outs = unrolled_forward(net, batch.tok, batch.feat, cfg.unroll, rope)
        loss, metrics = step_losses(net, th, outs, batch, feat_scale, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            _all_reduce_grads(params, world)
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        row = {
            "step": step,
            "epoch": step / steps_per_epoch,
            "lr": lr_at(step - 1),
            "loss": lv,
            "ce": metrics[0]["ce"],
            "kl": metrics[0]["kl"],
            "reg": metrics[0]["reg"],
            "top1": metrics[0]["top1"],
            "top1_last_step": metrics[-1]["top1"],
            "grad_norm": float(gnorm),
            "elapsed_s": trained_s + time.perf_counter() - t0,
            "tokens_seen": log.get("tokens_seen", 0) + int(batch.valid.sum()) * world,
        }
        log["tokens_seen"] = row["tokens_seen"]
        if val_idx and rank == 0 and (step % cfg.eval_every == 0 or step == total):
            net.eval()
            ev = evaluate(net, th, data, val_idx, cfg, feat_scale, rope, layout)
            row.update(val_ce=ev["val_ce"], val_kl=ev["val_kl"], val_reg=ev["val_reg"],
                       val_top1=ev["val_top1_by_step"][0], est_chain4_aal=ev["est_chain4_aal"],
                       est_tree4_aal=ev["est_tree4_aal"])
            log["last_eval"] = ev
        rows.append(row)
        desc = (
            f"training (loss {ema:.3f}, top1 {metrics[0]['top1']:.2f}"
            + (f", val est. chain-4 AAL {log['last_eval']['est_chain4_aal']:.2f}" if "last_eval" in log else "")
            + ")"
        )
        progress.update(task, advance=1, description=desc)
        _plain(f"{desc}: step {step}/{total}", force="val_kl" in row)
        over = budget_s is not None and time.perf_counter() - t0 >= budget_s and step < total
        if step % cfg.checkpoint_every == 0 or step == total or over:
            checkpoint()
        if over:
            log["train_s"] = trained_s + time.perf_counter() - t0
            _plain(f"budget of {cfg.budget_minutes} min used: checkpoint at step {step}/{total}", force=True)
            return {}
    log["train_s"] = trained_s + time.perf_counter() - t0
    log["steps"] = total
    log["steps_per_epoch"] = steps_per_epoch
    log["complete"] = True
    return log.get("last_eval", {})


# ----------------------------------------------------------------------------- report


def write_report(out: Path, curve: list[dict], ev: dict) -> None:
    """loss.png, acceptance.png, train_log.csv, acceptance.csv under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in curve for k in r}, key=lambda k: (k != "step", k))
    with (out / "train_log.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(curve)
    acc = ev.get("accept_by_depth", [])
    topk = ev.get("top8_at_depth", [])
    top1 = ev.get("val_top1_by_step", [])
    with (out / "acceptance.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["depth", "accept_chain_top1", "top8_hit", "val_top1_unrolled_step"])
        for d in range(len(acc)):
            w.writerow([d + 1, acc[d], topk[d] if d < len(topk) else "", top1[d] if d < len(top1) else ""])

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in curve]
    ax[0].plot(steps, [r["loss"] for r in curve], lw=0.6, alpha=0.5, label="train loss (weighted)")
    ax[0].plot(steps, [r["kl"] for r in curve], lw=0.6, alpha=0.5, label="train KL (step 0)")
    vs = [r for r in curve if "val_kl" in r]
    if vs:
        ax[0].plot([r["step"] for r in vs], [r["val_kl"] for r in vs], "o-", label="val KL (step 0)")
        ax[0].plot([r["step"] for r in vs], [r["val_reg"] for r in vs], "s-", label="val feature reg.")
    ax[0].set_xlabel("step")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[0].set_title("loss")
    ax[1].plot(steps, [r["top1"] for r in curve], lw=0.6, alpha=0.5, label="train top-1 (step 0)")
    ax[1].plot(steps, [r["top1_last_step"] for r in curve], lw=0.6, alpha=0.5, label="train top-1 (last unrolled)")
    if vs:
        ax[1].plot([r["step"] for r in vs], [r["val_top1"] for r in vs], "o-", label="val top-1 (step 0)")
    ax[1].set_xlabel("step")
    ax[1].set_ylim(0, 1)
    ax[1].legend()
    ax[1].set_title("agreement with the target")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    depth = list(range(1, len(acc) + 1))
    ax.plot(depth, acc, "o-", label="P(chain accepts >= d)")
    if topk:
        ax.plot(depth, topk, "s--", label="P(reached d-1, target token in top 8)")
    if top1:
        ax.plot(list(range(1, len(top1) + 1)), top1, "^:", label="top-1 agreement at unrolled step d-1")
    ax.set_xlabel("draft depth d")
    ax.set_ylim(0, 1)
    ax.set_title(f"held-out acceptance (est. chain-4 AAL {ev.get('est_chain4_aal', float('nan')):.2f})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the command


def _cfg_from_args(args) -> DistillConfig:
    fields = DistillConfig.__dataclass_fields__
    return DistillConfig(**{k: getattr(args, k) for k in fields if hasattr(args, k)})


def check_config(cfg: DistillConfig) -> None:
    checks = [
        (cfg.prompts >= 2, f"prompts must be >= 2, got {cfg.prompts}"),
        (cfg.max_new_tokens >= 1, f"max-new-tokens must be >= 1, got {cfg.max_new_tokens}"),
        (cfg.gen_batch >= 1, f"gen-batch must be >= 1, got {cfg.gen_batch}"),
        (cfg.max_seq_len >= 8, f"max-seq-len must be >= 8, got {cfg.max_seq_len}"),
        (0 <= cfg.val_frac < 1, f"val-frac must be in [0, 1), got {cfg.val_frac}"),
        (cfg.epochs > 0, f"epochs must be > 0, got {cfg.epochs}"),
        (cfg.batch_size >= 1, f"batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.lr > 0, f"lr must be > 0, got {cfg.lr}"),
        (cfg.unroll >= 1, f"unroll must be >= 1, got {cfg.unroll}"),
        (cfg.eval_depth >= 1, f"eval-depth must be >= 1, got {cfg.eval_depth}"),
        (cfg.save_dtype in ("float32", "bfloat16"), f"save-dtype must be float32 or bfloat16, got {cfg.save_dtype}"),
        (cfg.fc_init in ("identity", "random"), f"fc-init must be identity or random, got {cfg.fc_init}"),
        (cfg.train_autocast in ("none", "bfloat16"), f"train-autocast must be none or bfloat16, got {cfg.train_autocast}"),
        (cfg.teacher_dtype in ("float32", "bfloat16"), f"teacher-dtype must be float32 or bfloat16, got {cfg.teacher_dtype}"),
        (cfg.snippet_chars >= 50, f"snippet-chars must be >= 50, got {cfg.snippet_chars}"),
        (cfg.max_tokens is None or cfg.max_tokens >= 1, f"max-tokens must be >= 1, got {cfg.max_tokens}"),
        (cfg.heldout_seqs >= 1, f"heldout-seqs must be >= 1, got {cfg.heldout_seqs}"),
        (cfg.checkpoint_every >= 1, f"checkpoint-every must be >= 1, got {cfg.checkpoint_every}"),
        (cfg.budget_minutes is None or cfg.budget_minutes > 0, f"budget-minutes must be > 0, got {cfg.budget_minutes}"),
        (cfg.reduce_init in ("last", "random"), f"reduce-init must be last or random, got {cfg.reduce_init}"),
        (cfg.draft_layers >= 1, f"draft-layers must be >= 1, got {cfg.draft_layers}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise YggError(msg)


@torch.no_grad()
def init_head(net, target, vmap: torch.Tensor, cfg: DistillConfig, layout: FeatureLayout) -> None:
    """The head's starting point: the target's norm and LM head rows (``init_from_target``), fc
    passing the feature through and every decoder layer damped (``fc_init`` identity), the fusion
    of several layers starting as the last layer alone (``reduce_init`` last)."""
    h = target.cfg.hidden_size
    if cfg.init_from_target:
        net.norm.weight.copy_(target.norm.weight)
        net.lm_head.weight.copy_(target.lm_head.weight[vmap])
    if cfg.fc_init == "identity":
        # the target's features are large (std ~40, outlier dims in the thousands for
        # SmolLM2): start from f̂_{p+1} = f_p and let the block learn the change
        net.fc.weight[:, h:].copy_(torch.eye(h))
        net.fc.bias.zero_()
        for block in net.layers:
            block.self_attn.o_proj.weight.mul_(0.1)
            block.mlp.down_proj.weight.mul_(0.1)
    if len(layout.inputs) > 1 and cfg.reduce_init == "last" and layout.last < len(layout.inputs):
        # the fused feature starts as the (RMS-scaled) last layer alone: the single-layer head's
        # starting point, from which the other layers' blocks learn what they add
        net.reduce.weight.zero_()
        net.reduce.weight[:, layout.last * h : (layout.last + 1) * h].copy_(torch.eye(h))


def warm_start_head(cfg: DistillConfig, target, layout: FeatureLayout, v_d: int):
    """The head ``cfg.init_from`` to continue training from; refused (one line naming the
    directory) unless it has the shape this run asks for."""
    from ..runtime.eagle import load_eagle

    base = load_eagle(cfg.init_from, target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll))
    hc = base.cfg
    for name, theirs, ours in (
        ("target layers", tuple(hc.target_layers), tuple(layout.inputs)),
        ("draft vocabulary", hc.draft_vocab_size, v_d),
        ("decoder layers", hc.num_layers, cfg.draft_layers),
        ("input norm", hc.input_norm, cfg.input_norm),
    ):
        if theirs != ours:
            raise YggError(f"--init-from {cfg.init_from}: the head has {name} {theirs}, this run asks for {ours}")
    base.net.float()
    return base


def prompt_data(cfg: DistillConfig, target, tokenizer, prompt_ids, layout: "FeatureLayout", progress):
    """Teacher data from calibration chat prompts answered by the target (plus teacher-forced
    calibration text): (data, train_idx, val_idx, manifest "data" entries)."""
    from ..data import calibration_chat_prompts, corpus_hash
    from ..runtime.loading import encode_auto

    tc = target.cfg
    if prompt_ids is None:
        prompts = calibration_chat_prompts(cfg.prompts, cfg.seed, cfg.snippet_chars, cfg.prompt_style)
        prompt_texts = [p.text for p in prompts]
        data_hash = corpus_hash(prompt_texts)
        prompt_ids = [encode_auto(tokenizer, t) for t in prompt_texts]
    else:
        if len(prompt_ids) < cfg.prompts:
            raise YggError(f"{len(prompt_ids)} prompts given, asked for {cfg.prompts}")
        prompt_ids = [list(p) for p in prompt_ids[: cfg.prompts]]
        data_hash = corpus_hash([json.dumps(p) for p in prompt_ids])
    max_prompt = cfg.max_seq_len  # prompts longer than the training window are cut on the left
    prompt_ids = [p[-max_prompt:] for p in prompt_ids]
    eos = tuple(tc.eos_token_ids) or (
        (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
    )
    fp = target_fingerprint(target)
    data_meta = {
        "format": TEACHER_FORMAT,
        "target_fingerprint": fp,
        "target_layers": list(layout.stored),
        "prompts_hash": data_hash,
        "prompt_ids_hash": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest(),
        "max_new_tokens": cfg.max_new_tokens,
        "teacher_dtype": cfg.teacher_dtype,
        "eos": list(eos),
    }
    key = hashlib.sha256(json.dumps(data_meta, sort_keys=True).encode()).hexdigest()[:20]
    cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache" / "yggtree" / "distill"
    teacher_path = cache_root / key / TEACHER_FILE

    t0 = time.perf_counter()
    reused = teacher_path.is_file()
    teacher = None

    def teacher_model():
        nonlocal teacher
        if teacher is None:
            teacher = target
            if cfg.teacher_dtype != "float32":
                import copy

                teacher = copy.deepcopy(target).to(getattr(torch, cfg.teacher_dtype))
        return teacher

    if reused:
        data = load_teacher(teacher_path, layout.width)
        teacher_sha = teacher_hash(data)
    else:
        data = build_teacher(teacher_model(), prompt_ids, cfg, eos, layout.stored, progress)
        teacher_sha = save_teacher(data, teacher_path, data_meta)
    text_info = None
    if cfg.text_chars > 0:
        texts = calibration_text_chunks(cfg.prompts, cfg.text_chars, cfg.seed)
        text_ids = [tokenizer.encode(t)[: cfg.max_seq_len + 1] for t in texts]
        text_ids = [t for t in text_ids if len(t) >= 8]
        text_meta = {
            "format": TEACHER_FORMAT,
            "kind": "teacher-forced calibration texts",
            "target_fingerprint": fp,
            "target_layers": list(layout.stored),
            "texts_hash": corpus_hash(texts),
            "ids_hash": hashlib.sha256(json.dumps(text_ids).encode()).hexdigest(),
            "teacher_dtype": cfg.teacher_dtype,
        }
        tkey = hashlib.sha256(json.dumps(text_meta, sort_keys=True).encode()).hexdigest()[:20]
        text_path = cache_root / tkey / TEACHER_FILE
        text_reused = text_path.is_file()
        if text_reused:
            tdata = load_teacher(text_path, layout.width)
            text_sha = teacher_hash(tdata)
        else:
            tdata = teacher_force(teacher_model(), text_ids, layout.stored, cfg.text_batch, progress)
            text_sha = save_teacher(tdata, text_path, text_meta)
        text_info = {
            "source": "yggtree.data.calibration_corpus chunks after those used by the chat "
            "prompts, teacher-forced (no generation)",
            "n_texts": len(text_ids),
            "n_chars": sum(len(t) for t in texts),
            "n_tokens": int(tdata.tokens.shape[0]),
            "texts_hash": text_meta["texts_hash"],
            "teacher_cache_key": tkey,
            "teacher_sha256": text_sha,
            "teacher_reused": text_reused,
        }
        data = concat_teacher([data, tdata])
    del teacher

    # split by a seeded permutation of sequences
    gen = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(data.n_seq, generator=gen).tolist()
    n_val = int(round(cfg.val_frac * data.n_seq)) if cfg.val_frac > 0 else 0
    n_val = min(max(n_val, 1 if cfg.val_frac > 0 else 0), data.n_seq - 1)
    val_idx, train_idx = sorted(perm[:n_val]), perm[n_val:]
    info = {
        "data_sha256": teacher_sha + (text_info["teacher_sha256"] if text_info else ""),
        "source": "yggtree.data.calibration_chat_prompts (stdlib source + pydoc topics, "
        "decontaminated against MT-Bench and HumanEval), answered greedily by the target",
        "corpus_hash": data_hash,
        "n_prompts": len(prompt_ids),
        "teacher_cache_key": key,
        "teacher_sha256": teacher_sha,
        "teacher_reused": reused,
        "teacher_meta": data_meta,
        "texts": text_info,
    }
    return data, train_idx, val_idx, info


def transcript_data(cfg: DistillConfig, target, tokenizer, layout: "FeatureLayout", progress):
    """Teacher data from transcript shards (``yggtree transcripts``): the train shards in index
    order (up to ``max_tokens``), the held-out shards for validation. Features come from the local
    cache, else by batched prefill of the token ids (then cached). A conversation whose prompt
    repeats an earlier one (across shards) is dropped. Returns (data, train_idx, val_idx, manifest
    "data" entries)."""
    import copy

    from . import transcripts as tr
    from .transcripts_cmd import feature_cache_root

    root = Path(cfg.transcripts).expanduser()
    if not root.is_dir():
        raise YggError(f"transcript directory {root} does not exist")
    fp = target_fingerprint(target)
    tok_fp = tr.tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    train_paths, held_paths = tr.shard_paths(root, "train"), tr.shard_paths(root, "heldout")
    if not train_paths:
        raise YggError(f"no train-*.safetensors shards in {root} (make them with yggtree transcripts)")
    if not held_paths:
        raise YggError(f"no heldout-*.safetensors shards in {root} (yggtree transcripts --split heldout)")
    shards, n_tok = [], 0
    for p in train_paths:
        if cfg.max_tokens is not None and n_tok >= cfg.max_tokens:
            break
        sh = tr.load_shard(p, fp, tok_fp)
        shards.append((p, sh))
        n_tok += sh.n_tokens
    held = [(p, tr.load_shard(p, fp, tok_fp)) for p in held_paths]
    cache = feature_cache_root(cfg.feature_cache)
    teacher = None
    parts, info_shards, reused = [], [], 0
    rank, world = _world()
    if rank != 0:  # data-parallel: rank 0 fills the feature cache, the others then read it
        torch.distributed.barrier()
    n_all = sum(sh.n_tokens for _, sh in shards + held)
    task = progress.add_task("features", total=n_all)
    # one preallocated float16 buffer (float32 only if some feature overflows float16): the
    # shards' features are copied in one by one, so the peak is the data plus one shard
    buf = torch.empty(n_all, layout.width, dtype=torch.float16)
    at = 0
    for p, sh in shards + held:
        fpath = tr.feature_path(cache, sh, layout.stored, cfg.teacher_dtype)
        feats = tr.load_features(fpath, sh.n_tokens, layout.width)
        if feats is None:
            if teacher is None:
                teacher = target if cfg.teacher_dtype == "float32" else copy.deepcopy(target).to(getattr(torch, cfg.teacher_dtype))
            feats = tr.prefill_features(teacher, sh, layout.stored, on_batch=lambda r, t: progress.update(task, advance=t))
            tr.save_features(feats, fpath)
        else:
            reused += 1
            progress.update(task, advance=sh.n_tokens)
        if buf.dtype == torch.float16 and feats.dtype != torch.float16 and float(feats.abs().max()) >= 60000:
            buf = buf.float()
        buf[at : at + sh.n_tokens] = feats
        at += sh.n_tokens
        del feats
        parts.append(TeacherData(sh.tokens, buf[at - sh.n_tokens : at], sh.offsets, sh.role))
        info_shards.append({"file": p.name, "sha256": sh.meta["sha256"], "tokens": sh.n_tokens,
                            "sequences": sh.n_seq, "counts": sh.meta["counts"]})
    del teacher
    if world > 1 and rank == 0:
        torch.distributed.barrier()
    data = concat_teacher(parts, feats=buf)
    n_train_seq = sum(sh.n_seq for _, sh in shards)
    seen: set[bytes] = set()
    keep_train, keep_val, dup = [], [], 0
    for i in range(data.n_seq):
        t, r = data.seq(i)[0], data.roles(i)
        first = int(torch.nonzero(r > 0)[0]) if bool((r > 0).any()) else len(t)
        key = hashlib.sha256(t[:first].numpy().tobytes()).digest()
        if key in seen:
            dup += 1
            continue
        seen.add(key)
        (keep_train if i < n_train_seq else keep_val).append(i)
    val_idx = keep_val[: cfg.heldout_seqs]
    gen = torch.Generator().manual_seed(cfg.seed)
    train_idx = [keep_train[j] for j in torch.randperm(len(keep_train), generator=gen).tolist()]
    roles = data.role
    h = hashlib.sha256(json.dumps([s["sha256"] for s in info_shards]).encode())
    info = {
        "data_sha256": h.hexdigest(),
        "source": "yggtree transcripts: self-synthesised and templated requests (decontaminated against "
        "MT-Bench and HumanEval), answered by the target",
        "shards": info_shards,
        "n_train_shards": len(shards),
        "n_heldout_shards": len(held),
        "duplicates_dropped": dup,
        "features_reused": reused,
        "n_greedy_answer_tokens": int((roles == tr.ROLE_GREEDY).sum()),
        "n_sampled_answer_tokens": int((roles == tr.ROLE_SAMPLED).sum()),
        "contaminated_dropped": sum(s["counts"].get("contaminated", 0) for s in info_shards),
    }
    return data, train_idx, val_idx, info


def distill(
    cfg: DistillConfig,
    argv: list[str] | None = None,
    target=None,
    tokenizer=None,
    prompt_ids: list[list[int]] | None = None,
) -> dict:
    """The whole pipeline; returns the manifest. ``target``, ``tokenizer`` and ``prompt_ids``
    (token ids of chat-templated prompts) may be given directly: tests use a tiny random target."""
    from ..runtime.eagle import EagleDrafter, save_eagle
    from ..runtime.loading import load_model, load_tokenizer, resolve_model

    check_config(cfg)
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise YggError(f"threads must be >= 1, got {cfg.threads}")
        torch.set_num_threads(cfg.threads)
    _join_process_group()
    t_start = time.perf_counter()
    out = Path(cfg.out).expanduser()
    model_path = None
    if target is None:
        src = resolve_model(cfg.model)
        model_path = str(src.path)
        target = load_model(src, "float32")
        tokenizer = load_tokenizer(src)
    tc = target.cfg
    layout = FeatureLayout.make(tuple(cfg.target_layers), tc.num_layers, tc.hidden_size)
    progress = _progress()
    with progress:
        t0 = time.perf_counter()
        if cfg.transcripts is not None:
            data, train_idx, val_idx, data_info = transcript_data(cfg, target, tokenizer, layout, progress)
        else:
            data, train_idx, val_idx, data_info = prompt_data(cfg, target, tokenizer, prompt_ids, layout, progress)
        data_s = time.perf_counter() - t0
        fp = target_fingerprint(target)
        train_tokens = torch.cat([data.seq(i)[0] for i in train_idx])
        val_tokens = torch.cat([data.seq(i)[0] for i in val_idx]) if val_idx else torch.zeros(0, dtype=torch.int64)

        specials = special_ids(tokenizer, tc)
        v_d = min(cfg.draft_vocab, tc.vocab_size)
        base = warm_start_head(cfg, target, layout, v_d) if cfg.init_from is not None else None
        vmap = base.net.draft_vocab if base is not None else build_draft_vocab(train_tokens, tc.vocab_size, v_d, specials)

        drafter = EagleDrafter.random(
            target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll), draft_vocab=vmap,
            seed=cfg.seed, target_layers=layout.inputs, input_norm=cfg.input_norm,
            num_layers=cfg.draft_layers,
        )
        net = drafter.net
        if base is not None:
            net.load_state_dict(base.net.state_dict(), strict=True)
        else:
            init_head(net, target, vmap, cfg, layout)
        net.train().requires_grad_(True)
        torch.manual_seed(cfg.seed)
        th = TargetHead(
            norm_weight=target.norm.weight.detach().float(),
            eps=tc.rms_norm_eps,
            w_draft=target.lm_head.weight.detach()[vmap].float(),
            w_full=target.lm_head.weight.detach().float(),
        )
        log: dict = {}
        identity = checkpoint_identity(cfg, data_info["data_sha256"])
        if base is not None:
            identity["init_sha256"] = file_sha256(Path(cfg.init_from) / "model.safetensors")
        ev = train(net, th, data, train_idx, val_idx, cfg, progress, log, layout, out / CHECKPOINT_FILE, identity)
    if _world()[0] != 0:  # data-parallel: rank 0 writes the head
        return {"complete": bool(log.get("complete")), "rank": _world()[0]}
    if not log.get("complete"):
        return {"complete": False, "out": str(out), "data": {"n_tokens": int(data.tokens.shape[0])},
                "training": {"steps": None, "val": {}}, "wall_time_s": {"train": log.get("train_s"), "data": data_s}}

    net.eval().requires_grad_(False)
    if cfg.save_dtype == "bfloat16":
        net.to(torch.bfloat16)
    final = EagleDrafter(net, target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll))
    save_eagle(final, out)
    write_report(out / "report", log.get("curve", []), ev)
    curve = log.get("curve", [])
    tail = curve[-20:]
    n_answer = int((data.role > 0).sum())
    manifest = {
        "kind": "eagle-distill",
        "command": "yggtree distill " + " ".join(argv) if argv is not None else None,
        "seed": cfg.seed,
        "hyperparameters": asdict(cfg),
        "target": {
            "model": cfg.model,
            "file": Path(model_path).name if model_path else None,
            "fingerprint": fp,
            "feature_layers": list(layout.inputs),
            "vocab_size": tc.vocab_size,
            "hidden_size": tc.hidden_size,
            "num_layers": tc.num_layers,
        },
        "data": data_info | {
            "n_sequences": data.n_seq,
            "n_tokens": int(data.tokens.shape[0]),
            "n_answer_tokens": n_answer,
            "n_train_sequences": len(train_idx),
            "n_val_sequences": len(val_idx),
            "n_train_tokens": int(train_tokens.shape[0]),
        },
        "draft_vocab": {
            "size": int(vmap.shape[0]),
            "specials": specials,
            "train_coverage": vocab_coverage(train_tokens, vmap, tc.vocab_size),
            "val_coverage": vocab_coverage(val_tokens, vmap, tc.vocab_size),
        },
        "training": {
            "steps": log.get("steps"),
            "steps_per_epoch": log.get("steps_per_epoch"),
            "feature_scale": log.get("feat_scale"),
            "train_loss": sum(r["loss"] for r in tail) / max(len(tail), 1),
            "train_kl": sum(r["kl"] for r in tail) / max(len(tail), 1),
            "train_top1": sum(r["top1"] for r in tail) / max(len(tail), 1),
            "val": ev,
        },
        "wall_time_s": {
            "data": data_s,
            "train": log.get("train_s"),
            "total": time.perf_counter() - t_start,
        },
        "weights_dtype": cfg.save_dtype,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def run_distill(args) -> int:
    """The ``distill`` subcommand. Returns the exit code."""
    cfg = _cfg_from_args(args)
    manifest = distill(cfg, getattr(args, "argv", None))
    if manifest.get("rank", 0) != 0:  # data-parallel: rank 0 reports and writes the head
        return 0
    if manifest.get("complete") is False:
        sys.stderr.write(f"stopped after the {cfg.budget_minutes} min budget; the checkpoint in {cfg.out} holds the "
                         "run: repeat the same command to continue\n")
        print(json.dumps({"distill": str(cfg.out), "complete": False}), flush=True)
        return 0
    tr = manifest["training"]
    ev = tr.get("val") or {}
    sys.stderr.write(
        f"wrote {cfg.out}: {manifest['data']['n_tokens']} teacher tokens, "
        f"{tr['steps']} steps in {manifest['wall_time_s']['train']:.0f} s, "
        f"val KL {ev.get('val_kl', float('nan')):.3f}, "
        f"est. chain-4 AAL {ev.get('est_chain4_aal', float('nan')):.2f}\n"
    )
    summary = {
        "distill": str(cfg.out),
        "n_tokens": manifest["data"]["n_tokens"],
        "train_s": manifest["wall_time_s"]["train"],
        "data_s": manifest["wall_time_s"]["data"],
        "val_kl": ev.get("val_kl"),
        "accept_by_depth": ev.get("accept_by_depth"),
        "est_chain4_aal": ev.get("est_chain4_aal"),
    }
    print(json.dumps(summary), flush=True)
    return 0


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def add_distill_arguments(p: argparse.ArgumentParser) -> None:
    d = DistillConfig()
    p.add_argument("--model", default=d.model, help="target: 'default', a HF directory or a .gguf file")
    p.add_argument("--out", default=d.out, help="output directory (config.json, model.safetensors, manifest.json, report/)")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("teacher data")
    g.add_argument("--prompts", type=int, default=d.prompts, help="calibration chat prompts answered by the target")
    g.add_argument("--snippet-chars", type=int, default=d.snippet_chars)
    g.add_argument("--prompt-style", default=d.prompt_style, choices=["basic", "varied"],
                   help="request templates around the calibration snippets (varied: more kinds of request)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="answer length cap")
    g.add_argument("--gen-batch", type=int, default=d.gen_batch)
    g.add_argument("--teacher-dtype", default=d.teacher_dtype, choices=["float32", "bfloat16"],
                   help="target dtype while answering the prompts (bfloat16: ~2x faster on AVX-512 BF16)")
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    g.add_argument("--val-frac", type=float, default=d.val_frac)
    g.add_argument("--cache-dir", default=None, help="teacher data cache (default ~/.cache/yggtree/distill)")
    g.add_argument("--text-chars", type=int, default=d.text_chars,
                   help="characters of raw calibration text teacher-forced through the target (cheap extra data)")
    g.add_argument("--text-batch", type=int, default=d.text_batch, help="sequences per teacher-forcing forward")
    g = p.add_argument_group("head")
    g.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="reduced draft vocabulary size")
    g.add_argument("--target-layers", type=_layer_list, default=d.target_layers, metavar="I[,J,...]",
                   help="target layers the head reads (negative: from the end). Several, e.g. 2,15,-1: "
                   "their features are fused as in EAGLE-3")
    g.add_argument("--reduce-init", default=d.reduce_init, choices=["last", "random"],
                   help="several layers: start the fusion as the last layer alone, or random")
    g.add_argument("--no-init-from-target", dest="init_from_target", action="store_false")
    g.add_argument("--no-input-norm", dest="input_norm", action="store_false",
                   help="feed the raw embedding and feature to fc (no RMSNorm on either)")
    g.add_argument("--fc-init", default=d.fc_init, choices=["identity", "random"],
                   help="identity: the fused input starts as the target feature itself")
    g.add_argument("--draft-layers", type=int, default=d.draft_layers, metavar="N",
                   help="decoder layers of the head (1: EAGLE's single layer)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="continue from this EAGLE head (same shape; its draft vocabulary is kept)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=d.epochs)
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--min-lr-frac", type=float, default=d.min_lr_frac)
    g.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g.add_argument("--unroll", type=int, default=d.unroll, help="training-time-test draft steps")
    g.add_argument("--unroll-decay", type=float, default=d.unroll_decay)
    g.add_argument("--ce-weight", type=float, default=d.ce_weight)
    g.add_argument("--reg-weight", type=float, default=d.reg_weight)
    g.add_argument("--prompt-weight", type=float, default=d.prompt_weight, help="loss weight inside prompts")
    g.add_argument("--feature-noise", type=float, default=d.feature_noise)
    g.add_argument("--eval-depth", type=int, default=d.eval_depth)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--train-autocast", default=d.train_autocast, choices=["none", "bfloat16"],
                   help="matmul dtype of the training forward")
    g.add_argument("--save-dtype", default=d.save_dtype, choices=["float32", "bfloat16"])
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g = p.add_argument_group("transcripts and resumable training")
    g.add_argument("--transcripts", default=None, metavar="DIR",
                   help="train on transcript shards (yggtree transcripts) instead of calibration prompts")
    g.add_argument("--max-tokens", type=int, default=None, help="train shards in index order up to this many tokens")
    g.add_argument("--heldout-seqs", type=int, default=d.heldout_seqs, help="held-out conversations per validation pass")
    g.add_argument("--feature-cache", default=None, help="default ~/.cache/yggtree/features")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    g.add_argument("--budget-minutes", type=float, default=None,
                   help="stop after this many minutes of training with a checkpoint; the same command continues")


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``distill`` on a CLI's subparsers; the handler is ``args.func = run_distill``."""
    p = subparsers.add_parser(
        "distill",
        help="train an EAGLE-style drafter head for a target from the calibration corpus",
        description=__doc__.split("\n\n")[0],
    )
    add_distill_arguments(p)
    p.set_defaults(func=run_distill)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.distill ...``: the same options as ``yggtree distill``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m yggtree.offline.distill", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_distill_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run_reporting("yggtree distill", run_distill, args)


if __name__ == "__main__":
    sys.exit(main())
