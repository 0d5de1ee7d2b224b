#!/usr/bin/env python
"""Execution plans against each other (issue 21): one run, one engine, the same prompts.

Systems, all on ONE engine built from the plan (its compiled packages, its cache envelope),
greedy, every system on a prompt before the next prompt (the order rotating per prompt so the
drift of a shared machine hits all alike), one untimed warm-up generate per system first:

- ``plain@T``:       plain decoding (every step D = 0) with T intra-op threads, for every T in
  ``--threads`` (the real alternative to giving the cores to speculation);
- ``sequential@T``:  the plan's latency objective choosing trees (without a profile and
  calibration: the plan's largest tree every step), stages in sequence;
- ``ahead@T``:       the same objective, ahead-of-time tail and head draft (runtime/schedule.py).

Per prompt set and system: decode tokens/s (prefill excluded), AAL, per-stage ms per step, and
greedy outputs identical to plain; ratios of decode speed with a 95% bootstrap interval over
prompts (``yggtree.bench.paired_ratio``). A table, then ONE JSON line.

    python scripts/bench_stages.py --plan compile/NAME/plan.yaml --prompts-mtbench 40 \\
        --prompts-humaneval 40 --max-new-tokens 128 --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import time

from yggtree.bench import paired_ratio
from yggtree.errors import run_reporting


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True)
    p.add_argument("--prompts-mtbench", type=int, default=10)
    p.add_argument("--prompts-humaneval", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--stages", default="sequential,ahead", help="comma-separated execution plans")
    p.add_argument("--compile-missing", action="store_true")
    p.add_argument("--artifacts", metavar="DIR",
                   help="load the compiled packages in DIR without the staleness check of the "
                   "plan's manifest (the caller vouches that they were built from the same graphs)")
    p.add_argument("--out", help="also write the JSON line to this file")
    return p.parse_args(argv)


def run(args) -> int:
    from yggtree.data import load_prompts
    from yggtree.offline.compile import prepare_run
    from yggtree.plan import artifact_dir
    from yggtree.runtime.build import build_plan_engine, fixed_policy
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.objective import plan_policy
    from yggtree.runtime.policy import FixedPolicy, StepChoice

    threads = [int(t) for t in args.threads.split(",")]
    plans = args.stages.split(",")
    if args.artifacts:
        from yggtree.plan import load_plan

        plan, art = load_plan(args.plan), args.artifacts
    else:
        plan = prepare_run(args.plan, args.compile_missing)
        art = artifact_dir(plan) if plan.backend != "eager" else None
    engine, tok = build_plan_engine(plan, art, stages=plans[0])
    # the plan's latency objective chooses the trees; without a profile and calibration, the
    # plan's largest fixed tree every step
    objective = plan_policy(plan) or fixed_policy(engine, plan)
    for stages in plans[1:]:  # every plan's drafter widths built before anything is timed
        engine.use_plan(stages)
    plain = FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1)
    systems = {f"plain@{t}": ("sequential", t, plain) for t in threads}
    for stages in plans:
        for t in threads:
            systems[f"{stages}@{t}"] = (stages, t, objective)
    prompts = load_prompts(args.prompts_mtbench, args.prompts_humaneval, tok)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    policies = {}
    for name, (stages, t, pol) in systems.items():  # untimed warm-up; learning starts afresh
        engine.use_plan(stages, t)
        engine.generate(prompts[0][1], SamplingParams(max_new_tokens=16), policy=pol)
        policies[name] = pol.fresh() if hasattr(pol, "fresh") else pol
    names = list(systems)
    rows = []
    t_start = time.perf_counter()
    for i, (pid, ids) in enumerate(prompts):
        row = {"id": pid}
        for name in names[i % len(names):] + names[: i % len(names)]:
            stages, t, _ = systems[name]
            engine.use_plan(stages, t)
            res = engine.generate(ids, params, policy=policies[name])
            s = res.stats
            row[name] = {
                "new_tokens": s["new_tokens"], "decode_s": (s["total_ms"] - s["ttft_ms"]) / 1e3,
                "verify_calls": s["verify_calls"], "aal": s.get("aal", 1.0),
                "stage_ms": s.get("stage_ms", {}), "tokens": res.token_ids,
            }
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {pid} " + " ".join(
            f"{n} {(row[n]['new_tokens'] - 1) / row[n]['decode_s']:.1f}" for n in names), flush=True)
    out = {"plan": plan.name, "max_new_tokens": args.max_new_tokens, "prompts": len(rows),
           "wall_s": round(time.perf_counter() - t_start, 1), "sets": {}}
    base = f"plain@{min(threads)}"
    for set_name in ("all", "mtbench", "humaneval"):
        sel = [r for r in rows if set_name == "all" or r["id"].startswith(set_name)]
        if not sel:
            continue
        res = {}
        for n in names:
            tokens = sum(r[n]["new_tokens"] - 1 for r in sel)
            secs = sum(r[n]["decode_s"] for r in sel)
            steps = sum(r[n]["verify_calls"] for r in sel)
            stage = {}
            for r in sel:
                for k, v in r[n]["stage_ms"].items():
                    stage[k] = stage.get(k, 0.0) + v
            res[n] = {
                "decode_tok_s": round(tokens / secs, 2),
                "identical_to_plain": sum(r[n]["tokens"] == r[base]["tokens"] for r in sel),
                "aal": round(sum(r[n]["aal"] * r[n]["verify_calls"] for r in sel) / max(steps, 1), 3),
                "stage_ms_per_step": {k: round(v / max(steps, 1), 3) for k, v in stage.items() if v},
            }
        ratios = [paired_ratio(sel, n, base) for n in names if n != base]
        ratios += [paired_ratio(sel, f"ahead@{t}", f"sequential@{t}") for t in threads
                   if "ahead" in plans and "sequential" in plans]
        out["sets"][set_name] = {"systems": res, "ratios": ratios}
        print(f"\n{set_name} ({len(sel)} prompts x {args.max_new_tokens} tokens)")
        for n, v in res.items():
            print(f"  {n:<16} {v['decode_tok_s']:7.2f} tok/s  aal {v['aal']:.2f}  identical "
                  f"{v['identical_to_plain']}/{len(sel)}  {v['stage_ms_per_step']}")
        for r in ratios:
            print(f"  {r['a']} / {r['b']}: {r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
    line = json.dumps(out)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


def main(argv=None) -> int:
    return run_reporting("bench_stages", run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
