"""Teacher transcripts: the target's own answers to synthetic requests, stored as token ids only.

A *shard* is one deterministic unit of work (``split``, ``index``, ``seed``): its requests
(:mod:`yggtree.offline.requests`: self-synthesised + templated, decontaminated, deduplicated), the
target's answers (greedy for most, sampled at a recorded temperature for a share; a second turn
for some), written as one small safetensors file::

    tokens   [N] uint16/int32   every sequence's ids, concatenated
    offsets  [n + 1] int64      sequence i is tokens[offsets[i]:offsets[i+1]]
    role     [N] uint8          0 prompt (system/user turns, template), 1 greedy answer, 2 sampled answer

with the metadata (target and tokenizer fingerprints, generation settings, per-sequence request kind
and temperature, drop counts, a sha256 of the tensors) in the file's header. A million tokens take
about 3 MB, so shards are committed with the drafter and the features are never shipped.

Features (the target's stored layers at every position) are captured while the answers are
generated and cached on local disk next to nothing else (:func:`feature_path`, one float16
safetensors file per shard and layer set, its identity in the header); on a machine without that
cache they are recomputed from the token ids by batched prefill (:func:`prefill_features`).
Training memory-maps these files (:func:`map_features`) instead of reading them.

Generation is batched over rows of similar prompt length with a static KV cache per batch;
finished rows leave the batch (their cache rows are dropped), so the cost follows the tokens
actually generated.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import YggError
from ..files import atomic_path
from . import requests as rq

SHARD_FORMAT = 1
ROLE_PROMPT, ROLE_GREEDY, ROLE_SAMPLED = 0, 1, 2
SAMPLED_SHARE = 0.2  # share of conversations answered by sampling
SAMPLED_TEMPERATURES = (0.7, 0.8, 0.9, 1.0)
MAGPIE_TEMPERATURE = 1.0
MAGPIE_TOP_P = 0.95
MAGPIE_MAX_TOKENS = 96


@dataclass(frozen=True)
class ShardSpec:
    """Everything that decides a shard's content (with the target and tokenizer)."""

    split: str = "train"
    index: int = 0
    seed: int = 0
    size: int = 256  # conversations
    max_new_tokens: int = 320  # per answer
    gen_batch: int = 48  # rows per generation batch
    teacher_dtype: str = "bfloat16"

    def name(self) -> str:
        return f"{self.split}-{self.index:05d}"


@dataclass(frozen=True)
class Shard:
    """One shard in memory."""

    tokens: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [n + 1] int64
    role: torch.Tensor  # [N] uint8 (ROLE_*)
    meta: dict  # header metadata (see module docstring)

    @property
    def n_seq(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


# ----------------------------------------------------------------------------- fingerprints


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex) of the tokenizer's vocabulary and its chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    h = hashlib.sha256(json.dumps(vocab).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]


