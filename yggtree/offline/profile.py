"""``yggtree profile --hw NAME``: measure this machine's latency curves for a plan's pair.

What is timed is exactly what the decode loop calls, on the compiled graphs the runtime uses
(an engine built from the plan, every grid width warmed, run under the frozen stance):

- verify  ``T_v(W, ctx)``: the target over W tree nodes (tree mask, LM head, captured layers)
- draft   ``T_d(W, ctx)``: one drafter step over W nodes (its timing depends on shapes only)
- head    the drafter's head call (fixed width)
- stages  the non-model work of a step: EGT select/expand per call, pruning (top-k, re-index,
  ancestor table) per W_v, the objective's W_v choice, acceptance per W_v, KV commit
- stage forms  the stages as the execution plans run them, under every thread split, alone and
  overlapped (:mod:`yggtree.offline.profile_stages`; the plan search reads them)

for W in 1..128 (powers of two and the plan's widths) and one context per context bucket
(attention reads the whole bucket, so that is where latency changes). Each point: warm-up calls,
then ``repeats`` timed calls; median, 10th and 90th percentile. The fitted curves
(:mod:`yggtree.offline.fit`), their held-out error, the hardware and software are written to
``profiles/NAME.json`` with a CSV of every point and a PNG of the curves. The profile also records
what else ran while it timed (``load``: cores busy with other processes, cores stolen by the
hypervisor; :class:`yggtree.offline.timing.LoadMeter`) and warns when that inflates its times:
a profile measured beside other work prices every step too high.

Before the curves, the product kernel and the padding of short products
(:mod:`yggtree.runtime.packed`): one row through every packed float or int8 product of the target
(one plain step's products) on torch's kernel unpadded and padded to 2, 4 and 8 rows, and on our
tiled kernel, the variants interleaved; each is also checked for batch invariance at the plan's
widths on this machine (a one-row product may round otherwise than a row of a wider one:
:mod:`yggtree.runtime.packed`), and the fastest invariant one by median becomes the profile's
``packed_padding`` (``kernel``, and ``min_rows``, 1: no padding), recorded with every median and
every invariance, and the curves are measured on an engine built so, as every engine built from a
plan naming the profile is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..errors import YggError, module_main
from ..files import atomic_path, manifest_args, write_text_atomic
from ..plan import default_plan, load_plan
from ..runtime.artifacts import versions
from ..runtime.device import cpu_model, detect_device, device_record
from ..runtime.padding import PADDING_KEY
from ..shapes import measured_prefetch
from .profile_grid import STAGE_CALLS, ProfileGrid, grid_contexts, grid_widths, timed_calls
from .profile_padding import measure_padding, padding_line
from .timing import LoadMeter, load_warning

NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# ----------------------------------------------------------------------------- the machine


def check_hw_name(name: str) -> None:
    """A profile name is a file name (``profiles/<name>.json``); which device a profile belongs to
    is what it records as measured (``hardware``), never guessed from its name."""
    if not NAME_OK.match(name):
        raise YggError(
            f"--hw {name!r}: use letters, digits, '.', '_' or '-' (it names profiles/<hw>.json)"
        )


def hardware_info(threads: int) -> dict:
    from ..runtime.allocator import running

    dev = detect_device()
    return {
        **device_record(dev),  # device, device_name, device_identity: what a profile is matched on
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
        "allocator": running(),  # what the curves were measured on (runtime/allocator.py)
    }


def software_info(plan, mode: str) -> dict:
    import numpy

    return versions() | {
        "numpy": numpy.__version__,
        "dtype": plan.dtype,
        "backend": plan.backend,
        "mode": mode,
        "graphs": (
            "dynamo whole-step graphs (inductor; EAGLE head per block), frozen stance"
            if mode == "performance" else "eager"
        ),
    }


# ----------------------------------------------------------------------------- the command


def run_profile(args) -> int:
    check_hw_name(args.hw)
    out_dir = Path(args.out_dir)
    dst = out_dir / f"{args.hw}.json"
    if dst.exists() and not args.force:
        raise YggError(f"profile {dst} already exists (pass --force to overwrite it)")
    # the profile a plan names is what this command writes: it need not exist yet
    plan = load_plan(args.plan, unwritten=("profile",)) if args.plan else default_plan()
    t_start = time.perf_counter()
    grid = ProfileGrid(max_width=16 if args.quick else args.max_width,
                       warmup=1 if args.quick else args.warmup,
                       repeats=3 if args.quick else args.repeats, quick=args.quick)
    command = "yggtree profile " + " ".join(manifest_args(args.argv, out_dir))
    if args.compiled:
        profile = measure_compiled_profile(plan, args.hw, args.threads, grid, command)
    else:
        profile = measure_profile(plan, args.hw, args.threads, grid, command, Path(args.cache_dir))
    png = write_profile(profile, out_dir, plot=True)
    print_table(profile)
    print(json.dumps(profile_summary(profile, dst, png, time.perf_counter() - t_start)))
    return 0


def check_profile_plan(plan, device: dict) -> None:
    """YggError unless ``plan`` can be profiled on ``device``."""
    if not plan.speculative:
        raise YggError(f"plan {plan.name!r} has no drafter: there is no tree to profile")
    if plan.backend in ("cuda", "npu") and device["kind"] == "cpu":
        raise YggError(f"plan {plan.name!r} is for backend {plan.backend!r}; this machine has no such device")


def _checked_padding(plan, hw: str, threads: int, grid: ProfileGrid, engine, padding: dict | None) -> dict:
    """The padding of short packed products to profile with: the one ``engine`` was built with
    (refused if the engine pads otherwise), else ``padding``, else measured now."""
    from ..runtime.packed import kernel_of, min_rows_of

    if engine is not None:
        if padding is None:
            raise ValueError("measure_profile: an engine comes with the padding it was built with")
        if min_rows_of(engine.target) not in (None, padding["min_rows"]):
            raise YggError(f"this engine pads packed products to {min_rows_of(engine.target)} rows, "
                           f"the profile's padding is {padding['min_rows']}: build it with that min_rows")
        if kernel_of(engine.target) not in (None, padding.get("kernel", "torch")):
            raise YggError(f"this engine runs packed products on the {kernel_of(engine.target)} kernel, the "
                           f"profile's is {padding.get('kernel', 'torch')}: build it with that kernel")
    elif padding is None:
        sys.stderr.write(f"profile {hw}: timing padded and unpadded packed products...\n")
        padding = measure_padding(plan, threads, max(1, grid.warmup), max(5, grid.repeats))
    return padding


def _ready_engine(plan, engine, mode: str, padding: dict, n_slots: int, widths: list[int], drafted: set[int],
                  stage_forms: bool, cache: Path | None):
    """``(engine, compile_s)``: the given engine, or one built from ``plan`` with ``padding``'s
    product kernel and ``min_rows``
    (its graphs compiled into the inductor cache ``cache``), with every graph the timings call
    warmed up: target widths, drafted widths and, for the stage forms, the ahead call's."""
    import contextlib

    from ..runtime.build import EngineSpec, build_engine
    from ..runtime.graphs import inductor_cache

    with inductor_cache(cache) if cache is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        built = 0.0
        if engine is None:
            engine, _ = build_engine(EngineSpec.from_plan(plan, mode, min_rows=padding["min_rows"],
                                                          kernel=padding.get("kernel", "torch"),
                                                          prefetch=measured_prefetch(padding.get("prefetch"))))
            built = engine.compile_s
        if engine.n_slots != n_slots:
            raise YggError(f"engine has {engine.n_slots} slots, the plan's runtime {n_slots}")
        engine.graphs.warm_up(sorted(set(widths) | set(plan.target_widths)), engine.drafter.target_layers)
        ahead = {2 * w for w in plan.verify_widths} if stage_forms else set()  # the ahead call
        engine.drafter.setup(n_slots, sorted(drafted | ahead | {1, *plan.draft_widths}), plan.prefill_chunk)
    return engine, time.perf_counter() - t0 + built


