"""A plan's compiled artifacts: where they live (:func:`artifact_dir`) and why a directory of them
does not match the plan (:func:`check_artifacts`; empty: usable). Their layout (manifest, plan
copy, packages) and the identities a manifest records (model fingerprints, versions) are
runtime/artifacts.py's; the plan's own identity is :meth:`yggtree.plan.Plan.graph_hash`.
Light at load time (no torch import), like plan.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import YggError
from .files import file_sha256
from .plan import GRAPH_FIELDS, OPTIONAL_GRAPH_FIELDS, Plan, graph_hash_of
from .runtime.artifacts import (MANIFEST, MANIFEST_FORMAT, PLAN_COPY, cache_dir, is_documentation,
                                model_fingerprints, read_manifest, same_model_file, versions)
from .runtime.padding import plan_padding


def artifact_dir(plan: Plan, compile_root: str | Path = "compile") -> Path:
    """Where ``plan``'s artifacts live: ``<compile_root>/<name>/``, except that a plan read from
    a compiled copy (``compile/<name>/plan.yaml`` next to a manifest) uses its own directory."""
    src = plan.source
    if src is not None and src.name == PLAN_COPY and src.parent.name == plan.name:
        if (src.parent / MANIFEST).is_file():
            return src.parent
    return Path(compile_root) / plan.name


def check_artifacts(plan: Plan, compile_dir: str | Path) -> list[str]:
    """Reasons the artifacts in ``compile_dir`` (an artifact directory, e.g. ``compile/<name>``)
    are missing or stale for ``plan``; an empty list means they match."""
    d = Path(compile_dir)
    try:
        m = read_manifest(d)
    except YggError as e:
        return [str(e)]
    if m is None:
        return [f"no compiled artifacts: {d / MANIFEST} is missing"]
    reasons = []
    if m.get("format") != MANIFEST_FORMAT:
        reasons.append(
            f"the artifacts in {d} have format {m.get('format')}, this yggtree writes {MANIFEST_FORMAT}"
        )
    if graph_hash_of(m.get("plan")) != plan.graph_hash():
        what = _plan_diff(m.get("plan"), plan.to_dict(relative_to=d), GRAPH_FIELDS + OPTIONAL_GRAPH_FIELDS)
        reasons.append(f"the plan changed since it was compiled into {d}" + (f" ({what})" if what else ""))
    now = versions()
    for k, v in now.items():
        was = m.get("versions", {}).get(k)
        if was != v:
            what = "yggtree runtime code" if k == "yggtree_runtime" else f"{k} version"
            reasons.append(f"{what} changed: compiled with {was}, running {v}")
    if plan.backend != "eager":
        reasons += _package_reasons(plan, m, d)
    reasons += _model_reasons(plan, m)
    if plan.backend not in ("eager",) and m.get("graphs"):
        reasons += _graph_file_reasons(m, d)
    return reasons


def _package_reasons(plan: Plan, m: dict, d: Path) -> list[str]:
    """Reasons the compiled packages in ``d`` (manifest ``m``) do not fit this machine or what an
    engine of ``plan`` runs: the device they were built on, the padding and kernel of packed
    products they hold, their attention formulation."""
    from .runtime.device import detect_device, device_difference
    from .runtime.model import attention_formulation

    reasons = []
    differs = device_difference(m.get("device"), detect_device())  # their code is built for one device
    if differs is not None:
        reasons.append(f"the packages in {d} were not built on this machine: {differs}")
    # the packages hold the padding of their packed products
    source = "the plan's profile" if plan.profile is not None else "this machine's measurement"
    try:
        pad = plan_padding(plan)
    except YggError as e:
        reasons.append(str(e))
    else:  # without a profile and without a measurement here: the packages' own choice stands
        rows, kernel = ((pad["min_rows"], pad["kernel"]) if pad
                        else (m.get("packed_min_rows"), m.get("packed_kernel", "torch")))
        if m.get("packed_min_rows") != rows and m.get("packed_min_rows_raised_from") != rows:
            reasons.append(f"the padding of short packed products changed: compiled with min_rows "
                           f"{m.get('packed_min_rows')}, {source} says {rows}")
        if m.get("packed_kernel", "torch") != kernel:
            reasons.append(f"the product kernel changed: compiled with {m.get('packed_kernel', 'torch')}, "
                           f"{source} says {kernel}")
    want = attention_formulation(plan.prefill_chunk)  # the packages hold the formulation
    if m.get("attention") != want:
        def say(f) -> str:
            if not isinstance(f, dict) or set(f) != set(want):
                return "an earlier one"
            return f"row by row up to {f['rows_up_to']} rows, logical window {f['logical_window']}"

        reasons.append(f"the attention formulation changed: compiled with {say(m.get('attention'))}, an "
                       f"engine of this plan uses {say(want)}")
    return reasons


def _model_reasons(plan: Plan, m: dict) -> list[str]:
    """Reasons ``plan``'s model files are not those compiled (manifest ``m``): missing, new,
    changed or no longer used."""
    reasons = []
    # a model file is known by its role and name (the manifest records its path relative to its
    # directory, which changes when either moves); its size and checksum identify it
    was_prints = {(f["role"], Path(f["path"]).name): f for f in m.get("models", [])
                  if not is_documentation(f["path"])}  # earlier compiles recorded documentation too
    now_prints = {(f["role"], Path(f["path"]).name): f for f in model_fingerprints(plan)}
    for key, f in now_prints.items():
        old = was_prints.get(key)
        if f.get("missing"):
            reasons.append(f"{key[0]} model file is missing: {f['path']}")
        elif old is None:
            reasons.append(f"{key[0]} model file was not part of the compile: {f['path']}")
        elif not same_model_file(old, f):
            reasons.append(f"{key[0]} model file changed since the compile: {f['path']}")
    for key in was_prints.keys() - now_prints.keys():
        reasons.append(f"{key[0]} model file of the compile is no longer used: {key[1]}")
    return reasons


def _graph_file_reasons(m: dict, d: Path) -> list[str]:
    """Reasons the package files the manifest ``m`` lists are not intact in ``d``'s cache: missing,
    without a checksum, or altered (a truncated or altered package is refused)."""
    reasons = []
    cd = cache_dir(d)
    gone = sorted({g.get("file", "?") for g in m["graphs"]} - {p.name for p in cd.glob("*.pt2")})
    if gone:
        reasons.append(f"{len(gone)} compiled graph file(s) missing in {cd} (e.g. {gone[0]})")
    sums = {g.get("file", "?"): g.get("sha256") for g in m["graphs"]}
    for name in sorted(sums.keys() - set(gone)):  # a truncated or altered package is refused
        if sums[name] is None:
            reasons.append(f"compiled graph file {cd / name} has no checksum in the manifest")
            break
        if file_sha256(cd / name) != sums[name]:
            reasons.append(f"compiled graph file {cd / name} is corrupted (its sha256 differs "
                           "from the manifest's)")
    return reasons


def _plan_diff(old: Any, new: dict, only: tuple[str, ...] | None = None) -> str:
    if not isinstance(old, dict):
        return ""
    keys = [k for k in new if old.get(k) != new[k]] + [k for k in old if k not in new]
    if only is not None:
        keys = [k for k in keys if k in only]
    return "changed: " + ", ".join(keys) if keys else ""
