#!/usr/bin/env python
"""Whole plans against each other (issue #25): one run, the same prompts, one engine per system.

Systems, each its own engine built through the library's engine-building path
(``yggtree.runtime.build``), greedy:

- ``plain``: plain decoding, as ``yggtree run --no-speculate`` builds it (the base plan's target,
  dtype, context and prefill chunk; float weights; the process's intra-op threads); the
  baseline of every ratio;
- ``quick``: what ``yggtree run --prompt ...`` runs on a machine without a tuned plan: the
  default plan in ``--dtype`` with the shipped calibration and the quick latency profile from
  the user cache (``~/.cache/yggtree``), measured first when missing
  (``yggtree.quickstart.default_quick_start`` then ``QuickStart.engine``, the functions
  ``yggtree run`` calls); ``--quick-plan``/``--quick-calibration`` swap in another base plan
  (a tiny model in the tests) through ``quickstart.quick_start``;
- one system per ``--plan PATH`` (a compiled plan such as a tuned ``profiles/NAME.yaml``), run as
  ``yggtree run --plan PATH`` runs it with no other flag: its compiled packages, stage plan and
  thread split, weight format, lookup nodes and latency objective (with its depth predictor if it
  names one; the plan's largest tree every step if it names no profile and calibration).

Every plan must decode the base plan's target in its dtype (else "identical to plain" would mean
nothing). Prompts (MT-Bench first turns and HumanEval with the chat template, the two sets
alternating so that a stopped run covers both) run one at a time, every system on a prompt before
the next, the order of the systems rotating per prompt, after one untimed warm-up generate per
system (a learning policy then starts afresh). Per prompt and system a row records decode_s
(prefill excluded), new_tokens, tokens, steps, AAL, the stage plan and the threads the engine
used; with ``--out OUT`` rows are appended to ``OUT.rows.jsonl`` as they finish and ``--resume``
continues such a file. Start-up (engine build or package load, the quick profile when it had to be
measured, the warm-up generate) is reported per system apart from decoding. Then a table per prompt
set and for all: decode tok/s, speed over plain with a 95% bootstrap interval over prompts
(``yggtree.bench.paired_ratio``), AAL, greedy outputs identical to plain; then ONE JSON line.

    OMP_NUM_THREADS=1 python scripts/bench_plans.py --plan profiles/NAME.yaml \\
        --prompts-mtbench 40 --prompts-humaneval 40 --max-new-tokens 128 --threads 1 \\
        --out runs/plans/plans.json

``--synthetic N`` decodes N prompts of token ids instead (a smoke test on a tiny model; not a
measurement). Bad input (a missing plan, a profile of another device, threads above the cores, a
plan of another target) is one line naming the problem and exit status 1, before anything loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from yggtree.bench import by_prompt_set, decode_totals, paired_ratio
from yggtree.errors import YggError, run_reporting

WARMUP_TOKENS = 32  # new tokens of each system's untimed warm-up generate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="append", default=[], metavar="PATH",
                   help="a compiled plan to bench as its own system (repeatable)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the default plan's dtype for plain and quick (as yggtree run --dtype)")
    p.add_argument("--quick-plan", metavar="PATH",
                   help="base plan of plain and quick instead of the default plan (tests, other pairs)")
    p.add_argument("--quick-calibration", metavar="PATH",
                   help="with --quick-plan: its acceptance calibration (the shipped one otherwise)")
    p.add_argument("--prompts-mtbench", type=int, default=40)
    p.add_argument("--prompts-humaneval", type=int, default=40)
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="N prompts of token ids instead of the evaluation sets (smoke tests)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of the process (plain, quick, and plans without a split); "
                   "0: torch's setting (OMP_NUM_THREADS)")
    p.add_argument("--compile-root", default="compile", help="where the plans' compiled directories are")
    p.add_argument("--compile-missing", action="store_true", help="compile a missing or stale plan first")
    p.add_argument("--out", help="write the JSON line here, and every prompt's row to OUT.rows.jsonl as it runs")
    p.add_argument("--resume", action="store_true", help="with --out: continue OUT.rows.jsonl")
    return p.parse_args(argv)


@dataclass
class System:
    """One benched system: its engine and policy, how it was made, and its start-up times."""

    name: str
    kind: str  # plain | quick | plan
    what: str  # the plan or file it runs
    make: object = None  # () -> (engine, tokenizer, policy); called once, timed
    engine: object = None
    tok: object = None
    policy: object = None
    build_s: float = 0.0
    warmup_s: float = 0.0
    info: dict = field(default_factory=dict)
    base: object = None  # quick: the base plan (plain decodes its target)


# ----------------------------------------------------------------------------- the systems


def quick_system(args, threads: int) -> System:
    """``quick``: the quick start ``yggtree run`` takes without a tuned plan (checked, not built)."""
    from yggtree.plan import load_plan
    from yggtree.quickstart import default_quick_start, quick_start, shipped_calibration
    from yggtree.runtime.device import detect_device

    device = detect_device()
    if args.quick_plan:
        base = load_plan(args.quick_plan)
        cal = Path(args.quick_calibration) if args.quick_calibration else shipped_calibration(base)
        qs, why = quick_start(base, cal, device, threads)
    else:
        if args.quick_calibration:
            raise YggError("--quick-calibration needs --quick-plan (the default plan uses the shipped one)")
        qs, why = default_quick_start(args.dtype, device, threads)
    if qs is None:
        raise YggError(f"the quick system cannot run here (yggtree run would decode plainly): {why}")
    said: list[str] = []

    def make():
        return qs.engine(say=lambda line: (said.append(line), sys.stderr.write(f"quick: {line}\n")))

    return System("quick", "quick", f"{qs.plan.name} + quick profile {qs.profile}", make, base=qs.plan,
                  info={"profile": str(qs.profile), "profile_measured": not qs.cached(), "said": said})


def plain_system(base) -> System:
    """``plain``: the engine ``yggtree run --no-speculate`` builds for the base plan's target (the
    mode an eager plan implies, as ``EngineSpec.from_plan`` picks it)."""
    from yggtree.runtime.build import EngineSpec, build_engine

    spec = EngineSpec(model=base.target, dtype=base.dtype, max_context=base.max_context,
                      prefill_chunk=base.prefill_chunk,
                      mode="reference" if base.backend == "eager" else "performance")

    def make():
        return (*build_engine(spec), None)

    return System("plain", "plain", f"{base.target} ({base.dtype}), plain decoding", make)


def plan_system(path: str, base, args, taken: set[str]) -> System:
    """A ``--plan``: checked now (artifacts, target, profile and calibration, thread split), built
    later as ``yggtree run --plan PATH`` builds it with no other flag."""
    from yggtree.bench import plan_runner

    plan, info, make = plan_runner(path, args.compile_missing, args.compile_root)
    if (plan.target, plan.dtype) != (base.target, base.dtype):
        raise YggError(f"plan {path} decodes {plan.target} in {plan.dtype}, plain decodes {base.target} "
                       f"in {base.dtype}: compare plans of one target and dtype")
    name = plan.name if plan.name not in taken else f"{plan.name}#{len(taken)}"
    s = System(name, "plan", str(path), make)
    s.info = info
    return s


# ----------------------------------------------------------------------------- the run


def rows_path(args) -> Path | None:
    return Path(args.out + ".rows.jsonl") if args.out else None


def read_done(args, names: list[str]) -> list[dict]:
    """Rows of an earlier run of the same systems and token budget (``--resume``)."""
    path = rows_path(args)
    if path is None or not path.exists() or path.stat().st_size == 0:
        return []
    if not args.resume:
        raise YggError(f"rows file {path} exists: pass --resume to continue it, or remove it")
    try:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError) as e:
        raise YggError(f"cannot read rows file {path}: {e}") from None
    for r in rows:
        have = [k for k in r if isinstance(r[k], dict)]
        if sorted(have) != sorted(names) or r.get("max_new_tokens") != args.max_new_tokens:
            raise YggError(f"rows file {path} holds another run (systems {', '.join(have)}, "
                           f"{r.get('max_new_tokens')} tokens): use another --out")
    return rows


def load(args, tok, vocab: int) -> list[tuple[str, list[int]]]:
    if args.synthetic:
        return [(f"synthetic/{i}", [3 + (11 * i + 7 * j) % (vocab - 3) for j in range(10 + 4 * i)])
                for i in range(args.synthetic)]
    from yggtree.data import interleave, load_prompts

    return interleave(load_prompts(args.prompts_mtbench, args.prompts_humaneval, tok))


def run(args) -> int:
    import torch

    from yggtree.plan import load_plan
    from yggtree.progress import stderr_progress
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.schedule import resolve_plan

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    params.validate()
    if args.resume and not args.out:
        raise YggError("--resume needs --out (the rows file to continue)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    resolve_plan("sequential", False, threads=args.threads)  # above the cores: refused
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    for path in args.plan:  # a missing plan file before the quick start's checks
        load_plan(path)
    quick = quick_system(args, threads)
    systems = [plain_system(quick.base), quick]
    for path in args.plan:
        systems.append(plan_system(path, quick.base, args, {s.name for s in systems}))
    names = [s.name for s in systems]
    done = read_done(args, names)
    for s in systems:  # start-up: load or compile, the quick profile if missing
        t0 = time.perf_counter()
        s.engine, s.tok, s.policy = s.make()
        s.build_s = time.perf_counter() - t0
    tok = systems[0].tok
    prompts = load(args, tok, systems[0].engine.target.cfg.vocab_size)
    for s in systems:  # one untimed warm-up generate each; learning starts afresh
        t0 = time.perf_counter()
        s.engine.generate(prompts[0][1], SamplingParams(max_new_tokens=WARMUP_TOKENS), policy=s.policy)
        s.warmup_s = time.perf_counter() - t0
        if hasattr(s.policy, "fresh"):
            s.policy = s.policy.fresh()
    rows = [r for r in done if r["id"] in {pid for pid, _ in prompts}]
    seen = {r["id"] for r in rows}
    t_start = time.perf_counter()
    with stderr_progress() as progress:
        task = progress.add_task("plans bench", total=len(prompts), completed=len(seen))
        for i, (pid, ids) in enumerate(prompts):
            if pid in seen:
                continue
            row = {"id": pid, "set": pid.split("/")[0], "max_new_tokens": args.max_new_tokens}
            for s in systems[i % len(systems):] + systems[: i % len(systems)]:
                kw = {"policy": s.policy} if s.policy is not None else {}
                res = s.engine.generate(ids, params, **kw)
                st = res.stats
                row[s.name] = {
                    "decode_s": (st["total_ms"] - st["ttft_ms"]) / 1e3, "new_tokens": st["new_tokens"],
                    "tokens": res.token_ids, "steps": st["verify_calls"], "aal": st.get("aal", 1.0),
                    "plain_steps": st.get("plain_steps", st["verify_calls"]), "plan": st["plan"],
                    "threads": st["threads"], "draft_threads": st["draft_threads"],
                }
            rows.append(row)
            if args.out:
                with open(rows_path(args), "a") as f:
                    f.write(json.dumps(row) + "\n")
            progress.advance(task)
    out = report(rows, systems, args, threads, time.perf_counter() - t_start, torch.__version__)
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


# ----------------------------------------------------------------------------- the report


def summarise(rows: list[dict], names: list[str]) -> dict:
    """Per prompt set (and "all"): every system's decode speed, AAL, threads and identity with
    plain, and its speed over plain with a bootstrap interval."""
    sets = {}
    for st, sel in by_prompt_set(rows):
        res = {}
        for n in names:
            dec_n, dec_s, steps = decode_totals(sel, n)
            res[n] = {
                "decode_tok_s": round(dec_n / dec_s, 3) if dec_s else 0.0,
                "aal": round(sum(r[n]["aal"] * r[n]["steps"] for r in sel) / steps, 3) if steps else None,
                "plain_step_share": round(sum(r[n]["plain_steps"] for r in sel) / steps, 3) if steps else None,
                "threads": sorted({r[n]["threads"] for r in sel}),
                "plans": sorted({r[n]["plan"] for r in sel}),
                "identical_to_plain": sum(r[n]["tokens"] == r["plain"]["tokens"] for r in sel),
                "prompts": len(sel),
            }
            if n != "plain":
                c = paired_ratio(sel, n, "plain")
                res[n]["x_plain"] = round(c["ratio"], 4)
                res[n]["ci95"] = [round(x, 4) for x in c["ci95"]]
                res[n]["faster_share"] = round(c["a_faster_share"], 3)
        fastest = max(names, key=lambda n: res[n]["decode_tok_s"])
        sets[st] = {"systems": res, "fastest": fastest}
    return sets


def report(rows: list[dict], systems: list[System], args, threads: int, wall_s: float, torch_version: str) -> dict:
    """Start-up and decode tables; the JSON line's content."""
    from rich.console import Console
    from rich.table import Table

    names = [s.name for s in systems]
    console = Console(width=None if sys.stdout.isatty() else 200)
    start = Table(title="start-up per system (not in the decode times)")
    for c in ("system", "runs", "engine build / load s", "warm-up generate s", "note"):
        start.add_column(c, justify="right" if c.endswith(" s") else "left")
    for s in systems:
        note = ("quick profile measured now" if s.info.get("profile_measured") else
                "cached quick profile" if s.kind == "quick" else
                f"stages {s.info['stages']}, {s.info['policy']}" if s.kind == "plan" else "")
        start.add_row(s.name, s.what, f"{s.build_s:.1f}", f"{s.warmup_s:.1f}", note)
    console.print(start)
    sets = summarise(rows, names) if rows else {}
    for st, res in sets.items():
        n = len([r for r in rows if st == "all" or r["set"] == st])
        t = Table(title=f"{st}: {n} prompts x {args.max_new_tokens} tokens, greedy, one run, "
                        f"every system per prompt (fastest: {res['fastest']})")
        for c in ("system", "decode tok/s", "x plain [95% CI]", "AAL", "plain steps", "threads", "= plain"):
            t.add_column(c, justify="left" if c == "system" else "right")
        for name, v in res["systems"].items():
            ratio = (f"{v['x_plain']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]"
                     if "x_plain" in v else "1")
            t.add_row(name, f"{v['decode_tok_s']:.2f}", ratio,
                      f"{v['aal']:.2f}" if v["aal"] is not None else "-",
                      f"{100 * v['plain_step_share']:.0f}%" if v["plain_step_share"] is not None else "-",
                      ",".join(map(str, v["threads"])), f"{v['identical_to_plain']}/{n}")
        console.print(t)
    return {
        "command": "bench_plans", "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "threads": threads, "torch": torch_version, "wall_s": round(wall_s, 1),
        "systems": {s.name: {"kind": s.kind, "runs": s.what, "build_s": round(s.build_s, 2),
                             "warmup_s": round(s.warmup_s, 2),
                             **{k: v for k, v in s.info.items() if k != "said"},
                             **({"said": s.info["said"]} if s.info.get("said") else {})}
                    for s in systems},
        "sets": sets,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main(argv=None) -> int:
    from yggtree.runtime.allocator import ensure_script

    if argv is None:  # the command line: time what `yggtree run` runs, on this machine's allocator
        ensure_script()
    return run_reporting("bench_plans", run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
