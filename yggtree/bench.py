"""Benchmarks against baselines, measured in one run on the same prompts (docs/design.md section 12).

``yggtree bench`` (plain decoding, greedy) times, per dtype and on the same prompt token ids:

- ``hf``: transformers eager ``generate(do_sample=False)`` on the same weights (the baseline);
- ``ygg-reference``: the yggtree engine in reference mode (eager);
- ``ygg-compiled``: the yggtree engine in performance mode, built as ``yggtree run`` builds it
  (oneDNN-packed weights on a CPU, one static graph per step function and width).

Definitions (every number is a median over ``--repeats``; one repeat runs every prompt once)::

    tok/s        total new tokens / total wall time of the generate calls (prefill included)
    ms/token     decode-only time per token after the first:
                   yggtree: sum(total - ttft) / sum(new_tokens - 1)   (the engine's tpot)
                   hf:      sum(generate - prefill) / sum(new_tokens - 1), where prefill is a
                            separately timed forward pass over the prompt (an estimate: generate's
                            own prefill is not exposed)
    prefill ms   mean over prompts of ttft (yggtree) or of the separate prompt forward (hf)
    vs hf        tok/s of the system / tok/s of hf, same dtype, same repeat, same prompts
    x floor      ms/token / matmul floor at width 1 (1.0 = decoding as fast as the weight
                 matmuls alone; see yggtree.measure.floor.matmul_floor_ms): the faster of the two
                 kernels timed, ``x @ w.T`` over the model's 7 weights per layer (as eager code
                 runs them) and the oneDNN-packed product over the compiled system's own products
                 (q/k/v and gate/up stacked: 4 per layer, CPU); the JSON line has both under
                 ``matmul_floor_width1.<dtype>.kernel_ms``. The floor is sampled between the
                 prompts of the timed repeats (FLOOR_SAMPLES per prompt and kernel), so it sees
                 the same machine load as the systems; its median is over all those samples
    identical    prompts whose generated token ids equal hf's exactly, out of all prompts

Systems are interleaved per prompt (prompt 1 on every system, then prompt 2, ...) so that load from
other processes on a shared machine affects them alike. Each system gets one untimed warm-up
generate first (after the compiled engine's own compile, which is reported as ``compile_s``).

Output: a rich table on stdout, then ONE JSON line with all numbers; progress goes to stderr;
``--out DIR`` also writes ``results.csv`` (the table) and ``results.json`` (plus per-prompt data).

The helpers here (loading the transformers baseline, its greedy generation and prompt logits, the
yggtree prompt logits) are shared with ``scripts/check_equivalence.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data import interleave, load_prompts
from .errors import YggError, module_main
from .progress import stderr_progress
from .shapes import measured_prefetch

SYSTEMS = ("hf", "ygg-reference", "ygg-compiled")
BENCH_DTYPES = ("float32", "bfloat16")
WARMUP_TOKENS = 8  # new tokens of the untimed warm-up generate
FLOOR_SAMPLES = 3  # matmul-floor samples per kernel after each prompt of each timed repeat

CSV_FIELDS = (
    "system",
    "dtype",
    "prompts",
    "new_tokens",
    "tok_s",
    "ms_per_token",
    "prefill_ms",
    "vs_hf",
    "floor_ms",
    "x_floor",
    "identical",
    "compared",
    "compile_s",
)


# ----------------------------------------------------------------------------- shared helpers


def torch_dtype(name: str) -> torch.dtype:
    from .runtime.loading import DTYPES

    if name not in DTYPES:
        raise YggError(f"unsupported dtype {name!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def load_hf_model(src, dtype: str):
    """The transformers model on the same weights as ``load_model(src, dtype)``, in eval mode.

    GGUF files are dequantized by transformers (which needs ``accelerate``); HF directories are
    read as usual. Progress bars and generation warnings of transformers are silenced.
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise YggError(f"the transformers baseline needs transformers: {e}") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    kwargs = {"dtype": torch_dtype(dtype)}
    # transformers' GGUF conversion prints a bare tqdm bar that its logging switches do not reach
    quiet = contextlib.redirect_stderr(io.StringIO())
    try:
        with quiet:
            if src.kind == "gguf":
                model = AutoModelForCausalLM.from_pretrained(
                    str(src.path.parent), gguf_file=src.path.name, **kwargs
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(str(src.path), **kwargs)
    except (OSError, ValueError, ImportError) as e:
        raise YggError(f"transformers cannot load {src.path}: {e}") from None
    return model.eval().requires_grad_(False)


def hf_generate(hf, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    """Greedy ``generate(do_sample=False)``: the new token ids (an EOS, if emitted, is kept)."""
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    eos = list(eos_ids) or None
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_prompt_logits(hf, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [V] at the last prompt position (one causal forward)."""
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits[0, -1].float()


def ygg_prompt_logits(model, prompt_ids: list[int], chunk: int, n_slots: int) -> torch.Tensor:
    """yggtree's float32 logits [V] at the last prompt position, through the engine's prefill path.

    Runs ``steps.prefill_chunk`` chunk by chunk (padded to ``chunk``, like ``Engine._prefill``)
    on an eager ``shared_copy`` of ``model`` with a fresh cache of ``n_slots`` slots, so the
    caller's model, cache and compiled blocks are left alone.
    """
    from .runtime import steps

    if len(prompt_ids) >= n_slots:
        raise YggError(f"the prompt has {len(prompt_ids)} tokens, more than {n_slots - 1} cache slots")
    twin = model.shared_copy()
    twin.setup_cache(1, n_slots)
    prompt = torch.tensor(prompt_ids, dtype=torch.int64)
    logits = None
    with torch.no_grad():
        for start in range(0, len(prompt_ids), chunk):
            part = prompt[start : start + chunk]
            buf = torch.zeros(chunk, dtype=torch.int64)
            buf[: part.shape[0]] = part
            logits, _, _ = steps.prefill_chunk(
                twin, buf[None], torch.tensor(start), torch.tensor(part.shape[0])
            )
    return logits[0].float()


# ----------------------------------------------------------------------------- one measurement


@dataclass(frozen=True)
class Timing:
    """One system on one prompt in one repeat."""

    tokens: list[int]
    total_s: float  # wall time of the generate call
    prefill_s: float  # yggtree: ttft; hf: a separately timed forward over the prompt


def time_hf(hf, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> Timing:
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = hf_generate(hf, prompt_ids, max_new_tokens, eos_ids)
    return Timing(tokens, time.perf_counter() - t0, prefill)


def time_ygg(engine, prompt_ids: list[int], max_new_tokens: int) -> Timing:
    from .runtime.engine import SamplingParams

    res = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return Timing(res.token_ids, res.stats["total_ms"] / 1e3, res.stats["ttft_ms"] / 1e3)


def aggregate(timings: list[Timing]) -> dict[str, float]:
    """One repeat of one system over all prompts -> tok/s, decode ms/token, mean prefill ms."""
    n = sum(len(t.tokens) for t in timings)
    total = sum(t.total_s for t in timings)
    decode_n = sum(max(len(t.tokens) - 1, 0) for t in timings)
    decode_s = sum(max(t.total_s - t.prefill_s, 0.0) for t in timings if len(t.tokens) > 1)
    return {
        "new_tokens": n,
        "tok_s": n / total if total > 0 else 0.0,
        "ms_per_token": decode_s / decode_n * 1e3 if decode_n else float("nan"),
        "prefill_ms": statistics.fmean(t.prefill_s for t in timings) * 1e3,
    }


def by_prompt_set(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The rows of each prompt set (by ``set``), then all rows as ``"all"``."""
    return [(st, [r for r in rows if st == "all" or r["set"] == st])
            for st in sorted({r["set"] for r in rows}) + ["all"]]


def decode_totals(rows: list[dict], name: str) -> tuple[int, float, int]:
    """System ``name``'s decoded tokens (the first, prefill's, excluded), decode seconds and
    steps summed over ``rows``."""
    return (sum(max(r[name]["new_tokens"] - 1, 0) for r in rows),
            sum(r[name]["decode_s"] for r in rows), sum(r[name]["steps"] for r in rows))


def summarise_systems(rows: list[dict], names: list[str]) -> dict:
    """Per-prompt rows of several systems (each row: ``set``, and per system ``new_tokens``,
    ``decode_s``, ``steps``, ``tokens``, predicted times, plain-step counts; ``plain`` among them),
    per prompt set (and "all"): decode tok/s, measured and predicted speed-up over plain,
    prediction error, AAL, share of plain steps, outputs equal to plain."""
    summary = {}
    for st, sel in by_prompt_set(rows):
        res = {}
        for name in names:
            dec_n, dec_s, steps = decode_totals(sel, name)
            res[name] = {
                "decode_tok_s": dec_n / dec_s if dec_s else 0.0,
                "ms_per_token": dec_s / dec_n * 1e3 if dec_n else float("nan"),
                "aal": sum(r[name]["new_tokens"] - 1 for r in sel) / steps if steps else float("nan"),
                "predicted_speedup": (sum(r[name]["pred_plain_ms"] for r in sel)
                                      / max(sum(r[name]["pred_step_ms"] for r in sel), 1e-9)),
                "predicted_online": (sum(r[name].get("pred_plain_ms_online", r[name]["pred_plain_ms"]) for r in sel)
                                     / max(sum(r[name].get("pred_step_ms_online", r[name]["pred_step_ms"])
                                               for r in sel), 1e-9)),
                "same_as_plain": sum(r[name]["tokens"] == r["plain"]["tokens"] for r in sel),
                "plain_step_share": (sum(r[name]["n_plain_steps"] for r in sel) / steps) if steps else 0.0,
            }
            if steps and all("depth_counts" in r[name] for r in sel):  # share of steps per D
                c = Counter()
                for r in sel:
                    c.update({int(k): v for k, v in r[name]["depth_counts"].items()})
                res[name]["depth_share"] = {str(k): c[k] / steps for k in sorted(c)}
            if steps and all("stage_ms" in r[name] for r in sel):  # the policy's own time, in-run
                res[name]["policy_ms_per_step"] = sum(r[name]["stage_ms"].get("policy", 0.0) for r in sel) / steps
        for name in names:
            res[name]["measured_speedup"] = res["plain"]["ms_per_token"] / res[name]["ms_per_token"]
            m = res[name]["measured_speedup"]
            res[name]["prediction_error"] = abs(res[name]["predicted_speedup"] - m) / m
            res[name]["online_error"] = abs(res[name]["predicted_online"] - m) / m
        summary[st] = res
    return summary


def plan_runner(path: str, compile_missing: bool = False, compile_root: str = "compile"):
    """A compiled plan as ``yggtree run --plan PATH`` runs it with no other flag, for the bench
    scripts: ``(plan, info, make)``. The plan is checked now (artifacts, profile and calibration
    of this device, thread split), before anything loads; ``make()`` builds it and returns
    ``(engine, tokenizer, policy)``: the latency objective (with the plan's depth predictor) when
    the plan names a profile and calibration, else its largest tree every step; ``make(False)``
    builds the plan's plain engine (no drafter, policy None), as ``--no-speculate`` runs it."""
    from .offline.compile import prepare_run
    from .compiled import artifact_dir
    from .runtime.build import build_plan_engine, fixed_policy, searched_stages
    from .runtime.objective import plan_policy
    from .runtime.predictor import policy_with_predictor
    from .runtime.schedule import resolve_plan

    plan = prepare_run(path, compile_missing, compile_root)
    art = artifact_dir(plan, compile_root) if plan.backend != "eager" else None
    stages = searched_stages(art) if plan.stages == "auto" and art is not None else plan.stages
    resolve_plan(stages, plan.speculative)  # a split above the cores, refused before loading
    policy = plan_policy(plan)  # a profile of another device or setup is refused here
    if policy is None and plan.predictor is not None:
        policy_with_predictor(plan, None)  # refused: a depth predictor needs the objective

    def make(speculate: bool = True):
        engine, tok = build_plan_engine(plan, art, speculate=speculate)
        if not speculate:  # `yggtree run --plan PATH --no-speculate`: the plan's graphs, plain steps
            return engine, tok, None
        pol = policy
        if engine.drafter is not None:
            engine.set_lookup(plan.lookup)
            pol = (policy_with_predictor(plan, policy, hidden_size=engine.target.cfg.hidden_size)
                   if policy is not None else fixed_policy(engine, plan))
        return engine, tok, pol

    info = {"plan": plan.name, "stages": stages, "weights": plan.weights, "kv_cache": plan.kv_cache,
            "lookup": plan.lookup,
            "policy": ("objective" + (" + depth predictor" if plan.predictor else "")
                       if policy is not None else "largest tree")}
    return plan, info, make


def paired_ratio(rows: list[dict], a: str, b: str, n_boot: int = 4000, seed: int = 0) -> dict:
    """System ``a`` against ``b`` on the same prompts: the ratio of their decode speeds (summed
    decode time over summed decoded tokens, as in :func:`summarise_systems`) and a 95% percentile
    bootstrap interval over prompts (prompts resampled with replacement, both systems' times of
    a prompt kept together), and the share of prompts on which ``a`` was faster."""
    n = np.array([[max(r[s]["new_tokens"] - 1, 0) for s in (a, b)] for r in rows], dtype=np.float64)
    t = np.array([[r[s]["decode_s"] for s in (a, b)] for r in rows], dtype=np.float64)

    def ratio(idx):  # speed of a / speed of b
        return (n[idx, 0].sum() / t[idx, 0].sum()) / (n[idx, 1].sum() / t[idx, 1].sum())

    rng = np.random.default_rng(seed)
    boots = np.sort([ratio(rng.integers(0, len(rows), len(rows))) for _ in range(n_boot)])
    per = (n[:, 0] / t[:, 0]) > (n[:, 1] / t[:, 1])
    return {"a": a, "b": b, "ratio": float(ratio(np.arange(len(rows)))),
            "ci95": [float(boots[int(0.025 * n_boot)]), float(boots[int(0.975 * n_boot) - 1])],
            "a_faster_share": float(per.mean()), "prompts": len(rows)}



# ----------------------------------------------------------------------------- the benchmark


def bench_dtype(args, src, prompts, dtype: str, progress) -> tuple[list[dict], list[dict], dict]:
    """All systems at one dtype: (table rows, per-prompt records, the matmul floor measurement)."""
    from .measure.floor import floor_summary, time_calls

    status = progress.add_task(f"[{dtype}] loading yggtree weights", total=None)
    runners, compile_s, floor_steps = _dtype_runners(args, src, dtype, progress, status)

    for system, run in runners.items():
        progress.update(status, description=f"[{dtype}] warm-up {system}")
        run(prompts[0][1], min(WARMUP_TOKENS, args.max_new_tokens))
    for step, ws in floor_steps.values():  # warm-up of the floor (oneDNN primitives, caches)
        time_calls(step, FLOOR_SAMPLES, 1, ws[0].device)
    progress.update(status, description=f"[{dtype}] done warming up", total=1, completed=1)

    task = progress.add_task(f"[{dtype}] timing", total=args.repeats * len(prompts) * len(runners))
    per_repeat: dict[str, list[dict]] = {s: [] for s in runners}
    floor_ms: dict[str, list[float]] = {k: [] for k in floor_steps}
    last: dict[str, list[Timing]] = {}
    for _ in range(args.repeats):
        timings: dict[str, list[Timing]] = {s: [] for s in runners}
        for _pid, ids in prompts:
            for system, run in runners.items():
                timings[system].append(run(ids, args.max_new_tokens))
                progress.advance(task)
            for k, (step, ws) in floor_steps.items():
                floor_ms[k] += [t * 1e3 for t in time_calls(step, FLOOR_SAMPLES, 0, ws[0].device)]
        for system, ts in timings.items():
            per_repeat[system].append(aggregate(ts))
        last = timings
    by_kernel = {k: floor_summary(floor_ms[k], floor_steps[k][1], 1, k) for k in floor_steps}
    floor = dict(min(by_kernel.values(), key=lambda f: f["median_ms"]))  # the stricter floor
    floor["kernel_ms"] = {k: f["median_ms"] for k, f in by_kernel.items()}
    floor["kernel_p10_ms"] = {k: f["p10_ms"] for k, f in by_kernel.items()}

    rows = _dtype_rows(per_repeat, last, len(prompts), dtype, floor, compile_s)
    records = _dtype_records(prompts, last, dtype)
    progress.update(status, visible=False)
    return rows, records, floor


def _dtype_runners(args, src, dtype: str, progress, status) -> tuple[dict, dict, dict]:
    """The systems of :func:`bench_dtype` built: ``(runners, compile_s, floor_steps)``, system ->
    ``run(ids, n) -> Timing`` and its compile seconds, and per product kernel the matmul floor's
    step (:func:`yggtree.measure.floor.matmul_floor_step`) of the products the systems run."""
    from .measure.floor import matmul_floor_step
    from .runtime.engine import Engine, EngineConfig
    from .runtime.loading import load_model
    from .runtime.prepare import pack_models
    from .measure.kernel_choice import measured_choice
    from .runtime.packed import can_pack

    model = load_model(src, dtype)
    eos = tuple(model.cfg.eos_token_ids)
    runners = {}
    compile_s = {}
    if not args.no_hf:
        progress.update(status, description=f"[{dtype}] loading transformers model")
        hf = load_hf_model(src, dtype)
        runners["hf"] = lambda ids, n: time_hf(hf, ids, n, eos)
    floor_weights = {"linear": model.matmul_weights()}  # the 7 products per layer eager code runs
    for system, mode in (("ygg-reference", "reference"), ("ygg-compiled", "performance")):
        progress.update(status, description=f"[{dtype}] building {system} engine")
        m = model.shared_copy()
        choice = {}
        if mode == "performance":  # as `yggtree run` builds it: the kernel (and prefetch) measured on this CPU
            choice = measured_choice(src, dtype, None, (1,), torch.get_num_threads())
            pack_models(m, min_rows=choice["min_rows"], kernel=choice["kernel"])  # a no-op off CPUs
            fused = m.matmul_weights()  # the products the compiled system runs (q/k/v, gate/up fused)
            for kernel in ("packed", "tiled"):
                if can_pack(model, "torch" if kernel == "packed" else kernel):
                    floor_weights[kernel] = fused
        engine = Engine(
            m,
            EngineConfig(mode=mode, max_context=args.max_context, prefetch=measured_prefetch(choice.get("prefetch"))),
            eos_ids=eos,
        )
        compile_s[system] = engine.compile_s
        runners[system] = lambda ids, n, e=engine: time_ygg(e, ids, n)
    floor_steps = {k: matmul_floor_step(ws, 1, kernel=k) for k, ws in floor_weights.items()}
    return runners, compile_s, floor_steps


def _dtype_rows(per_repeat: dict, last: dict, n_prompts: int, dtype: str, floor: dict,
                compile_s: dict) -> list[dict]:
    """:func:`bench_dtype`'s table rows: per system the medians over repeats (``per_repeat``),
    against transformers and the floor, and how many of the last repeat's outputs (``last``)
    equal transformers'."""
    rows = []
    hf_tok_s = [r["tok_s"] for r in per_repeat["hf"]] if "hf" in per_repeat else None
    for system, reps in per_repeat.items():
        row = {"system": system, "dtype": dtype, "prompts": n_prompts}
        for key in ("new_tokens", "tok_s", "ms_per_token", "prefill_ms"):
            row[key] = statistics.median(r[key] for r in reps)
        row["vs_hf"] = (
            statistics.median(r["tok_s"] / h for r, h in zip(reps, hf_tok_s)) if hf_tok_s else None
        )
        row["floor_ms"] = floor["median_ms"]
        row["x_floor"] = row["ms_per_token"] / floor["median_ms"]
        if "hf" in last and system != "hf":
            same = [a.tokens == b.tokens for a, b in zip(last[system], last["hf"])]
            row["identical"], row["compared"] = sum(same), len(same)
        else:
            row["identical"], row["compared"] = None, None
        row["compile_s"] = compile_s.get(system)
        row["floor_gbps"] = floor["gbps"]
        rows.append(row)
    return rows


def _dtype_records(prompts, last: dict, dtype: str) -> list[dict]:
    """:func:`bench_dtype`'s per-prompt records: each system's last timing of each prompt."""
    records = []
    for i, (pid, ids) in enumerate(prompts):
        rec = {"dtype": dtype, "prompt_id": pid, "prompt_tokens": len(ids)}
        for system, ts in last.items():
            rec[system] = {
                "new_tokens": len(ts[i].tokens),
                "total_ms": ts[i].total_s * 1e3,
                "prefill_ms": ts[i].prefill_s * 1e3,
                "identical_to_hf": ts[i].tokens == last["hf"][i].tokens if "hf" in last else None,
            }
        records.append(rec)
    return records


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_table(rows: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("system", "dtype", "tok/s", "ms/token", "prefill ms", "vs hf", "x floor", "identical", "compile s"):
        table.add_column(name, justify="left" if name in ("system", "dtype") else "right", no_wrap=True)
    for r in rows:
        ident = "-" if r["identical"] is None else f"{r['identical']}/{r['compared']}"
        table.add_row(
            r["system"],
            r["dtype"],
            _fmt(r["tok_s"], ".1f"),
            _fmt(r["ms_per_token"], ".1f"),
            _fmt(r["prefill_ms"], ".0f"),
            _fmt(r["vs_hf"], ".2f"),
            _fmt(r["x_floor"], ".2f"),
            ident,
            _fmt(r["compile_s"], ".1f"),
        )
    return table


def run(args) -> int:
    """The ``bench`` subcommand: table on stdout, one JSON line last. Returns the exit code."""
    from rich.console import Console

    from .measure.floor import copy_bandwidth_gbps
    from .runtime.loading import load_tokenizer, resolve_model

    if args.max_new_tokens < 1:
        raise YggError(f"max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise YggError(f"repeats must be >= 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            raise YggError(f"threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)  # this process only; recorded in the JSON line
    dtypes = list(BENCH_DTYPES) if args.dtype == "both" else [args.dtype]
    src = resolve_model(args.model)
    tokenizer = load_tokenizer(src)
    prompts = load_prompts(args.prompts, args.prompts, tokenizer)

    rows: list[dict] = []
    records: list[dict] = []
    floors: dict[str, dict] = {}
    with stderr_progress() as progress:
        t = progress.add_task("copy bandwidth", total=None)
        copy_gbps = copy_bandwidth_gbps()
        progress.update(t, visible=False)
        for dtype in dtypes:
            r, rec, floors[dtype] = bench_dtype(args, src, prompts, dtype, progress)
            rows += r
            records += rec

    for row in rows:
        row["copy_gbps"] = copy_gbps
    summary = {
        "bench": "plain",
        "model": str(src.path),
        "dtypes": dtypes,
        "prompts": [pid for pid, _ in prompts],
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "max_context": args.max_context,
        "copy_gbps": copy_gbps,
        "matmul_floor_width1": floors,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            with (out / "results.csv").open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS) + ["floor_gbps", "copy_gbps"])
                w.writeheader()
                w.writerows(rows)
            (out / "results.json").write_text(json.dumps({**summary, "per_prompt": records}, indent=2))
        except OSError as e:
            raise YggError(f"cannot write results to {out}: {e}") from None
    if not args.json:
        title = (
            f"plain greedy decoding, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
            f"median of {args.repeats}; copy bandwidth {copy_gbps:.1f} GB/s"
        )
        Console(width=None if sys.stdout.isatty() else 120).print(render_table(rows, title))
    print(json.dumps(summary), flush=True)
    return 0


# ----------------------------------------------------------------------------- argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a HF directory or a .gguf file")
    p.add_argument("--dtype", default="both", choices=[*BENCH_DTYPES, "both"])
    p.add_argument(
        "--prompts", type=int, default=4, metavar="N", help="N MT-Bench first turns + N HumanEval prompts"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed repeats (medians are reported)")
    p.add_argument("--max-context", type=int, default=1024, help="yggtree engine context (static cache)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads for every system (default: torch's)"
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", metavar="DIR", help="also write results.csv and results.json here")
    p.add_argument("--json", action="store_true", help="print only the JSON line (no table)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``bench`` on a CLI's subparsers (help line, description, flags), handled by :func:`run`."""
    p = subparsers.add_parser(
        "bench",
        help="plain-decoding benchmark: transformers vs yggtree reference and compiled",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.bench ...``: the same options as ``yggtree bench``."""
    return module_main("yggtree.bench", "bench", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
