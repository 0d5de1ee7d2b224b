"""``yggtree compile plan.yaml``: build every static graph a plan can need, once, into compile/<name>/.

The graphs (regional: one graph per input shape of a decoder block, shared by all its layers,
and one per context bucket C of the target's attention):

    target   prefill chunk, plain decoding 1, verify W_v for every W_v of the plan
    drafter  prefill chunk, head (1 for a standalone LM, D_max + 1 for an EAGLE head),
             one draft step W_d for every W_d of the plan

The shapes are found by running the engine's own warm-up eagerly with a recorder on every block
(``runtime.aoti.ShapeRecorder``), so the compiled set is exactly what a run asks for. A shape that
serves several roles (say a W_v equal to the prefill chunk, or a self-drafter's step) is one graph.
All of them share the KV cache size of the plan's envelope (``runtime.build.plan_slots``).

Backends:

- ``inductor-cpu``: each shape is exported (``torch.export``, the layer's weights and KV cache as
  inputs, the cache written in place) and compiled by AOTInductor into a self-contained package
  ``compile/<name>/graphs/block-<kind>-w<W>-c<C>.pt2``; the target's tree steps (the plain step and
  every W_v, ``Plan.step_widths``) are also compiled whole, once per context bucket
  (``step-<key>-w<W>-c<C>.pt2``: every layer inlined, up to the final norm, returning the layers
  the drafter reads; bitwise the block packages' step, so plain and verify steps run them). A run loads the packages and calls them directly
  (``runtime.aoti``): no dynamo tracing, no guards, no compile in the process.
  Inductor's intermediate build files go to a scratch directory deleted after the compile.
- ``eager``: nothing to build; the manifest (fingerprints, versions) is written alone.
- ``cuda`` and ``npu``: refused where the runtime is missing, saying what to install; the engine
  does not run them yet.

Output: a rich progress bar (stderr), a per-graph compile-time table (stdout), then ONE JSON line.
A second compile of the same plan finds a matching manifest and returns at once (``--force``
rebuilds from an empty cache). A directory holding another plan's artifacts is never replaced
without ``--force``.

Helper graphs (EGT selection, acceptance, commit) run as eager ops today and are not compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from ..compiled import artifact_dir, check_artifacts
from ..errors import YggError, module_main
from ..files import file_sha256, manifest_path
from ..measure.kernel_choice import measure_plan
from ..measure.loops_choice import forced as forced_loops
from ..plan import Plan, graph_hash_of, load_plan, save_plan
from ..runtime.artifacts import (
    CACHE_SUBDIR,
    MANIFEST,
    MANIFEST_FORMAT,
    PLAN_COPY,
    cache_dir,
    model_fingerprints,
    read_manifest,
    versions,
)
from ..runtime.padding import plan_kernel, plan_min_rows, plan_prefetch
from ..runtime.schedule import usable_cores

from .plan_search import search_plan

OLD_CACHE_SUBDIR = "inductor-cache"  # manifest format 1 (removed by a rebuild)

# ----------------------------------------------------------------------------- helpers


def dir_size(path: Path) -> int:
    """Bytes of every regular file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _owned_entries(art: Path) -> set[str]:
    scratch = {p.name for p in art.glob("build-*") if p.is_dir()}  # left by an interrupted compile
    return {MANIFEST, PLAN_COPY, CACHE_SUBDIR, MANIFEST + ".tmp", OLD_CACHE_SUBDIR} | scratch


def _write_manifest(art: Path, manifest: dict) -> None:
    """Write ``art``'s manifest atomically (a stopped write never leaves half a manifest)."""
    tmp = art / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(art / MANIFEST)


def _check_destination(plan: Plan, art: Path, force: bool) -> None:
    """Refuse to overwrite another plan's artifacts (or foreign files) without ``force``."""
    if not art.exists():
        return
    if not art.is_dir():
        raise YggError(f"{art} exists and is not a directory")
    m = read_manifest(art)
    if m is not None:
        if graph_hash_of(m.get("plan")) != plan.graph_hash() and not force:
            raise YggError(
                f"{art} holds the artifacts of a different plan (name {m.get('plan_name')!r}, hash "
                f"{str(m.get('plan_hash'))[:12]}); pass --force to replace them, or rename the plan"
            )
        return
    foreign = sorted(p.name for p in art.iterdir() if p.name not in _owned_entries(art))
    if foreign and not force:
        raise YggError(
            f"{art} is not empty and has no {MANIFEST} (found {', '.join(foreign[:3])}); "
            "pass --force to use it anyway, or choose another --out"
        )


