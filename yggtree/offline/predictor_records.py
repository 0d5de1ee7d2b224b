"""The depth predictor's records (``yggtree train-predictor``, step 1): the plan's pair decodes
calibration prompts with one deep tree every step (D = D_max calls at one draft width W_d, the whole
tree verified, greedy); per step the target's final-norm hidden state at the root, the drafter
head's top log-probs at the root, the realised accepted length and the length it would have had with
only D = 1..D_max calls. Stored as safetensors with a JSON sidecar (kind, version, data hash), and
read back checked."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import YggError
from ..files import atomic_path, write_text_atomic

if TYPE_CHECKING:
    import torch


RECORDS_KIND = "yggtree-depth-records"
RECORDS_VERSION = 2
RECORD_FIELDS = ("h", "n_accepted", "len_by_depth", "prompt", "committed", "head_logp")


@dataclass(frozen=True)
class Records:
    """One row per speculation step of the record run."""

    h: torch.Tensor  # [S, H] float32 target final-norm hidden state at the root
    n_accepted: torch.Tensor  # [S] int64 drafted tokens accepted with D_max calls (bonus excluded)
    len_by_depth: torch.Tensor  # [S, D_max] int64 accepted length had the step made D = 1.. calls
    prompt: torch.Tensor  # [S] int64 index of the prompt in calibration_chat_prompts order
    committed: torch.Tensor  # [S] int64 committed length before the step
    head_logp: torch.Tensor  # [S, W_d] float32 log-probs of the root's drafted children (the
    #                          drafter head's top W_d at the root), descending

    @property
    def d_max(self) -> int:
        return int(self.len_by_depth.shape[1])

    def tensors(self) -> dict:
        return {k: getattr(self, k).contiguous() for k in RECORD_FIELDS}

    def select(self, mask) -> "Records":
        return Records(**{k: v[mask] for k, v in self.tensors().items()})


def concat_records(parts: list[Records]) -> Records:
    """Rows of several record sets, in order (prompt indices kept: they are global)."""
    import torch

    return Records(**{k: torch.cat([getattr(r, k) for r in parts]) for k in parts[0].tensors()})


def step_lengths(rec, d_max: int, wd: int) -> list[int]:
    """Accepted length (bonus excluded) of one recorded step had it drafted only D = 1..d_max calls
    (EGT's first D calls fill slots 1..D*W_d; the whole tree is verified)."""
    from .fit import measured_aal, step_edges

    e = step_edges(rec, d_max)
    full = 1 + d_max * wd
    return [int(round(r[0])) - 1 for r in measured_aal(e["tree"], e["path_ok"], wd, d_max, [full])]


def head_logp(tree, wd: int):
    """[W_d] float32: log-probs of the root's children in a drafted tree (depth-1 nodes),
    descending; a missing child counts as log-prob -inf."""
    import torch

    lp = tree.logp[(tree.depth == 1) & tree.valid].to("cpu", dtype=torch.float32)
    lp = torch.cat([lp, torch.full((wd,), float("-inf"))])
    return lp.sort(descending=True).values[:wd]


def collect_records(engine, prompt_ids: list[list[int]], d_max: int, wd: int, max_new_tokens: int,
                    advance=None, first_index: int = 0) -> Records:
    """Decode every prompt with D = d_max calls at width ``wd`` (whole tree verified) and record
    each step (prompt i gets index ``first_index + i``); ``advance()`` is called after each prompt."""
    import torch

    from ..runtime.engine import SamplingParams
    from ..runtime.policy import FixedPolicy, StepChoice

    pol = FixedPolicy(StepChoice(d_max, wd), 1 + d_max * wd)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows: dict[str, list] = {k: [] for k in RECORD_FIELDS}
    for i, x in enumerate(prompt_ids):
        recs = []
        engine.generate(x, params, policy=pol, on_step=recs.append)
        for r in recs:
            rows["h"].append(r.h_root.detach().to(torch.float32).clone())
            rows["n_accepted"].append(r.n_accepted)
            rows["len_by_depth"].append(step_lengths(r, d_max, wd))
            rows["prompt"].append(first_index + i)
            rows["committed"].append(r.committed)
            rows["head_logp"].append(head_logp(r.tree, wd))
        if advance is not None:
            advance()
    if not rows["h"]:
        raise YggError("the record run produced no speculation steps")
    return Records(
        torch.stack(rows["h"]),
        torch.tensor(rows["n_accepted"], dtype=torch.int64),
        torch.tensor(rows["len_by_depth"], dtype=torch.int64),
        torch.tensor(rows["prompt"], dtype=torch.int64),
        torch.tensor(rows["committed"], dtype=torch.int64),
        torch.stack(rows["head_logp"]),
    )


def data_hash(rec: Records) -> str:
    """sha256 over the record tensors (names, dtypes, shapes, bytes), in a fixed order."""
    h = hashlib.sha256()
    for k, v in rec.tensors().items():
        h.update(f"{k}:{v.dtype}:{list(v.shape)};".encode())
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def sidecar_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def save_records(path: str | Path, rec: Records, meta: dict) -> Path:
    """``path`` (safetensors) and its JSON sidecar (``meta`` + kind, version, data hash)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(p) as tmp:
        save_file(rec.tensors(), str(tmp))
    side = {"kind": RECORDS_KIND, "version": RECORDS_VERSION, "data_hash": data_hash(rec),
            "steps": int(rec.h.shape[0]), "hidden_size": int(rec.h.shape[1]), "d_max": rec.d_max} | meta
    write_text_atomic(sidecar_path(p), json.dumps(side, indent=1) + "\n")
    return p


def load_records(path: str | Path) -> tuple[Records, dict]:
    """Records and their sidecar; YggError if either is missing, corrupt, or they disagree."""
    from ..runtime.loading import read_safetensors
    from ..runtime.artifacts import read_artifact

    p, side_p = Path(path), sidecar_path(path)

    if not p.is_file():
        raise YggError(f"depth records {p} do not exist")
    meta = read_artifact(side_p, "depth records sidecar", RECORDS_KIND, RECORDS_VERSION)
    t = read_safetensors(p, "depth records")
    lack = [k for k in RECORD_FIELDS if k not in t]
    if lack:
        raise YggError(f"cannot read depth records {p}: no tensor {', '.join(lack)}")
    rec = Records(**{k: t[k] for k in RECORD_FIELDS})
    s = rec.h.shape[0]
    if rec.h.ndim != 2 or rec.len_by_depth.ndim != 2 or any(
            v.shape[0] != s for v in rec.tensors().values()):
        raise YggError(f"depth records {p}: tensors of inconsistent shapes")
    if data_hash(rec) != meta.get("data_hash"):
        raise YggError(f"depth records {p} do not match {side_p} (data hash differs)")
    return rec, meta
