"""The memory allocator a ``yggtree`` process runs on: glibc's, or jemalloc or tcmalloc preloaded.

A CPU decode step makes thousands of small allocations (AOTInductor's tensor handles and views,
every product's output), and glibc's malloc spends a measurable share of a short step on them.
Which allocator decodes fastest is a property of the machine (its
CPU, its C library, the allocators installed), so it is measured there, never assumed:
``yggtree compile`` times the compiled plan's decoding (as ``yggtree run --plan`` runs it) under
every allocator installed (``yggtree.measure.allocator_choice``) and caches the choice under the user cache directory, keyed by
the CPU and the libraries; every later ``yggtree`` command reads the cache before anything heavy
is imported and, where the choice is another allocator than the one running, starts itself again
with it preloaded (``LD_PRELOAD``: an allocator cannot change once a process has allocated), as
do the benchmark scripts (:func:`ensure_script`), so that they time what ``yggtree run`` runs.

``YGGTREE_ALLOCATOR`` in the environment: ``auto`` (the default: the cached measurement),
``system`` (never preload), ``jemalloc`` or ``tcmalloc`` (that allocator, unmeasured), or a path
to an allocator's shared library. A program that embeds the engine in its own process chooses its
allocator itself: ``LD_PRELOAD=<library> python ...``.

This module imports nothing heavy (no torch): the launcher (``yggtree.launch``) calls it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from ..errors import YggError
from ..files import cache_root

ALLOCATOR_ENV = "YGGTREE_ALLOCATOR"  # auto | system | jemalloc | tcmalloc | a library path
LOADED_ENV = "YGGTREE_ALLOCATOR_EXEC"  # set on the restarted process: never restart twice
SYSTEM = "system"
# allocator -> its shared libraries' file names, preferred first
LIBRARIES = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}


def library_dirs() -> list[Path]:
    """Where allocator libraries are looked for: ``LD_LIBRARY_PATH``, the Python prefix's
    ``lib`` (a conda environment's), then the system's library directories."""
    dirs = [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs.append(Path(sys.prefix) / "lib")
    machine = os.uname().machine
    for root in ("/usr/local/lib", "/usr/lib", "/lib"):
        dirs += [Path(f"{root}/{machine}-linux-gnu"), Path(f"{root}64"), Path(root)]
    return dirs


def find(name: str, dirs: list[Path] | None = None) -> Path | None:
    """The shared library of allocator ``name`` (a key of :data:`LIBRARIES`), or None."""
    for d in library_dirs() if dirs is None else dirs:
        for lib in LIBRARIES[name]:
            if (d / lib).is_file():
                return d / lib
    return None


def installed(dirs: list[Path] | None = None) -> dict[str, Path]:
    """Every allocator of :data:`LIBRARIES` found on this machine -> its library (none off
    Linux: ``LD_PRELOAD`` is the glibc loader's)."""
    if dirs is None and not sys.platform.startswith("linux"):
        return {}
    found = {name: find(name, dirs) for name in LIBRARIES}
    return {name: path for name, path in found.items() if path is not None}


def name_of(path: str | Path) -> str:
    """The allocator a library file is (its name up to ``.so``, any version), or the file's name."""
    base = Path(path).name
    stem = base.split(".so")[0]
    for name, libs in LIBRARIES.items():
        if any(lib.split(".so")[0] == stem for lib in libs):
            return name
    return base


def running(maps: str | None = None) -> str:
    """The allocator this process runs on: an allocator of :data:`LIBRARIES` whose library is
    mapped (``/proc/self/maps``, or ``maps``' text), else ``system``."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return SYSTEM
    mapped = {name_of(line.split()[-1]) for line in maps.splitlines() if "/" in line}
    return next((name for name in LIBRARIES if name in mapped), SYSTEM)


def machine_key(libraries: dict[str, Path]) -> dict:
    """What a measured choice depends on: the CPU (its identity, usable cores included:
    runtime/cpuinfo.py), the C library, the allocators' libraries (path, size and time of each)."""
    from .cpuinfo import cpu_identity

    cpu = cpu_identity().to_dict()
    libs = {}
    for name, path in sorted(libraries.items()):
        st = Path(path).stat()
        libs[name] = [str(path), st.st_size, st.st_mtime_ns]
    return {"cpu": cpu, "cores": cpu["cores"], "libc": os.confstr("CS_GNU_LIBC_VERSION") or "",
            "libraries": libs}


def choice_path(key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_root()) / "allocator" / f"choice-{digest}.json"


def cached(root: Path | None = None, dirs: list[Path] | None = None) -> tuple[dict | None, Path, dict]:
    """``(record, path, key)``: the allocator measured on this machine as cached (None: not
    measured, or measured with other libraries), the file and the key it is cached under."""
    key = machine_key(installed(dirs))
    path = choice_path(key, root)
    try:
        record = json.loads(path.read_text())
        if record.get("key") == key and isinstance(record.get("choice"), str):
            return record, path, key
    except (OSError, ValueError, AttributeError):
        pass
    return None, path, key


def forced() -> str | None:
    """What ``YGGTREE_ALLOCATOR`` names: None for ``auto`` (or unset), ``system``, or a library
    path; YggError in one line for a value that names nothing here."""
    v = os.environ.get(ALLOCATOR_ENV, "auto").strip() or "auto"
    if v == "auto":
        return None
    if v == SYSTEM:
        return SYSTEM
    if v in LIBRARIES:
        path = find(v)
        if path is None:
            raise YggError(f"{ALLOCATOR_ENV}={v}: no {v} library on this machine "
                           f"(looked for {', '.join(LIBRARIES[v])})")
        return str(path)
    if "/" in v:
        if not Path(v).is_file():
            raise YggError(f"{ALLOCATOR_ENV}={v}: no such file")
        return v
    raise YggError(f"{ALLOCATOR_ENV}={v!r}: must be auto, {SYSTEM}, {', '.join(LIBRARIES)} or a library path")


def chosen(root: Path | None = None) -> str:
    """The allocator library this machine's ``yggtree`` processes run on (a path), or ``system``:
    the forced one, else the cached measurement's (``system`` when none is cached)."""
    f = forced()
    if f is not None:
        return f
    record, _, _ = cached(root)
    if record is None or record["choice"] == SYSTEM:
        return SYSTEM
    path = record.get("library")
    return path if isinstance(path, str) and Path(path).is_file() else SYSTEM


def _preloads(env: dict, drop: str | None) -> list[str]:
    """``env``'s ``LD_PRELOAD`` entries (separated by colons or spaces), without ``drop``."""
    return [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != drop]


def preload_env(env: dict, library: str) -> dict:
    """``env`` with ``library`` first in ``LD_PRELOAD`` (and the restart marker set)."""
    return {**env, "LD_PRELOAD": ":".join([library, *_preloads(env, library)]), LOADED_ENV: library}


def without_preload(env: dict) -> dict:
    """``env`` without the allocator a restart preloaded (for a program of another project a
    benchmark runs as a peer, which should run as its users run it)."""
    library = env.get(LOADED_ENV)
    out = {k: v for k, v in env.items() if k not in (LOADED_ENV, "LD_PRELOAD")}
    rest = _preloads(env, library)
    if rest:
        out["LD_PRELOAD"] = ":".join(rest)
    return out


def ensure(command: list[str], root: Path | None = None) -> None:
    """Run ``command`` (this process's own command line: ``[sys.executable, ...]``) in place of
    this process, on the chosen allocator (:func:`chosen`), when this process runs on glibc's (or,
    with ``YGGTREE_ALLOCATOR`` set, on any other); return at once otherwise, off Linux, and on the
    restarted process (even if the library did not load there: the loader says why on stderr,
    and the program runs on). Call it before importing torch. YggError for a
    ``YGGTREE_ALLOCATOR`` that names nothing."""
    if os.environ.get(LOADED_ENV) is not None or not sys.platform.startswith("linux"):
        return
    library = chosen(root)
    now = running()
    if library == SYSTEM or now == name_of(library):
        return
    if now != SYSTEM and forced() is None:
        return  # the user preloaded another allocator: theirs stays
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, preload_env(os.environ, library))


def ensure_script() -> None:
    """:func:`ensure` for a script run as ``python script.py ...`` (the benchmarks): one line and
    exit status 1 for a bad ``YGGTREE_ALLOCATOR``."""
    try:
        ensure([sys.executable, *sys.argv])
    except YggError as e:
        sys.stderr.write(f"yggtree: error: {e}\n")
        raise SystemExit(1) from None