def _clear(art: Path) -> None:
    """Remove the artifacts yggtree owns in ``art`` (never other files)."""
    for name in (MANIFEST, MANIFEST + ".tmp", PLAN_COPY):
        (art / name).unlink(missing_ok=True)
    for name in _owned_entries(art) - {MANIFEST, MANIFEST + ".tmp", PLAN_COPY}:
        shutil.rmtree(art / name, ignore_errors=True)


def _roles_target(plan: Plan, w: int) -> str:
    roles = []
    if w == plan.prefill_chunk:
        roles.append("prefill")
    if w == 1:
        roles.append("plain")
    if plan.speculative and w in plan.verify_widths:
        roles.append("verify")
    return "+".join(roles)


def _roles_drafter(plan: Plan, w: int, head: int) -> str:
    roles = []
    if w == plan.prefill_chunk:
        roles.append("prefill")
    if w == head:
        roles.append("head")
    if w in plan.draft_widths:
        roles.append("draft")
    return "+".join(roles) or "warm-up"


# ----------------------------------------------------------------------------- the build


def _build_graphs(plan: Plan, progress, task, out: Path, min_rows: int, whole: bool = True,
                  workers: int = 1) -> tuple[list[dict], dict]:
    """Prepare the plan's models as its engine does (``runtime.prepare.prepare_models``: packed
    products padded to ``min_rows``, raised where a speculative plan's padding is not
    batch-invariant here), record every block shape the engine's warm-up asks for
    (:func:`_record_shapes`), and compile one AOTInductor package per distinct (block kind, W, C)
    into ``out`` (and, with ``whole``, the whole-step and drafter-call packages:
    :func:`_package_jobs`). A package already in ``out`` (a build of the same key stopped halfway,
    or linked from another directory: :func:`_seed_packages`) is kept. Returns one record per
    (model, W, C) and load timings."""
    from dataclasses import replace

    import torch

    from ..runtime.aoti import compile_drafter_call_package, compile_package, compile_step_package, library_loops_only
    from ..runtime.build import EngineSpec, plan_slots
    from ..runtime.attention_choice import native_attention
    from ..runtime.prepare import prepare_models

    t0 = time.perf_counter()
    progress.update(task, description="loading models")
    models = prepare_models(replace(EngineSpec.from_plan(plan), min_rows=min_rows), tokenizer=False)
    target, drafter = models.target, models.drafter
    n_slots = plan_slots(plan)  # every package's cache size: the plan's engine's
    target.setup_cache(1, n_slots)
    load_s = time.perf_counter() - t0

    progress.update(task, description="recording shapes")
    rec, uses = _record_shapes(plan, target, drafter, n_slots)
    # capturing the drafter's layers: the target's whole steps return them
    capture = tuple(drafter.target_layers) if drafter is not None else ()
    jobs = _package_jobs(plan, rec, target, drafter, capture, n_slots, whole)
    # a plain plan whose products all run on the kernel library: its packages' own loops serial, so
    # that the library's may run on its pool (aoti.library_loops_only; measure/loops_choice.py measures it)
    serial_loops = drafter is None and library_loops_only(target)

    def build(key: tuple[str, int, int], scope: str, path: Path) -> None:
        kind, w, c = key
        if scope == "block":
            compile_package(rec.blocks[kind], rec.examples[key], path, serial_loops=serial_loops)
        elif scope == "step":
            compile_step_package(target, w, c, capture, path, serial_loops=serial_loops)
        else:
            compile_drafter_call_package(drafter, scope, w, plan.top_k, plan.max_tree, path)

    secs, sums = _compile_packages(jobs, out, progress, task, build, workers)
    records = [*_block_records(plan, rec, uses, secs, sums)]
    for key, scope in jobs.items():
        if scope == "step":
            records.append(_step_record(plan, key, capture, target.cfg.hidden_size, secs, sums))
        elif scope != "block":
            records.append(_call_record(plan, key, scope, drafter.cfg.hidden_size, secs, sums))
    return records, {"load_s": round(load_s, 3), "n_slots": n_slots, "threads": torch.get_num_threads(),
                     "min_rows": models.min_rows or min_rows, "serial_loops": serial_loops,
                     "attention_kernel": native_attention(target)}  # runtime/attention_choice.py


