#!/usr/bin/env python
"""The latency objective against fixed trees (Yggdrasil section 4.1-4.2): one run, same prompts.

Systems, all on ONE engine built from the plan (its compiled AOTInductor packages, its cache
envelope), greedy:

- ``plain``:     plain decoding (every step D = 0: the target at width 1);
- ``objective``: the plan's latency objective (its profile and calibration) choosing D and W_d
  before drafting and W_v after, every step, correcting its model from the measured steps
  (``Feedback``);
- ``offline``: the same objective on the offline profile and calibration alone (no feedback);
- ``fixed``:     the single (W_d, D, W_v) of the plan with the highest calibrated accepted length
  (chosen by accepted length alone, as a latency-blind system would; ``--fixed`` overrides);
- ``chain``:     a chain (W_d = 1) of the length the profile and calibration predict fastest
  (``--chain D,W_v`` overrides);
- ``predictor`` / ``baseline`` (when the plan names a depth predictor): the objective with D
  chosen every step by the MLP depth predictor / its scikit-learn (logistic) baseline;
- ``depth=N`` (``--depths N,M,...``): the objective with D fixed to N (W_d, W_v still chosen);
  ``depth=N+lookup`` the same with the lookup nodes merged into its trees;
- ``chain=N`` (``--chain-depths N,M,...``): chains of length N (W_d = 1, the smallest verify
  width holding N + 1 nodes), so "a chain of the best fixed length" is measured, not predicted;
- ``lookup``: lookup-only speculation (issue 22): up to ``--lookup`` continuations of the
  prompt and the text so far per step, no drafter call; the objective chooses per step between a
  plain step and a lookup tree of any verify width;
- ``objective+lookup``: the objective with the lookup nodes merged into the drafter's trees (and
  lookup-only or plain steps when those are faster);
- ``hf-lookup`` (``--hf-lookup N``): transformers' own prompt-lookup decoding
  (``generate(prompt_lookup_num_tokens=N)``, greedy, eager, the same weights): its decode time is
  the time after its first new token.

``--systems`` keeps a subset (plain always runs: it is the baseline of every ratio).

The fixed choices come from the calibration (calibration prompts), never from the evaluation
prompts. Prompts (MT-Bench first turns, HumanEval, chat template) run one at a time, every system
on a prompt before the next prompt, the order of the systems rotating per prompt so the drift of
a shared machine hits all alike (after one untimed warm-up generate per system). Per prompt set and system: decode tokens/s (prefill excluded),
measured speed-up over plain (ratio of decode ms/token), the predicted speed-up (the plain time
of the expected tokens over the predicted step times, summed over the steps actually taken) of
the offline model and, for feedback systems, of the online-corrected one (each step's
prediction is made before it runs), AAL, and greedy outputs equal to plain. A table, then ONE
JSON line.

    python scripts/bench_objective.py --plan my_plan.yaml --prompts-mtbench 40 --prompts-humaneval 40
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
import sys
import time
from pathlib import Path

import torch

from yggtree.bench import paired_ratio, summarise_systems
from yggtree.errors import YggError, run_reporting


def parse_ints(text: str | None, n: int, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        v = tuple(int(x) for x in text.split(","))
    except ValueError:
        v = ()
    if len(v) != n:
        raise YggError(f"{flag} wants {n} comma-separated integers, got {text!r}")
    return v


def fixed_by_aal(calib, plan) -> tuple[int, int, int]:
    """(W_d, D, W_v) of the plan with the highest calibrated AAL (ties: the cheaper tree)."""
    best, best_a = None, -1.0
    for wd in sorted(plan.draft_widths):
        for d in range(1, plan.d_max + 1):
            for wv in sorted(plan.verify_widths):
                a = calib.expected_aal(wd, d, wv)
                if a is not None and wv <= 1 + d * wd and a > best_a + 1e-9:
                    best, best_a = (wd, d, wv), a
    if best is None:
        raise YggError("the calibration has no AAL table for the plan's widths (re-run yggtree calibrate)")
    return best


def best_chain(cost, calib, plan, ctx: int) -> tuple[int, int]:
    """(D, W_v) of the chain (W_d = 1) with the best predicted speed-up at context ``ctx``."""
    if 1 not in plan.draft_widths:
        raise YggError(f"plan {plan.name!r} has no draft width 1: no chain to compare with")
    best, best_s = None, -1.0
    for d in range(1, plan.d_max + 1):
        for wv in plan.verify_widths:
            a = calib.expected_aal(1, d, wv)
            if a is None or wv > 1 + d:
                continue
            s = a * cost.plain_ms(ctx) / cost.step_ms(d, 1, wv, ctx)
            if s > best_s:
                best, best_s = (d, wv), s
    if best is None:
        raise YggError(f"plan {plan.name!r}: no verify width fits a chain (W_v <= 1 + D)")
    return best


def report(rows: list[dict], names: list[str], settings: dict, what: str, args, partial: bool = False) -> None:
    """The table, then ONE JSON line."""
    from rich.console import Console
    from rich.table import Table

    summary = summarise_systems(rows, names)
    table = Table(title=f"latency objective vs fixed trees: {what}, {len(rows)} prompts x "
                        f"{args.max_new_tokens} tokens, {args.threads} thread(s), one run")
    for c in ("set", "system", "W_d,D,W_v", "decode tok/s", "x plain", "predicted offline", "error",
              "predicted online", "error ", "AAL", "plain steps", "policy ms/step", "= plain"):
        table.add_column(c, justify="left" if c in ("set", "system", "W_d,D,W_v") else "right")
    for st, res in summary.items():
        n = len([r for r in rows if st == "all" or r["set"] == st])
        for name, r in res.items():
            table.add_row(st, name, settings.get(name, name), f"{r['decode_tok_s']:.2f}",
                          f"{r['measured_speedup']:.3f}", f"{r['predicted_speedup']:.3f}",
                          f"{100 * r['prediction_error']:.1f}%", f"{r['predicted_online']:.3f}",
                          f"{100 * r['online_error']:.1f}%", f"{r['aal']:.2f}",
                          f"{100 * r['plain_step_share']:.0f}%",
                          f"{r['policy_ms_per_step']:.2f}" if "policy_ms_per_step" in r else "-",
                          f"{r['same_as_plain']}/{n}")
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    comparisons = []
    for pair in getattr(args, "compare", None) or []:
        a, _, b = pair.partition(":")
        if a not in names or b not in names:
            raise YggError(f"--compare {pair}: both systems must be in the rows (have {', '.join(names)})")
        for st in sorted({r["set"] for r in rows}) + ["all"]:
            c = paired_ratio([r for r in rows if st == "all" or r["set"] == st], a, b) | {"set": st}
            comparisons.append(c)
            console.print(f"{st}: {a} / {b} decode speed {c['ratio']:.3f} (95% bootstrap over prompts "
                          f"{c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}), {a} faster on "
                          f"{100 * c['a_faster_share']:.0f}% of {c['prompts']} prompts")
    line = {
        "command": "bench_objective", "what": what, "threads": args.threads, "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens, "settings": settings, "torch": torch.__version__,
        "summary": {st: {n: {k: (round(v, 4) if isinstance(v, float) else
                                 {d: round(x, 4) for d, x in v.items()} if isinstance(v, dict) else v)
                             for k, v in r.items()} for n, r in res.items()}
                    for st, res in summary.items()},
        "comparisons": comparisons,
        "partial": partial, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(json.dumps(line), flush=True)


def summarise_rows(args) -> int:
    """--summarise: the report of one or more rows files (e.g. one per prompt set, run in
    parallel processes; each process's timings are interleaved per prompt, so ratios hold)."""
    rows = []
    for path in args.summarise:
        try:
            rows += [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        except (OSError, ValueError) as e:
            raise YggError(f"cannot read rows file {path}: {e}") from None
    if not rows:
        raise YggError("the rows files hold no prompt")
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    names = [n for n in names if all(n in r for r in rows)]
    report(rows, names, {}, "rows of " + ", ".join(Path(p).name for p in args.summarise), args)
    return 0


class _FirstToken:
    """A transformers streamer noting when the first new token arrives (its first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.calls, self.t_first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_lookup_row(hf, ids: list[int], max_new: int, n: int, eos: tuple[int, ...]) -> dict:
    """One prompt through transformers' prompt-lookup decoding: the fields summarise_systems() reads."""
    x = torch.tensor([ids], dtype=torch.int64)
    seen = _FirstToken()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=max_new, eos_token_id=list(eos) or None,
                          pad_token_id=eos[0] if eos else None, temperature=None, top_p=None, top_k=None,
                          prompt_lookup_num_tokens=n, streamer=seen)
    t1 = time.perf_counter()
    toks = out[0, len(ids):].tolist()
    return {"new_tokens": len(toks), "decode_s": t1 - (seen.t_first or t0), "steps": 0, "tokens": toks,
            "pred_plain_ms": 0.0, "pred_step_ms": 0.0, "choices": [], "n_plain_steps": 0}


def run(args) -> int:
    from yggtree.data import load_prompts
    from yggtree.progress import stderr_progress
    from yggtree.offline.compile import ensure_artifacts
    from yggtree.plan import load_plan
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.objective import plan_policy
    from yggtree.runtime.prediction import Prediction
    from yggtree.runtime.policy import FixedPolicy, StepChoice

    torch.set_num_threads(args.threads)
    if not args.plan:
        raise YggError("--plan is required (a plan naming a profile and a calibration)")
    plan = load_plan(args.plan)
    objective = plan_policy(plan)
    if objective is None:
        raise YggError(f"plan {args.plan} names no profile and calibration: there is no objective to bench")
    cost, calib = objective.cost, objective.calib
    wd, d, wv = parse_ints(args.fixed, 3, "--fixed") or fixed_by_aal(calib, plan)
    cd, cwv = parse_ints(args.chain, 2, "--chain") or best_chain(cost, calib, plan, 256)
    for name, (w1, dd, w2) in (("--fixed", (wd, d, wv)), ("--chain", (1, cd, cwv))):
        plan.tree_params(w1, w2, dd)  # refuses widths outside the compiled sets
    art = ensure_artifacts(plan, args.compile_missing, args.compile_root)
    engine, tok = build_plan_engine(plan, art)
    policies = {
        "plain": FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1),
        "objective": objective,
        "offline": objective.fresh(feedback=None),
        "fixed": FixedPolicy(StepChoice(d, wd), wv),
        "chain": FixedPolicy(StepChoice(cd, 1), cwv),
    }
    settings = {"plain": "D=0", "objective": "adaptive", "offline": "adaptive, no feedback", "fixed": f"{wd},{d},{wv}", "chain": f"1,{cd},{cwv}"}
    lookups = {}  # lookup nodes per step of each system (0 when absent)
    if args.lookup:
        if args.lookup > max(plan.verify_widths):
            raise YggError(f"--lookup {args.lookup} exceeds the plan's largest verify width {max(plan.verify_widths)}")
        policies["lookup"] = objective.fresh(d_max=0)  # plain or lookup-only steps, never the drafter
        policies["objective+lookup"] = objective.fresh()
        settings["lookup"] = f"lookup-only <= {args.lookup} nodes"
        settings["objective+lookup"] = f"adaptive + <= {args.lookup} lookup nodes"
        lookups = {"lookup": args.lookup, "objective+lookup": args.lookup}
    if plan.predictor is not None:  # the depth predictor and its scikit-learn baseline
        from yggtree.runtime.predictor import depth_fn_for, load_predictor

        h = engine.target.cfg.hidden_size
        for name, which in (("predictor", "mlp"), ("baseline", "baseline")):
            model = load_predictor(plan.predictor, plan, which, h)
            policies[name] = objective.fresh(predictor=depth_fn_for(model, cost, plan))
            settings[name] = f"objective, D by {which}"
    for dd in args.chain_depths:  # chains of other lengths than the predicted best
        w2 = min((w for w in plan.verify_widths if w >= 1 + dd), default=None)
        if w2 is None or dd > plan.d_max:
            raise YggError(f"--chain-depths: no verify width of plan {plan.name!r} holds a chain of {dd}")
        plan.tree_params(1, w2, dd)
        policies[f"chain={dd}"] = FixedPolicy(StepChoice(dd, 1), w2)
        settings[f"chain={dd}"] = f"1,{dd},{w2}"
    for dd in args.depths:  # the objective with one fixed depth
        policies[f"depth={dd}"] = objective.fresh(depth_fn=lambda h_root, c, dd=dd: dd)
        settings[f"depth={dd}"] = f"objective, D={dd}"
        if args.lookup:  # and with the lookup nodes merged into its trees, as objective+lookup's
            policies[f"depth={dd}+lookup"] = objective.fresh(depth_fn=lambda h_root, c, dd=dd: dd)
            settings[f"depth={dd}+lookup"] = f"objective, D={dd} + <= {args.lookup} lookup nodes"
            lookups[f"depth={dd}+lookup"] = args.lookup
    unknown = [n for n in args.systems if n not in policies]
    if unknown:
        raise YggError(f"--systems: unknown {', '.join(unknown)} (have {', '.join(policies)})")
    if args.systems:  # plain is every ratio's baseline; --depths asked for its own systems
        keep = {"plain", *args.systems, *(f"depth={d}" for d in args.depths),
                *(f"chain={d}" for d in args.chain_depths)}
        policies = {n: p for n, p in policies.items() if n in keep}
    prompts = load_prompts(args.prompts_mtbench, args.prompts_humaneval, tok)
    hf = None
    if args.hf_lookup:  # transformers' prompt lookup on the same weights, in the same run
        from yggtree.bench import load_hf_model
        from yggtree.runtime.loading import resolve_model

        hf = load_hf_model(resolve_model(plan.target), plan.dtype)
        settings["hf-lookup"] = f"transformers prompt_lookup_num_tokens={args.hf_lookup}"
        hf_lookup_row(hf, prompts[0][1], 8, args.hf_lookup, engine.eos_ids)  # untimed warm-up
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    names = list(policies) + (["hf-lookup"] if hf is not None else [])
    settings = {n: settings[n] for n in names}
    rows = []

    def predictions(name, recs) -> list[Prediction]:
        if hasattr(policies[name], "log"):  # an objective policy: its own predictions
            return list(policies[name].log)
        out = []
        for r in recs:  # what the cost model and calibration expected of the fixed choice
            dd, w1 = r.choice.draft_depth, r.choice.draft_width
            plain = cost.plain_ms(r.committed)
            if dd == 0:
                out.append(Prediction(r.committed, 0, 1, 1.0, plain, plain))
            else:
                a = calib.expected_aal(w1, dd, r.verify_width)
                out.append(Prediction(r.committed, dd, r.verify_width, a, cost.step_ms(dd, w1, r.verify_width, r.committed), plain))
        return out

    # one untimed warm-up generate per system: the first call of a compiled graph pages in its
    # code and weights; a policy that learns from measured steps then starts afresh
    for name, pol in list(policies.items()):
        engine.set_lookup(lookups.get(name, 0))
        engine.generate(prompts[0][1], SamplingParams(max_new_tokens=32, temperature=0.0), policy=pol)
        if hasattr(pol, "fresh"):
            policies[name] = pol.fresh()
    with stderr_progress() as progress:
        task = progress.add_task("objective bench", total=len(prompts))
        for i, (pid, ids) in enumerate(prompts):
            row = {"prompt": pid, "set": pid.split("/")[0]}
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                if name == "hf-lookup":
                    row[name] = hf_lookup_row(hf, ids, args.max_new_tokens, args.hf_lookup, engine.eos_ids)
                    continue
                recs: list = []
                if hasattr(policies[name], "log"):
                    policies[name].log.clear()
                engine.set_lookup(lookups.get(name, 0))
                res = engine.generate(ids, params, policy=policies[name], on_step=recs.append)
                preds = predictions(name, recs)
                s = res.stats
                n = len(res.token_ids)
                row[name] = {
                    "new_tokens": n, "decode_s": (s["total_ms"] - s["ttft_ms"]) / 1e3,
                    "steps": len(recs), "tokens": res.token_ids,
                    "pred_plain_ms": sum(p.aal * p.plain_ms for p in preds),
                    "pred_step_ms": sum(p.step_ms for p in preds),
                    "pred_plain_ms_online": sum(a * pl for a, _, pl in (p.terms(True) for p in preds)),
                    "pred_step_ms_online": sum(p.terms(True)[1] for p in preds),
                    "choices": sorted({(r.choice.draft_depth, r.choice.draft_width if r.choice.draft_depth else 0,
                                        r.verify_width) for r in recs}),
                    "n_plain_steps": sum(r.choice.draft_depth == 0 and r.verify_width == 1 for r in recs),
                    "depth_counts": dict(Counter(r.choice.draft_depth for r in recs)),
                    **({"stage_ms": s["stage_ms"]} if "stage_ms" in s else {}),  # the engine's per-stage sums
                    **({"accepted_by_source": s["accepted_by_source"], "lookup_steps": s["lookup_steps"]}
                       if "accepted_by_source" in s else {}),
                }
            rows.append(row)
            if args.out:  # every finished prompt is kept, so a stopped run can still be read
                with open(args.out + ".rows.jsonl", "a") as f:
                    f.write(json.dumps(row, default=list) + "\n")
            progress.advance(task)

    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "settings": settings}, default=list) + "\n")
    report(rows, names, settings, f"plan {plan.name} ({plan.dtype})", args)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", help="plan YAML naming a profile and a calibration")
    p.add_argument("--prompts-mtbench", type=int, default=40)
    p.add_argument("--prompts-humaneval", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fixed", help="W_d,D,W_v of the fixed system (default: highest calibrated AAL)")
    p.add_argument("--chain", help="D,W_v of the chain (default: best predicted chain)")
    p.add_argument("--depths", action="extend", type=lambda t: [int(x) for x in t.split(",")] if t else [], default=[],
                   help="also the objective with these fixed depths, e.g. 2,3,4")
    p.add_argument("--chain-depths", action="extend", type=lambda t: [int(x) for x in t.split(",")] if t else [], default=[],
                   help="also chains of these lengths, e.g. 1,2")
    p.add_argument("--systems", action="extend", type=lambda t: t.split(","), default=[],
                   help="only these systems (plain always runs): objective,fixed,chain,predictor,baseline,depth=N,"
                   "lookup,objective+lookup")
    p.add_argument("--hf-lookup", type=int, default=0, metavar="N",
                   help="also transformers' prompt-lookup decoding with N lookup tokens (0: not run)")
    p.add_argument("--lookup", type=int, default=8,
                   help="lookup nodes per step of the lookup and objective+lookup systems (0: no such systems)")
    p.add_argument("--compile-root", default="compile")
    p.add_argument("--compile-missing", action="store_true", help="compile a missing/stale plan first")
    p.add_argument("--out", help="also write every prompt's record as JSON (and OUT.rows.jsonl as it runs)")
    p.add_argument("--compare", action="extend", type=lambda t: t.split(","), default=[], metavar="A:B,...",
                   help="paired comparisons to report: speed of A over B with a bootstrap interval (repeatable)")
    p.add_argument("--summarise", action="extend", nargs="+", metavar="ROWS", help="only report OUT.rows.jsonl file(s) of earlier runs")
    args = p.parse_args(argv)
    return run_reporting("bench_objective", summarise_rows if args.summarise else run, args)


if __name__ == "__main__":
    sys.exit(main())
