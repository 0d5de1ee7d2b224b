"""Artifact files written whole or not at all, JSON files read with a one-line error, and paths as
manifests record them."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .errors import YggError


@contextlib.contextmanager
def atomic_path(dst: str | Path):
    """Yields a temporary path beside ``dst`` (same suffix, so writers that look at it still
    work); when the block ends normally it replaces ``dst`` in one rename, otherwise it is
    removed. A reader never sees a half-written ``dst``, whatever stops the writer."""
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.stem}.partial{dst.suffix}")
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | Path, what: str = "") -> Any:
    """The JSON value in the file at ``path``. A file that cannot be read or is not JSON is a
    YggError of one line naming it: ``cannot read [what ]PATH: reason``."""
    name = f"{what} {path}" if what else str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise YggError(f"cannot read {name}: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise YggError(f"cannot read {name}: not valid JSON: {e}") from None


def read_record(path: str | Path, what: str, kind: str, make: str) -> dict:
    """The version-1 JSON record of ``kind`` at ``path`` (``what`` names it in messages); YggError in
    one line where it does not exist (``make``: what makes one), is not JSON, or is another kind or
    version."""
    p = Path(path)
    if not p.is_file():
        raise YggError(f"{what} {p} does not exist (make one with {make})")
    d = read_json(p, what)
    if not isinstance(d, dict) or d.get("kind") != kind or d.get("version") != 1:
        raise YggError(f"{what} {p} is malformed: not a version-1 {what}")
    return d


def write_text_atomic(dst: str | Path, text: str) -> Path:
    """``dst.write_text(text)`` through :func:`atomic_path`."""
    with atomic_path(dst) as tmp:
        tmp.write_text(text)
    return Path(dst)


def save_figure(fig, dst: str | Path, dpi: int = 110) -> Path:
    """A matplotlib figure laid out, written to ``dst`` through :func:`atomic_path`, and closed."""
    import matplotlib.pyplot as plt  # the caller drew the figure: matplotlib is loaded

    fig.tight_layout()
    with atomic_path(dst) as tmp:
        fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    return Path(dst)


def manifest_path(path: str | Path, base: str | Path) -> str:
    """``path`` as a manifest in directory ``base`` records it: relative to ``base`` (never
    absolute, so a manifest says nothing about the machine that wrote it)."""
    return os.path.relpath(Path(path).expanduser().resolve(), Path(base).expanduser().resolve())


def manifest_args(argv: list[str], base: str | Path) -> list[str]:
    """A command's arguments as a manifest in ``base`` records them: absolute paths (also in
    ``--flag=PATH``) made relative to ``base``."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=") if a.startswith("--") else ("", "", a)
        if os.path.isabs(value):
            value = manifest_path(value, base)
        out.append(flag + eq + value)
    return out


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks; a file this process hashed already, unchanged
    since (same inode, size and modification time), is not read again (a run checks its packages
    at several steps: finding the plan, checking it, loading it)."""
    st = os.stat(path)
    return _sha256_of(str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _sha256_of(path: str, ino: int, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_root() -> Path:
    """``$XDG_DATA_HOME/yggtree`` (default ``~/.local/share/yggtree``): what a machine built or
    measured for itself (tuned plans, this machine's plan)."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "yggtree"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/yggtree`` (default ``~/.cache/yggtree``): caches that any machine can
    rebuild (converted weights, features, kernels)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "yggtree"
