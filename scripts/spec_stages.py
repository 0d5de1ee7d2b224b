#!/usr/bin/env python
"""A compiled speculative plan's latency objective and fixed trees against its own plain steps.

One engine built from the plan's compiled packages, held-out calibration-corpus prompts (never
evaluation prompts: ``yggtree.data.calibration_chat_prompts``, the 30 after the calibration's own
30), greedy, every system on a prompt before the next, two passes of which the second is timed.
Per system: decode ms per token and its speed over plain steps, and in brackets the same with the
prompt's prefill included (a policy that may decode plainly defers the drafter's prompt prefill to
its first drafted step, inside the decode time), AAL, outputs identical to plain, per-stage ms per
step; then ONE JSON line.

    python scripts/spec_stages.py profiles/epyc-2core-w4a8.yaml 6 256 3,1,4 --root compile

Each ``D,W_d,W_v`` adds a fixed tree of that depth, draft width and verify width.
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="the plan's YAML (compiled under --root)")
    ap.add_argument("prompts", type=int, help="held-out calibration-corpus prompts")
    ap.add_argument("new_tokens", type=int, help="new tokens per prompt")
    ap.add_argument("trees", nargs="*", help="fixed trees D,W_d,W_v")
    ap.add_argument("--root", default="compile", help="the compile root (default: compile)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from yggtree.bench import plan_runner
    from yggtree.data import calibration_chat_prompts
    from yggtree.runtime.build import fixed_policy
    from yggtree.runtime.loading import encode_prompt
    from yggtree.runtime.policy import FixedPolicy, StepChoice
    from yggtree.shapes import SamplingParams

    trees = [tuple(int(x) for x in t.split(",")) for t in args.trees]
    torch.set_num_threads(args.threads)
    plan, _info, make = plan_runner(args.plan, compile_root=args.root)
    eng, tok, pol = make()
    prompts = [encode_prompt(tok, p.text)
               for p in calibration_chat_prompts(30 + args.prompts, seed=7)[30:]]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    systems = {"plain": FixedPolicy(StepChoice(0, 1), 1), "objective": pol}
    for d, wd, wv in trees:
        systems[f"d{d}w{wd}v{wv}"] = fixed_policy(eng, plan, draft_width=wd, verify_width=wv, draft_depth=d)
    rows = {k: [] for k in systems}
    for rep in range(2):
        for ids in prompts:
            for name, p in systems.items():
                r = eng.generate(ids, params, policy=p)
                if rep == 1:
                    rows[name].append(r)

    texts = {name: [r.token_ids for r in rs] for name, rs in rows.items()}
    out = {}
    for name, rs in rows.items():
        dec_t = sum(r.stats["tpot_ms"] * (r.stats["new_tokens"] - 1) for r in rs)
        dec_n = sum(r.stats["new_tokens"] - 1 for r in rs)
        steps = sum(r.stats["verify_calls"] for r in rs)
        stage: dict[str, float] = {}
        for r in rs:
            for k, v in r.stats.get("stage_ms", {}).items():
                stage[k] = stage.get(k, 0) + v
        e2e = sum(r.stats["total_ms"] for r in rs) / sum(r.stats["new_tokens"] for r in rs)
        accepted = sum(r.stats.get("accepted_tokens", 0) + r.stats["verify_calls"] for r in rs)
        out[name] = {"ms_per_token": dec_t / dec_n, "e2e_ms_per_token": e2e, "aal": accepted / steps,
                     "stage_ms_per_step": {k: round(v / steps, 3) for k, v in stage.items() if v},
                     "same_as_plain": sum(a == b for a, b in zip(texts[name], texts["plain"]))}
    base, base_e2e = out["plain"]["ms_per_token"], out["plain"]["e2e_ms_per_token"]
    for name, o in out.items():
        print(f"{name:12s} {o['ms_per_token']:.2f} ms/token  x plain {base / o['ms_per_token']:.3f}  "
              f"(prefill included {base_e2e / o['e2e_ms_per_token']:.3f})  AAL {o['aal']:.2f}  "
              f"= plain {o['same_as_plain']}/{len(prompts)}  {o['stage_ms_per_step']}", flush=True)
    print(json.dumps({"plan": plan.name, "prompts": len(prompts), "new": args.new_tokens, "systems": out}))
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("spec_stages", lambda _: main(), None))
