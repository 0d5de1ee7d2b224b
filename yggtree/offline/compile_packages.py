"""The packages of ``yggtree compile`` (offline/compile.py): one AOTInductor package per graph a
plan's engine asks for, built into the plan's package cache, with their manifest records.

The shapes are found by running the engine's own warm-up eagerly with a recorder on every block
(``runtime.aoti.ShapeRecorder``), so the compiled set is exactly what a run asks for; a shape that
serves several roles (say a W_v equal to the prefill chunk, or a self-drafter's step) is one
package; the target's tree steps and an EAGLE drafter's calls are also compiled whole
(:func:`_package_jobs`).

The package cache records the key its packages were built under (:data:`BUILD_KEY`: the plan's
graph hash, the versions, the device, the padding, kernel and attention) and every finished
package's sha256 beside it, so a stopped build resumes where it stopped (:func:`seed_packages`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from ..files import file_sha256
from ..plan import Plan
from ..runtime.artifacts import cache_dir, versions
from ..runtime.padding import plan_kernel

# ----------------------------------------------------------------------------- the package cache


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


def seed_packages(out: Path, key: dict) -> int:
    """Prepare the package cache ``out`` for a build under ``key``: kept if it holds packages of
    the same key (a stopped build resumes), else emptied, and a package that is not intact
    (:func:`_finished`) dropped. Returns how many it holds."""
    if not _same_key(out, key):
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for part in out.glob("partial-*"):  # a package a stopped build was writing
        shutil.rmtree(part, ignore_errors=True) if part.is_dir() else part.unlink(missing_ok=True)
    for pkg in out.glob("*.pt2"):
        if not _finished(pkg):
            pkg.unlink()
    (out / BUILD_KEY).write_text(json.dumps(key) + "\n")
    return len(list(out.glob("*.pt2")))


# ----------------------------------------------------------------------------- the build


def build_packages(plan: Plan, art: Path, console, min_rows: int, workers: int = 1) -> tuple[list[dict], dict]:
    """Every package of ``plan`` built into ``art``'s package cache (:func:`seed_packages` first:
    what a stopped build of the same key finished is kept), with a progress bar on ``console``;
    returns the manifest records and load timings (:func:`_build_graphs`)."""
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
    seed_packages(out, _build_key(plan, min_rows))
    # inductor's build files go to a scratch cache that is deleted afterwards: a package is
    # self-contained, and runs never read an inductor cache
    with tempfile.TemporaryDirectory(prefix="build-", dir=art) as scratch, inductor_cache(scratch), \
            Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("loading", total=None)
        return _build_graphs(plan, progress, task, out, min_rows, workers)


def _build_graphs(plan: Plan, progress, task, out: Path, min_rows: int,
                  workers: int = 1) -> tuple[list[dict], dict]:
    """Prepare the plan's models as its engine does (``runtime.prepare.prepare_models``: packed
    products padded to ``min_rows``, raised where a speculative plan's padding is not
    batch-invariant here), record every block shape the engine's warm-up asks for
    (:func:`_record_shapes`), and compile one AOTInductor package per distinct (block kind, W, C)
    into ``out``, and the whole-step and drafter-call packages (:func:`_package_jobs`). A package
    already in ``out`` (a build of the same key stopped halfway: :func:`seed_packages`) is kept.
    Returns one record per (model, W, C) and load timings."""
    from dataclasses import replace

    import torch

    from ..runtime.aoti import compile_drafter_call_package, compile_package, compile_step_package, loops_serial
    from ..runtime.build import EngineSpec, plan_slots
    from ..runtime.model import native_attention
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
    jobs, uses = _package_jobs(plan, rec, uses, target, drafter, capture, n_slots)
    # inductor's own loops serial where the library runs every product (aoti.loops_serial; its loops may
    # then run on its pool: measure/loops_choice.py measures it)
    serial_loops = loops_serial(target, drafter.graphs.model if drafter is not None else None)

    def build(key: tuple[str, int, int], scope: str, path: Path) -> None:
        kind, w, c = key
        if scope == "block":
            compile_package(rec.blocks[kind], rec.examples[key], path, serial_loops=serial_loops)
        elif scope == "step":
            compile_step_package(target, w, c, capture, path, serial_loops=serial_loops)
        else:
            compile_drafter_call_package(drafter, scope, w, plan.top_k, plan.max_tree, path, serial_loops=serial_loops)

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
    heads = getattr(drafter, "head_widths", (1,))  # EAGLE: its head calls' widths; standalone LM: 1
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
                uses += [("drafter", _roles_drafter(plan, w, heads), k) for k in rec.take()]
    for model in (target, drafter.graphs.model if drafter is not None else None):
        for block in model.layers if model is not None else ():
            block.__dict__.pop("forward", None)
    return rec, uses


def _roles_target(plan: Plan, w: int) -> str:
    roles = []
    if w == plan.prefill_chunk:
        roles.append("prefill")
    if w == 1:
        roles.append("plain")
    if plan.speculative and w in plan.verify_widths:
        roles.append("verify")
    return "+".join(roles)


def _roles_drafter(plan: Plan, w: int, heads: tuple[int, ...]) -> str:
    roles = []
    if w == plan.prefill_chunk:
        roles.append("prefill")
    if w in heads:
        roles.append("head")
    if w in plan.draft_widths:
        roles.append("draft")
    return "+".join(roles) or "warm-up"


def _package_jobs(plan: Plan, rec, uses: list, target, drafter, capture: tuple[int, ...], n_slots: int
                  ) -> tuple[dict[tuple[str, int, int], str], list]:
    """``(jobs, uses)``: every package of the build, (key, W, C) -> its scope, in build order, the
    longest first (packages build side by side as cores free up, so the long ones started last
    would leave cores idle at the end): the target's whole tree steps (runtime.aoti, "Step
    packages": every step width at every context bucket it runs at and fits, graphs.call_buckets:
    all layers each), an EAGLE drafter's head and draft calls (runtime.aoti, "Drafter-call
    packages", for the plan's top-k and largest tree: one decoder layer each, and a drafted step's
    calls run ~3x slower op by op around block packages), and a block package per recorded shape
    that a run calls (:func:`_block_uses`); and the recorded ``uses`` of those shapes."""
    from ..runtime.aoti import drafter_call_key, step_key
    from ..runtime.graphs import call_buckets

    skey = step_key(target, capture)
    jobs = {(skey, w, c): "step" for w in plan.step_widths for c in call_buckets(target, w) if c >= w}
    if hasattr(drafter, "calls"):
        jobs |= {(drafter_call_key(drafter, kind, plan.top_k, plan.max_tree), w, n_slots): kind
                 for kind, ws in (("head", drafter.head_widths), ("draft", plan.draft_widths)) for w in ws}
    needed = {key for _, _, key in _block_uses(plan, uses, jobs, drafter)}
    return (jobs | {key: "block" for key in rec.examples if key in needed},
            [use for use in uses if use[2] in needed])


def _block_uses(plan: Plan, uses: list, jobs: dict, drafter) -> list:
    """The recorded block uses a run makes (pure): a target's tree step that a whole-step package
    runs (runtime.graphs.Graphs.tree_step; never the prefill chunk) and a drafter's call that a
    whole-call package runs (runtime.eagle.block_widths) call no block package, so none is built
    for them (the runtime's warm-up skips them alike)."""
    from ..runtime.build import drafter_widths
    from ..runtime.eagle import block_widths

    steps = {(w, c) for (_, w, c), scope in jobs.items() if scope == "step"}
    calls = {(scope, w) for (_, w, _), scope in jobs.items() if scope in ("head", "draft")}
    heads = getattr(drafter, "head_widths", (1,))
    drafted = set(block_widths([*drafter_widths(plan), plan.prefill_chunk], heads, plan.prefill_chunk, calls))
    return [(model, roles, key) for model, roles, key in uses
            if (model == "target" and ("prefill" in roles.split("+") or key[1:] not in steps))
            or (model == "drafter" and key[1] in drafted)]


def _compile_packages(jobs: dict[tuple[str, int, int], str], out: Path, progress, task,
                      build, workers: int = 1) -> tuple[dict, dict]:
    """Each package of ``jobs`` written into ``out`` by ``build(key, scope, path)``, unless one is
    there already (a stopped build's of the same key: kept); ``(seconds, sha256)`` by
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


# ----------------------------------------------------------------------------- manifest records


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
