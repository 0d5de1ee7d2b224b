"""The offline artifacts the runtime reads (a latency profile, an acceptance calibration, a depth
predictor's manifest, a compiled plan's directory): their kinds and format version, the identity of
the models they were measured for, and reading one's JSON with a one-line error naming what is wrong.

The models are known by their files' content (:func:`model_fingerprints`, :func:`same_model_file`:
size and sha256, the mtime only saving a re-read). A profile holds for the plan's :func:`timing_identity` (latency depends on shapes, dtype
and backend), a calibration and a predictor for its :func:`pair_identity` (acceptance depends on
the drafter's weights too); a reader refuses an artifact of another identity, naming the first key
that differs (:func:`first_difference`).

The artifacts of a compiled plan live in one directory (``compile/<name>/``)::

    manifest.json      the plan and its hash, model fingerprints, torch/python versions and a
                       hash of yggtree's runtime sources (:func:`versions`), backend, dtype, the
                       padding of short packed products (``packed_min_rows``), every graph
                       (shapes, compile seconds, sha256), size on disk; paths relative to the
                       directory
    plan.yaml          the plan as compiled (paths rewritten relative to this directory)
    graphs/            one AOTInductor package per block shape (block-<kind>-w<W>-c<C>.pt2)
                       and per plain-step context bucket (step-<key>-w1-c<C>.pt2)

Whether they match a plan: ``yggtree.compiled.check_artifacts``. A ``plan`` here is a
:class:`yggtree.plan.Plan`.
"""

from __future__ import annotations

import ast
import hashlib
import platform
import time
from pathlib import Path

from ..errors import YggError
from ..files import file_sha256, read_json

__all__ = [
    "PROFILE_KIND", "CALIBRATION_KIND", "FORMAT_VERSION", "timing_identity", "pair_identity",
    "first_difference", "read_artifact", "artifact_head", "DEFAULT_DRAFTER_DIR", "model_fingerprints",
    "same_model_file",
    "is_documentation", "MANIFEST", "PLAN_COPY", "MANIFEST_FORMAT", "CACHE_SUBDIR", "cache_dir",
    "read_manifest", "GRAPH_SOURCES", "runtime_code_hash", "versions",
]

PROFILE_KIND = "yggtree-profile"
CALIBRATION_KIND = "yggtree-acceptance-calibration"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN_COPY = "plan.yaml"
MANIFEST_FORMAT = 2  # 2: AOTInductor packages (1 was an inductor cache read through dynamo)
CACHE_SUBDIR = "graphs"  # AOTInductor packages (one .pt2 per block shape)
# the trained EAGLE head for the embedded default target (yggtree distill; see its manifest.json)
DEFAULT_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "assets" / "drafters" / "smollm2-135m-eagle"


# ----------------------------------------------------------------------------- model files


