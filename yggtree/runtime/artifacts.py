"""The offline artifacts the runtime reads (a latency profile, an acceptance calibration, a depth
predictor's manifest): their kinds and format version, the identity of the models they were measured
for, and reading one's JSON with a one-line error naming what is wrong.

A profile holds for the plan's :func:`timing_identity` (latency depends on shapes, dtype and
backend), a calibration and a predictor for its :func:`pair_identity` (acceptance depends on the
drafter's weights too); a reader refuses an artifact of another identity, naming the first key
that differs (:func:`first_difference`).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from ..errors import YggError
from ..files import read_json
from ..plan import model_fingerprints

__all__ = [
    "PROFILE_KIND", "CALIBRATION_KIND", "FORMAT_VERSION", "timing_identity", "pair_identity",
    "first_difference", "read_artifact", "artifact_head",
]

PROFILE_KIND = "yggtree-profile"
CALIBRATION_KIND = "yggtree-acceptance-calibration"
FORMAT_VERSION = 1


def _entries(plan, role: str) -> list[dict]:
    return [f for f in model_fingerprints(plan) if f["role"] == role]


def timing_identity(plan) -> dict:
    """What latency depends on: dtype, backend, the target's files (name, size, config hashes)
    and the drafter's shapes (its config and weight file sizes; retrained weights keep it)."""
    out = {"dtype": plan.dtype, "backend": plan.backend, "target": [], "drafter": []}
    for f in _entries(plan, "target"):
        out["target"].append({k: f[k] for k in ("size", "sha256", "missing") if k in f}
                             | {"name": Path(f["path"]).name})
    for f in _entries(plan, "drafter"):
        name = Path(f["path"]).name
        if name == "config.json" or name.endswith((".safetensors", ".gguf", ".bin")):
            out["drafter"].append({k: f[k] for k in ("size", "sha256") if k in f} | {"name": name})
    if plan.drafter == "self":
        out["drafter"] = "self"
    if plan.kv_cache is not None:  # a 16-bit KV cache (absent: in dtype, as before the field)
        out["kv_cache"] = plan.kv_cache
    return out


def pair_identity(plan) -> dict:
    """What acceptance depends on: the timing identity plus the drafter's weights (sha256)."""
    ident = timing_identity(plan)
    weights = []
    for f in _entries(plan, "drafter"):
        p = Path(f["path"])
        if p.suffix in (".safetensors", ".gguf", ".bin"):
            weights.append({"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    return ident | {"drafter_weights": weights}


def first_difference(have: dict, want: dict) -> str:
    """The first key (sorted) whose value differs between two identities; "?" if none does."""
    for k in sorted(set(have) | set(want)):
        if have.get(k) != want.get(k):
            return k
    return "?"


def artifact_head(kind: str, identity: dict, version: int = FORMAT_VERSION) -> dict:
    """The first keys of an offline artifact, those :func:`read_artifact` and the identity checks
    read: kind, format version, when it was made (local time) and the identity it was made for."""
    return {"kind": kind, "version": version, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "identity": identity}


def read_artifact(path: str | Path, what: str, kind: str, version: int = FORMAT_VERSION,
                  missing_hint: str = "") -> dict:
    """The JSON object of an offline artifact (profile, calibration, predictor manifest):
    YggError naming ``what`` and the file when it is missing, not JSON, of another kind or of
    another format version."""
    p = Path(path)
    if not p.is_file():
        raise YggError(f"{what} {p} does not exist{missing_hint}")
    d = read_json(p, what)
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise YggError(f"{what} {p} is not a {kind} file")
    if d.get("version") != version:
        raise YggError(f"{what} {p} has format version {d.get('version')!r}, expected {version}")
    return d