def _timed_stage_forms(engine, plan, hw: str, context: int, grid: ProfileGrid) -> dict | None:
    """The ahead-of-time and overlapped stage forms (profile_stages.py) timed at ``context`` or
    below, where the worker's job and the ahead call fit in the cache; None where none fits."""
    from ..runtime.schedule import usable_cores
    from .profile_stages import measure_stage_forms

    sys.stderr.write(f"profile {hw}: stage forms (ahead-of-time, each thread split, overlapped)...\n")
    # the worker's job drafts a D_max-deep guess and a whole tree past the context, and the
    # ahead call writes 2 W_v rows: time them where they fit in the cache
    room = 1 + max(plan.d_max + 2 + plan.d_max * max(plan.draft_widths),
                   2 * max(max(plan.verify_widths), plan.d_max + 1))
    ctx_forms = min(context, engine.n_slots - room)
    if ctx_forms < 1:
        sys.stderr.write(f"profile {hw}: no stage forms (the cache of {engine.n_slots} slots has no room)\n")
        return None
    return measure_stage_forms(engine, plan, ctx_forms, grid.warmup, grid.repeats, usable_cores())


def measure_profile(plan, hw: str, threads: int, grid: ProfileGrid, command: str,
                    cache: Path | None = None, engine=None, padding: dict | None = None) -> dict:
    """Measure ``plan``'s padding of short packed products and its latency curves on this
    machine; returns the profile (not written).

    ``engine``: an engine already built from ``EngineSpec.from_plan(plan, min_rows=...)`` (its
    graphs are reused), given with the ``padding`` (:func:`measure_padding`) it was built with;
    otherwise the padding is measured and an engine padding so is built, its graphs compiled into
    the inductor cache ``cache``."""
    import torch

    from ..runtime.artifacts import FORMAT_VERSION, PROFILE_KIND, timing_identity
    from ..runtime.build import plan_slots
    from ..runtime.cost import CostModel
    from ..runtime.graphs import context_buckets
    from .fit import fit_profile

    torch.set_num_threads(threads)
    check_profile_plan(plan, detect_device())
    mode = "reference" if plan.backend == "eager" else "performance"
    widths = sorted(set(grid.widths)) if grid.widths else grid_widths(plan, grid.max_width)
    n_slots = plan_slots(plan)
    buckets = context_buckets(n_slots)
    contexts = grid_contexts(buckets, plan.max_context, max(widths))
    if grid.quick:
        contexts = contexts[:2]
    padding = _checked_padding(plan, hw, threads, grid, engine, padding)
    sys.stderr.write(f"profile {hw}: {padding_line(padding)}\n")
    where = f"inductor cache {cache}" if cache is not None else "the default inductor cache"
    sys.stderr.write(
        f"profile {hw}: plan {plan.name!r} ({plan.dtype}, {mode}), widths {widths}, contexts "
        f"{contexts}, {grid.warmup} warm-up + {grid.repeats} timed calls each; compiling graphs "
        f"({where})...\n"
    )
    drafted = set(plan.draft_widths) if grid.widths else set(widths)
    engine, compile_s = _ready_engine(plan, engine, mode, padding, n_slots, widths, drafted,
                                      grid.stage_forms, cache)
    # the kernels' loops where the engine decodes them (its pool, for compiled packages that chose it)
    with torch.no_grad(), engine.graphs.frozen(), engine.drafter.frozen(), engine.library(threads), \
            LoadMeter() as load:
        rows, stages = timed_calls(engine, plan, widths, contexts, drafted, grid)
        forms = _timed_stage_forms(engine, plan, hw, contexts[0], grid) if grid.stage_forms else None
    warning = load_warning(f"profile {hw}", load.result)
    if warning is not None:
        sys.stderr.write(f"warning: {warning}\n")
    fit, errors = fit_profile(rows)
    profile = {
        "kind": PROFILE_KIND,
        "version": FORMAT_VERSION,
        "name": hw,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "identity": timing_identity(plan),
        "hardware": hardware_info(threads),
        "software": software_info(plan, mode),
        "plan": {
            "name": plan.name, "hash": plan.hash(), "draft_widths": list(plan.draft_widths),
            "verify_widths": list(plan.verify_widths), "d_max": plan.d_max, "top_k": plan.top_k,
            "max_context": plan.max_context, "n_slots": n_slots, "buckets": buckets,
            "weights": plan.weights or plan.dtype,  # the format the curves measured (canonical)
        },
        "grid": {"widths": widths, "contexts": contexts, "warmup": grid.warmup,
                 "repeats": grid.repeats, "quick": grid.quick},
        "compile_s": round(compile_s, 1),
        "load": load.result,  # what else ran while timing (timing.LoadMeter); None: unknown
        "points": rows,
        "stage_ms": stages,
        "stage_calls": STAGE_CALLS,  # what the stage timings time (profile_grid.STAGE_CALLS)
        PADDING_KEY: padding,
        "fit": fit,
        "fit_error": errors,
    }
    if forms is not None:  # profile_stages.py: ahead-of-time and overlapped stage times
        profile["stage_forms"] = forms
    profile["pruning_share"] = pruning_share(CostModel.from_profile_dict(profile), plan, contexts)
    attn = _attention_record(engine, threads)
    if attn is not None:
        profile["attention_kernel"] = attn
    return profile


