"""``yggtree compile plan.yaml``: build every static graph a plan can need, once, into compile/<name>/.

The graphs (regional: one graph per input width of a decoder block, shared by all its layers):

    target   prefill chunk C, plain decoding 1, verify W_v for every W_v of the plan
    drafter  prefill chunk C, head (1 for a standalone LM, D_max + 1 for an EAGLE head),
             one draft step W_d for every W_d of the plan

A width that serves several roles (say C = W_v) is one graph. All of them share the KV cache size
of the plan's envelope (``runtime.build.plan_slots``), exactly what ``build_plan_engine`` uses,
so a run with the plan finds every graph in the cache.

Backends:

- ``inductor-cpu``: ``torch.compile(fullgraph=True, dynamic=False)``; inductor's on-disk caches
  (FX graph cache, AOTAutograd cache, compiled C++ kernels) are pointed at
  ``compile/<name>/inductor-cache/`` for the compile and for every run with the plan
  (``runtime.graphs.inductor_cache``). A warm start still re-traces each graph with dynamo (about
  a second per graph) but skips inductor's code generation and C++ compilation.
- ``eager``: nothing to build; the manifest (fingerprints, versions) is written alone.
- ``cuda`` (CUDA graphs via ``mode="reduce-overhead"``) and ``npu`` (torchair): refused where the
  runtime is missing, saying what to install; the code path exists but is unverified here.

Output: a rich progress bar (stderr), a per-graph compile-time table (stdout), then ONE JSON line.
A second compile of the same plan finds a matching manifest and returns at once (``--force``
rebuilds from an empty cache). A directory holding another plan's artifacts is never replaced
without ``--force``.

Helper graphs (EGT selection, acceptance, commit) run as eager ops today and are not compiled.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..errors import YggError, run_reporting
from ..plan import (
    CACHE_SUBDIR,
    MANIFEST,
    PLAN_COPY,
    Plan,
    artifact_dir,
    cache_dir,
    check_artifacts,
    load_plan,
    model_fingerprints,
    read_manifest,
    save_plan,
    versions,
)

MANIFEST_FORMAT = 1


# ----------------------------------------------------------------------------- helpers


def dir_size(path: Path) -> int:
    """Bytes of every regular file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _owned_entries(art: Path) -> set[str]:
    return {MANIFEST, PLAN_COPY, CACHE_SUBDIR, MANIFEST + ".tmp"}


def _check_destination(plan: Plan, art: Path, force: bool) -> None:
    """Refuse to overwrite another plan's artifacts (or foreign files) without ``force``."""
    if not art.exists():
        return
    if not art.is_dir():
        raise YggError(f"{art} exists and is not a directory")
    m = read_manifest(art)
    if m is not None:
        if m.get("plan_hash") != plan.hash() and not force:
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
    shutil.rmtree(art / CACHE_SUBDIR, ignore_errors=True)


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fx_bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "graphs": counters["stats"]["unique_graphs"],
    }


def _cache_state(before: dict, after: dict) -> str:
    d = {k: after[k] - before[k] for k in before}
    if d["graphs"] == 0:
        return "reused"  # already compiled in this process (same block code, same shapes)
    if d["fx_miss"] or d["fx_bypass"]:
        return "miss" if not d["fx_bypass"] else "bypass"
    return "hit" if d["fx_hit"] else "?"


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


class _ShapeRecorder:
    """Records the (input width, context) of every forward call of a model's eager glue (the
    compiled blocks inside are untouched): each distinct pair seen while warming one width is one
    graph of the block. The context is the last dimension of the call's bool attention mask."""

    def __init__(self, model) -> None:
        self.model, self.seen = model, []
        orig = model.forward

        def forward(*args, **kwargs):
            mask = next(a for a in (*args, *kwargs.values()) if getattr(a, "dtype", None) is not None
                        and str(a.dtype) == "torch.bool")
            pair = (int(args[0].shape[-1]), int(mask.shape[-1]))
            if pair not in self.seen:
                self.seen.append(pair)
            return orig(*args, **kwargs)

        model.forward = forward  # instance attribute: removed by close()

    def take(self) -> list[tuple[int, int]]:
        out, self.seen = self.seen, []
        return out

    def close(self) -> None:
        self.model.__dict__.pop("forward", None)


