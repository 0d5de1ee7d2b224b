#!/usr/bin/env python
"""Execution plans against each other (issue 21, the O4 ablation): one run, one engine, the same prompts.

Systems, all on ONE engine built from the plan (its compiled packages, its cache envelope),
greedy, every system on a prompt before the next prompt (the order rotating per prompt so the
drift of a shared machine hits all alike), one untimed warm-up generate per system first:

- ``plain@T``:       plain decoding (every step D = 0) with T intra-op threads, for every T in
  ``--threads`` (the real alternative to giving the cores to speculation);
- ``sequential@T``:  the plan's latency objective choosing trees (without a profile and
  calibration: the plan's largest tree every step), stages in sequence, T threads;
- the searched plan: the choice of ``yggtree compile``'s plan search (the manifest's
  ``stage_plan``; computed here from the plan's profile when the manifest has none);
- the best plan at each thread split by the search's prediction (``ahead@2``, ``overlap@1+1``...);
- any other plan labels in ``--stages``.

Per prompt set and system: decode tokens/s (prefill excluded), AAL, the overlap worker's hit rate,
per-stage ms per step, greedy outputs identical to plain, and the search's predicted step latency
(at the shapes the objective chose, step by step) against the measured one. Ratios of decode speed
with a 95% bootstrap interval over prompts (``yggtree.bench.paired_ratio``): every system against
plain at the fewest threads, the searched plan against sequential at each T. A table, then ONE
JSON line.

    python scripts/bench_stages.py --plan compile/NAME/plan.yaml --prompts-mtbench 40 \\
        --prompts-humaneval 40 --max-new-tokens 128 --threads 1,2

``--synthetic N`` decodes N prompts of token ids instead of MT-Bench and HumanEval (a smoke test
of the script on a tiny model; not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from yggtree.bench import paired_ratio
from yggtree.errors import YggError, run_reporting


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True)
    p.add_argument("--prompts-mtbench", type=int, default=10)
    p.add_argument("--prompts-humaneval", type=int, default=10)
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="N prompts of token ids instead of the evaluation sets (smoke tests)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts of plain and sequential")
    p.add_argument("--stages", default="", help="comma-separated extra plan labels (ahead@2, overlap@1+1)")
    p.add_argument("--policy", choices=("objective", "fixed"), default="objective",
                   help="who chooses the trees: the plan's latency objective (the ablation) or the "
                   "plan's largest tree every step (smoke tests: a tiny model's objective may never speculate)")
    p.add_argument("--compile-missing", action="store_true")
    p.add_argument("--artifacts", metavar="DIR",
                   help="load the compiled packages in DIR without the staleness check of the "
                   "plan's manifest (the caller vouches that they were built from the same graphs)")
    p.add_argument("--out", help="also write the JSON line to this file (and every prompt's record to "
                   "OUT.rows.jsonl as it runs)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- pure helpers


def best_per_split(found: dict | None) -> dict[str, str]:
    """The plan with the lowest mean predicted step latency at each thread split of a search."""
    best: dict[str, str] = {}
    for label, ms in (found or {}).get("mean_ms", {}).items():
        split = label.partition("@")[2]
        if split not in best or ms < found["mean_ms"][best[split]]:
            best[split] = label
    return best


def system_labels(threads: list[int], found: dict | None, extra: list[str]) -> dict[str, tuple[str, bool]]:
    """System name -> (the plan label it runs, whether it decodes plainly)."""
    out = {f"plain@{t}": (f"sequential@{t}", True) for t in threads}
    labels = [f"sequential@{t}" for t in threads]
    labels += [found["chosen"]] if found else []
    labels += list(best_per_split(found).values()) + [x for x in extra if x]
    for lab in labels:
        out.setdefault(lab, (lab, False))
    return out


def step_accuracy(steps: list[tuple], label: str, forms: dict | None, other_ms, hit, feeds_leaves: bool) -> dict | None:
    """The search's predicted step latency at the shapes run, against the measured one (ms, means
    over speculation steps); None when the profile has no data for ``label``."""
    from yggtree.offline.plan_search import candidates, predict_ms

    if not steps or label not in candidates(forms):
        return None
    covered = [s for s in steps if covers(forms, label, s[:3])]
    if not covered:
        return {"steps": 0, "not_covered": len(steps)}
    pred = [predict_ms(label, forms, s[:3], other_ms(s[:3]), hit(s[:3]), feeds_leaves) for s in covered]
    meas = sum(s[3] for s in covered) / len(covered)
    mean = sum(pred) / len(pred)
    return {"steps": len(covered), "not_covered": len(steps) - len(covered), "predicted_ms": round(mean, 3),
            "measured_ms": round(meas, 3), "error": round((mean - meas) / meas, 4) if meas else None}


def covers(forms: dict, label: str, shape: tuple[int, int, int]) -> bool:
    """Whether the stage forms timed ``shape``'s widths for ``label`` (they time the plan's verify
    and draft widths; a step the objective pruned to W_v = 1 is not among them)."""
    from yggtree.runtime.schedule import split_name

    _, t, _ = split_name(label)
    seq = forms["splits"].get(str(t), {})
    return str(shape[2]) in seq.get("verify_ms", {}) and str(shape[1]) in seq.get("draft_ms", {})


# ----------------------------------------------------------------------------- the run


def run(args) -> int:
    from dataclasses import replace

    from yggtree.compiled import artifact_dir
    from yggtree.offline.compile import prepare_run
    from yggtree.offline.plan_search import hit_rate, search_plan
    from yggtree.plan import load_plan
    from yggtree.runtime.artifacts import read_manifest
    from yggtree.runtime.build import build_plan_engine, fixed_policy
    from yggtree.runtime.calibration import Calibration
    from yggtree.runtime.cost import CostModel
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.objective import plan_policy
    from yggtree.runtime.policy import FixedPolicy, StepChoice
    from yggtree.runtime.prepare import drafter_feeds_leaves

    threads = [int(t) for t in args.threads.split(",")]
    if args.out and os.path.exists(args.out + ".rows.jsonl"):
        raise YggError(f"{args.out}.rows.jsonl already exists: move it away or choose another --out")
    if args.artifacts:
        plan, art = load_plan(args.plan), args.artifacts
    else:
        plan = prepare_run(args.plan, args.compile_missing)
        art = artifact_dir(plan)
    found = (read_manifest(art) or {}).get("stage_plan") if art else None
    found = found or search_plan(plan)
    names = system_labels(threads, found, args.stages.split(","))
    engine, tok = build_plan_engine(plan, art if plan.backend != "eager" else None,
                                    stages=f"sequential@{threads[0]}")
    objective = (plan_policy(plan) if args.policy == "objective" else None) or fixed_policy(engine, plan)
    for label, _ in names.values():  # every plan's drafter widths built before anything is timed
        engine.use_plan(label)
    plain = FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1)
    prompts = load(args, tok, engine.target.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    policies = {}
    for name, (label, is_plain) in names.items():  # untimed warm-up; learning starts afresh
        pol = plain if is_plain else objective
        engine.use_plan(label)
        engine.generate(prompts[0][1], SamplingParams(max_new_tokens=16), policy=pol)
        policies[name] = pol.fresh() if hasattr(pol, "fresh") else pol
    order = list(names)
    rows = []
    t_start = time.perf_counter()
    for i, (pid, ids) in enumerate(prompts):
        row = {"id": pid}
        for name in order[i % len(order):] + order[: i % len(order)]:
            steps: list[tuple] = []

            def on_step(r, steps=steps):
                if r.choice.draft_depth > 0:
                    steps.append((r.choice.draft_depth, r.choice.draft_width, r.verify_width,
                                  sum(v for k, v in r.stage_ms.items() if k != "resync")))

            engine.use_plan(names[name][0])
            res = engine.generate(ids, params, policy=policies[name], on_step=None if names[name][1] else on_step)
            s = res.stats
            row[name] = {
                "new_tokens": s["new_tokens"], "decode_s": (s["total_ms"] - s["ttft_ms"]) / 1e3,
                "verify_calls": s["verify_calls"], "aal": s.get("aal", 1.0),
                "stage_ms": s.get("stage_ms", {}), "tokens": res.token_ids,
                "speculation": s.get("speculation"), "steps": steps,
            }
        rows.append(row)
        if args.out:  # every prompt's record as it is measured: a crash later keeps the run
            with open(args.out + ".rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"[{i + 1}/{len(prompts)}] {pid} " + " ".join(
            f"{n} {(row[n]['new_tokens'] - 1) / row[n]['decode_s']:.1f}" for n in order), flush=True)
    forms, other_ms, hit, leaves = None, (lambda s: 0.0), (lambda s: 0.0), drafter_feeds_leaves(plan)
    if plan.profile is not None:
        prof = json.loads(open(plan.profile).read())
        forms = prof.get("stage_forms")
        cost = replace(CostModel.from_profile_dict(prof), feeds_leaves=leaves)
        other_ms = lambda s: cost.overhead_ms(*s)  # noqa: E731
        if plan.calibration:
            calib = Calibration.load(plan.calibration, plan)
            hit = lambda s: hit_rate(calib.aal, calib.verify_widths, *s)  # noqa: E731
    out = summarise(rows, names, threads, found, args, time.perf_counter() - t_start,
                    lambda n, steps: step_accuracy(steps, names[n][0], forms, other_ms, hit, leaves))
    out["plan"] = plan.name
    line = json.dumps(out)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


def load(args, tok, vocab: int) -> list[tuple[str, list[int]]]:
    if args.synthetic:
        return [(f"synthetic/{i}", [(7 * i + 5 * j) % (vocab - 3) + 3 for j in range(12 + 3 * i)])
                for i in range(args.synthetic)]
    from yggtree.data import load_prompts

    return load_prompts(args.prompts_mtbench, args.prompts_humaneval, tok)


def summarise(rows, names, threads, found, args, wall_s: float, accuracy) -> dict:
    """Per prompt set: every system's speed, AAL, hit rate, stage times, equality with plain and
    prediction accuracy; ratios with bootstrap intervals; printed as a table."""
    order = list(names)
    base = f"plain@{min(threads)}"
    out = {"max_new_tokens": args.max_new_tokens, "prompts": len(rows), "wall_s": round(wall_s, 1),
           "searched": found["chosen"] if found else None, "best_per_split": best_per_split(found),
           "predicted_mean_ms": found["mean_ms"] if found else None, "sets": {}}
    for set_name in ("all", "mtbench", "humaneval"):
        sel = [r for r in rows if set_name == "all" or r["id"].startswith(set_name)]
        if not sel:
            continue
        res = {}
        for n in order:
            tokens = sum(r[n]["new_tokens"] - 1 for r in sel)
            secs = sum(r[n]["decode_s"] for r in sel)
            steps = sum(r[n]["verify_calls"] for r in sel)
            stage: dict = {}
            for r in sel:
                for k, v in r[n]["stage_ms"].items():
                    stage[k] = stage.get(k, 0.0) + v
            spec = [r[n]["speculation"] for r in sel if r[n]["speculation"]]
            tried = sum(s["steps"] for s in spec)
            res[n] = {
                "plan": names[n][0],
                "decode_tok_s": round(tokens / secs, 2),
                "identical_to_plain": sum(r[n]["tokens"] == r[base]["tokens"] for r in sel),
                "aal": round(sum(r[n]["aal"] * r[n]["verify_calls"] for r in sel) / max(steps, 1), 3),
                "hit_rate": round(sum(s["hits"] for s in spec) / tried, 3) if tried else None,
                "stage_ms_per_step": {k: round(v / max(steps, 1), 3) for k, v in stage.items() if v},
                "step_latency": None if names[n][1] else accuracy(n, [s for r in sel for s in r[n]["steps"]]),
            }
        ratios = [paired_ratio(sel, n, base) for n in order if n != base]
        if found:
            ratios += [paired_ratio(sel, found["chosen"], f"sequential@{t}") for t in threads
                       if found["chosen"] != f"sequential@{t}"]
        spec_names = [n for n in order if not names[n][1]]
        fastest = max(spec_names, key=lambda n: res[n]["decode_tok_s"]) if spec_names else None
        errs = [abs(v["step_latency"]["error"]) for v in res.values()
                if v["step_latency"] and v["step_latency"]["error"] is not None]
        out["sets"][set_name] = {"systems": res, "ratios": ratios, "fastest_measured": fastest,
                                 "mean_abs_prediction_error": round(sum(errs) / len(errs), 4) if errs else None}
        print(f"\n{set_name} ({len(sel)} prompts x {args.max_new_tokens} tokens)")
        for n, v in res.items():
            acc = v["step_latency"]
            pm = f"  step pred {acc['predicted_ms']:.1f} / meas {acc['measured_ms']:.1f} ms" if acc else ""
            hr = f"  hits {v['hit_rate']:.2f}" if v["hit_rate"] is not None else ""
            print(f"  {n:<16} {v['decode_tok_s']:7.2f} tok/s  aal {v['aal']:.2f}  identical "
                  f"{v['identical_to_plain']}/{len(sel)}{hr}{pm}")
        for r in ratios:
            print(f"  {r['a']} / {r['b']}: {r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
        print(f"  fastest measured: {fastest}; searched: {out['searched']}")
    return out


def main(argv=None) -> int:
    from yggtree.runtime.allocator import ensure_script

    if argv is None:  # the command line: time what `yggtree run` runs, on this machine's allocator
        ensure_script()
    return run_reporting("bench_stages", run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