def _record_shapes(plan: Plan, target, drafter, n_slots: int):
    """``(recorder, uses)``: the engine's own warm-up run eagerly with a recorder on every block
    (``runtime.aoti.ShapeRecorder``: each distinct (block kind, W, C) with a block and example
    inputs), and every (model, roles, (kind, W, C)) it asked for, in order. The blocks get their
    plain forward back after, to be exported."""
    import torch

    from ..runtime.aoti import ShapeRecorder, install_recorder
    from ..runtime.build import drafter_widths
    from ..runtime.graphs import Graphs

    rec = ShapeRecorder()
    install_recorder(target, rec)
    head = getattr(drafter, "max_depth", 0) + 1  # EAGLE: D_max + 1; standalone LM: 1
    uses: list[tuple[str, str, tuple[str, int, int]]] = []  # (model, role, shape)
    with torch.no_grad():
        graphs = Graphs(target, "performance", backend=plan.backend)
        for w in plan.target_widths:
            graphs.warm_up([w])
            uses += [("target", _roles_target(plan, w), k) for k in rec.take()]
        if drafter is not None:
            install_recorder(drafter.graphs.model, rec)
            drafter.setup(n_slots, [plan.prefill_chunk], plan.prefill_chunk)
            uses += [("drafter", "prefill+head", k) for k in rec.take()]
            for w in drafter_widths(plan):
                drafter.setup(n_slots, [w], plan.prefill_chunk)
                uses += [("drafter", _roles_drafter(plan, w, head), k) for k in rec.take()]
    for model in (target, drafter.graphs.model if drafter is not None else None):
        for block in model.layers if model is not None else ():
            block.__dict__.pop("forward", None)
    return rec, uses


def _package_jobs(plan: Plan, rec, target, drafter, capture: tuple[int, ...], n_slots: int,
                  whole: bool) -> dict[tuple[str, int, int], str]:
    """Every package of the build, (key, W, C) -> its scope, in build order: a block package per
    recorded shape; with ``whole``, the target's whole tree steps (runtime.aoti, "Step
    packages": every step width at every context bucket it fits) and an EAGLE drafter's head and
    draft calls (runtime.aoti, "Drafter-call packages", for the plan's top-k and largest tree)."""
    from ..runtime.aoti import drafter_call_key, step_key
    from ..runtime.graphs import context_buckets

    jobs = {key: "block" for key in rec.examples}
    if not whole:
        return jobs
    skey = step_key(target, capture)
    jobs |= {(skey, w, c): "step" for w in plan.step_widths for c in context_buckets(n_slots) if c >= w}
    if hasattr(drafter, "calls"):
        head = drafter.max_depth + 1
        jobs |= {(drafter_call_key(drafter, kind, plan.top_k, plan.max_tree), w, n_slots): kind
                 for kind, ws in (("head", [head]), ("draft", plan.draft_widths)) for w in ws}
    return jobs


