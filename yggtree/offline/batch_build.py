"""The batch packages of a compiled plan (runtime/batch_packages.py), built where they are missing.

Once per plan and batch size, in the plan's package cache beside its packages: each package is
exported from the engine's own target block (the plan's format, padding, kernel and attention:
what its packages were built from), written under a partial name and renamed, its sha256 beside
it (offline/compile_packages.py), so an interrupted build resumes and a damaged package is built
again. A package cache of another build key (the plan recompiled) starts over.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ..errors import YggError
from ..runtime.batch_packages import (
    SCOPE,
    BatchPackages,
    batch_dir,
    batch_key,
    batch_shapes,
    entry,
    example_inputs,
    package_root,
)
from ..runtime.graphs import reads_visible_slots
from .compile_packages import BUILD_KEY, _compile_packages, _same_key, seed_packages


def engine_batch_shapes(engine, max_batch: int) -> list[tuple[int, int, int]]:
    """The (b, W, C) a decoder of ``max_batch`` rows calls on ``engine``: its plain step and
    verify widths, its prefill chunk, its cache."""
    widths = (1, *engine.envelope.verify_widths) if engine.cfg.tree is not None else (1,)
    # the library's row attention, which reads only the visible slots: steps at the whole cache alone
    native = all(reads_visible_slots(engine.target, w) for w in widths)
    return batch_shapes(max_batch, widths, engine.cfg.prefill_chunk, engine.n_slots, native)


def batch_packages(engine, max_batch: int, say=None) -> BatchPackages:
    """``engine``'s batch packages for ``max_batch`` rows: loaded, after building whatever is
    missing or damaged (one line on ``say`` first: how many, and that it happens once)."""
    target = engine.target
    root = package_root(target)
    shapes = engine_batch_shapes(engine, max_batch)
    out = batch_dir(root, max_batch)
    if _same_key(out, build_key(target, root, max_batch, engine.n_slots)):
        try:
            return BatchPackages.load(out, target, shapes, max_batch, engine.n_slots)
        except YggError:  # one missing or damaged: built below
            pass
    say = say or (lambda line: sys.stderr.write(f"yggtree: {line}\n"))
    say(f"building the compiled graphs of {max_batch} requests at once ({len(shapes)} packages, "
        f"minutes; once for this plan, in {out})")
    build(target, root, max_batch, engine.n_slots, shapes, _serial_loops(root))
    return BatchPackages.load(out, target, shapes, max_batch, engine.n_slots)


def _serial_loops(root: Path) -> bool:
    """Whether the plan's packages were compiled with inductor's loops serial (their manifest's
    ``serial_loops``, aoti.loops_serial): its batch packages are compiled alike, since the engine
    runs the kernel library's loops where the plan's measurement put them (OpenMP or the pool)."""
    from ..runtime.artifacts import read_manifest

    return bool((read_manifest(root.parent) or {}).get("serial_loops"))


def build_key(target, root: Path, max_batch: int, n_slots: int) -> dict:
    """What the batch packages of ``root`` depend on: the plan's packages' build key (its graphs,
    versions, device, padding, kernel, attention), the block's kind over the cache, and the code
    that shapes the packages' inputs. Packages of another key are built again."""
    import hashlib
    import inspect

    try:
        parent = json.loads((root / BUILD_KEY).read_text())
    except (OSError, ValueError):
        parent = None
    shaping = hashlib.sha256(inspect.getsource(example_inputs).encode()).hexdigest()[:12]
    return {"packages": parent, "batch": batch_key(target.layers[0], max_batch, n_slots), "inputs": shaping}


def build(target, root: Path, max_batch: int, n_slots: int, shapes: list[tuple[int, int, int]],
          serial_loops: bool, console=None) -> None:
    """Every package of ``shapes`` not already in :func:`batch_dir` built from ``target``'s
    first block (every layer shares its kind), with a progress bar on ``console``."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..runtime.aoti import (
        _BlockFn,
        _export_and_package,
        block_tensors,
        package_config,
    )
    from ..runtime.graphs import inductor_cache
    block = target.layers[0]
    key = batch_key(block, max_batch, n_slots)
    out = batch_dir(root, max_batch)
    try:
        seed_packages(out, build_key(target, root, max_batch, n_slots))
    except OSError as e:
        raise YggError(f"cannot build the batched graphs in {out}: {e.strerror or e}") from None
    jobs = {entry(key, s): SCOPE for s in shapes}
    shape_of = {entry(key, s): s for s in shapes}
    config = package_config(block, serial_loops)

    def build_one(job, scope, path: Path) -> None:
        args = (*example_inputs(block, shape_of[job], max_batch, n_slots),
                *(p.detach() for _, p in block_tensors(block)))
        installed = block.__dict__.pop("forward", None)  # export the block's own forward
        try:
            _export_and_package(_BlockFn(block), args, config, path)
        finally:
            if installed is not None:
                block.forward = installed

    columns = (TextColumn("[bold]compile[/] {task.description:<22}"), BarColumn(),
               TextColumn("{task.completed}/{task.total} graphs"), TimeElapsedColumn())
    try:
        with tempfile.TemporaryDirectory(prefix="build-", dir=out) as scratch, inductor_cache(scratch), \
                Progress(*columns, console=console or Console(stderr=True), transient=False) as progress:
            task = progress.add_task("batched steps", total=len(jobs))
            _compile_packages(jobs, out, progress, task, build_one)
    except OSError as e:
        raise YggError(f"cannot build the batched graphs in {out}: {e.strerror or e}") from None
