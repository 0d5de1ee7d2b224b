#!/usr/bin/env python
"""In-process A/B of two engine settings of one compiled plan, by decoding (one run).

One engine built from the plan's compiled packages (its recorded choices applied), held-out
calibration-corpus prompts (the ones after the calibration's own; never evaluation prompts),
greedy. For every system -- plain steps, and each fixed tree ``D,W_d,W_v`` -- every prompt is
decoded with setting A and with setting B in turn (``EngineConfig`` fields, as the compile-time
choices measure them: ``yggtree.measure.paired_decode``), the order alternating by prompt and
round, over ``--rounds`` rounds after one warm-up pair. Per system: the median over the pairs of
A's decode ms per token over B's (above 1: B is faster), the pairs B won, each setting's median,
whether every output equals plain steps' under A, and each setting's median stage times per step.
Then ONE JSON line. A measurement, not a test.

    python scripts/ab_config.py PLAN.yaml --root COMPILE --a loop_balance=false --b loop_balance=true \\
        --prompts 8 --new-tokens 96 --rounds 3 --trees 3,1,4
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import fields, replace

import torch

from yggtree.errors import YggError, run_reporting


def setting(text: str) -> dict:
    """``field=value;field=value`` -> {field: value}: each value as JSON (true, 8, null, [1024, 0]),
    else as a string; a field EngineConfig lacks is an error in one line."""
    from yggtree.runtime.engine import EngineConfig

    known = {f.name for f in fields(EngineConfig)}
    out = {}
    for part in filter(None, text.split(";")):
        key, sep, value = part.partition("=")
        if not sep or key not in known:
            raise YggError(f"{part!r} is not FIELD=VALUE of an EngineConfig field ({', '.join(sorted(known))})")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
        if isinstance(out[key], list):
            out[key] = tuple(out[key])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="the plan's YAML (compiled under --root)")
    ap.add_argument("--root", default="compile", help="the compile root (default: compile)")
    ap.add_argument("--a", required=True, type=setting, help="setting A: FIELD=VALUE (several: ';'-separated)")
    ap.add_argument("--b", required=True, type=setting, help="setting B")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", nargs="*", default=[], help="fixed trees D,W_d,W_v besides plain steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from yggtree.bench import plan_runner
    from yggtree.data import calibration_chat_prompts
    from yggtree.runtime.build import fixed_policy
    from yggtree.runtime.loading import encode_prompt
    from yggtree.runtime.policy import FixedPolicy, StepChoice
    from yggtree.shapes import SamplingParams

    torch.set_num_threads(args.threads)
    plan, _info, make = plan_runner(args.plan, compile_root=args.root)
    eng, tok, _pol = make()
    prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(30 + args.prompts, seed=7)[30:]]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    systems = {"plain": FixedPolicy(StepChoice(0, 1), 1)}
    for t in args.trees:
        d, wd, wv = (int(x) for x in t.split(","))
        systems[f"d{d}w{wd}v{wv}"] = fixed_policy(eng, plan, draft_width=wd, verify_width=wv, draft_depth=d)
    base = eng.cfg

    def run(ids, name: str, which: str):
        eng.cfg = replace(base, **(args.a if which == "a" else args.b))
        r = eng.generate(ids, params, policy=systems[name])
        steps = max(r.stats["verify_calls"], 1)
        return r.stats["tpot_ms"], r.token_ids, {k: v / steps for k, v in r.stats.get("stage_ms", {}).items() if v}

    rows = {(name, w): [] for name in systems for w in "ab"}
    try:
        for name in systems:
            run(prompts[0], name, "a"), run(prompts[0], name, "b")  # warm-up
        for rnd in range(args.rounds):
            for i, ids in enumerate(prompts):
                for name in systems:
                    for w in ("ab" if (i + rnd) % 2 == 0 else "ba"):
                        rows[name, w].append(run(ids, name, w))
    finally:
        eng.cfg = base
    out = {}
    plain_a = [r[1] for r in rows["plain", "a"]]
    for name in systems:
        a, b = rows[name, "a"], rows[name, "b"]
        ratios = [x[0] / y[0] for x, y in zip(a, b)]
        stages = {w: {k: round(statistics.median(r[2].get(k, 0.0) for r in rows[name, w]), 3)
                      for k in sorted({k for r in rows[name, w] for k in r[2]})} for w in "ab"}
        out[name] = {"a_over_b": statistics.median(ratios), "b_won": sum(x > 1 for x in ratios), "pairs": len(ratios),
                     "ms_per_token": [statistics.median(r[0] for r in a), statistics.median(r[0] for r in b)],
                     "same_as_plain": all(x[1] == p for x, p in zip(a, plain_a)) and all(y[1] == p for y, p in zip(b, plain_a)),
                     "stage_ms_per_step": stages}
        o = out[name]
        print(f"{name:10s} A/B {o['a_over_b']:.3f} (B faster on {o['b_won']}/{o['pairs']})  ms/token A "
              f"{o['ms_per_token'][0]:.3f} B {o['ms_per_token'][1]:.3f}  = plain {o['same_as_plain']}\n"
              f"{'':10s} stages A {stages['a']}\n{'':10s} stages B {stages['b']}", flush=True)
    print(json.dumps({"plan": plan.name, "a": args.a, "b": args.b, "prompts": len(prompts), "new": args.new_tokens,
                      "rounds": args.rounds, "systems": out}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_reporting("ab_config", lambda _: main(), None))