def tensors_sha256(tokens: torch.Tensor, offsets: torch.Tensor, role: torch.Tensor) -> str:
    h = hashlib.sha256()
    for name, t in (("tokens", tokens.to(torch.int64)), ("offsets", offsets.to(torch.int64)), ("role", role.to(torch.uint8))):
        h.update(f"{name}:{list(t.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- generation


@dataclass
class Generated:
    answer: list[int]  # generated ids (the stop token included when one was emitted)
    stopped: bool  # ended on a stop token (not cut at max_new_tokens)
    feats: torch.Tensor | None  # [len(prompt) + len(answer), L*H] float32, or None (no capture)


def _sample(logits: torch.Tensor, temps: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Next ids [b]: argmax where ``temps`` is 0, else a draw at that temperature (top-p < 1:
    nucleus)."""
    greedy = logits.argmax(-1)
    if bool((temps == 0).all()):
        return greedy
    t = torch.where(temps > 0, temps, 1.0)[:, None]
    probs = torch.softmax(logits.float() / t, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    drawn = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return torch.where(temps > 0, drawn, greedy)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    temperatures: list[float],
    seed: int,
    layers: tuple[int, ...] = (),
    top_p: float = 1.0,
) -> list[Generated]:
    """Answers to ``prompts`` (one batch, one static cache). With ``layers``, the outputs of those
    target layers (side by side) at every position of prompt + answer are returned as well (the
    last answer token is fed once more for its feature)."""
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    w = int(lens.max())
    s = w + max_new_tokens + 2  # + the scratch slot written by padding
    model.setup_cache(b, s)
    toks = torch.zeros(b, w, dtype=torch.int64)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p)
    ar = torch.arange(w)
    real = ar[None, :] < lens[:, None]
    slots = torch.where(real, ar[None, :], s - 1)
    pos = torch.where(real, ar[None, :], 0)
    cols = torch.arange(w)
    mask = (cols[None, None, :] <= ar[None, :, None]) & (cols[None, None, :] < lens[:, None, None])
    mask = mask | (~real[:, :, None] & (cols[None, None, :] == 0))  # padding rows attend somewhere
    out = model(toks, pos, slots, mask, layers)
    feats: list[list[torch.Tensor]] = [[] for _ in range(b)]
    if layers:
        f_all = torch.cat(list(out.layers), dim=-1).float()
        for i in range(b):
            feats[i].append(f_all[i, : lens[i]])
    gen = torch.Generator().manual_seed(seed)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    nxt = _sample(model.logits(out.hidden[torch.arange(b), lens - 1]), temps, top_p, gen)
    rows = torch.arange(b)  # original index of each active row
    at = lens.clone()  # slot/position of the token fed next, per active row
    answers: list[list[int]] = [[] for _ in range(b)]
    stopped = [False] * b
    stop = torch.tensor(sorted(stop_ids) or [-1])
    for step in range(max_new_tokens):
        for r, i in enumerate(rows.tolist()):
            answers[i].append(int(nxt[r]))
        ends = torch.isin(nxt, stop)
        for r in torch.nonzero(ends).flatten().tolist():
            stopped[int(rows[r])] = True
        last = ends | (step == max_new_tokens - 1)
        if not layers and bool(last.all()):
            break
        c = int(at.max()) + 1
        m = torch.arange(c)[None, None, :] <= at[:, None, None]
        o = model(nxt[:, None], at[:, None], at[:, None], m, layers)
        if layers:
            f = torch.cat(list(o.layers), dim=-1)[:, 0].float()
            for r, i in enumerate(rows.tolist()):
                feats[i].append(f[r : r + 1])
        keep = ~last
        if not bool(keep.any()):
            break
        nxt = _sample(model.logits(o.hidden[:, 0]), temps[rows], top_p, gen)
        at = at + 1
        if not bool(keep.all()):
            idx = torch.nonzero(keep).flatten()
            model.set_store(model.kv.keep_rows(idx))
            rows, at, nxt = rows[idx], at[idx], nxt[idx]
    return [
        Generated(answers[i], stopped[i], torch.cat(feats[i]) if layers else None) for i in range(b)
    ]


def generate_all(
    model, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...], temperatures: list[float],
    seed: int, batch: int, layers: tuple[int, ...] = (), top_p: float = 1.0, on_batch=None,
) -> list[Generated]:
    """:func:`generate` over batches of similar prompt length (a fixed order, so the result is
    deterministic); ``on_batch(n_rows, n_tokens)`` after each batch."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    res: dict[int, Generated] = {}
    for bi, start in enumerate(range(0, len(order), batch)):
        idx = order[start : start + batch]
        outs = generate(
            model, [prompts[i] for i in idx], max_new_tokens, stop_ids, [temperatures[i] for i in idx],
            (seed * 100003 + bi) % (1 << 62), layers, top_p,
        )
        for i, o in zip(idx, outs):
            res[i] = o
        if on_batch is not None:
            on_batch(len(idx), sum(len(prompts[i]) + len(o.answer) for i, o in zip(idx, outs)))
    return [res[i] for i in range(len(prompts))]


# ----------------------------------------------------------------------------- shards


class ChatFormat:
    """Token ids of chat turns for one tokenizer (from its own template)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.magpie = tokenizer(rq.magpie_prefix(tokenizer), add_special_tokens=False)["input_ids"]
        marker_a, marker_u = "\x00A\x00", "\x00U\x00"
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker_a},
             {"role": "user", "content": marker_u}],
            add_generation_prompt=True, tokenize=False,
        )
        between = full[full.index(marker_a) + len(marker_a) : full.index(marker_u)]
        self.after_user = full[full.index(marker_u) + len(marker_u) :]
        self.between = between  # from the end of an assistant answer to the next user text

    def first(self, text: str) -> list[int]:
        t = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return self.tok(t, add_special_tokens=False)["input_ids"]

    def follow_up(self, answer_ids: list[int], text: str) -> list[int]:
        """Ids that continue a conversation whose last answer is ``answer_ids`` (ending in the stop
        token) with the user turn ``text`` and the assistant's generation prompt."""
        stop_text = self.tok.decode(answer_ids[-1:])
        between = self.between[len(stop_text) :] if self.between.startswith(stop_text) else self.between
        return self.tok(between + text + self.after_user, add_special_tokens=False)["input_ids"]


def _requests_for_shard(model, fmt: ChatFormat, spec: ShardSpec, decon: rq.Decontaminator, stop_ids, log) -> tuple[list[rq.Request], dict]:
    """The shard's deduplicated, decontaminated requests (Magpie turns sampled from ``model``)."""
    rng = random.Random(f"shard/{spec.split}/{spec.seed}/{spec.index}")
    kinds = rq.draw_kinds(spec.size, rng)
    n_magpie = kinds.count("magpie")
    counts = {"contaminated": 0, "duplicates": 0, "magpie_rejected": 0, "template_unusable": 0}
    seen: set[str] = set()
    reqs: list[rq.Request] = []

    def take(req: rq.Request) -> bool:
        if decon.contaminated(req.text):
            counts["contaminated"] += 1
            return False
        key = rq.normalised(req.text)
        if key in seen:
            counts["duplicates"] += 1
            return False
        seen.add(key)
        reqs.append(rq.with_follow_up(req, rng))
        return True

    if n_magpie:
        n_try = int(n_magpie * 1.5) + 4
        outs = generate_all(
            model, [fmt.magpie] * n_try, MAGPIE_MAX_TOKENS, stop_ids, [MAGPIE_TEMPERATURE] * n_try,
            seed=hash_seed("magpie", spec), batch=spec.gen_batch, top_p=MAGPIE_TOP_P,
        )
        got = 0
        for o in outs:
            if got == n_magpie:
                break
            text = fmt.tok.decode(o.answer[:-1] if o.stopped else o.answer).strip()
            if not o.stopped or not rq.usable_magpie(text):
                counts["magpie_rejected"] += 1
                continue
            got += take(rq.Request("magpie", text))
        kinds = [k for k in kinds if k != "magpie"] + ["code"] * (n_magpie - got)  # shortfall: templates
        log(f"{spec.name()}: {got} self-synthesised requests of {n_try} sampled")
    for kind in kinds:
        for _ in range(20):
            req = rq.template_request(kind, rng, spec.split, spec.seed)
            if req is None:
                counts["template_unusable"] += 1
                continue
            if take(req):
                break
    return reqs, counts


def hash_seed(*parts) -> int:
    return int(hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:12], 16)


def build_shard(model, tokenizer, spec: ShardSpec, fingerprint: str, layers: tuple[int, ...], log=lambda m: None,
                on_tokens=None) -> tuple[Shard, torch.Tensor]:
    """Generate shard ``spec`` with ``model`` (the teacher, any dtype; ``fingerprint`` is the target's
    float32 fingerprint). Returns the shard and its features [N, len(layers) * H] (float32)."""
    from ..data import evaluation_texts

    t0 = time.perf_counter()
    stop_ids = tuple(model.cfg.eos_token_ids) or (tokenizer.eos_token_id,)
    fmt = ChatFormat(tokenizer)
    decon = rq.Decontaminator(evaluation_texts())
    reqs, counts = _requests_for_shard(model, fmt, spec, decon, stop_ids, log)
    rng = random.Random(f"temperature/{spec.split}/{spec.seed}/{spec.index}")
    temps = [rng.choice(SAMPLED_TEMPERATURES) if rng.random() < SAMPLED_SHARE else 0.0 for _ in reqs]
    p1 = [fmt.first(r.text) for r in reqs]
    multi = [i for i, r in enumerate(reqs) if r.follow_up is not None]
    out1 = generate_all(
        model, p1, spec.max_new_tokens, stop_ids, temps, hash_seed("turn1", spec), spec.gen_batch, layers,
        on_batch=on_tokens,
    )
    seqs: list[tuple[list[int], list[int]]] = []  # (ids, roles)
    info = []
    ans_role = [ROLE_SAMPLED if t > 0 else ROLE_GREEDY for t in temps]
    feats: dict[int, torch.Tensor] = {}
    two = [i for i in multi if out1[i].stopped]
    p2 = [p1[i] + out1[i].answer + fmt.follow_up(out1[i].answer, reqs[i].follow_up) for i in two]
    out2 = generate_all(
        model, p2, spec.max_new_tokens, stop_ids, [temps[i] for i in two], hash_seed("turn2", spec),
        spec.gen_batch, layers, on_batch=on_tokens,
    ) if two else []
    second = dict(zip(two, zip(p2, out2)))
    for i, r in enumerate(reqs):
        a1 = out1[i].answer
        ids = p1[i] + a1
        roles = [ROLE_PROMPT] * len(p1[i]) + [ans_role[i]] * len(a1)
        f = out1[i].feats
        turns = 1
        if i in second:
            p, o = second[i]
            ids = p + o.answer
            roles = roles + [ROLE_PROMPT] * (len(p) - len(roles)) + [ans_role[i]] * len(o.answer)
            f = o.feats
            turns = 2
        seqs.append((ids, roles))
        if f is not None:
            feats[i] = f
        info.append({"kind": r.kind, "temperature": temps[i], "turns": turns})
    tokens = torch.tensor([t for ids, _ in seqs for t in ids], dtype=torch.int64)
    role = torch.tensor([x for _, rl in seqs for x in rl], dtype=torch.uint8)
    lengths = torch.tensor([len(ids) for ids, _ in seqs], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    meta = {
        "format": SHARD_FORMAT,
        "spec": spec.__dict__,
        "target_fingerprint": fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": int(model.cfg.vocab_size),
        "counts": counts | {"requests": len(reqs), "two_turn": len(two)},
        "sequences": info,
        "sha256": tensors_sha256(tokens, offsets, role),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    shard = Shard(tokens, offsets, role, meta)
    f_all = torch.cat([feats[i] for i in range(len(reqs))]) if layers else torch.zeros(0)
    return shard, f_all


def save_shard(shard: Shard, path: Path) -> None:
    """Write ``shard`` to ``path`` (write-then-rename)."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    small = shard.meta["vocab_size"] <= np.iinfo(np.uint16).max + 1
    tokens = shard.tokens.numpy().astype(np.uint16 if small else np.int32)
    with atomic_path(path) as tmp:
        save_file(
            {"tokens": tokens, "offsets": shard.offsets.numpy(), "role": shard.role.numpy()},
            str(tmp),
            metadata={"yggtree": "transcripts", "meta": json.dumps(shard.meta, sort_keys=True)},
        )


def load_shard(path: Path, fingerprint: str | None = None, tokenizer_fp: str | None = None) -> Shard:
    """Read and validate a shard: complete, untampered, and (when given) for this target and
    tokenizer. Every failure is one :class:`YggError` line naming the file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise YggError(f"transcript shard {path} does not exist")
    try:
        with safe_open(str(path), "np") as f:
            header = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise YggError(f"cannot read transcript shard {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if header.get("yggtree") != "transcripts" or not {"tokens", "offsets", "role"} <= set(arrays):
        raise YggError(f"{path} is not a yggtree transcript shard")
    meta = json.loads(header["meta"])
    if meta.get("format") != SHARD_FORMAT:
        raise YggError(f"transcript shard {path} has format {meta.get('format')}, expected {SHARD_FORMAT}")
    tokens = torch.from_numpy(arrays["tokens"].astype(np.int64))
    offsets = torch.from_numpy(arrays["offsets"].astype(np.int64))
    role = torch.from_numpy(arrays["role"].astype(np.uint8))
    if tensors_sha256(tokens, offsets, role) != meta.get("sha256"):
        raise YggError(f"transcript shard {path} is damaged: its tensors do not match the checksum in its header")
    if fingerprint is not None and meta["target_fingerprint"] != fingerprint:
        raise YggError(
            f"transcript shard {path} was made by another target (fingerprint {meta['target_fingerprint']}, "
            f"this target {fingerprint})"
        )
    if tokenizer_fp is not None and meta["tokenizer_fingerprint"] != tokenizer_fp:
        raise YggError(
            f"transcript shard {path} was made with another tokenizer (fingerprint {meta['tokenizer_fingerprint']}, "
            f"this tokenizer {tokenizer_fp})"
        )
    return Shard(tokens, offsets, role, meta)


def shard_paths(root: Path, split: str) -> list[Path]:
    return sorted(Path(root).glob(f"{split}-[0-9][0-9][0-9][0-9][0-9].safetensors"))


# ----------------------------------------------------------------------------- features


def feature_cache_root(given: str | None) -> Path:
    """The local cache of shard features (``--feature-cache``; default ~/.cache/yggtree/features)."""
    if given:
        return Path(given).expanduser()
    from ..files import cache_root

    return cache_root() / "features"


def feature_path(cache_root: Path, shard: Shard, layers: tuple[int, ...], teacher_dtype: str) -> Path:
    key = hashlib.sha256(json.dumps([shard.meta["sha256"], list(layers), teacher_dtype]).encode()).hexdigest()[:20]
    return Path(cache_root) / key / "features.safetensors"


FEATURES_FORMAT = 1


def feature_identity(shard: Shard, target_fp: str, layers: tuple[int, ...], teacher_dtype: str) -> dict:
    """What a feature cache file holds the features of: written in its header, checked when it is read."""
    return {"format": FEATURES_FORMAT, "shard_sha256": shard.meta["sha256"], "target_fingerprint": target_fp,
            "layers": [int(i) for i in layers], "teacher_dtype": teacher_dtype}


def save_features(feats: torch.Tensor, path: Path, identity: dict | None = None) -> None:
    """``feats`` [N, W] as one safetensors file (float16 unless some value overflows it), the
    ``identity`` (:func:`feature_identity`) in its header; write-then-rename. The tensor's bytes are
    one flat row-major block, which :func:`map_features` maps without reading."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    amax = float(feats.abs().max()) if feats.numel() else 0.0
    store = feats.to(torch.float16) if amax < 60000 else feats.float()
    meta = {"yggtree": "features", "identity": json.dumps(identity, sort_keys=True)} if identity is not None else None
    with atomic_path(path) as tmp:
        save_file({"feats": store.contiguous()}, str(tmp), metadata=meta)


_FEATURE_DTYPES = {"F16": np.float16, "F32": np.float32}


def map_features(path: Path, n_tokens: int, width: int, identity: dict | None = None) -> torch.Tensor | None:
    """The cached features [n_tokens, width], memory-mapped (nothing is read until a row is used;
    the pages are the page cache's, shared by every process that maps the file: data-parallel
    ranks on one machine hold one copy), or None when absent or unusable (unreadable header,
    truncated, another shape): the caller recomputes and rewrites them.

    A file whose header names another shard, target, layers or teacher dtype than ``identity`` is
    refused (one line naming the file); a file without one (written before identities) is used
    when its shape fits, as before (its path is already keyed by the shard, layers and dtype).
    The mapping is private (copy-on-write): nothing writes to it, and nothing could reach the file.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= size - 8:
                return None
            header = json.loads(fh.read(n))
        entry = header["feats"]
        dtype = _FEATURE_DTYPES[entry["dtype"]]
        shape = tuple(int(x) for x in entry["shape"])
        a, b = (int(x) for x in entry["data_offsets"])
        meta = header.get("__metadata__") or {}
        theirs = json.loads(meta["identity"]) if "identity" in meta else None
    except (OSError, ValueError, KeyError, TypeError):  # a damaged cache entry is recomputed
        return None
    if identity is not None and isinstance(theirs, dict):
        diff = [k for k in identity if theirs.get(k) != identity[k]]
        if diff:
            k = diff[0]
            raise YggError(f"feature cache {path} holds other features: {k} is {theirs.get(k)!r} there, "
                           f"{identity[k]!r} here (delete it to recompute, or use another --feature-cache)")
    itemsize = np.dtype(dtype).itemsize
    if shape != (n_tokens, width) or b - a != n_tokens * width * itemsize or 8 + n + b != size:
        return None
    if n_tokens * width == 0:
        return torch.zeros(shape, dtype=torch.float16 if dtype is np.float16 else torch.float32)
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", offset=8 + n + a, shape=shape))


@torch.no_grad()
def prefill_sequences(model, seqs: list[torch.Tensor], layers: tuple[int, ...], batch: int = 8, on_batch=None) -> list[torch.Tensor]:
    """The ``layers`` outputs (side by side) at every position of each sequence, by one causal
    forward per batch of similar-length sequences: per sequence [len, len(layers) * H] float32."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    out: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        lens = torch.tensor([len(seqs[i]) for i in idx])
        w = int(lens.max())
        model.setup_cache(len(idx), w + 1)
        toks = torch.zeros(len(idx), w, dtype=torch.int64)
        for r, i in enumerate(idx):
            toks[r, : len(seqs[i])] = torch.as_tensor(seqs[i])
        ar = torch.arange(w)
        real = ar[None, :] < lens[:, None]
        slots = torch.where(real, ar[None, :], w)
        pos = torch.where(real, ar[None, :], 0)
        cols = torch.arange(w + 1)
        mask = (cols[None, None, :] <= ar[None, :, None]) & (cols[None, None, :] < lens[:, None, None])
        mask = mask | (~real[:, :, None] & (cols[None, None, :] == w))  # padding sees the scratch slot
        o = model(toks, pos, slots, mask, layers)
        f = torch.cat(list(o.layers), dim=-1).float()
        for r, i in enumerate(idx):
            out[i] = f[r, : len(seqs[i])]
        if on_batch is not None:
            on_batch(len(idx), int(lens.sum()))
    return [out[i] for i in range(len(seqs))]


def prefill_features(model, shard: Shard, layers: tuple[int, ...], batch: int = 8, on_batch=None) -> torch.Tensor:
    """:func:`prefill_sequences` over a shard's sequences, concatenated: [N, len(layers) * H] float32."""
    seqs = [shard.tokens[int(shard.offsets[i]) : int(shard.offsets[i + 1])] for i in range(shard.n_seq)]
    return torch.cat(prefill_sequences(model, seqs, layers, batch, on_batch))

def heldout_prompts(root: Path, n: int, fingerprint: str | None = None) -> list[tuple[str, list[int]]]:
    """(id, prompt ids) of the first ``n`` held-out conversations: each one's tokens up to its first
    answer token (the chat-templated first request), for evaluating drafters by real decoding on
    prompts no training run used."""
    out: list[tuple[str, list[int]]] = []
    for path in shard_paths(root, "heldout"):
        sh = load_shard(path, fingerprint)
        for i in range(sh.n_seq):
            if len(out) == n:
                return out
            a, b = int(sh.offsets[i]), int(sh.offsets[i + 1])
            first = torch.nonzero(sh.role[a:b] > 0)
            if len(first):
                out.append((f"heldout/{sh.meta['sequences'][i]['kind']}/{path.stem}/{i}", sh.tokens[a : a + int(first[0])].tolist()))
    if len(out) < n:
        raise YggError(f"{root} holds {len(out)} held-out conversations; asked for {n}")
    return out