def _build_graphs(plan: Plan, progress, task) -> tuple[list[dict], dict]:
    """Load the plan's models and build every graph; returns one record per built input width
    (with its graphs: one per context bucket) and load timings."""
    import torch

    from ..runtime.build import EngineSpec, drafter_widths, load_drafter, plan_slots
    from ..runtime.graphs import Graphs, backend_device
    from ..runtime.loading import load_model, load_tokenizer, resolve_model

    spec = EngineSpec.from_plan(plan) if plan.backend in ("inductor-cpu", "eager") else None
    t0 = time.perf_counter()
    progress.update(task, description="loading target")
    src = resolve_model(plan.target)
    target = load_model(src, plan.dtype).to(backend_device(plan.backend))
    # the tokenizer only serves load_drafter's vocabulary check of a standalone drafter
    tokenizer = load_tokenizer(src) if plan.drafter not in (None, "self") else None
    n_slots = plan_slots(plan)
    target.setup_cache(1, n_slots)
    drafter = None
    if plan.speculative:
        progress.update(task, description="loading drafter")
        if spec is None:  # cuda / npu: same fields, the engine cannot run them yet
            spec = EngineSpec(plan.target, plan.drafter, plan.dtype, "performance", plan.max_context,
                              plan.prefill_chunk, plan.tree_params())
        drafter = load_drafter(spec, target, tokenizer)
    load_s = time.perf_counter() - t0

    h, dt = target.cfg.hidden_size, plan.dtype
    head = getattr(drafter, "max_depth", 0) + 1  # EAGLE: D_max + 1; standalone LM: 1
    d_extra = {plan.prefill_chunk, head}
    total = len(plan.target_widths) + (len(d_extra | set(drafter_widths(plan))) if drafter else 0)
    progress.update(task, total=total, completed=0)

    records: list[dict] = []

    def timed(model_name: str, build, graphs, rec: _ShapeRecorder) -> None:
        before = set(graphs.widths)
        c0 = _counters()
        t = time.perf_counter()
        with torch.no_grad():
            build()
        secs = time.perf_counter() - t
        new = sorted(graphs.widths - before)
        state = _cache_state(c0, _counters())
        seen = rec.take()
        for w in new:
            roles = _roles_target(plan, w) if model_name == "target" else _roles_drafter(plan, w, head)
            ctx = sorted(c for (ww, c) in seen if ww == w)
            records.append(
                {
                    "model": model_name,
                    "role": roles,
                    "width": w,
                    "contexts": ctx,
                    "n_graphs": len(ctx),
                    "shapes": {"x": [1, w, h], "mask": [[1, w, c] for c in ctx], "slots": [1, w]},
                    "dtype": dt,
                    "compile_s": round(secs / len(new), 4),
                    "cache": state,
                }
            )
            if len(new) > 1:
                records[-1]["built_together"] = new
            progress.update(task, advance=1, description=f"{model_name} W={w}")

    graphs = Graphs(target, "performance", backend=plan.backend)
    rec = _ShapeRecorder(target)
    try:
        for w in plan.target_widths:
            progress.update(task, description=f"target W={w}")
            timed("target", lambda w=w: graphs.warm_up([w]), graphs, rec)
    finally:
        rec.close()
    if drafter is not None:
        dg = drafter.graphs
        rec = _ShapeRecorder(dg.model)
        try:
            # first call: the drafter's own widths (prefill chunk; EAGLE's head), then one per W_d
            progress.update(task, description="drafter prefill")
            timed("drafter", lambda: drafter.setup(n_slots, [plan.prefill_chunk], plan.prefill_chunk), dg, rec)
            for w in drafter_widths(plan):
                progress.update(task, description=f"drafter W={w}")
                timed("drafter", lambda w=w: drafter.setup(n_slots, [w], plan.prefill_chunk), dg, rec)
        finally:
            rec.close()
    return records, {"load_s": round(load_s, 3), "n_slots": n_slots}


