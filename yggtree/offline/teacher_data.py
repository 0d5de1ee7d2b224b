"""Teacher data, the record every stage of ``yggtree distill`` passes (offline/distill_data.py makes
it): token sequences side by side with the target's features at every position and each token's
role (:class:`TeacherData`); the features as consecutive blocks, each typically memory-mapped from
the feature cache (:class:`FeatureBlocks`); which target layers they hold and which of them the
head reads (:class:`FeatureLayout`); and its file in the teacher cache, keyed by what made it
(:func:`cached_teacher`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import YggError
from ..runtime.loading import read_safetensors
from .distill_config import DistillConfig

TEACHER_FILE = "teacher.safetensors"
TEACHER_FORMAT = 1


# ----------------------------------------------------------------------------- the record


class FeatureBlocks:
    """[N, W] feature rows held as consecutive blocks (one per transcript shard, each typically
    memory-mapped from the feature cache: :func:`transcripts.map_features`), never copied whole.

    Indexing, as a tensor's: ``f[a:b]`` is a view of one block when the rows lie in it (a
    sequence always does) and a copy otherwise; ``f[a:b:k]`` gathers rows (a copy); ``f[..., c:d]``
    (or ``f[:, c:d]``) is a FeatureBlocks of column views. Copies have :attr:`dtype`: float16, or
    float32 when some block is (a float16 block then converts exactly), so every read equals the
    same read of the blocks concatenated into one tensor (:meth:`materialize`)."""

    def __init__(self, blocks: list[torch.Tensor]) -> None:
        if not blocks:
            raise ValueError("FeatureBlocks needs at least one block")
        if len({tuple(b.shape[1:]) for b in blocks}) != 1:
            raise ValueError("FeatureBlocks: blocks of different widths")
        self.blocks = list(blocks)
        self.starts = [0]
        for b in self.blocks:
            self.starts.append(self.starts[-1] + int(b.shape[0]))
        self.dtype = torch.float32 if any(b.dtype == torch.float32 for b in self.blocks) else torch.float16
        self.shape = torch.Size([self.starts[-1], *self.blocks[0].shape[1:]])

    def __len__(self) -> int:
        return self.starts[-1]

    def _rows(self, key: slice) -> torch.Tensor:
        start, stop, step = key.indices(len(self))
        if step < 1:
            raise IndexError("FeatureBlocks: negative steps are not supported")
        if step == 1 and start < stop:
            j = bisect.bisect_right(self.starts, start) - 1
            if stop <= self.starts[j + 1]:
                return self.blocks[j][start - self.starts[j] : stop - self.starts[j]]
        pieces = []
        for b, s0, s1 in zip(self.blocks, self.starts, self.starts[1:]):
            lo, hi = max(start, s0), min(stop, s1)
            first = start + -(-(lo - start) // step) * step  # the first selected row >= lo
            if first < hi:
                pieces.append(b[first - s0 : hi - s0 : step].to(self.dtype))
        if not pieces:
            return torch.zeros(0, *self.shape[1:], dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._rows(key)
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], slice) and (
            key[0] is Ellipsis or (isinstance(key[0], slice) and key[0] == slice(None))
        ):
            return FeatureBlocks([b[:, key[1]] for b in self.blocks])
        raise TypeError(f"FeatureBlocks supports row slices and [..., columns], not {key!r}")

    def materialize(self) -> torch.Tensor:
        """The rows in one preallocated tensor of :attr:`dtype` (in memory: the layout before memory
        mapping, kept for comparison and for features that must be private)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        for b, s0, s1 in zip(self.blocks, self.starts, self.starts[1:]):
            out[s0:s1] = b
        return out


@dataclass
class TeacherData:
    """Sequences concatenated: ``tokens[offsets[i]:offsets[i+1]]`` and their features."""

    tokens: torch.Tensor  # [N] int64 target ids
    feats: torch.Tensor | FeatureBlocks  # [N, L*H] float16/float32: the L stored target layers' outputs, side by side
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


# ----------------------------------------------------------------------------- its file and cache


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


def meta_key(meta: dict) -> str:
    """The teacher cache's key of the data ``meta`` describes (a folder under the cache root)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:20]


def teacher_cache_root(cfg: DistillConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache" / "yggtree" / "distill"


def cached_teacher(path: Path, width: int, meta: dict, build) -> tuple[TeacherData, str, bool]:
    """(data, sha256, reused): the teacher data cached at ``path``, else ``build()`` saved there."""
    if path.is_file():
        data = load_teacher(path, width)
        return data, teacher_hash(data), True
    data = build()
    return data, save_teacher(data, path, meta), False