def _compile_packages(jobs: dict[tuple[str, int, int], str], out: Path, progress, task,
                      build, workers: int = 1) -> tuple[dict, dict]:
    """Each package of ``jobs`` written into ``out`` by ``build(key, scope, path)``, unless one is
    there already (a stopped build's of the same key, or linked: kept); ``(seconds, sha256)`` by
    key (0 s for a kept one). Each is written under a partial name and renamed: a stopped
    compile leaves no package. ``workers`` > 1: that many built at once, each in a forked child
    (:mod:`yggtree.offline.build_jobs`)."""
    from ..runtime.aoti import package_name
    from .build_jobs import run_here, run_in_children

    progress.update(task, total=len(jobs), completed=0)
    secs: dict[tuple[str, int, int], float] = {}
    sums: dict[tuple[str, int, int], str] = {}  # each package's sha256, checked at every load
    todo = []
    for key, scope in jobs.items():
        name = package_name(*key, scope)
        if (out / name).is_file():  # built by a stopped build of the same key, or linked
            secs[key], sums[key] = 0.0, file_sha256(out / name)
            progress.update(task, advance=1)
        else:
            todo.append((key, scope, name))
    parallel = workers > 1 and len(todo) > 1
    for key, name, dt in (run_in_children(todo, out, build, progress, task, workers) if parallel
                          else run_here(todo, out, build, progress, task)):
        secs[key] = dt
        sums[key] = file_sha256(out / name)
        _checksum(out / name).write_text(sums[key] + "\n")  # finished: _finished
        progress.update(task, advance=1)
    return secs, sums


def _block_records(plan: Plan, rec, uses, secs: dict, sums: dict) -> list[dict]:
    """The manifest records of the block packages: one per (model, roles, shape) the warm-up asked
    for; the first use of a package "compiled", later ones "shared" (a self-drafter's blocks)."""
    from ..runtime.aoti import package_name

    records, done = [], set()
    for model_name, roles, key in uses:
        kind, w, c = key
        records.append({
            "model": model_name,
            "role": roles,
            "key": kind,
            "scope": "block",
            "width": w,
            "context": c,
            "file": package_name(kind, w, c),
            "sha256": sums[key],
            "shapes": {"x": list(rec.examples[key][0].shape), "mask": [1, w, c], "slots": [1, w]},
            "dtype": plan.dtype,
            "compile_s": round(secs[key], 3) if key not in done else 0.0,
            "cache": "compiled" if key not in done else "shared",
        })
        done.add(key)
    return records


def _step_record(plan: Plan, key: tuple[str, int, int], capture: tuple[int, ...], hidden: int, secs: dict,
                 sums: dict) -> dict:
    """The manifest record of a whole-step package of the target."""
    from ..runtime.aoti import package_name

    skey, w, c = key
    return {
        "model": "target",
        "role": "plain (whole step)" if w == 1 else "verify (whole step)",
        "key": skey,
        "scope": "step",
        "capture": list(capture),
        "width": w,
        "context": c,
        "file": package_name(skey, w, c, "step"),
        "sha256": sums[key],
        "shapes": {"x": [1, w, hidden], "mask": [1, w, c], "slots": [1, w]},
        "dtype": plan.dtype,
        "compile_s": round(secs[key], 3),
        "cache": "compiled",
    }


def _call_record(plan: Plan, key: tuple[str, int, int], scope: str, hidden: int, secs: dict, sums: dict) -> dict:
    """The manifest record of a drafter-call package (``scope``: head or draft)."""
    from ..runtime.aoti import package_name

    ckey, w, c = key
    return {
        "model": "drafter",
        "role": f"{scope} (whole call)",
        "key": ckey,
        "scope": scope,
        "top_k": plan.top_k,  # the call's constants, which its engine installs it with
        "nodes": plan.max_tree,
        "width": w,
        "context": c,
        "file": package_name(ckey, w, c, scope),
        "sha256": sums[key],
        "shapes": {"x": [w, hidden], "mask": [w, c]},
        "dtype": plan.dtype,
        "compile_s": round(secs[key], 3),
        "cache": "compiled",
    }


