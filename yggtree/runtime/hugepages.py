"""Weights and KV caches on 2 MiB pages (Linux transparent huge pages, asked for with ``madvise``).

A decode step streams every weight once. On 4 KiB pages that is a TLB miss every 4 KiB (a
two-level page walk inside a virtual machine) and the hardware prefetchers stop at every page
boundary; small products, whose weights span few pages, never reach full speed. In one arena of
2 MiB pages they stream like one large tensor: the w4a8 target's products at one row, called
back to back, ran faster in a huge-page arena than on the model's own tensors or in an arena of
ordinary pages.

Where the kernel has no transparent huge pages (or they are set to ``never``), or off Linux, the
arena is ordinary memory and nothing else changes: values, aliasing and ties are kept either way.
:func:`huge_page_bytes` reports how much of the process the kernel did back with huge pages.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

PAGE = 2 << 20  # bytes of one huge page (x86-64, arm64 with 4 KiB base pages)
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # bytes: every tensor in an arena starts on a cache line


def _advise(addr: int, length: int) -> bool:
    """Ask the kernel to back [addr, addr + length) with huge pages; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_empty(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 on the CPU, not yet touched, starting on a 2 MiB boundary, its pages asked
    to be huge (the kernel backs them when they are first written)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % PAGE
    buf = raw[off: off + nbytes]
    _advise(buf.data_ptr(), (nbytes + PAGE - 1) // PAGE * PAGE)
    return buf


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor of ``shape`` and ``dtype`` in memory of its own on huge pages."""
    n = 1
    for s in shape:
        n *= s
    return huge_empty(n * torch.empty((), dtype=dtype).element_size()).view(dtype).view(shape).zero_()


def _region(arena: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 at ``offset`` of ``arena``, as a storage of its own that keeps the arena
    alive: compiled regions refuse inputs that share a storage (torch.compile's nested regions
    treat them as aliases), so every moved storage stays a storage of its own."""
    buf = (ctypes.c_uint8 * nbytes).from_address(arena.data_ptr() + offset)
    buf.arena = arena  # the memory's owner lives as long as any tensor over it
    return torch.frombuffer(buf, dtype=torch.uint8)


def _movable(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn


def move_to_huge_pages(modules: list[nn.Module], skip: tuple[type, ...] = (), reserve=None) -> int:
    """Move every dense CPU parameter and buffer of ``modules`` into one huge-page arena, storage
    by storage: each storage becomes a storage of its own over a region of the arena, so tensors
    that shared one (tied weights, views, a self-drafter's copy of the target) still share it and
    others do not, and a Parameter held by several modules is one Parameter after. A storage held
    only by modules of a type in ``skip`` stays where it is (a KV cache, on huge pages of its own;
    an embedding table, read one row a token, which gains nothing from them and is the largest
    copy); one also held elsewhere moves, and its holders in ``skip`` follow it (a tied LM head
    and embedding stay one Parameter). Call it before anything keeps references to the weights
    (compiled packages' input lists). ``reserve`` (runtime/reserve.py), when given, is taken as
    the arena where it fits (its pages faulted in already). Returns the bytes moved."""
    holders = []  # (module, "_parameters" | "_buffers", name, tensor)
    wanted: set[int] = set()  # storages some holder outside ``skip`` holds
    for root in modules:
        for m in root.modules():
            for kind in ("_parameters", "_buffers"):
                held = [(m, kind, n, t) for n, t in getattr(m, kind).items() if _movable(t)]
                holders += held
                if not isinstance(m, skip):
                    wanted.update(t.untyped_storage().data_ptr() for *_, t in held)
    storages: dict[int, torch.UntypedStorage] = {}
    for *_, t in holders:
        ptr = t.untyped_storage().data_ptr()
        if ptr in wanted and t.untyped_storage().nbytes():
            storages.setdefault(ptr, t.untyped_storage())
    offsets, total = {}, 0
    for ptr, s in storages.items():
        offsets[ptr] = total
        total += (s.nbytes() + ALIGN - 1) // ALIGN * ALIGN
    if total == 0:
        return 0
    arena = reserve.take(total) if reserve is not None else None
    if arena is None:
        arena = huge_empty(total)
    regions = {ptr: _region(arena, offsets[ptr], s.nbytes()) for ptr, s in storages.items()}
    for ptr, s in storages.items():
        regions[ptr].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
    moved: dict[int, torch.Tensor] = {}  # id(old tensor) -> new tensor (a Parameter stays one)
    for m, kind, name, t in holders:
        region = regions.get(t.untyped_storage().data_ptr())
        if region is None:
            continue
        new = moved.get(id(t))
        if new is None:
            new = torch.empty(0, dtype=t.dtype).set_(region.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            moved[id(t)] = new
        getattr(m, kind)[name] = new
    return total


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on huge pages (``AnonHugePages`` of
    /proc/self/smaps_rollup); None where that is not known."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