def _attention_record(engine, threads: int) -> dict | None:
    """The kernel library's attention ``engine``'s target ran while timed, as the profile records
    it (runtime/kernels.py attention_kernel, and what ran); None where it runs none."""
    attn = next((m.native_rows for m in engine.target.modules() if getattr(m, "native_rows", None)), None)
    if attn is None:
        return None
    from ..runtime.attention_choice import attention_kernel
    from ..runtime.kernels import kv_dtype, library_dir

    cfg = engine.target.cfg
    return attention_kernel((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), threads, library_dir(),
                            kv_dtype(engine.target)) | {"ran": attn}


def measure_compiled_profile(plan, hw: str, threads: int, grid: ProfileGrid, command: str) -> dict:
    """The profile of ``plan`` timed on its compiled packages (``yggtree compile``; what ``yggtree
    run --plan`` runs), at the widths they were compiled for: every verify width of the plan and
    one row, every draft width, at one context per bucket. The packages hold the padding of short
    packed products they were compiled with, so the padding is the plan's profile's, not measured
    again; the stage forms (the plan search's data) need graphs a sequential plan does not compile,
    so they are the plan's profile's too, marked as such. YggError unless the plan has a profile
    and fresh compiled artifacts."""
    import torch

    from ..compiled import artifact_dir, check_artifacts
    from ..files import read_json
    from ..runtime.build import build_plan_engine

    if plan.profile is None:
        raise YggError(f"plan {plan.name!r} names no profile: profile it first (without --compiled), then "
                       "compile it")
    art = artifact_dir(plan)
    reasons = check_artifacts(plan, art)
    if reasons:
        raise YggError(f"--compiled: the artifacts of plan {plan.name!r} in {art} are not usable "
                       f"({'; '.join(reasons)}): run `yggtree compile` on the plan first")
    before = read_json(plan.profile, "profile")
    if not isinstance(before, dict) or not isinstance(before.get(PADDING_KEY), dict):
        raise YggError(f"--compiled: profile {plan.profile} records no padding of short packed products: "
                       "profile the plan again without --compiled, then compile it")
    torch.set_num_threads(threads)
    sys.stderr.write(f"profile {hw}: timing the compiled packages in {art}...\n")
    engine, _ = build_plan_engine(plan, art, threads=threads)
    widths = tuple(sorted({1, *plan.verify_widths}))
    profile = measure_profile(plan, hw, threads, replace(grid, widths=widths, stage_forms=False), command,
                              engine=engine, padding=before[PADDING_KEY])
    # (file names only: profiles are shipped, and hold no absolute path)
    profile["software"]["graphs"] = f"AOTInductor packages of compile/{art.name} (yggtree compile)"
    if before.get("stage_forms") is not None:
        profile["stage_forms"] = before["stage_forms"] | {
            "from": f"{Path(plan.profile).name} ({before.get('created')}), timed on dynamo graphs"}
    return profile