def _file_print(p: Path, role: str, content: bool = False) -> dict:
    st = p.stat()
    d = {"role": role, "path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if content or p.name == "config.json" or (p.suffix in (".json", ".yaml") and st.st_size < (1 << 20)):
        d["sha256"] = file_sha256(p)
    return d


def same_model_file(was: dict, now: dict) -> bool:
    """Whether the model file recorded as ``was`` (a fingerprint) is the file ``now`` describes.
    A file is its content: an equal size and mtime is taken as unchanged without reading it; a new
    mtime (a fresh clone, a reinstalled package) is checked against the recorded sha256 when there
    is one, so copying the same weights again never invalidates what was built for them."""
    if was.get("size") != now.get("size"):
        return False
    if "sha256" in was and "sha256" in now:
        return was["sha256"] == now["sha256"]
    if was.get("mtime_ns") == now.get("mtime_ns"):
        return True
    return "sha256" in was and was["sha256"] == file_sha256(Path(now["path"]))


def _resolve_model_path(role: str, name: str | None) -> Path | None:
    """The file or directory behind a plan's target/drafter (None: nothing on disk to track)."""
    if name is None or name == "self":
        return None
    if name == "default":
        if role == "target":
            from .loading import default_model_path  # imports torch; only here

            return default_model_path()
        return DEFAULT_DRAFTER_DIR  # the shipped default drafter
    return Path(name)


def is_documentation(path: str | Path) -> bool:
    """A model directory's documentation (``*.md``): no model file (editing it changes no weight)."""
    return Path(path).suffix == ".md"


def model_fingerprints(plan, content: bool = False) -> list[dict]:
    """Size and mtime (plus sha256 of small config files, of every file with ``content``: what a
    compile records, :func:`same_model_file`) of every model file the plan uses.

    A directory (HF checkpoint, EAGLE head) contributes every regular file at its top level but
    its documentation (``*.md``: a README edited after the compile changes no weight)."""
    out = []
    for role in ("target", "drafter"):  # the plan's models (plan.MODEL_KEYS)
        p = _resolve_model_path(role, getattr(plan, role))
        if p is None:
            continue
        if not p.exists():
            out.append({"role": role, "path": str(p), "missing": True})
        elif p.is_dir():
            out += [_file_print(f, role, content) for f in sorted(p.iterdir())
                    if f.is_file() and not is_documentation(f)]
        else:
            out.append(_file_print(p, role, content))
    return out


# ----------------------------------------------------------------------------- identities and reading


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
    if plan.drafter_weights is not None:  # the drafter in a format of its own
        out["drafter_weights"] = plan.drafter_weights
    return out


def pair_identity(plan) -> dict:
    """What acceptance depends on: the timing identity plus the drafter's weights (sha256), without
    the KV cache's dtype and the drafter's own weight format (as without the target's: a 16-bit
    cache or quantized weights move the logits by their rounding, which the calibration's
    acceptance statistics do not resolve)."""
    ident = timing_identity(plan)
    ident.pop("kv_cache", None)
    ident.pop("drafter_weights", None)  # as the target's format: not resolved by the statistics
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


# ----------------------------------------------------------------------------- compiled plans


def cache_dir(art_dir: str | Path) -> Path:
    """The directory of compiled graph packages inside an artifact directory."""
    return Path(art_dir) / CACHE_SUBDIR


# the runtime sources compiled graphs are traced from (decoder block, KV cache, the export
# wrapper); the rest of the runtime only decides which shapes are called, and a shape without a
# graph is refused loudly at warm-up
# eagle_config.py: the drafter's layer shapes; packed.py, quant.py and w4a8.py: the custom ops and the quantized layers the packages call
# (csrc/w4a8.cpp is not traced: packages call the op, which the process loads); steps.py: the
# step functions a whole-step package inlines; prepare.py: what the models hold when traced (padding,
# each model's attention formulation), constants of every package
GRAPH_SOURCES = ("aoti.py", "eagle.py", "eagle_config.py", "kernels.py", "kv_cache.py", "model.py",
                 "packed.py", "prepare.py", "quant.py", "steps.py", "w4a8.py")


def runtime_code_hash() -> str:
    """sha256 (16 hex digits) of the code of the runtime sources the compiled graphs are traced
    from: of their syntax trees without docstrings, so that an edit of comments or docstrings
    alone leaves every compiled package valid (the Python version, which the trees' form depends
    on, is a version of its own: :func:`versions`). Parsing them is a tenth of a second of every
    run's start, so the result is kept in the user cache by the sources' bytes and the Python
    version (``code/<sha256>``; an unwritable cache only costs the parse)."""
    from ..files import cache_root, write_text_atomic

    texts = [(Path(__file__).parent / name).read_text() for name in GRAPH_SOURCES]
    raw = hashlib.sha256(platform.python_version().encode())
    for name, text in zip(GRAPH_SOURCES, texts):
        raw.update(name.encode() + b"\0" + text.encode() + b"\0")
    kept = cache_root() / "code" / raw.hexdigest()[:32]
    try:
        got = kept.read_text()
        if len(got) == 16:
            return got
    except OSError:
        pass
    h = hashlib.sha256()
    for name, text in zip(GRAPH_SOURCES, texts):
        h.update(name.encode() + b"\0" + code_of(text).encode())
    code = h.hexdigest()[:16]
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(kept, code)
    except OSError:
        pass
    return code


def code_of(source: str) -> str:
    """The code of Python ``source``: its syntax tree without docstrings, dumped (comments and
    layout are not in a syntax tree)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def versions() -> dict:
    """What compiled graphs depend on besides the plan and the models."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "yggtree_runtime": runtime_code_hash(),
    }


def read_manifest(art_dir: str | Path) -> dict | None:
    """The manifest in ``art_dir``, or None if absent; YggError if unreadable."""
    p = Path(art_dir) / MANIFEST
    if not p.is_file():
        return None
    m = read_json(p, "manifest")
    if not isinstance(m, dict):
        raise YggError(f"manifest {p} is not a JSON object")
    return m
