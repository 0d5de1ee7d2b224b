"""Every instruction-set variant of the kernel library compiles, whatever this CPU runs.

The library is built only for a variant the CPU runs (runtime/kernels.py), so a variant that no
test machine runs could stop compiling unseen; :func:`check_sources` compiles each source for any
variant with the compiler's ``-fsyntax-only`` (no object, no run). Kept apart from kernels.py,
whose text keys every compiled package.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig

from torch.utils import cpp_extension

from ..errors import YggError
from . import kernels
from .kernels import ISAS

__all__ = ["check_sources"]


def check_sources(name: str) -> None:
    """Compile every source for the instruction set ``name`` of :data:`ISAS` without building or
    running it (the compiler's ``-fsyntax-only``: templates instantiated, static_asserts
    checked), whatever this CPU runs; YggError naming the source and the compiler's first error
    line where one fails. The tests call it for every variant, so one no test machine can run
    still compiles (the build itself is only ever for a variant the CPU runs)."""
    if name not in ISAS:
        raise YggError(f"no instruction set {name!r} (one of {', '.join(ISAS)})")
    includes = [f"-isystem{p}" for p in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    # as cpp_extension.load compiles them (its -std for this torch, its two defines)
    base = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20", "-DTORCH_EXTENSION_NAME=yggtree_kernels",
            "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, *kernels.CFLAGS, *ISAS[name][1]]
    for src in kernels.SOURCES:
        r = subprocess.run([*base, str(src)], capture_output=True, text=True)
        if r.returncode:
            lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
            first = next((ln for ln in lines if "error:" in ln), lines[0] if lines else f"exit status {r.returncode}")
            raise YggError(f"the kernel library's {src.name} does not compile for {name}: {first}")
