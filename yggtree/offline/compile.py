"""``yggtree compile plan.yaml``: build every static graph a plan can need, once, into compile/<name>/.

The graphs (regional: one graph per input shape of a decoder block, shared by all its layers,
and one per context bucket C of the target's attention):

    target   prefill chunk, plain decoding 1, verify W_v for every W_v of the plan
    drafter  prefill chunk, head (1 for a standalone LM, D_max + 1 for an EAGLE head),
             one draft step W_d for every W_d of the plan

The shapes are found by running the engine's own warm-up eagerly with a recorder on every block,
so the compiled set is exactly what a run asks for (offline/compile_packages.py builds them). All
of them share the KV cache size of the plan's envelope (``runtime.build.plan_slots``).

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
rebuilds from an empty cache); a stopped one resumes with the packages it finished. A directory
holding another plan's artifacts is never replaced without ``--force``. This module: the command,
its artifact directory and manifest, and the checks of a run with a plan (:func:`ensure_artifacts`).

Helper graphs (EGT selection, acceptance, commit) run as eager ops today and are not compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..compiled import artifact_dir, check_artifacts
from ..errors import YggError, module_main
from ..files import manifest_path
from ..measure.kernel_choice import measure_plan
from ..measure.loops_choice import forced as forced_loops
from ..measure.prefetch_choice import forced as forced_prefetch
from ..plan import Plan, graph_hash_of, load_plan, save_plan
from ..runtime.artifacts import (
    CACHE_SUBDIR,
    MANIFEST,
    MANIFEST_FORMAT,
    PLAN_COPY,
    model_fingerprints,
    read_manifest,
    versions,
)
from ..runtime.padding import plan_kernel, plan_min_rows, plan_prefetch
from ..runtime.schedule import usable_cores

from .compile_packages import build_packages
from .plan_search import search_plan

OLD_CACHE_SUBDIR = "inductor-cache"  # manifest format 1 (removed by a rebuild)

# ----------------------------------------------------------------------------- the artifact directory


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
    prints = model_fingerprints(plan, content=True)  # a file is its content: a copy of it stays it
    missing = [f["path"] for f in prints if f.get("missing")]
    if missing:
        raise YggError(f"plan {plan.name!r}: model file not found: {missing[0]}")
    return [f | {"path": manifest_path(f["path"], art)} for f in prints]  # no absolute paths


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
        # inductor's own loops serial (aoti.loops_serial): the kernel library's may run on its pool
        # (``loops`` below), and a batch package built later for these is compiled alike
        "serial_loops": bool(info.get("serial_loops")),
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
    workers: int = 1,
    allocator: bool = True,
    decoding: bool = True,
) -> dict:
    """Compile ``plan`` into its artifact directory; returns the summary (the manifest plus
    ``status`` = ``compiled`` | ``up-to-date`` | ``plan-updated``, ``dir`` and ``wall_s``).
    ``allocator``: measure this machine's allocator on the compiled plan where not cached yet
    (measure/allocator_choice.py); ``decoding``: the settings measured by decoding on the new
    packages (:func:`record_decoding`: the products' prefetch, where the kernel library's loops run).
    Its caller may measure either later instead.

    Up to date (manifest matches: same plan hash, torch/python versions, model files) and not
    ``force``: returns at once without loading anything. Stale artifacts of the same plan are
    rebuilt from scratch.
    A directory holding another plan's manifest is refused unless ``replace`` (keep the cache)
    or ``force`` (start from an empty cache).

    A build stopped halfway resumes: the packages it finished are kept (same build key).
    ``workers``: packages built at once (each in a forked child; 0: one per usable core)."""
    from ..runtime.graphs import check_backend

    t_start = time.perf_counter()
    check_backend(plan.backend)
    art = artifact_dir(plan, out_root)
    _check_destination(plan, art, force or replace)
    forced_loops(), forced_prefetch()  # a bad YGGTREE_LOOPS or YGGTREE_PREFETCH is refused now, not after the build
    measure_plan(plan)  # a plan without a profile: its product kernel on this machine (cached)
    current = None if force else _up_to_date(plan, art)
    if current is not None:
        return {**current, "dir": str(art), "wall_s": time.perf_counter() - t_start}
    stale = _clear_for_rebuild(plan, art, force)
    built_with = versions()
    prints = _model_prints(plan, art)
    min_rows = plan_min_rows(plan)  # the padding of packed products the packages hold
    records, info = [], {"load_s": 0.0, "n_slots": None, "threads": None}
    if plan.backend != "eager":
        records, info = build_packages(plan, art, console, min_rows, workers or usable_cores())
    built_rows = info.get("min_rows", min_rows)  # raised where the plan's is not batch-invariant here
    save_plan(plan, art / PLAN_COPY)
    manifest = _manifest(plan, art, prints, built_rows, records, info, stale, built_with)
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
            record = measure_compiled(art / PLAN_COPY, out_root, say=say) if allocator else None
        except YggError as e:  # the packages are built: a run only misses the faster allocator
            say(f"the memory allocator was not measured: {e}")
            record = None
        if record is not None:
            manifest["allocator"] = {k: record.get(k) for k in ("choice", "library", "stats")}
            _write_manifest(art, manifest)
        if decoding:
            manifest = record_decoding(plan, art, say) or manifest
    return {**manifest, "status": "compiled", "dir": str(art), "wall_s": time.perf_counter() - t_start}


def record_decoding(plan: Plan, art: Path, say) -> dict | None:
    """The settings measured by decoding on ``plan``'s packages compiled in ``art``, recorded in
    their manifest for the engines built from them: the products' prefetch (:func:`record_prefetch`),
    then, at that prefetch, where the library's loops run (:func:`record_loops`). Returns the
    manifest (None: nothing measured). Both decode on one plain engine, built on first use."""
    from ..runtime.build import build_plan_engine, confirmed_prefetch

    @functools.cache
    def engine():
        return build_plan_engine(plan, art, speculate=False)

    prefetched = record_prefetch(plan, art, say, engine)
    if prefetched is not None and engine.cache_info().currsize:  # the loops decode at the prefetch runs take
        eng, _ = engine()
        eng.cfg = dataclasses.replace(eng.cfg, prefetch=confirmed_prefetch(prefetched, eng.cfg.prefetch))
    return record_loops(plan, art, say, engine) or prefetched


def record_prefetch(plan: Plan, art: Path, say, engine=None) -> dict | None:
    """Confirm by decoding the prefetch setting the products of ``plan``'s packages compiled in
    ``art`` run at (measure/prefetch_choice.py) and record it in their manifest (``prefetch``);
    returns the manifest, None where there is nothing to measure: no manifest, or an engine at the
    library's default already. A measurement that fails, or whose record cannot be written, is one
    ``say`` line: runs keep the measured setting. ``engine``: as measure_compiled takes it."""
    from ..measure.prefetch_choice import measure_compiled as measure_prefetch

    manifest = read_manifest(art)
    if manifest is None:
        return None
    return _record(art, manifest, "prefetch", lambda: measure_prefetch(plan, art, say=say, engine=engine), say,
                   "the products' prefetch was not measured by decoding")


def record_loops(plan: Plan, art: Path, say, engine=None) -> dict | None:
    """Measure where the kernel library's loops run in ``plan``'s packages compiled in ``art``
    (measure/loops_choice.py) and record it in their manifest (``loops``, which engines built from
    them read); returns the manifest, None where there is nothing to measure: no manifest, packages
    with inductor's own parallel loops (the library's are not the step's only parallel regions), or
    one thread. A measurement that fails, or whose record cannot be written, is one ``say`` line:
    runs keep OpenMP's loops. ``engine``: as measure_compiled takes it."""
    from ..measure.loops_choice import measure_compiled as measure_loops

    manifest = read_manifest(art)
    if manifest is None or not manifest.get("serial_loops") or (manifest.get("threads") or 1) <= 1:
        return None
    return _record(art, manifest, "loops", lambda: measure_loops(plan, art, say=say, engine=engine), say,
                   "the kernel loops were not measured")


def _record(art: Path, manifest: dict, key: str, measure, say, failed: str) -> dict | None:
    """``manifest`` with ``measure()``'s record under ``key``, written to ``art``'s manifest;
    None where the measurement had nothing to record; ``manifest`` unchanged, said in one line
    (``failed: why``), where it failed or the record could not be written (the packages are built:
    runs keep what they had)."""
    try:
        record = measure()
        if record is None:
            return None
        _write_manifest(art, manifest | {key: record})
    except (YggError, OSError) as e:
        say(f"{failed}: {e}")
        return manifest
    return manifest | {key: record}


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