def write_profile(profile: dict, out_dir: Path, plot: bool = True) -> Path | None:
    """``<out_dir>/<name>.json`` (and its CSV of points and, with ``plot``, its PNG), each
    written whole or not at all; returns the PNG's path (None without ``plot``)."""
    import pandas as pd

    from .fit import plot_profile

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = profile["name"]
    with atomic_path(out_dir / f"{name}.csv") as tmp:
        pd.DataFrame(profile["points"]).to_csv(tmp, index=False)
    write_text_atomic(out_dir / f"{name}.json", json.dumps(profile, indent=1) + "\n")
    return plot_profile(profile, out_dir / f"{name}.png") if plot else None


def profile_summary(profile: dict, dst: Path, png: Path | None, elapsed_s: float) -> dict:
    """The one JSON line of ``yggtree profile``."""
    from ..runtime.cost import CostModel

    cost = CostModel.from_profile_dict(profile)
    contexts = profile["grid"]["contexts"]
    errors = profile["fit_error"]
    hw = profile["hardware"]
    return {
        "profile": str(dst),
        "hw": profile["name"],
        "device": hw["device_name"],
        "threads": hw["threads"],
        "dtype": profile["software"]["dtype"],
        "weights": profile["plan"]["weights"],
        "points": len(profile["points"]),
        "verify_ms_w1": {str(c): round(cost.t_verify(1, c), 2) for c in contexts},
        "packed_min_rows": profile[PADDING_KEY]["min_rows"],
        "packed_kernel": profile[PADDING_KEY].get("kernel", "torch"),
        "fit_median_rel_err": errors["overall"]["median_rel"],
        "fit_max_rel_err": errors["overall"]["max_rel"],
        "pruning_share_max": max(v["share"] for v in profile["pruning_share"]),
        "plot": str(png) if png is not None else None,
        "compile_s": profile["compile_s"],
        "other_cores": (profile.get("load") or {}).get("other_cores"),
        "elapsed_s": round(elapsed_s, 1),
    }


