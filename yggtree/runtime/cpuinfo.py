"""What CPU this process runs on: ``/proc/cpuinfo`` read once, as a frozen identity.

A KVM guest may name its CPU by marketing name only, one name for CPU generations with different
instruction sets (AVX2 only, or AVX-512), so a device is known by what it is: vendor, family,
model, stepping, the instruction-set features the kernels use (:data:`FEATURES`) and the cores
this process may run on (``os.sched_getaffinity``). Profiles, kernel choices, compiled packages and tuned plans record
:meth:`CpuIdentity.to_dict` and are matched on it (``runtime/device.py``: ``device_difference``).
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

# the instruction-set features yggtree's kernels (runtime/csrc, inductor's generated code) depend
# on, as /proc/cpuinfo names them; a record measured with another set is of another CPU
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
            "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class CpuIdentity:
    """A CPU as the kernels see it. ``flags``: every flag /proc/cpuinfo lists (not part of the
    identity, which holds only :data:`FEATURES`)."""

    vendor: str
    family: int | None
    model: int | None
    stepping: int | None
    model_name: str
    features: tuple[str, ...]  # of FEATURES, in that order
    cores: int  # usable by this process (its affinity mask)
    flags: frozenset = field(default=frozenset(), compare=False, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["flags"]
        d["features"] = list(self.features)
        return d


def _int(text: str | None) -> int | None:
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_cpuinfo(text: str, cores: int) -> CpuIdentity:
    """The identity of the CPU whose ``/proc/cpuinfo`` is ``text`` (its first processor; x86
    names, or ARM's ``CPU implementer``/``Features``) with ``cores`` usable cores."""
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if first:
                break  # one processor block is enough: a machine's cores are alike
            continue
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip(), value.strip())
    flags = frozenset((first.get("flags") or first.get("Features") or "").split())
    return CpuIdentity(
        vendor=first.get("vendor_id") or first.get("CPU implementer") or platform.machine(),
        family=_int(first.get("cpu family") or first.get("CPU architecture")),
        model=_int(first.get("model") or first.get("CPU part")),
        stepping=_int(first.get("stepping") or first.get("CPU revision")),
        model_name=first.get("model name") or platform.processor() or platform.machine(),
        features=tuple(f for f in FEATURES if f in flags),
        cores=cores,
        flags=flags,
    )


@functools.cache
def cpu_identity() -> CpuIdentity:
    """This machine's CPU (``/proc/cpuinfo`` read once per process; where there is none, the
    platform's name without features)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, usable_cores())


def cpu_flags() -> frozenset:
    """Every feature flag of this CPU (/proc/cpuinfo names; empty where there is none)."""
    return cpu_identity().flags