def compile_plan(
    plan: Plan,
    out_root: str | Path = "compile",
    force: bool = False,
    console=None,
    replace: bool = False,
) -> dict:
    """Compile ``plan`` into its artifact directory; returns the summary (the manifest plus
    ``status`` = ``compiled`` | ``up-to-date``, ``dir`` and ``wall_s``).

    Up to date (manifest matches: same plan hash, torch/python versions, model files) and not
    ``force``: returns at once without loading anything. Stale artifacts of the same plan are
    rebuilt (inductor's cache is content-addressed, so still-valid graphs load from it).
    A directory holding another plan's manifest is refused unless ``replace`` (keep the cache)
    or ``force`` (start from an empty cache).

    Graphs already compiled earlier in this process are reused by dynamo and not written to the
    cache again: compile in a fresh process (as ``yggtree compile`` does)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..runtime.graphs import check_backend, inductor_cache

    t_start = time.perf_counter()
    check_backend(plan.backend)
    art = artifact_dir(plan, out_root)
    _check_destination(plan, art, force or replace)
    if not force and read_manifest(art) is not None and not check_artifacts(plan, art):
        m = read_manifest(art)
        return {**m, "status": "up-to-date", "dir": str(art), "wall_s": time.perf_counter() - t_start}
    stale = check_artifacts(plan, art) if read_manifest(art) is not None else []
    if force:
        _clear(art)  # a forced rebuild starts from an empty cache
    else:
        (art / MANIFEST).unlink(missing_ok=True)  # stale: rebuilt below (cache hits where valid)
    art.mkdir(parents=True, exist_ok=True)
    prints = model_fingerprints(plan)
    missing = [f["path"] for f in prints if f.get("missing")]
    if missing:
        raise YggError(f"plan {plan.name!r}: model file not found: {missing[0]}")

    records: list[dict] = []
    info: dict = {"load_s": 0.0, "n_slots": None}
    if plan.backend != "eager":
        console = console or Console(stderr=True)
        columns = (
            TextColumn("[bold]compile[/] {task.description:<22}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} widths"),
            TimeElapsedColumn(),
        )
        with inductor_cache(cache_dir(art)), Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("loading", total=None)
            records, info = _build_graphs(plan, progress, task)
    save_plan(plan, art / PLAN_COPY)
    manifest = {
        "format": MANIFEST_FORMAT,
        "plan_name": plan.name,
        "plan_hash": plan.hash(),
        "plan": plan.to_dict(),
        "backend": plan.backend,
        "dtype": plan.dtype,
        "versions": versions(),
        "models": prints,
        "n_slots": info["n_slots"],
        "cache_dir": CACHE_SUBDIR if plan.backend != "eager" else None,
        "graphs": records,
        # distinct graphs compiled: a record "reused" had its graphs built already (a self-drafter
        # shares the target's block graphs)
        "n_graphs": sum(r["n_graphs"] for r in records if r["cache"] != "reused"),
        "n_shapes": sum(r["n_graphs"] for r in records),
        "compile_s": round(sum(r["compile_s"] for r in records), 3),
        "load_s": info["load_s"],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "replaced_because": stale,
    }
    manifest["size_bytes"] = dir_size(art)  # the cache and the plan copy (not the manifest)
    tmp = art / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(art / MANIFEST)
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
    for name in ("model", "role", "W", "graphs", "block input x", "mask contexts C", "compile s", "cache"):
        right = name in ("W", "graphs", "compile s")
        t.add_column(name, justify="right" if right else "left", no_wrap=True)
    for r in summary["graphs"]:
        x = "[" + ",".join(str(v) for v in r["shapes"]["x"]) + "]"
        ctx = ",".join(str(c) for c in r["contexts"])
        t.add_row(r["model"], r["role"], str(r["width"]), str(r["n_graphs"]), x, ctx,
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
    """Load a plan for ``yggtree run --plan`` and make sure its compiled artifacts are usable.

    Artifacts missing or stale (see :func:`yggtree.plan.check_artifacts`): with
    ``compile_missing`` they are compiled now (the reasons go to stderr), otherwise a YggError
    lists the reasons. A plan never silently runs with other graphs. The artifact directory is
    ``yggtree.plan.artifact_dir(plan, compile_root)``; pass it to ``build_plan_engine``."""
    plan = load_plan(plan_path)
    from ..runtime.graphs import check_backend

    check_backend(plan.backend)
    if plan.backend == "eager":
        return plan  # nothing compiled is used
    art = artifact_dir(plan, compile_root)
    reasons = check_artifacts(plan, art)
    if not reasons:
        return plan
    if not compile_missing:
        raise YggError(
            f"compiled artifacts of plan {plan.name!r} in {art} are not usable: {'; '.join(reasons)}. "
            f"Run `yggtree compile {plan_path}` or pass --compile-missing"
        )
    sys.stderr.write(f"yggtree: compiling plan {plan.name!r} into {art}: {'; '.join(reasons)}\n")
    own_copy = plan.source is not None and plan.source == (art / PLAN_COPY).resolve()
    compile_plan(plan, compile_root, replace=own_copy)  # an edited copy replaces its own dir
    return plan


# ----------------------------------------------------------------------------- command line


def add_compile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan YAML file (see yggtree/plan.py for the schema)")
    p.add_argument("--out", default="compile", metavar="DIR", help="artifact root: DIR/<plan-name>/ (default: compile)")
    p.add_argument("--force", action="store_true", help="rebuild from an empty cache; replace another plan's artifacts")
    p.add_argument("--json", action="store_true", help="print only the JSON line (no table)")


def run_compile(args) -> int:
    """The ``compile`` subcommand: progress on stderr, table on stdout, one JSON line last."""
    from rich.console import Console

    plan = load_plan(args.plan)
    summary = compile_plan(plan, args.out, force=args.force)
    if not args.json:
        con = Console(width=None if sys.stdout.isatty() else 140)
        if summary["status"] == "up-to-date":
            con.print(f"plan {plan.name!r} is up to date in {summary['dir']} (manifest matches; --force rebuilds)")
        con.print(graph_table(summary))
    print(json.dumps(summary_line(summary)), flush=True)
    return 0


def add_compile_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``compile`` on a CLI's subparsers; the handler is ``args.func = run_compile``."""
    p = subparsers.add_parser(
        "compile",
        help="build every static graph of a plan into compile/<plan-name>/",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_compile_arguments(p)
    p.set_defaults(func=run_compile)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.compile ...``: the same options as ``yggtree compile``."""
    parser = argparse.ArgumentParser(prog="python -m yggtree.offline.compile", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_compile_arguments(parser)
    args = parser.parse_args(argv)
    return run_reporting("yggtree compile", run_compile, args)


if __name__ == "__main__":
    sys.exit(main())
