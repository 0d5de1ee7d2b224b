#!/usr/bin/env python
"""Build the static lookup table (yggtree/runtime/static_lookup.py) from the embedded target's own
answers to our open questions and general questions (``yggtree.data.open_questions``,
``general_questions``; never evaluation prompts, and neither the open questions the machine plan's
verdict times nor the first ``HELD`` general questions, kept for comparisons), greedy, plain steps of a
compiled plan of the embedded model; a share of the answers is held out of the table to measure its
acceptance.

    python scripts/build_lookup_table.py --plan <machine plan dir>/compile/machine-w4a8/plan.yaml \\
        --root <machine plan dir>/compile --out yggtree/assets/lookup_table.json

Prints one JSON line: the table's size and its held-out acceptance by order and share bucket.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HELD = 20  # general questions never in the table (held-out comparisons: general_questions(HELD))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="a compiled plan of the embedded model (its YAML)")
    ap.add_argument("--root", required=True, help="the plan's compile root")
    ap.add_argument("--out", default="yggtree/assets/lookup_table.json")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--held-out", type=float, default=0.2, help="share of the answers kept out of the table")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from yggtree.bench import plan_runner
    from yggtree.data import general_questions, open_questions
    from yggtree.errors import YggError
    from yggtree.files import write_text_atomic
    from yggtree.measure.speculation_choice import PROMPTS
    from yggtree.runtime.loading import default_model_path, encode_prompt
    from yggtree.runtime.policy import FixedPolicy, StepChoice
    from yggtree.runtime.static_lookup import build_table
    from yggtree.shapes import SamplingParams

    torch.set_num_threads(args.threads)
    plan, _info, make = plan_runner(args.plan, compile_root=args.root)
    if plan.target != "default":
        raise YggError(f"plan {args.plan} is not of the embedded model (target {plan.target!r})")
    engine, tok, policy = make()
    timed = {p.text for p in open_questions(PROMPTS // 2)}  # the verdict's open questions stay unseen
    questions = [q for q in open_questions(None) if q.text not in timed] + general_questions(None)[HELD:]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    plain = FixedPolicy(StepChoice(0, 1), 1) if policy is not None else None
    pairs, t0 = [], time.perf_counter()
    for i, q in enumerate(questions):
        ids = encode_prompt(tok, q.text)
        pairs.append((ids, engine.generate(ids, params, policy=plain).token_ids))
        if (i + 1) % 50 == 0:
            print(f"build_lookup_table: {i + 1}/{len(questions)} answers, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    random.Random(0).shuffle(pairs)
    cut = int(len(pairs) * (1 - args.held_out))
    src = default_model_path()
    table = build_table([a for _, a in pairs[:cut]], pairs[cut:], {"name": src.name, "size": src.stat().st_size})
    out = Path(args.out)
    write_text_atomic(out, json.dumps(table.to_json(), separators=(",", ":")) + "\n")
    print(json.dumps({"out": str(out), "answers": cut, "held_out": len(pairs) - cut,
                      "contexts": {n: len(t) for n, t in table.next.items()},
                      "accept": {n: [round(x, 3) for x in a] for n, a in table.accept.items()},
                      "bytes": out.stat().st_size}))
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("build_lookup_table", lambda _: main(), None))
