"""Package builds side by side: each in a forked child process, at most ``workers`` at a time.

Most of a package's build is single-threaded Python (``torch.export`` tracing the graph,
inductor lowering it, writing its C++) and one compiler process, so one build keeps one core
busy: on a machine of N cores, N builds at once take about 1/N of the time. A child is forked
from the process that prepared the models (it inherits them, copy-on-write: nothing is loaded
again) and builds one package: ``build(key, scope, part)`` into a partial name, renamed into
place when it is whole, so a stopped build leaves no package under a final name.

The children run no parallel region of their own (``torch.set_num_threads(1)``: a forked child
has none of its parent's OpenMP threads), while the packages' loops are compiled for the
parent's thread count (inductor's ``cpp.threads``, which a package's own configuration may
still override), exactly as a build in the parent would compile them. A child that fails writes
its error's first line beside the partial package and exits non-zero; the parent then stops the
others and raises it in one line. Ctrl-C reaches the children too (same process group); the
parent kills what is left and re-raises; a parent killed outright takes its children with it
(they ask the kernel for that first).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

from ..errors import YggError

Key = tuple[str, int, int]  # (kind, W, C) of a package
Job = tuple[Key, str, str]  # (key, scope, package file name)


def build_one(build: Callable[[Key, str, Path], object], key: Key, scope: str, out: Path, name: str) -> None:
    """``build`` the package ``name`` into ``out`` under a partial name, then rename it."""
    part = out / f"partial-{name}"
    with warnings.catch_warnings():  # torch's own pytree deprecation noise while packaging
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*treespec")
        build(key, scope, part)
    os.replace(part, out / name)


def run_here(jobs: list[Job], out: Path, build, progress, task) -> Iterator[tuple[Key, str, float]]:
    """Build ``jobs`` one after another in this process; yields (key, name, seconds) per package."""
    for key, scope, name in jobs:
        kind, w, c = key
        progress.update(task, description=f"{scope} W={w} C={c}")
        t = time.perf_counter()
        build_one(build, key, scope, out, name)
        yield key, name, time.perf_counter() - t


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (a parent killed outright, which
    cannot stop its children itself; Linux only, elsewhere nothing); a parent that died before
    that: exit now."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _child(build, key: Key, scope: str, out: Path, name: str, threads: int, parent: int) -> None:
    """A forked child's whole life: build one package, exit 0 (or write the error, exit 1)."""
    code = 1
    try:
        _die_with_parent(parent)
        sys.stdout = open(os.dup(1), "w")  # fresh stream objects: a parent thread may have held
        sys.stderr = open(os.dup(2), "w")  # the inherited ones' locks when it forked
        import torch
        import torch._inductor.config as inductor

        if inductor.cpp.threads < 1:
            inductor.cpp.threads = threads
        torch.set_num_threads(1)
        build_one(build, key, scope, out, name)
        code = 0
    except BaseException as e:  # noqa: BLE001 (the parent reports it)
        try:
            first = (str(e).strip().splitlines() or [""])[0]
            (out / f"partial-{name}.err").write_text(f"{type(e).__name__}: {first}".rstrip(": ") + "\n")
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def warm_compiler() -> None:
    """What every package build does first, done once in the process its builds fork from (the
    children inherit it): import the compiler stack, and have inductor probe which vector
    instruction sets its C++ compiler builds and this CPU runs (a test program compiled and run
    per set: seconds, cached only in the process)."""
    import torch._inductor.codegen.cpp_wrapper_cpu  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()


def run_in_children(jobs: list[Job], out: Path, build, progress, task, workers: int
                    ) -> Iterator[tuple[Key, str, float]]:
    """Build ``jobs`` in forked children, ``workers`` at a time; yields (key, name, seconds) as
    each finishes. YggError naming the package where one fails."""
    import torch

    warm_compiler()
    threads, parent = torch.get_num_threads(), os.getpid()
    pending, running = list(jobs), {}  # pid -> (key, name, start)
    try:
        while pending or running:
            while pending and len(running) < workers:
                key, scope, name = pending.pop(0)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(build, key, scope, out, name, threads, parent)
                running[pid] = (key, name, time.perf_counter())
            progress.update(task, description=", ".join(f"W={k[1]} C={k[2]}" for k, _, _ in running.values()))
            pid, status = os.wait()
            if pid not in running:
                continue
            key, name, start = running.pop(pid)
            if os.waitstatus_to_exitcode(status) != 0 or not (out / name).is_file():
                err = out / f"partial-{name}.err"
                why = err.read_text().strip() if err.is_file() else f"exit status {os.waitstatus_to_exitcode(status)}"
                if why.startswith("KeyboardInterrupt"):
                    raise KeyboardInterrupt
                raise YggError(f"building package {name} failed: {why}")
            yield key, name, time.perf_counter() - start
    finally:
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
