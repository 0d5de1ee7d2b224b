"""Which device this process runs on (recorded in profiles, checked when a profile is loaded)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def detect_device() -> dict:
    """What this process can run on: kind (cpu | cuda | npu) and its name."""
    import torch

    if torch.cuda.is_available():
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0)}
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return {"kind": "npu", "name": torch.npu.get_device_name(0)}  # type: ignore[attr-defined]
    except ImportError:
        pass
    return {"kind": "cpu", "name": cpu_model()}


def measured_on(hardware: dict, device: dict) -> bool:
    """True when a profile's ``hardware`` record (``device``, ``device_name``) names ``device``
    (``{"kind", "name"}`` as from :func:`detect_device`)."""
    return (hardware.get("device"), hardware.get("device_name")) == (device["kind"], device["name"])