def pruning_share(cost, plan, contexts: list[int]) -> list[dict]:
    """Pruning + the W_v choice as a share of the predicted step, per (W_d, W_v) at D_max."""
    out = []
    policy = cost._stage("policy")
    for wd in plan.draft_widths:
        for wv in plan.verify_widths:
            ctx = contexts[0]
            step = cost.step_ms(plan.d_max, wd, wv, ctx)
            prune = cost._stage("prune", wv) + policy
            out.append({"draft_width": wd, "verify_width": wv, "context": ctx,
                        "prune_ms": round(prune, 4), "step_ms": round(step, 3),
                        "share": round(prune / step, 4)})
    return out


def print_table(profile: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    contexts = profile["grid"]["contexts"]
    t = Table(title=f"profile {profile['name']}: median ms (p10-p90)")
    t.add_column("call")
    t.add_column("width", justify="right")
    for c in contexts:
        t.add_column(f"ctx {c}", justify="right")
    by = {(r["kind"], r["width"], r["context"]): r for r in profile["points"]}
    for kind in ("verify", "draft", "head"):
        for w in sorted({r["width"] for r in profile["points"] if r["kind"] == kind}):
            cells = []
            for c in contexts:
                r = by.get((kind, w, c))
                cells.append("" if r is None else f"{r['median_ms']:.2f} ({r['p10_ms']:.2f}-{r['p90_ms']:.2f})")
            t.add_row(kind, str(w), *cells)
    console = Console(file=sys.stdout, width=160)
    console.print(t)
    s = Table(title="non-model stages (median ms)")
    s.add_column("stage")
    s.add_column("per width / value")
    for k, v in profile["stage_ms"].items():
        s.add_row(k, ", ".join(f"{w}: {x:.3f}" for w, x in v.items()) if isinstance(v, dict) else f"{v:.3f}")
    console.print(s)
    console.print(f"padding of short packed products: {padding_line(profile[PADDING_KEY])}")
    load = profile.get("load")
    if load is not None:
        console.print(f"while timing ({load['wall_s']:.0f} s): other processes kept {load['other_cores']:.2f} "
                      f"cores busy, the hypervisor took {load['steal_cores']:.2f}")
    e = profile["fit_error"]
    console.print(
        "fit (held-out widths, leave-one-out): "
        + ", ".join(f"{k} median {v['median_rel']:.1%} max {v['max_rel']:.1%}" for k, v in e.items())
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hw", required=True, help="profile name, e.g. cpu-2core (profiles/<hw>.json; the profile records the device it measured)")
    p.add_argument("--plan", default=None, help="plan YAML (default: the embedded default plan)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--force", action="store_true", help="overwrite an existing profile")
    p.add_argument("--quick", action="store_true", help="a small grid (widths <= 16, 2 contexts, 3 repeats)")
    p.add_argument("--max-width", type=int, default=128, help="largest width measured (default 128)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out-dir", default="profiles")
    p.add_argument("--compiled", action="store_true",
                   help="time the plan's compiled packages (after `yggtree compile`; what `yggtree run --plan` "
                   "runs) at its own widths, keeping its profile's padding and stage forms")
    p.add_argument("--cache-dir", default="compile/_inductor-profile",
                   help="inductor cache for the profiled graphs (reused by later runs)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``profile`` on a CLI's subparsers (help line, flags), handled by :func:`run`."""
    p = subparsers.add_parser("profile", help="measure latency curves of a plan's pair on this machine")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """``args.argv``: the subcommand's own arguments (set by both entry points), for the manifest."""
    if args.threads < 1:
        raise YggError(f"--threads must be >= 1, got {args.threads}")
    if not 1 <= args.max_width <= 1024 or args.repeats < 1 or args.warmup < 0:
        raise YggError("--max-width must be in 1..1024, --repeats >= 1, --warmup >= 0")
    return run_profile(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.profile ...``: the same options as ``yggtree profile``."""
    return module_main("yggtree.offline.profile", "profile", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())