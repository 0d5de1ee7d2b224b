"""Memory for a run's weights, faulted in on 2 MiB pages while torch imports.

An engine moves its weights into one arena of huge pages (runtime/hugepages.py). Faulting fresh
huge pages in can cost a virtual machine most of a second per 100 MB (the host backs the
guest's memory on first touch; docs/results.md section 12), on the path to a run's first token.
A :class:`Reserve` maps the arena the last run needed (:func:`run_hint`, a small JSON file; the
build of this machine's plan writes it for the run after it) at process start and faults it in
on a thread of its own: ``memset`` through ctypes releases the interpreter lock, so the fault
runs beside torch's import (~1 s of Python on the other core). The engine then takes it (:meth:`Reserve.take`) where it fits, and records what it needed for the next
run; where nothing was recorded, the need grew, or the platform has no huge pages, the engine
makes its arena as before. Nothing here imports torch until the engine takes the reserve.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
from pathlib import Path

PAGE = 2 << 20  # bytes of one huge page (runtime/hugepages.py's)
RUN_HINT = "run-arena.json"  # in the user cache: the bytes the next `yggtree run`'s arena needs


def run_hint() -> Path:
    """Where `yggtree run` reads its reserve's size (written by the last run, or by the build of
    this machine's plan, whose engine the next run is)."""
    from ..files import cache_root

    return cache_root() / RUN_HINT


class Reserve:
    """An anonymous private mapping of the hinted size, its 2 MiB-aligned part advised huge and
    written once by a thread (start it with :meth:`open`)."""

    def __init__(self, hint: Path, nbytes: int):
        self.hint = hint
        self.nbytes = nbytes  # bytes the aligned region holds (0: nothing reserved)
        self._map: mmap.mmap | None = None
        self._offset = 0  # of the aligned region in the mapping
        self._thread: threading.Thread | None = None
        if nbytes > 0 and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, ValueError):
                return
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            self._offset = (-base) % PAGE
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._offset, nbytes)
            except OSError:
                pass  # ordinary pages: faulted in all the same
            self._stop = threading.Event()
            self._thread = threading.Thread(target=_fault, args=(base + self._offset, nbytes, self._stop), daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, hint: Path) -> "Reserve":
        """The reserve ``hint`` asks for (its ``{"bytes": N}``), faulting in already; an empty one
        where the hint is missing or unreadable, or asks for more than half the memory free now
        (a damaged hint must not fault in the machine's memory)."""
        try:
            n = int(json.loads(hint.read_text())["bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            n = 0
        return cls(hint, n if 0 < n <= _free_bytes() // 2 else 0)

    def take(self, nbytes: int):
        """A [nbytes] uint8 tensor over the reserve, starting on a 2 MiB boundary, once its fault
        has finished; None where the reserve is smaller (or taken already, or empty). Records
        ``nbytes`` as the next run's hint where it differs (a hint that cannot be written is
        skipped: it only saves time). The rest of a larger reserve goes back to the system."""
        import torch

        if nbytes != self.nbytes:
            self._record(nbytes)
        if self._map is None or nbytes > self.nbytes:
            self._release()
            return None
        self._thread.join()
        keep = (nbytes + PAGE - 1) // PAGE * PAGE
        if keep < self.nbytes:
            self._map.madvise(mmap.MADV_DONTNEED, self._offset + keep, self.nbytes - keep)
        mapping, self._map = self._map, None  # taken: the tensor keeps the mapping alive
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=self._offset)

    def _record(self, nbytes: int) -> None:
        from ..files import write_text_atomic

        try:
            self.hint.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.hint, json.dumps({"bytes": nbytes}) + "\n")
        except OSError:
            pass

    def close(self) -> None:
        """Stop faulting the reserve in and give it back, unless the engine took it: a command
        that ends early (a bad flag, an error before its engine) must not leave the process's exit
        unmapping memory the fault thread still writes."""
        if self._map is not None:
            self._stop.set()
            self._release()

    def _release(self) -> None:
        if self._map is not None:
            self._thread.join()
            self._map.close()
            self._map = None


FAULT_CHUNK = 32 << 20  # bytes the fault writes between looks at its stop flag


def _fault(addr: int, nbytes: int, stop: threading.Event) -> None:
    """Write zeros over [addr, addr + nbytes) chunk by chunk (``ctypes.memset`` releases the
    interpreter lock), until done or ``stop`` is set."""
    for at in range(0, nbytes, FAULT_CHUNK):
        if stop.is_set():
            return
        ctypes.memset(addr + at, 0, min(FAULT_CHUNK, nbytes - at))


def _free_bytes() -> int:
    """Physical memory free now (0 where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0
