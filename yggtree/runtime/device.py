"""Which device this process runs on, and whether a record was made on it.

A device is what it is, not what it is called: :func:`detect_device` gives its kind, its name and
its identity (a CPU: vendor, family, model, stepping, the kernels' instruction-set features and
the usable cores, ``runtime/cpuinfo.py``; a GPU: its name and compute capability). Profiles,
kernel choices, compiled packages and tuned plans record it (:func:`device_record`) and every
match goes through :func:`device_difference`: a record of another device, or one made before
identities were recorded, is refused or re-measured with one line saying what differs.
"""

from __future__ import annotations

from .cpuinfo import cpu_identity

# the key of the identity in a record (a profile's ``hardware``, a kernel choice's key, a manifest)
IDENTITY_KEY = "device_identity"


def cpu_model() -> str:
    return cpu_identity().model_name


def detect_device() -> dict:
    """What this process runs on: ``{"kind": cpu | cuda | npu, "name", "identity"}``."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        return {"kind": "cuda", "name": name, "identity": {"name": name, "capability": f"{major}.{minor}"}}
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            name = torch.npu.get_device_name(0)  # type: ignore[attr-defined]
            return {"kind": "npu", "name": name, "identity": {"name": name}}
    except ImportError:
        pass
    cpu = cpu_identity()
    return {"kind": "cpu", "name": cpu.model_name, "identity": cpu.to_dict()}


def device_record(device: dict) -> dict:
    """The fields a record of something made on ``device`` holds (a profile's ``hardware``, a
    kernel choice's key, a compile manifest)."""
    return {"device": device["kind"], "device_name": device["name"], IDENTITY_KEY: device.get("identity")}


def device_slug(device: dict) -> str:
    """``<kind>-<name>-<key>``: a file name for per-device records in the user's directories
    (readable by its name, told apart by :func:`device_key`)."""
    import re

    name = re.sub(r"[^a-z0-9]+", "-", device["name"].lower()).strip("-")[:48] or "device"
    return f"{device['kind']}-{name}-{device_key(device)}"


def device_key(device: dict) -> str:
    """A short digest of ``device``'s kind and identity, for the names of per-device files in the
    user cache (two CPUs of one name get two files)."""
    import hashlib
    import json

    text = json.dumps([device["kind"], device.get("identity")], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _features(x) -> list:
    return [str(f) for f in x] if isinstance(x, (list, tuple)) else []


def identity_difference(was: dict, now: dict) -> str:
    """What differs between two identities, in words (empty if nothing)."""
    parts = []
    had, has = _features(was.get("features")), _features(now.get("features"))
    lacks, extra = [f for f in had if f not in has], [f for f in has if f not in had]
    if lacks:
        parts.append(f"it had {', '.join(lacks)}, this CPU has not")
    if extra:
        parts.append(f"this CPU has {', '.join(extra)}, it had not")
    for key in sorted(set(was) | set(now)):
        if key == "features" or was.get(key) == now.get(key):
            continue
        parts.append(f"{key.replace('_', ' ')} {was.get(key)!r} there, {now.get(key)!r} here")
    return "; ".join(parts)


def device_difference(record: dict | None, device: dict) -> str | None:
    """None when ``record`` (a dict holding ``device``, ``device_name`` and ``device_identity``
    as :func:`device_record` writes them) was made on ``device`` (as from
    :func:`detect_device`); otherwise what differs, in one clause (a record without an identity:
    made before yggtree recorded one, on whatever machine; it never matches)."""
    if not isinstance(record, dict):
        return "it records no device"
    kind, name = record.get("device"), record.get("device_name")
    if (kind, name) != (device["kind"], device["name"]):
        return f"it was made on {kind} {name!r}, this process runs on {device['kind']} {device['name']!r}"
    was, now = record.get(IDENTITY_KEY), device.get("identity")
    if not isinstance(was, dict):
        return (f"it records the {kind} only by name ({name!r}), not by vendor, family, model, stepping, "
                "features and cores: made before yggtree recorded a device's identity")
    if not isinstance(now, dict):
        return f"this {device['kind']}'s identity is unknown"
    if was != now:
        return f"it was made on another {kind} named {name!r} ({identity_difference(was, now)})"
    return None


def measured_on(hardware: dict, device: dict) -> bool:
    """True when a profile's ``hardware`` record was measured on ``device``."""
    return device_difference(hardware, device) is None
