#!/usr/bin/env python
"""Exact-equivalence check of yggtree against transformers, greedy, on the same weights.

For each prompt (the first MT-Bench first turns, then the first HumanEval prompts, chat template applied):

- ``hf``: transformers ``generate(do_sample=False, max_new_tokens=N)``, the reference tokens;
- ``logits``: yggtree's prefill logits at the last prompt position (``steps.prefill_chunk`` chunk
  by chunk, as the engine prefills, on an eager copy) vs transformers' logits from one causal forward:
  ``torch.allclose(rtol, atol)`` and the max abs difference;
- ``ygg-<mode>``: plain greedy decoding with the engine in each ``--modes`` mode, compared with hf;
- ``spec-<W_d,D,W_v,k>-<mode>``: tree speculation with the ``--drafter`` (``self``: the target
  drafting for itself) for each ``--spec``, compared with hf and with plain yggtree in the same mode.

A token cell reads ``ok`` or ``@i`` (first differing position; ``len`` if one sequence is a prefix of the
other). Output: a table (one row per prompt), a summary table, then one JSON line. Exit code 1 if any
token sequence differs or any logits comparison fails, 2 on a usage error, 0 otherwise. Defaults are the full check
(10 + 10 prompts, 128 new tokens, float32, both modes); ``--offset-*`` and ``--prompts-*`` select a
slice so a long job can be split into parts and resumed.

    python scripts/check_equivalence.py --prompts-mtbench 10 --prompts-humaneval 10 \\
        --spec 4,4,16,4 --out runs/equivalence.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from yggtree.errors import YggError, run_reporting
from yggtree.shapes import parse_tree

MODES = ("reference", "performance")


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def select_prompts(args, tokenizer) -> list[tuple[str, list[int]]]:
    from yggtree.data import humaneval_prompts, mtbench_first_turns
    from yggtree.runtime.loading import encode_prompt

    for name in ("prompts_mtbench", "prompts_humaneval", "offset_mtbench", "offset_humaneval"):
        if getattr(args, name) < 0:
            raise YggError(f"--{name.replace('_', '-')} must be >= 0")
    picked = []
    if args.prompts_mtbench:
        picked += mtbench_first_turns(args.offset_mtbench + args.prompts_mtbench)[args.offset_mtbench :]
    if args.prompts_humaneval:
        picked += humaneval_prompts(args.offset_humaneval + args.prompts_humaneval)[args.offset_humaneval :]
    if not picked:
        raise YggError("no prompts selected")
    return [(p.id, encode_prompt(tokenizer, p.text)) for p in picked]


def run_engine(engine, prompts, max_new_tokens: int, progress, label: str) -> list[dict]:
    from yggtree.runtime.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    task = progress.add_task(label, total=len(prompts))
    out = []
    for _pid, ids in prompts:
        res = engine.generate(ids, params)
        out.append({"tokens": res.token_ids, "aal": res.stats.get("aal"), "finish": res.finish_reason})
        progress.advance(task)
    return out


def check(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from yggtree.bench import hf_generate, hf_prompt_logits, load_hf_model, ygg_prompt_logits
    from yggtree.progress import stderr_progress
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.loading import load_model, load_tokenizer, resolve_model

    if args.max_new_tokens < 1:
        raise YggError(f"max-new-tokens must be >= 1, got {args.max_new_tokens}")
    specs = [(s, parse_tree(s, "--spec")) for s in args.spec]
    src = resolve_model(args.model)
    tokenizer = load_tokenizer(src)
    prompts = select_prompts(args, tokenizer)
    t_start = time.perf_counter()

    with stderr_progress() as progress:
        status = progress.add_task("loading yggtree and transformers weights", total=None)
        model = load_model(src, args.dtype)  # eager, for the prompt logits
        eos = tuple(model.cfg.eos_token_ids)
        hf = load_hf_model(src, args.dtype)
        progress.update(status, visible=False)

        task = progress.add_task("transformers generate + prompt logits", total=len(prompts))
        hf_tokens, logit_diffs, logit_ok = [], [], []
        chunk = EngineSpec().prefill_chunk
        n_slots = args.max_context + 2  # as the plain engine allocates: context + 1 reserve + scratch
        for _pid, ids in prompts:
            hf_tokens.append(hf_generate(hf, ids, args.max_new_tokens, eos))
            ref = hf_prompt_logits(hf, ids)
            ours = ygg_prompt_logits(model, ids, chunk, n_slots)
            logit_diffs.append(float((ours - ref).abs().max()))
            logit_ok.append(bool(torch.allclose(ours, ref, rtol=args.rtol, atol=args.atol)))
            progress.advance(task)
        del hf

        systems: dict[str, list[dict]] = {}
        baseline_of: dict[str, str] = {}  # speculative system -> the plain system it must equal
        compile_s: dict[str, float] = {}
        # every engine as `yggtree run` builds it (oneDNN-packed weights on a CPU)
        spec = EngineSpec(model=args.model, dtype=args.dtype, max_context=args.max_context)
        for mode in args.modes:
            name = f"ygg-{mode}"
            progress.update(status, visible=True, description=f"building {name} engine")
            engine, _ = build_engine(replace(spec, mode=mode))
            compile_s[name] = engine.compile_s
            progress.update(status, visible=False)
            systems[name] = run_engine(engine, prompts, args.max_new_tokens, progress, name)
            del engine
            for text, tp in specs:
                sname = f"spec-{text}-{mode}"
                progress.update(status, visible=True, description=f"building {sname} engine")
                engine, _ = build_engine(replace(spec, mode=mode, drafter=args.drafter, tree=tp))
                compile_s[sname] = engine.compile_s
                progress.update(status, visible=False)
                systems[sname] = run_engine(engine, prompts, args.max_new_tokens, progress, sname)
                baseline_of[sname] = name
                del engine

    # ------------------------------------------------------------------ compare and report
    per_prompt = []
    for i, (pid, ids) in enumerate(prompts):
        rec = {
            "prompt_id": pid,
            "prompt_tokens": len(ids),
            "hf_new_tokens": len(hf_tokens[i]),
            "logits_max_abs_diff": logit_diffs[i],
            "logits_allclose": logit_ok[i],
            "systems": {},
        }
        for name, results in systems.items():
            r = results[i]
            entry = {"new_tokens": len(r["tokens"]), "diff_vs_hf": first_diff(r["tokens"], hf_tokens[i])}
            if name in baseline_of:
                entry["diff_vs_plain"] = first_diff(r["tokens"], systems[baseline_of[name]][i]["tokens"])
                entry["aal"] = r["aal"]
            rec["systems"][name] = entry
        per_prompt.append(rec)

    def cell(d: int | None) -> str:
        return "ok" if d is None else f"@{d}"

    failures = sum(not ok for ok in logit_ok)
    summary_rows = []
    for name in systems:
        vs_hf = [r["systems"][name]["diff_vs_hf"] is None for r in per_prompt]
        row = {"system": name, "identical_vs_hf": sum(vs_hf), "total": len(vs_hf), "compile_s": compile_s[name]}
        failures += len(vs_hf) - sum(vs_hf)
        if name in baseline_of:
            vs_plain = [r["systems"][name]["diff_vs_plain"] is None for r in per_prompt]
            row["identical_vs_plain"] = sum(vs_plain)
            aals = [r["systems"][name]["aal"] for r in per_prompt if r["systems"][name]["aal"] is not None]
            row["mean_aal"] = sum(aals) / len(aals) if aals else None
            failures += len(vs_plain) - sum(vs_plain)
        summary_rows.append(row)

    summary = {
        "check": "equivalence",
        "model": str(src.path),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "max_context": args.max_context,
        "modes": list(args.modes),
        "specs": [s for s, _ in specs],
        "drafter": args.drafter,
        "rtol": args.rtol,
        "atol": args.atol,
        "prompts": [pid for pid, _ in prompts],
        "logits_allclose": sum(logit_ok),
        "logits_max_abs_diff": max(logit_diffs),
        "systems": summary_rows,
        "failures": failures,
        "passed": failures == 0,
        "wall_s": time.perf_counter() - t_start,
    }
    if args.out:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({**summary, "per_prompt": per_prompt}, indent=2))
        except OSError as e:
            raise YggError(f"cannot write {args.out}: {e}") from None

    if not args.json:
        console = Console(width=None if sys.stdout.isatty() else 160)
        table = Table(title=f"greedy equivalence vs transformers generate, {args.dtype}, {args.max_new_tokens} new tokens")
        for col in ("prompt", "n prompt", "hf new", "logits max|d|", "allclose", *systems):
            table.add_column(col, no_wrap=True)
        for r in per_prompt:
            cells = []
            for name in systems:
                e = r["systems"][name]
                c = cell(e["diff_vs_hf"])
                if name in baseline_of:
                    c += f" (plain {cell(e['diff_vs_plain'])}, aal {e['aal']:.2f})"
                cells.append(c)
            table.add_row(
                r["prompt_id"],
                str(r["prompt_tokens"]),
                str(r["hf_new_tokens"]),
                f"{r['logits_max_abs_diff']:.2e}",
                "yes" if r["logits_allclose"] else "NO",
                *cells,
            )
        console.print(table)
        st = Table(title="summary")
        for col in ("system", "identical vs hf", "identical vs plain", "mean aal", "compile s"):
            st.add_column(col, no_wrap=True)
        st.add_row("prefill logits", f"{sum(logit_ok)}/{len(logit_ok)} allclose", "-", "-", "-")
        for row in summary_rows:
            st.add_row(
                row["system"],
                f"{row['identical_vs_hf']}/{row['total']}",
                f"{row['identical_vs_plain']}/{row['total']}" if "identical_vs_plain" in row else "-",
                f"{row['mean_aal']:.2f}" if row.get("mean_aal") is not None else "-",
                f"{row['compile_s']:.1f}",
            )
        console.print(st)
        console.print("PASS" if failures == 0 else f"FAIL: {failures} mismatches")
    print(json.dumps(summary), flush=True)
    return 0 if failures == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default', a HF directory or a .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts-mtbench", type=int, default=10, metavar="N")
    p.add_argument("--prompts-humaneval", type=int, default=10, metavar="M")
    p.add_argument("--offset-mtbench", type=int, default=0, help="skip the first K MT-Bench prompts")
    p.add_argument("--offset-humaneval", type=int, default=0, help="skip the first K HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument(
        "--spec", action="extend", nargs="+", default=[], metavar="W_d,D,W_v,k",
        help="also check tree speculation with these tree parameters (several allowed)",
    )
    p.add_argument(
        "--drafter",
        default="self",
        help="as yggtree run --drafter: self (the target drafts for itself) | default (the shipped "
        "EAGLE head) | an EAGLE head directory | a standalone LM drafter (HF directory or .gguf)",
    )
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--out", metavar="FILE", help="also write the full results (per prompt) as JSON")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    return run_reporting("check_equivalence", check, args, 2)


if __name__ == "__main__":
    sys.exit(main())