def _up_to_date(plan: Plan, art: Path) -> dict | None:
    """The manifest of ``art`` with its ``status`` if its packages serve ``plan`` as they are
    (``up-to-date``, or ``plan-updated``: only fields the graphs do not depend on changed, so the
    plan copy and the manifest are refreshed and every package kept); None if they do not."""
    m = read_manifest(art)
    if m is None or check_artifacts(plan, art):
        return None
    if m.get("plan_hash") == plan.hash():
        return {**m, "status": "up-to-date"}
    save_plan(plan, art / PLAN_COPY)
    m = {**m, "plan_hash": plan.hash(), "plan": plan.to_dict(relative_to=art), "stage_plan": search_plan(plan),
         "plan_updated": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    _write_manifest(art, m)
    return {**m, "status": "plan-updated"}


def _clear_for_rebuild(plan: Plan, art: Path, force: bool) -> list[str]:
    """Empty ``art`` for a build (``force``: everything; else the stale manifest and the old cache
    layout); returns why the artifacts there were stale (none if there were none)."""
    stale = check_artifacts(plan, art) if read_manifest(art) is not None else []
    if force:
        _clear(art)  # a forced rebuild starts from an empty cache
    else:
        (art / MANIFEST).unlink(missing_ok=True)  # stale: rebuilt below
        shutil.rmtree(art / OLD_CACHE_SUBDIR, ignore_errors=True)
    art.mkdir(parents=True, exist_ok=True)
    return stale


def _model_prints(plan: Plan, art: Path) -> list[dict]:
    """The plan's model fingerprints with paths relative to ``art``; YggError if a file is missing."""
    prints = model_fingerprints(plan)
    missing = [f["path"] for f in prints if f.get("missing")]
    if missing:
        raise YggError(f"plan {plan.name!r}: model file not found: {missing[0]}")
    return [f | {"path": manifest_path(f["path"], art)} for f in prints]  # no absolute paths


def _build_key(plan: Plan, min_rows: int) -> dict:
    """What every package of a build depends on: packages built under the same key are the same
    files, so a stopped build resumes and another directory's packages can be linked."""
    from ..runtime.device import detect_device, device_record
    from ..runtime.model import attention_formulation

    return {"graph_hash": plan.graph_hash(), "versions": versions(), "device": device_record(detect_device()),
            "min_rows": min_rows, "kernel": plan_kernel(plan), "attention": attention_formulation(plan.prefill_chunk)}


BUILD_KEY = "build-key.json"  # in a package cache: the key its packages were built under


def _same_key(d: Path, key: dict) -> bool:
    try:
        return json.loads((d / BUILD_KEY).read_text()) == json.loads(json.dumps(key))
    except (OSError, ValueError):
        return False


def _checksum(pkg: Path) -> Path:
    """Where the sha256 of the finished package ``pkg`` is written, beside it."""
    return pkg.with_suffix(".sha256")


def _finished(pkg: Path) -> bool:
    """Whether ``pkg`` is a package a build finished: its bytes hash to the sha256 written beside
    it when it was renamed into place (a truncated or damaged one does not)."""
    try:
        return _checksum(pkg).read_text().strip() == file_sha256(pkg)
    except OSError:
        return False


def _seed_packages(out: Path, key: dict, reuse: tuple[Path, ...]) -> int:
    """Prepare the package cache ``out`` for a build under ``key``: kept if it holds packages of
    the same key (a stopped build resumes), else emptied, and a package that is not intact
    (:func:`_finished`) dropped; then the intact packages of the artifact directories ``reuse``
    built under the same key are linked in. Returns how many it holds."""
    if not _same_key(out, key):
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for part in out.glob("partial-*"):  # a package a stopped build was writing
        shutil.rmtree(part, ignore_errors=True) if part.is_dir() else part.unlink(missing_ok=True)
    for pkg in out.glob("*.pt2"):
        if not _finished(pkg):
            pkg.unlink()
    (out / BUILD_KEY).write_text(json.dumps(key) + "\n")
    for art in reuse:
        src = cache_dir(art)
        if src.resolve() == out.resolve() or not _same_key(src, key):
            continue
        for pkg in src.glob("*.pt2"):
            if pkg.name.startswith("partial-") or (out / pkg.name).exists() or not _finished(pkg):
                continue
            for f in (pkg, _checksum(pkg)):
                try:
                    os.link(f, out / f.name)
                except OSError:
                    shutil.copy2(f, out / f.name)
    return len(list(out.glob("*.pt2")))


def _build_with_progress(plan: Plan, art: Path, console, min_rows: int, whole: bool = True,
                         reuse: tuple[Path, ...] = (), workers: int = 1) -> tuple[list[dict], dict]:
    """Every graph of ``plan`` built into ``art``'s package cache, with a progress bar on ``console``."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..runtime.graphs import inductor_cache

    console = console or Console(stderr=True)
    columns = (
        TextColumn("[bold]compile[/] {task.description:<22}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} graphs"),
        TimeElapsedColumn(),
    )
    out = cache_dir(art)
    _seed_packages(out, _build_key(plan, min_rows), reuse)
    # inductor's build files go to a scratch cache that is deleted afterwards: a package is
    # self-contained, and runs never read an inductor cache
    with tempfile.TemporaryDirectory(prefix="build-", dir=art) as scratch, inductor_cache(scratch), \
            Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("loading", total=None)
        return _build_graphs(plan, progress, task, out, min_rows, whole, workers)


def _manifest(plan: Plan, art: Path, prints: list[dict], min_rows: int, records: list[dict], info: dict,
              stale: list[str], built_with: dict) -> dict:
    """The manifest of a build of ``plan`` in ``art`` (no absolute paths)."""
    from ..runtime.device import detect_device, device_record
    from ..runtime.model import attention_formulation

    return {
        "format": MANIFEST_FORMAT,
        "plan_name": plan.name,
        "plan_hash": plan.hash(),
        "plan": plan.to_dict(relative_to=art),  # no absolute paths
        "backend": plan.backend,
        "dtype": plan.dtype,
        # read when the build started: sources edited meanwhile (an upgrade) make the packages stale
        "versions": built_with,
        # the device the packages were built for and on (runtime/device.py), checked by check_artifacts
        "device": device_record(detect_device()),
        "models": prints,
        "n_slots": info["n_slots"],
        # the library attention the packages call for tree rows (runtime/attention_choice.py; None:
        # none): an engine loading them runs the same, whatever this machine measures later
        "attention_kernel": info.get("attention_kernel"),
        # inductor's CPU kernels are built for the thread count of the compiling process
        "threads": info["threads"],
        "packed_min_rows": min_rows,  # compared with the plan's profile by check_artifacts
        "packed_kernel": plan_kernel(plan),  # likewise
        # the library's prefetch setting measured with the kernel (a record: no package holds it;
        # the engine sets it while decoding, from the profile or this machine's measurement)
        "packed_prefetch": plan_prefetch(plan),
        # how the packages compute attention (model.attention_formulation), checked by check_artifacts
        "attention": attention_formulation(plan.prefill_chunk),
        "cache_dir": CACHE_SUBDIR if plan.backend != "eager" else None,
        "graphs": records,
        # distinct packages: a record "shared" uses one built for another model (a self-drafter
        # shares the target's block graphs)
        "n_graphs": sum(r["cache"] == "compiled" for r in records),
        "n_shapes": len(records),
        "compile_s": round(sum(r["compile_s"] for r in records), 3),
        "load_s": info["load_s"],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "replaced_because": stale,
        # the execution plan search over the profile's stage forms (plan_search.py; None: no
        # data): `--stages auto` runs its choice when the plan's stages field is `auto`
        "stage_plan": search_plan(plan),
    }


def compile_plan(
    plan: Plan,
    out_root: str | Path = "compile",
    force: bool = False,
    console=None,
    replace: bool = False,
    whole: bool = True,
    reuse: tuple[Path, ...] = (),
    workers: int = 1,
) -> dict:
    """Compile ``plan`` into its artifact directory; returns the summary (the manifest plus
    ``status`` = ``compiled`` | ``up-to-date`` | ``plan-updated``, ``dir`` and ``wall_s``).

    Up to date (manifest matches: same plan hash, torch/python versions, model files) and not
    ``force``: returns at once without loading anything. Stale artifacts of the same plan are
    rebuilt from scratch.
    A directory holding another plan's manifest is refused unless ``replace`` (keep the cache)
    or ``force`` (start from an empty cache).

    ``whole=False`` builds the block packages alone (a run of them computes the same bits, its
    steps a little slower); a later ``whole`` build adds the whole-step and drafter-call packages.
    A build stopped halfway resumes: the packages it finished are kept (same build key). ``reuse``:
    other artifact directories whose packages of the same key are linked instead of compiled.
    ``workers``: packages built at once (each in a forked child; 0: one per usable core)."""
    from ..runtime.graphs import check_backend

    t_start = time.perf_counter()
    check_backend(plan.backend)
    art = artifact_dir(plan, out_root)
    _check_destination(plan, art, force or replace)
    forced_loops()  # a bad YGGTREE_LOOPS is refused now, not after the build
    measure_plan(plan)  # a plan without a profile: its product kernel on this machine (cached)
    current = None if force else _up_to_date(plan, art)
    if current is not None and whole and not current.get("whole", True):
        current = None  # block packages alone: the whole ones are built below
    if current is not None:
        return {**current, "dir": str(art), "wall_s": time.perf_counter() - t_start}
    stale = _clear_for_rebuild(plan, art, force)
    built_with = versions()
    prints = _model_prints(plan, art)
    min_rows = plan_min_rows(plan)  # the padding of packed products the packages hold
    records, info = [], {"load_s": 0.0, "n_slots": None, "threads": None}
    if plan.backend != "eager":
        records, info = _build_with_progress(plan, art, console, min_rows, whole, tuple(reuse),
                                             workers or usable_cores())
    built_rows = info.get("min_rows", min_rows)  # raised where the plan's is not batch-invariant here
    save_plan(plan, art / PLAN_COPY)
    manifest = _manifest(plan, art, prints, built_rows, records, info, stale, built_with)
    manifest["whole"] = whole  # False: the block packages alone (compile_plan ``whole``)
    if built_rows != min_rows:  # check_artifacts accepts the plan's padding for the raised one
        manifest["packed_min_rows_raised_from"] = min_rows
    manifest["size_bytes"] = dir_size(art)  # the cache and the plan copy (not the manifest)
    _write_manifest(art, manifest)
    # this machine's allocator, measured once on a compiled plan (its children load the plan through
    # the manifest just written, which then records the choice)
    if plan.backend == "inductor-cpu":
        from ..measure.allocator_choice import measure_compiled

        say = lambda line: sys.stderr.write(f"yggtree: {line}\n")  # noqa: E731
        try:
            record = measure_compiled(art / PLAN_COPY, out_root, say=say)
        except YggError as e:  # the packages are built: a run only misses the faster allocator
            say(f"the memory allocator was not measured: {e}")
            record = None
        if record is not None:
            manifest["allocator"] = {k: record.get(k) for k in ("choice", "library", "stats")}
            _write_manifest(art, manifest)
        # where the kernel library's loops run (measure/loops_choice.py): only where they are the step's only
        # parallel regions, at 2+ threads
        if info.get("serial_loops") and (info.get("threads") or 1) > 1:
            from ..measure.loops_choice import measure_compiled as measure_loops

            try:
                manifest["loops"] = measure_loops(plan, art, say=say)
            except YggError as e:  # the packages are built: a run keeps OpenMP's loops
                say(f"the kernel loops were not measured: {e}")
            _write_manifest(art, manifest)
    return {**manifest, "status": "compiled", "dir": str(art), "wall_s": time.perf_counter() - t_start}


def graph_table(summary: dict):
    """A rich table of the graphs of a compile summary or manifest."""
    from rich.table import Table

    title = (
        f"plan {summary['plan_name']} ({summary['backend']}, {summary['dtype']}): "
        f"{summary['n_graphs']} graphs, {summary['compile_s']:.1f} s, "
        f"{summary['size_bytes'] / 1e6:.1f} MB in {summary.get('dir', '')} [{summary.get('status', '')}]"
    )
    t = Table(title=title)
    for name in ("model", "role", "W", "C", "block input x", "compile s", "package"):
        right = name in ("W", "C", "compile s")
        t.add_column(name, justify="right" if right else "left", no_wrap=True)
    for r in summary["graphs"]:
        x = "[" + ",".join(str(v) for v in r["shapes"]["x"]) + "]"
        t.add_row(r["model"], r["role"], str(r["width"]), str(r["context"]), x,
                  f"{r['compile_s']:.2f}", r["cache"])
    return t


def summary_line(summary: dict) -> dict:
    """The one JSON line of ``yggtree compile``."""
    return {
        "command": "compile",
        "plan": summary["plan_name"],
        "plan_hash": summary["plan_hash"],
        "dir": summary["dir"],
        "status": summary["status"],
        "backend": summary["backend"],
        "dtype": summary["dtype"],
        "graphs": summary["n_graphs"],
        "compile_s": summary["compile_s"],
        "load_s": summary["load_s"],
        "wall_s": round(summary["wall_s"], 3),
        "size_bytes": summary["size_bytes"],
        "torch": summary["versions"]["torch"],
    }


# ----------------------------------------------------------------------------- runs with a plan


def prepare_run(plan_path: str | Path, compile_missing: bool, compile_root: str | Path = "compile") -> Plan:
    """Load a plan for ``yggtree run --plan`` and make sure its compiled artifacts are usable
    (:func:`ensure_artifacts`). The artifact directory is ``yggtree.compiled.artifact_dir(plan,
    compile_root)``; pass it to ``build_plan_engine``."""
    plan = load_plan(plan_path)
    ensure_artifacts(plan, compile_missing, compile_root, shown_as=str(plan_path))
    return plan


def ensure_artifacts(plan: Plan, compile_missing: bool, compile_root: str | Path = "compile",
                     shown_as: str | None = None) -> Path | None:
    """The plan's artifact directory, its artifacts checked (None for the eager backend, which
    uses none). Missing or stale (see :func:`yggtree.compiled.check_artifacts`): with
    ``compile_missing`` they are compiled now (the reasons go to stderr), otherwise a YggError
    lists the reasons. A plan never silently runs with other graphs."""
    from ..runtime.graphs import check_backend

    check_backend(plan.backend)
    if plan.backend == "eager":
        return None  # nothing compiled is used
    art = artifact_dir(plan, compile_root)
    if (art / MANIFEST).is_file():  # a plan without a profile: its product kernel here (cached)
        measure_plan(plan)
    reasons = check_artifacts(plan, art)
    if not reasons:
        return art
    if not compile_missing:
        raise YggError(
            f"compiled artifacts of plan {plan.name!r} in {art} are not usable: {'; '.join(reasons)}. "
            f"Run `yggtree compile {shown_as or plan.source or 'PLAN'}` or pass --compile-missing"
        )
    sys.stderr.write(f"yggtree: compiling plan {plan.name!r} into {art}: {'; '.join(reasons)}\n")
    own_copy = plan.source is not None and plan.source == (art / PLAN_COPY).resolve()
    compile_plan(plan, compile_root, replace=own_copy)  # an edited copy replaces its own dir
    return art


# ----------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan YAML file (see yggtree/plan.py for the schema)")
    p.add_argument("--out", default="compile", metavar="DIR", help="artifact root: DIR/<plan-name>/ (default: compile)")
    p.add_argument("--force", action="store_true", help="rebuild from an empty cache; replace another plan's artifacts")
    p.add_argument("--json", action="store_true", help="print only the JSON line (no table)")
    p.add_argument("--jobs", type=int, default=0, metavar="N",
                   help="packages built at once, each in its own process (default 0: one per usable core)")


def run(args) -> int:
    """The ``compile`` subcommand: progress on stderr, table on stdout, one JSON line last."""
    from rich.console import Console

    plan = load_plan(args.plan)
    if args.jobs < 0:
        raise YggError(f"--jobs must be >= 0, got {args.jobs}")
    summary = compile_plan(plan, args.out, force=args.force, workers=args.jobs)
    if not args.json:
        con = Console(width=None if sys.stdout.isatty() else 140)
        if summary["status"] == "up-to-date":
            con.print(f"plan {plan.name!r} is up to date in {summary['dir']} (manifest matches; --force rebuilds)")
        con.print(graph_table(summary))
    print(json.dumps(summary_line(summary)), flush=True)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``compile`` on a CLI's subparsers (help line, description, flags), handled by :func:`run`."""
    p = subparsers.add_parser(
        "compile",
        help="build every static graph of a plan into compile/<plan-name>/",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.compile ...``: the same options as ``yggtree compile``."""
    return module_main("yggtree.offline.compile", "compile", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
