"""Teacher data for ``yggtree distill`` made: token sequences with the target's features (the
record, its layout and its file: offline/teacher_data.py).

The target answers calibration chat prompts greedily (:func:`build_teacher`, batched with a static
cache) or is run over fixed text (:func:`teacher_force`) or over transcript shards (``yggtree
transcripts``); the outputs of the stored target layers (``FeatureLayout``) are captured in the
same pass. :func:`prompt_data` and :func:`transcript_data` make the data of a run, from the
on-disk caches when they hold it, and split it into training and validation sequences.
The draft vocabulary is the ``V_d`` most frequent target ids in the training sequences plus every
special token (:func:`build_draft_vocab`).

Where the teacher data are cached and how the cache is keyed: yggtree/offline/distill.py's
docstring.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import calibration_chat_prompts, calibration_corpus, corpus_hash
from ..errors import YggError
from ..progress import PlainLog
from ..runtime.loading import encode_auto
from . import transcripts as tr
from .distill_config import DistillConfig
from .teacher_data import (
    TEACHER_FILE, TEACHER_FORMAT, FeatureBlocks, FeatureLayout, TeacherData, cached_teacher, concat_teacher, meta_key,
    roles_from_prompt_lengths, teacher_cache_root,
)

# one rate-limited log for every stage of a run (teacher data, then training)
plain_log = PlainLog()


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


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) under torchrun (gloo), else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- the teacher's passes


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
        plain_log(f"{desc}: {start + len(idx)}/{len(order)} prompts")
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
        plain_log(desc)

    feats = tr.prefill_sequences(model, seqs, layers, batch, on_batch)
    lengths = torch.tensor([len(t) for t in seqs], dtype=torch.int64)
    f = torch.cat(feats)
    return TeacherData(
        tokens=torch.tensor([t for q in seqs for t in q], dtype=torch.int64),
        feats=f.to(torch.float16) if float(f.abs().max()) < 60000 else f,
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        role=torch.zeros(int(lengths.sum()), dtype=torch.uint8),
    )


def calibration_text_chunks(skip: int, max_chars: int, seed: int) -> list[str]:
    """Calibration corpus chunks after the first ``skip`` (those become the chat prompts), whole
    chunks up to ``max_chars`` characters in corpus order."""
    out, total = [], 0
    for chunk in calibration_corpus(None, seed).chunks[skip:]:
        if total + len(chunk.text) > max_chars:
            break
        out.append(chunk.text)
        total += len(chunk.text)
    return out


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


# ----------------------------------------------------------------------------- the data of a run


def chat_prompt_ids(cfg: DistillConfig, tokenizer, prompt_ids) -> tuple[list[list[int]], str]:
    """(the prompts' token ids, cut on the left to the training window; their corpus hash): the
    calibration chat prompts, or the first ``cfg.prompts`` of the ``prompt_ids`` given."""
    if prompt_ids is None:
        prompt_texts = [p.text for p in calibration_chat_prompts(cfg.prompts, cfg.seed, cfg.snippet_chars,
                                                                 cfg.prompt_style)]
        data_hash = corpus_hash(prompt_texts)
        prompt_ids = [encode_auto(tokenizer, t) for t in prompt_texts]
    else:
        if len(prompt_ids) < cfg.prompts:
            raise YggError(f"{len(prompt_ids)} prompts given, asked for {cfg.prompts}")
        prompt_ids = [list(p) for p in prompt_ids[: cfg.prompts]]
        data_hash = corpus_hash([json.dumps(p) for p in prompt_ids])
    return [p[-cfg.max_seq_len :] for p in prompt_ids], data_hash


def teacher_eos(model_cfg, tokenizer) -> tuple[int, ...]:
    """The ids that end a teacher answer: the target's, else the tokenizer's EOS, else none."""
    return tuple(model_cfg.eos_token_ids) or (
        (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
    )


def teacher_in_dtype(target, dtype: str):
    """The target itself in float32, else a copy in ``dtype`` (the target stays float32)."""
    return target if dtype == "float32" else copy.deepcopy(target).to(getattr(torch, dtype))


class LazyTeacher:
    """The target in the teacher dtype, made at the first call (never when every cache is hit)."""

    def __init__(self, target, dtype: str):
        self.target, self.dtype, self.model = target, dtype, None

    def __call__(self):
        if self.model is None:
            self.model = teacher_in_dtype(self.target, self.dtype)
        return self.model


def text_teacher(cfg: DistillConfig, tokenizer, fp: str, layout: FeatureLayout, cache_root: Path, teacher,
                 progress) -> tuple[TeacherData, dict]:
    """Teacher-forced calibration text (``cfg.text_chars``), cached: (data, manifest "texts" entry)."""
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
    tkey = meta_key(text_meta)
    tdata, text_sha, text_reused = cached_teacher(
        cache_root / tkey / TEACHER_FILE, layout.width, text_meta,
        lambda: teacher_force(teacher(), text_ids, layout.stored, cfg.text_batch, progress))
    return tdata, {
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


def split_sequences(n_seq: int, val_frac: float, seed: int) -> tuple[list[int], list[int]]:
    """(train_idx, val_idx) by a seeded permutation of the sequences: ``val_frac`` of them (at least
    one when ``val_frac`` > 0, at most all but one) for validation, sorted."""
    perm = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(round(val_frac * n_seq)) if val_frac > 0 else 0
    n_val = min(max(n_val, 1 if val_frac > 0 else 0), n_seq - 1)
    return perm[n_val:], sorted(perm[:n_val])


def prompt_data(cfg: DistillConfig, target, tokenizer, prompt_ids, layout: FeatureLayout, progress):
    """Teacher data from calibration chat prompts answered by the target (plus teacher-forced
    calibration text): (data, train_idx, val_idx, manifest "data" entries)."""
    prompt_ids, data_hash = chat_prompt_ids(cfg, tokenizer, prompt_ids)
    eos = teacher_eos(target.cfg, tokenizer)
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
    key, cache_root = meta_key(data_meta), teacher_cache_root(cfg)
    teacher = LazyTeacher(target, cfg.teacher_dtype)
    data, teacher_sha, reused = cached_teacher(
        cache_root / key / TEACHER_FILE, layout.width, data_meta,
        lambda: build_teacher(teacher(), prompt_ids, cfg, eos, layout.stored, progress))
    text_info = None
    if cfg.text_chars > 0:
        tdata, text_info = text_teacher(cfg, tokenizer, fp, layout, cache_root, teacher, progress)
        data = concat_teacher([data, tdata])
    del teacher
    train_idx, val_idx = split_sequences(data.n_seq, cfg.val_frac, cfg.seed)
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


def transcript_data(cfg: DistillConfig, target, tokenizer, layout: FeatureLayout, progress, in_memory: bool = False):
    """Teacher data from transcript shards (``yggtree transcripts``): the train shards in index
    order (up to ``max_tokens``), the held-out shards for validation. Features come from the local
    cache, else by batched prefill of the token ids (then cached), and stay there: ``data.feats``
    is a :class:`FeatureBlocks` of the memory-mapped cache files (``in_memory``: copied into one
    tensor instead, as before memory mapping; the training reads the same values). A conversation
    whose prompt repeats an earlier one (across shards) is dropped. Returns (data, train_idx,
    val_idx, manifest "data" entries)."""
    root = Path(cfg.transcripts).expanduser()
    if not root.is_dir():
        raise YggError(f"transcript directory {root} does not exist")
    fp = target_fingerprint(target)
    shards, held = _transcript_shards(root, cfg.max_tokens, fp, tokenizer)
    every = shards + held
    fpaths, idents, cached = _cached_features(cfg, target, layout, every, fp, progress)
    parts, blocks, info_shards = [], [], []
    # each shard's features stay in their cache file, memory-mapped: nothing is read before a batch
    # uses it, and the ranks of one machine share the page cache's one copy
    for (p, sh), fpath, ident in zip(every, fpaths, idents, strict=True):
        feats = tr.map_features(fpath, sh.n_tokens, layout.width, ident)
        if feats is None:
            raise YggError(f"feature cache {fpath} cannot be read back after writing it")
        blocks.append(feats)
        parts.append(TeacherData(sh.tokens, feats, sh.offsets, sh.role))
        info_shards.append({"file": p.name, "sha256": sh.meta["sha256"], "tokens": sh.n_tokens,
                            "sequences": sh.n_seq, "counts": sh.meta["counts"]})
    reused = sum(cached)
    feats_all = FeatureBlocks(blocks)
    data = concat_teacher(parts, feats=feats_all.materialize() if in_memory else feats_all)
    train_idx, val_idx, dup = _unique_split(data, sum(sh.n_seq for _, sh in shards), cfg)
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


def _transcript_shards(root: Path, max_tokens: int | None, fp: str, tokenizer) -> tuple[list, list]:
    """``(train, held-out)``: the transcript shards in ``root`` as ``(path, shard)``, the train
    shards in index order up to ``max_tokens``, each checked against the target's fingerprint
    ``fp`` and the tokenizer; YggError if either split is missing."""
    tok_fp = tr.tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    train_paths, held_paths = tr.shard_paths(root, "train"), tr.shard_paths(root, "heldout")
    if not train_paths:
        raise YggError(f"no train-*.safetensors shards in {root} (make them with yggtree transcripts)")
    if not held_paths:
        raise YggError(f"no heldout-*.safetensors shards in {root} (yggtree transcripts --split heldout)")
    shards, n_tok = [], 0
    for p in train_paths:
        if max_tokens is not None and n_tok >= max_tokens:
            break
        sh = tr.load_shard(p, fp, tok_fp)
        shards.append((p, sh))
        n_tok += sh.n_tokens
    held = [(p, tr.load_shard(p, fp, tok_fp)) for p in held_paths]
    return shards, held


def _cached_features(cfg: DistillConfig, target, layout: FeatureLayout, every: list, fp: str,
                     progress) -> tuple[list, list, list[bool]]:
    """``(paths, identities, cached)`` of the feature cache files of the shards ``every`` (``(path,
    shard)``), after the missing ones are made by the target's prefill (data-parallel: each rank
    its share, then all wait); ``cached``: which the cache held before this run."""
    cache = tr.feature_cache_root(cfg.feature_cache)
    rank, world = rank_and_world()
    idents = [tr.feature_identity(sh, fp, layout.stored, cfg.teacher_dtype) for _, sh in every]
    fpaths = [tr.feature_path(cache, sh, layout.stored, cfg.teacher_dtype) for _, sh in every]
    # what the cache holds before this run (the same answer on every rank: nobody has written yet)
    cached = [tr.map_features(f, sh.n_tokens, layout.width, i) is not None
              for f, (_, sh), i in zip(fpaths, every, idents, strict=True)]
    if world > 1:
        torch.distributed.barrier()
    # data-parallel: rank r fills the missing shards j with j % world == r, then every rank reads all
    missing = [j for j in range(len(every)) if not cached[j] and j % world == rank]
    task = progress.add_task("features", total=sum(every[j][1].n_tokens for j in missing))
    teacher = teacher_in_dtype(target, cfg.teacher_dtype) if missing else None
    for j in missing:
        made = tr.prefill_features(teacher, every[j][1], layout.stored,
                                   on_batch=lambda r, t: progress.update(task, advance=t))
        tr.save_features(made, fpaths[j], idents[j])
        del made
    del teacher
    if world > 1:
        torch.distributed.barrier()
    return fpaths, idents, cached


def _unique_split(data: TeacherData, n_train_seq: int, cfg: DistillConfig) -> tuple[list[int], list[int], int]:
    """``(train_idx, val_idx, duplicates)``: the sequences of ``data`` whose prompt (the tokens
    before the first answer token) no earlier sequence had; the first ``n_train_seq`` sequences'
    shuffled by ``cfg.seed`` for training, the others' first ``cfg.heldout_seqs`` for validation."""
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
    return train_idx, val_idx, dup
