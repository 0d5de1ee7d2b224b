#!/usr/bin/env python
"""Every weight format against transformers and llama.cpp in one run (issue #20, "Must show").

Systems, all greedy, on the same prompts (``--prompts N``: N MT-Bench first turns and N HumanEval
prompts with the chat template, as ``yggtree bench``; the two sets alternating):

- ``hf/float32``, ``hf/bfloat16``: transformers eager ``generate(do_sample=False)`` on the same
  weights (``yggtree.bench.load_hf_model``, ``time_hf``); ``hf/float32`` is the baseline;
- ``llama.cpp``: the peer on the same GGUF file (``--llama-cpp DIR``: the directory of a llama.cpp
  build holding ``llama-completion`` or ``llama-cli``; absent: skipped, said in one line). It gets
  the prompt's chat-templated text (the same token ids decoded, special tokens kept; its own
  count of prompt tokens is checked against ours), ``--temp 0``, ``-n``, ``-t``/``-tb`` the
  run's threads, weights read into memory (``-lm none``, ``--no-mmap`` in older builds), no escape
  processing, one process per prompt (its commit is printed, from ``--version``);
  its speed is its own reported eval (generation) time;
- ``ygg/FMT/plain`` and ``ygg/FMT/spec`` for every ``--formats`` entry (float32, bfloat16, int8,
  int4[@G], gguf-native, w4a8): the engine as ``yggtree run --weights FMT`` builds it
  (``yggtree.runtime.build``; float formats in their own dtype, quantized ones in ``--quant-dtype``),
  plain decoding and speculative decoding with ``--drafter`` on the fixed tree ``--spec-tree``
  (W_d,D,W_v,top_k; default 8,6,32,8 as scripts/eval_drafter.py; ``--spec-tree none``: no
  fixed-tree systems). A speculative engine the format cannot run exactly (a kernel that is not
  batch-invariant on this CPU) is reported as refused;
- ``ygg/FMT/plan:NAME`` (``NAME+lookupN`` for a plan of N lookup nodes) for every ``--plan PATH`` (repeatable): a compiled plan as ``yggtree run
  --plan PATH`` runs it (its weight format FMT, which ``--formats`` must name so that its output
  is checked against that format's plain decoding; its packages, stage plan, and the latency
  objective over its own profile, with its depth predictor if it names one): the speculative
  configuration the objective picks for the format on this machine; and ``ygg/FMT/plan:NAME/plain``,
  the same plan's compiled graphs decoding plainly as ``yggtree run --plan PATH --no-speculate``
  runs it (no drafter loaded), checked against the format's plain decoding as well; a plan
  without a drafter gives only the latter. A plan with a 16-bit KV cache (``kv_cache``) computes
  another model than the format's plain engine: its tokens are not compared.
  Every format's products run on the kernel and padding ``yggtree profile`` would choose for a
  plan on this machine (``--min-rows auto``: torch's kernel at the fastest padding that is
  batch-invariant at widths 1 and the tree's W_v, or the tiled kernel, whichever is faster,
  measured per format before its engines are built, the same for its plain and speculative
  engine, as one plan's engine runs its plain and tree steps alike); ``--min-rows N`` fixes
  torch's kernel padded to N.

Timing: one untimed warm-up generate per system, then ``--repeats`` passes; in each pass every
system decodes prompt i before any decodes prompt i + 1 (their order rotating per prompt), so a
slow stretch of a shared host hits all of them. Per prompt and system the median over repeats of
the decode time is kept. Definitions::

    decode tok/s  sum over prompts of (new tokens - 1) / sum of decode time (prefill excluded):
                    yggtree: total - ttft; transformers: generate - a separately timed prompt
                    forward; llama.cpp: its "eval time" over its "runs"
    x hf-f32      decode speed over hf/float32's on the same prompts, with a 95% bootstrap interval
    x ygg-f32     the same over ygg/float32/plain (yggtree.bench.paired_ratio)
    weight MB     bytes one decode step streams: every tensor the target's forward reads (packed,
                    quantized or float products, norms, the LM head), not the embedding (rows are
                    gathered), nor caches; llama.cpp: the GGUF's 2-D tensors the same way
    limit tok/s   streaming bandwidth / weight bytes: plain decoding's bandwidth limit. A shared
                    host's bandwidth can move in phases within a run (docs/results.md), so it is
                    probed through the run: a 256 MiB sum on huge pages (where yggtree keeps weights:
                    runtime/hugepages.py) before every prompt's systems and once after the last;
                    the limit is at the median probe. Once, before the timed passes, a 256 MiB copy
                    (yggtree.measure.floor.copy_bandwidth_gbps, bytes read per second) and sums on ordinary
                    and huge pages are also measured and reported
    % limit       per pass, its decode tok/s over the limit at the mean of the probes just before
                    and after its prompt's systems; the median over prompts of each prompt's median
                    over passes (speculation can pass 100%: it is plain's limit)
    = plain       prompts whose speculative tokens equal the same format's plain tokens (last pass)

Output: one rich table on stdout; ``--out DIR`` writes results.json (everything, per prompt
included) and results.csv (the table). Bad input (an unknown format, a format this model or
machine cannot run, a missing llama.cpp directory) is one line and exit status 1, before
anything loads.

    OMP_NUM_THREADS=2 python scripts/bench_formats.py --llama-cpp /path/to/llama.cpp/build/bin \\
        --prompts 4 --max-new-tokens 64 --threads 2 --repeats 2 --out runs/formats
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from yggtree.bench import by_prompt_set, decode_totals, paired_ratio
from yggtree.errors import YggError, run_reporting
from yggtree.runtime.allocator import ensure_script, running, without_preload

FORMATS = ("float32", "bfloat16", "int8", "int4", "gguf-native", "w4a8")
WARMUP_TOKENS = 16  # new tokens of each system's untimed warm-up generate
BANDWIDTH_BYTES = 256 << 20  # well above the last-level cache
PROBE_SUMS = 3  # timed sums of a bandwidth probe between prompts
LLAMA_BINARIES = ("llama-completion", "llama-cli")  # newest first: llama-cli became chat-only
BASE_HF, BASE_YGG = "hf/float32", "ygg/float32/plain"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default', a HF directory or a .gguf file")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats")
    p.add_argument("--quant-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the run's dtype of the quantized formats (float formats run in their own)")
    p.add_argument("--drafter", default="default", help="drafter of the speculative systems (as yggtree run)")
    p.add_argument("--spec-tree", default="8,6,32,8", metavar="W_d,D,W_v,k",
                   help="the speculative systems' fixed tree")
    p.add_argument("--plan", action="append", default=[], metavar="PATH",
                   help="a compiled plan to bench as a speculative system of its weight format (repeatable)")
    p.add_argument("--compile-root", default="compile", help="where the plans' compiled directories are")
    p.add_argument("--compile-missing", action="store_true", help="compile a missing or stale plan first")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers systems")
    p.add_argument("--llama-cpp", metavar="DIR", help="directory of the llama.cpp binaries (absent: skipped)")
    p.add_argument("--prompts", type=int, default=4, metavar="N", help="N MT-Bench + N HumanEval prompts")
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="N prompts of token ids instead (smoke tests on models without a chat template)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="threads of every system (0: torch's setting)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes (per-prompt medians)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--min-rows", default="auto", metavar="auto|N",
                   help="padding of short packed products (float formats): auto measures it per format on "
                        "this machine as `yggtree profile` does (the fastest padding that is batch-invariant at "
                        "the engine's widths); N fixes it")
    p.add_argument("--mode", choices=("performance", "reference"), default="performance",
                   help="yggtree engines: compiled (as yggtree run) or eager")
    p.add_argument("--out", metavar="DIR", help="write results.json and results.csv here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- checks, sizes


def format_dtype(fmt: str, quant_dtype: str) -> str:
    """The run's dtype of weight format ``fmt``: a float format's own, else ``quant_dtype``."""
    return fmt if fmt in ("float32", "bfloat16") else quant_dtype


def check_formats(formats: list[str], src, quant_dtype: str) -> None:
    """YggError (one line) for a format that is unknown, that this torch/CPU cannot run, or that
    this model has no weights for (gguf-native of a non-GGUF model), before anything loads."""
    import torch

    from yggtree.runtime.quant import check_kernel
    from yggtree.shapes import weight_format

    if not formats:
        raise YggError("--formats names no format")
    if len(set(formats)) != len(formats):
        raise YggError(f"--formats names a format twice: {','.join(formats)}")
    for f in formats:
        dtype = format_dtype(f.partition("@")[0], quant_dtype)
        name, _ = weight_format(f, dtype)
        if name in ("int8", "int4", "gguf-native", "w4a8"):
            check_kernel(name if name in ("int8", "w4a8") else "int4", getattr(torch, dtype))
        if name == "gguf-native" and src.kind != "gguf":
            raise YggError(f"weights gguf-native need a GGUF model, {src.path} is a {src.kind} directory")


def streamed_weight_bytes(model) -> int:
    """Bytes of the tensors one decode step of ``model`` (a yggtree Transformer, possibly packed or
    quantized) reads: each product's own weights (a packed layer's packed copy, a quantized layer's
    codes and scales, a fused q/k/v or gate/up product instead of its parts), norms and biases, the
    LM head; not the embedding (a step gathers one row), the rope table or the caches."""
    from yggtree.measure.floor import weight_bytes
    from yggtree.runtime.kv_cache import KVCache
    from yggtree.runtime.model import FUSED_PROJECTIONS

    skip = {id(model.embed_tokens)}
    for block in model.layers:
        for mod_name, attr, parts in FUSED_PROJECTIONS:
            mod = getattr(block, mod_name)
            if getattr(mod, attr, None) is not None:  # the fused product runs, not its parts
                skip |= {id(getattr(mod, k)) for k in parts if getattr(mod, k, None) is not None}
    tensors = {}
    for mod in model.modules():
        if id(mod) in skip or isinstance(mod, KVCache):
            continue
        own = {**dict(mod.named_parameters(recurse=False)), **dict(mod.named_buffers(recurse=False))}
        if "packed" in own:
            own.pop("weight", None)  # kept for the state dict; the product reads the packed copy
        if mod is model:
            own.pop("rope", None)
        tensors.update({id(t): t for t in own.values() if t is not None})
    return weight_bytes(list(tensors.values()))


def gguf_streamed_bytes(src, cfg) -> int:
    """Bytes of a GGUF file's 2-D tensors a llama.cpp decode step reads: all but the embedding,
    which it reads too when it doubles as the output projection (tied)."""
    from yggtree.runtime.loading import gguf_raw_weights

    raw = gguf_raw_weights(src, cfg)
    tied = "lm_head.weight" not in raw
    return sum(b.numel() for name, (_, b) in raw.items() if name != "embed_tokens.weight" or tied)


def sum_gbps(x, repeats: int = 10, warmup: int = 2) -> float:
    """GB/s of ``x.sum()`` (bytes read per second, the median of ``repeats`` timed sums)."""
    import numpy as np

    from yggtree.measure.floor import time_calls

    return x.numel() * x.element_size() / float(np.median(time_calls(x.sum, repeats, warmup, x.device))) / 1e9


def probe_buffer():
    """The bandwidth probes' 256 MiB float32 tensor on huge pages (the weights' own kind of pages)."""
    import torch

    from yggtree.runtime.hugepages import huge_zeros

    return huge_zeros((BANDWIDTH_BYTES // 4,), torch.float32).fill_(1.0)


def bandwidth(threads: int, probe) -> dict:
    """Streaming bandwidth at the run's threads, once: a copy (bytes read per second), a sum on
    ordinary pages and one on huge pages (``probe``, the run's probe buffer)."""
    import torch

    from yggtree.measure.floor import copy_bandwidth_gbps

    copy = copy_bandwidth_gbps(BANDWIDTH_BYTES)
    read = sum_gbps(torch.ones(BANDWIDTH_BYTES // 4))
    huge = sum_gbps(probe)
    return {"copy_gbps": copy, "sum_gbps": read, "sum_huge_gbps": huge, "gbps": max(copy, read, huge),
            "threads": threads, "bytes": BANDWIDTH_BYTES}


# ----------------------------------------------------------------------------- llama.cpp


def llama_binary(directory: str) -> Path:
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise YggError(f"--llama-cpp {directory}: no such directory")
    for sub in (d, d / "bin", d / "build" / "bin"):
        for name in LLAMA_BINARIES:
            if (sub / name).is_file():
                return sub / name
    raise YggError(f"--llama-cpp {directory}: holds none of {', '.join(LLAMA_BINARIES)} (nor bin/ does)")


def llama_output(binary: Path, *flags: str) -> str:
    try:
        out = subprocess.run([str(binary), *flags], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, env=without_preload(os.environ))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise YggError(f"cannot run {binary}: {e}") from None
    return out.stdout + out.stderr


def llama_info(binary: Path) -> dict:
    """The build's version line and commit (its ``--version``), and the flag that reads the
    weights into memory instead of mapping them (``-lm none`` in newer builds, ``--no-mmap`` before)."""
    text = llama_output(binary, "--version")
    version = re.search(r"version:\s*(.+)", text)
    commit = re.search(r"commit\s+([0-9a-f]{6,40})\b", text) or re.search(r"\(([0-9a-f]{6,40})\)", text)
    help_text = llama_output(binary, "--help")
    no_mmap = ["-lm", "none"] if "--load-mode" in help_text else ["--no-mmap"] if "--no-mmap" in help_text else []
    return {"binary": str(binary), "version": version.group(1).strip() if version else "unknown",
            "commit": commit.group(1) if commit else "unknown", "no_mmap": no_mmap}


_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*tokens")
_EVAL = re.compile(r"(?<!prompt )eval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*(?:runs|tokens)")


def parse_llama_timings(text: str) -> dict:
    """llama.cpp's own timings from its log (``llama_perf_context_print``): prompt eval ms and
    tokens, eval (generation) ms and runs. YggError naming the last lines when absent."""
    p, e = _PROMPT_EVAL.findall(text), _EVAL.findall(text)
    if not p or not e:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise YggError(f"llama.cpp printed no eval timings (its last lines: {tail[:300]})")
    return {"prompt_ms": float(p[-1][0]), "prompt_tokens": int(p[-1][1]),
            "eval_ms": float(e[-1][0]), "eval_runs": int(e[-1][1])}


def exit_words(code: int) -> str:
    """A child's exit status in words: ``exited 1``, or the signal that killed it (a build for
    another CPU dies of SIGILL)."""
    if code >= 0:
        return f"exited {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (an instruction this CPU or its hypervisor does not run: build it for this machine)" if name == "SIGILL" else ""
    return f"was killed by {name}{hint}"


def run_llama(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """One llama.cpp process, as its users run it: not on the allocator yggtree preloaded, no
    stdin; YggError in one line where it cannot start or outlives ``timeout`` seconds."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=without_preload(os.environ))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise YggError(f"llama.cpp failed: {e}") from None


def llama_check(info: dict, gguf: Path, threads: int) -> None:
    """One token from llama.cpp before anything else is built: a build that cannot run on this
    machine is refused in one line at the start, not after every other system has loaded."""
    out = run_llama(llama_command(info, gguf, "Hello", 1, threads, 64), 120)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise YggError(f"--llama-cpp: {info['binary']} {exit_words(out.returncode)} on one token "
                       f"(its last line: {last[:200]})")


def llama_command(info: dict, gguf: Path, text: str, n: int, threads: int, ctx: int) -> list[str]:
    """Greedy completion of ``text`` as it is (special tokens parsed, no escapes processed, no chat
    mode: the text already holds the chat template), weights in memory, ``threads`` threads."""
    return [info["binary"], "-m", str(gguf), "-p", text, "-n", str(n), "-t", str(threads), "-tb", str(threads),
            "--temp", "0", "--top-k", "1", "--seed", "0", "-c", str(ctx), *info["no_mmap"], "-no-cnv",
            "--no-escape", "--no-display-prompt", "--simple-io"]


# ----------------------------------------------------------------------------- systems


@dataclass
class System:
    name: str
    kind: str  # hf | llama | plain | spec | plan-plain (a plan's graphs, plain steps)
    fmt: str
    dtype: str
    run: object = None  # (prompt ids, prompt text, new tokens) -> per-prompt record
    weight_bytes: int | None = None
    build_s: float = 0.0
    warmup_s: float = 0.0
    refused: str | None = None
    info: dict = field(default_factory=dict)


def ygg_runner(engine, policy=None):
    from yggtree.runtime.engine import SamplingParams

    kw = {"policy": policy} if policy is not None else {}

    def run(ids, _text, n):
        res = engine.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0), **kw)
        st = res.stats
        return {"decode_s": (st["total_ms"] - st["ttft_ms"]) / 1e3, "prefill_s": st["ttft_ms"] / 1e3,
                "new_tokens": st["new_tokens"], "tokens": res.token_ids, "steps": st["verify_calls"],
                "aal": st.get("aal", 1.0)}

    return run


def hf_runner(hf, eos):
    from yggtree.bench import time_hf

    def run(ids, _text, n):
        t = time_hf(hf, ids, n, eos)
        return {"decode_s": max(t.total_s - t.prefill_s, 0.0), "prefill_s": t.prefill_s,
                "new_tokens": len(t.tokens), "tokens": t.tokens, "steps": max(len(t.tokens) - 1, 0), "aal": 1.0}

    return run


def llama_runner(info: dict, gguf: Path, threads: int, ctx: int):
    def run(ids, text, n):
        out = run_llama(llama_command(info, gguf, text, n, threads, ctx), 600)
        if out.returncode != 0:
            raise YggError(f"llama.cpp {exit_words(out.returncode)}: {out.stderr.strip().splitlines()[-1:]}")
        t = parse_llama_timings(out.stderr + out.stdout)
        return {"decode_s": t["eval_ms"] / 1e3, "prefill_s": t["prompt_ms"] / 1e3,
                "new_tokens": t["eval_runs"] + 1,  # the first token comes from the prompt's logits
                "steps": t["eval_runs"], "aal": 1.0, "text": out.stdout,
                "prompt_tokens": t["prompt_tokens"], "prompt_tokens_ours": len(ids)}

    return run


def plan_format(plan, formats: list[str], quant_dtype: str) -> str | None:
    """The entry of ``formats`` naming the weights ``plan`` runs (``int4`` for a plan's canonical
    ``int4@32``), or None."""
    from yggtree.shapes import weight_format

    want = (weight_format(plan.weights, plan.dtype), plan.dtype)
    for f in formats:
        dtype = format_dtype(f.partition("@")[0], quant_dtype)
        if (weight_format(None if f in ("float32", "bfloat16") else f, dtype), dtype) == want:
            return f
    return None


def build_systems(args, src, formats: list[str], tree, plans, threads: int, say) -> list[System]:
    """Every system, built (engines compiled, transformers loaded), in table order."""
    from yggtree.bench import load_hf_model
    from yggtree.offline.profile_padding import model_padding
    from yggtree.runtime.packed import min_rows_of
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import TreeParams

    systems: list[System] = []
    float_bytes = {}

    def timed(s: System, make):
        t0 = time.perf_counter()
        say(f"building {s.name}")
        try:
            s.run = make()
        except YggError as e:
            if s.kind not in ("spec", "plan-plain"):
                raise
            s.refused = str(e)
            say(f"{s.name}: refused: {e}")
        s.build_s = time.perf_counter() - t0
        systems.append(s)

    for fmt in formats:
        dtype = format_dtype(fmt.partition("@")[0], args.quant_dtype)
        weights = None if fmt in ("float32", "bfloat16") else fmt
        pad, min_rows, kernel = None, 1, "torch"
        if args.min_rows == "auto":  # the product kernel and padding, measured as a profile does
            pad = model_padding(src, dtype, weights, (1, tree.verify_width) if tree is not None else (1,))
            min_rows, kernel = pad["min_rows"], pad["kernel"]
            if pad["products"]:
                say(f"ygg/{fmt}: products on {kernel}, padded to {min_rows} row(s) (median ms by kernel "
                    f"and rows: {pad['median_ms']})")
        elif weights is None:
            min_rows = int(args.min_rows)
        for kind in ("plain", "spec") if tree is not None else ("plain",):
            s = System(f"ygg/{fmt}/{kind}", kind, fmt, dtype)
            s.info["min_rows"], s.info["kernel"], s.info["padding"] = min_rows, kernel, pad
            spec = EngineSpec(model=args.model, drafter=args.drafter if kind == "spec" else None, dtype=dtype,
                              mode=args.mode, max_context=args.max_context, weights=weights, min_rows=min_rows,
                              kernel=kernel, tree=tree if kind == "spec" else TreeParams())

            def make(s=s, spec=spec):
                engine, tok = build_engine(spec)
                s.weight_bytes = streamed_weight_bytes(engine.target)
                s.info["compile_s"] = engine.compile_s
                s.info["eos"] = list(engine.eos_ids)
                s.info["tokenizer"] = tok
                return ygg_runner(engine)

            timed(s, make)
        if fmt in ("float32", "bfloat16"):
            float_bytes[fmt] = next(s.weight_bytes for s in systems if s.name == f"ygg/{fmt}/plain")
        for plan_fmt, plan, info, make_plan in plans:
            if plan_fmt != fmt:
                continue
            kinds = ((("", "spec", True),) if plan.speculative else ()) + (("/plain", "plan-plain", False),)
            # two plans of one name apart by their lookup count (a copy with ``lookup: N``) stay apart
            name = f"{plan.name}+lookup{plan.lookup}" if plan.lookup else plan.name
            for suffix, kind, speculate in kinds:  # a plan without a drafter: its plain steps only
                s = System(f"ygg/{fmt}/plan:{name}{suffix}", kind, fmt, plan.dtype)
                s.info.update(info, **({} if speculate else {"policy": "plain steps (--no-speculate)"}))

                def make(s=s, make_plan=make_plan, speculate=speculate):
                    engine, tok, policy = make_plan(speculate)
                    s.weight_bytes = streamed_weight_bytes(engine.target)
                    s.info["compile_s"] = engine.compile_s
                    s.info["min_rows"] = min_rows_of(engine.target)
                    return ygg_runner(engine, policy)

                timed(s, make)
    for dtype in ("float32", "bfloat16") if not args.no_hf else ():
        s = System(f"hf/{dtype}", "hf", dtype, dtype)

        def make(s=s, dtype=dtype):
            hf = load_hf_model(src, dtype)
            eos = tuple(systems[0].info["eos"])  # the yggtree engines' stop tokens
            s.weight_bytes = float_bytes.get(dtype)  # the same weights as ygg's plain engine of dtype
            return hf_runner(hf, eos)

        timed(s, make)
    if args.llama_cpp:
        binary = llama_binary(args.llama_cpp)
        s = System("llama.cpp", "llama", "gguf", "gguf")
        s.info = llama_info(binary)
        say(f"llama.cpp: {binary}, commit {s.info['commit']} ({s.info['version']})")

        def make():
            from yggtree.runtime.loading import load_config

            s.weight_bytes = gguf_streamed_bytes(src, load_config(src))
            return llama_runner(s.info, src.path, threads, args.max_context)

        timed(s, make)
    return systems


# ----------------------------------------------------------------------------- the run


def synthetic(n: int, vocab: int) -> list[tuple[str, list[int]]]:
    return [(f"synthetic/{i}", [3 + (11 * i + 7 * j) % (vocab - 3) for j in range(10 + 4 * i)]) for i in range(n)]


def run(args) -> int:
    import torch

    from yggtree.data import interleave, load_prompts
    from yggtree.progress import stderr_progress
    from yggtree.runtime.loading import load_tokenizer, resolve_model
    from yggtree.runtime.schedule import resolve_plan
    from yggtree.shapes import parse_tree

    if args.max_new_tokens < 1 or args.repeats < 1 or args.prompts < 0 or args.synthetic < 0:
        raise YggError("--max-new-tokens and --repeats must be >= 1, --prompts and --synthetic >= 0")
    if args.min_rows != "auto" and not (args.min_rows.isdigit() and int(args.min_rows) >= 1):
        raise YggError(f"--min-rows must be 'auto' or an integer >= 1, got {args.min_rows!r}")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    src = resolve_model(args.model)
    check_formats(formats, src, args.quant_dtype)
    tree = None if args.spec_tree == "none" else parse_tree(args.spec_tree, "--spec-tree")
    plans = []
    for path in args.plan:  # checked before anything loads
        from yggtree.bench import plan_runner

        plan, info, make = plan_runner(path, args.compile_missing, args.compile_root)
        if plan.target != args.model and resolve_model(plan.target).path != src.path:
            raise YggError(f"plan {path} decodes {plan.target}, the bench decodes {src.path}")
        plan_fmt = plan_format(plan, formats, args.quant_dtype)
        if plan_fmt is None:
            raise YggError(f"plan {path} runs weights {plan.weights or plan.dtype} in {plan.dtype}: add them to "
                           "--formats so that its output is checked against that format's plain decoding")
        plans.append((plan_fmt, plan, info, make))
    if args.llama_cpp:
        binary = llama_binary(args.llama_cpp)  # a missing directory or binary, before anything loads
        if src.kind != "gguf":
            raise YggError(f"llama.cpp runs GGUF files, {src.path} is a {src.kind} directory")
        llama_check(llama_info(binary), src.path, args.threads or torch.get_num_threads())
    resolve_plan("sequential", False, threads=args.threads)  # above the cores: refused
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.llama_cpp:
        print("llama.cpp: skipped (no --llama-cpp DIR given)", file=sys.stderr)

    def say(line):
        print(f"bench_formats: {line}", file=sys.stderr, flush=True)

    systems = build_systems(args, src, formats, tree, plans, threads, say)
    live = [s for s in systems if s.refused is None]
    tok = next((s.info["tokenizer"] for s in systems if "tokenizer" in s.info), None) or load_tokenizer(src)
    if args.synthetic:
        prompts = synthetic(args.synthetic, len(tok))
    else:
        prompts = interleave(load_prompts(args.prompts, args.prompts, tok))
    texts = {pid: tok.decode(ids, skip_special_tokens=False) for pid, ids in prompts}
    for s in live:  # one untimed warm-up generate each
        t0 = time.perf_counter()
        s.run(prompts[0][1], texts[prompts[0][0]], min(WARMUP_TOKENS, args.max_new_tokens))
        s.warmup_s = time.perf_counter() - t0
    say("measuring the streaming bandwidth")
    probe = probe_buffer()
    bw = bandwidth(threads, probe)
    rows = [{"id": pid, "set": pid.split("/")[0], "max_new_tokens": args.max_new_tokens} for pid, _ in prompts]
    passes: list[dict] = [{s.name: [] for s in live} for _ in prompts]
    probes = [sum_gbps(probe, PROBE_SUMS, 1)]
    t_start = time.perf_counter()
    with stderr_progress() as progress:
        task = progress.add_task("formats bench", total=args.repeats * len(prompts) * len(live))
        for _ in range(args.repeats):
            for i, (pid, ids) in enumerate(prompts):
                group = []
                for s in live[i % len(live):] + live[: i % len(live)]:
                    group.append(s.run(ids, texts[pid], args.max_new_tokens))
                    passes[i][s.name].append(group[-1])
                    progress.advance(task)
                probes.append(sum_gbps(probe, PROBE_SUMS, 1))
                for rec in group:  # the bandwidth around this prompt's systems
                    rec["gbps"] = (probes[-2] + probes[-1]) / 2
    del probe
    bw["probes_gbps"] = [round(g, 2) for g in probes]
    bw["probe_gbps"] = statistics.median(probes)
    for row, per in zip(rows, passes):
        for name, recs in per.items():
            rec = dict(recs[-1])  # tokens and counts of the last pass, the median decode time
            rec["decode_s"] = statistics.median(r["decode_s"] for r in recs)
            rec["prefill_s"] = statistics.median(r["prefill_s"] for r in recs)
            rec["decode_s_all"] = [r["decode_s"] for r in recs]
            rec["gbps_all"] = [r["gbps"] for r in recs]
            row[name] = rec
    out = report(rows, systems, args, threads, bw, time.perf_counter() - t_start, torch.__version__)
    if args.out:
        d = Path(args.out)
        (d / "results.json").write_text(json.dumps({**out, "per_prompt": rows}, indent=1) + "\n")
        with (d / "results.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out["table"][0]))
            w.writeheader()
            w.writerows(out["table"])
        say(f"wrote {d / 'results.json'} and {d / 'results.csv'}")
    return 0


# ----------------------------------------------------------------------------- the report


def limit_fraction(rows: list[dict], name: str, weight_bytes: int) -> float:
    """System ``name``'s decode speed over the bandwidth limit measured around each of its passes:
    the median over prompts of each prompt's median over passes."""
    per_prompt = []
    for x in rows:
        r = x[name]
        n = max(r["new_tokens"] - 1, 0)
        per_prompt.append(statistics.median(
            (n / d if d else 0.0) / (g * 1e9 / weight_bytes) for d, g in zip(r["decode_s_all"], r["gbps_all"])))
    return statistics.median(per_prompt)


def table_rows(rows: list[dict], systems: list[System], gbps: float) -> list[dict]:
    """One row per system over all prompts (refused systems with their reason)."""
    names = {s.name for s in systems if s.refused is None}
    out = []
    for s in systems:
        r = {"system": s.name, "format": s.fmt, "dtype": s.dtype, "prompts": len(rows), "new_tokens": None,
             "decode_tok_s": None, "ms_per_token": None, "e2e_tok_s": None,
             "x_hf_float32": None, "x_hf_float32_lo": None, "x_hf_float32_hi": None,
             "x_ygg_float32": None, "x_ygg_float32_lo": None, "x_ygg_float32_hi": None,
             "weight_bytes": s.weight_bytes, "limit_tok_s": None, "limit_fraction": None, "aal": None,
             "identical_to_plain": None, "compared": None, "build_s": round(s.build_s, 2),
             "min_rows": s.info.get("min_rows"), "kernel": s.info.get("kernel"),
             "note": f"refused: {s.refused}" if s.refused else ""}
        if s.refused is None:
            dec_n, dec_s, steps = decode_totals(rows, s.name)
            r["new_tokens"] = sum(x[s.name]["new_tokens"] for x in rows)
            r["decode_tok_s"] = dec_n / dec_s if dec_s else 0.0
            r["ms_per_token"] = dec_s / dec_n * 1e3 if dec_n else None
            wall = sum(x[s.name]["decode_s"] + x[s.name]["prefill_s"] for x in rows)
            r["e2e_tok_s"] = r["new_tokens"] / wall if wall else 0.0
            r["aal"] = dec_n / steps if steps else None
            for base, key in ((BASE_HF, "x_hf_float32"), (BASE_YGG, "x_ygg_float32")):
                if base in names:
                    c = paired_ratio(rows, s.name, base)
                    r[key], (r[key + "_lo"], r[key + "_hi"]) = c["ratio"], c["ci95"]
            if s.weight_bytes:
                r["limit_tok_s"] = gbps * 1e9 / s.weight_bytes
                r["limit_fraction"] = limit_fraction(rows, s.name, s.weight_bytes)
            plain = f"ygg/{s.fmt}/plain"
            if s.info.get("kv_cache"):  # another model than the format's plain engine (a float32 cache)
                r["note"] = (f"KV cache in {s.info['kv_cache']}: not compared with {plain} "
                             "(scripts/exact_formats.py --kv-cache checks speculation over it)")
            elif s.kind in ("spec", "plan-plain") and plain in names:
                r["identical_to_plain"] = sum(x[s.name]["tokens"] == x[plain]["tokens"] for x in rows)
                r["compared"] = len(rows)
            if s.kind == "llama":
                bad = sum(x[s.name]["prompt_tokens"] != x[s.name]["prompt_tokens_ours"] for x in rows)
                r["note"] = f"llama.cpp commit {s.info['commit']}" + (
                    f"; its prompt token count differs from ours on {bad} prompt(s)" if bad else "")
        out.append(r)
    return out


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(rows: list[dict], systems: list[System], args, threads: int, bw: dict, wall_s: float,
           torch_version: str) -> dict:
    from rich.console import Console
    from rich.table import Table

    table = table_rows(rows, systems, bw["probe_gbps"])
    llama = next((s for s in systems if s.kind == "llama"), None)
    title = (f"{len(rows)} prompts x {args.max_new_tokens} new tokens, greedy, {threads} threads, "
             f"median of {args.repeats} pass(es) per prompt; bandwidth probed between prompts {bw['probe_gbps']:.1f} GB/s "
             f"(median; {min(bw['probes_gbps']):.1f}-{max(bw['probes_gbps']):.1f}), before the passes copy "
             f"{bw['copy_gbps']:.1f}, sum {bw['sum_gbps']:.1f}, sum on huge pages {bw['sum_huge_gbps']:.1f}; spec tree {args.spec_tree}, "
             f"drafter {args.drafter}; allocator {running()}; "
             + (f"llama.cpp commit {llama.info['commit']}" if llama else "llama.cpp skipped"))
    t = Table(title=title)
    for c in ("system", "decode tok/s", "x hf-f32 [95% CI]", "x ygg-f32 [95% CI]", "weight MB",
              "limit tok/s", "% limit", "AAL", "= plain", "note"):
        t.add_column(c, justify="left" if c in ("system", "note") else "right")
    for r in table:
        def ci(key):
            return "-" if r[key] is None else f"{r[key]:.2f} [{r[key + '_lo']:.2f}, {r[key + '_hi']:.2f}]"

        t.add_row(r["system"], _f(r["decode_tok_s"], ".1f"), ci("x_hf_float32"), ci("x_ygg_float32"),
                  _f(r["weight_bytes"] and r["weight_bytes"] / 1e6, ".1f"), _f(r["limit_tok_s"], ".1f"),
                  _f(r["limit_fraction"] and 100 * r["limit_fraction"], ".0f"), _f(r["aal"], ".2f"),
                  "-" if r["compared"] is None else f"{r['identical_to_plain']}/{r['compared']}", r["note"])
    Console(width=None if sys.stdout.isatty() else 220).print(t)
    by_set = {st: {r["system"]: r["decode_tok_s"] for r in table_rows(sel, systems, bw["probe_gbps"])}
              for st, sel in by_prompt_set(rows)}
    return {
        "command": "bench_formats", "model": args.model, "formats": args.formats, "quant_dtype": args.quant_dtype,
        "drafter": args.drafter, "spec_tree": args.spec_tree, "mode": args.mode, "prompts": [r["id"] for r in rows],
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": threads,
        "bandwidth": bw, "allocator": running(), "torch": torch_version, "machine": platform.machine(), "wall_s": round(wall_s, 1),
        "llama_cpp": llama.info if llama else None,
        "systems": {s.name: {"kind": s.kind, "format": s.fmt, "dtype": s.dtype, "build_s": round(s.build_s, 2),
                             "warmup_s": round(s.warmup_s, 2), "refused": s.refused,
                             **{k: v for k, v in s.info.items() if k != "tokenizer"}} for s in systems},
        "table": table, "decode_tok_s_by_set": by_set,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main(argv=None) -> int:
    if argv is None:  # the command line: time what `yggtree run` runs, on this machine's allocator
        ensure_script()
    return run_reporting("bench_formats", run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
