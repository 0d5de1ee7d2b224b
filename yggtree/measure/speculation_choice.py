"""Whether a compiled plan decodes faster with its latency objective than with plain steps on this
machine, measured once (the machine plan's build, yggtree.machine_plan).

The objective declines the trees that do not pay, but keeping the option costs every step a little
(the target's features kept for the drafter, the policy, its probe trees and the drafter's
catch-up before them): where no tree pays on this machine, plain steps are the faster default.
Both decode the same calibration chat prompts (``probe_prompts``: never evaluation prompts) on one
engine, alternating which goes first, after one warm-up prompt each; the verdict is the geometric
mean over prompts of plain ms per token over the objective's (above 1: the objective is faster).
"""

from __future__ import annotations

import math

from .probe_prompts import decode_ms_per_token, probe_requests

PROMPTS = 10  # calibration chat prompts timed (after one warm-up prompt)
NEW_TOKENS = 128  # each: whole answers, as a run decodes them (a short probe's openings draft better)


def speed_ratio(plain_ms: list[float], objective_ms: list[float]) -> float:
    """The objective's decode speed over plain steps': the geometric mean over prompts of
    ``plain_ms / objective_ms`` (per-token times, paired by prompt; pure)."""
    if not plain_ms or len(plain_ms) != len(objective_ms):
        raise ValueError("speed_ratio needs the same prompts' times for both")
    return math.exp(sum(math.log(p / o) for p, o in zip(plain_ms, objective_ms)) / len(plain_ms))


def measure_speculation(plan, art, threads: int) -> dict:
    """``{"ratio", "prompts", "load"}`` of ``plan`` (a speculative plan with a profile and
    calibration, its compiled artifacts ``art``) at ``threads`` threads: the objective's decode
    speed over plain steps' on the calibration prompts."""
    from ..offline.timing import LoadMeter
    from ..runtime.build import build_plan_engine
    from ..runtime.objective import plan_policy
    from ..runtime.policy import FixedPolicy, StepChoice

    engine, tok = build_plan_engine(plan, art, threads=threads)
    ids, params = probe_requests(tok, plan.max_context, PROMPTS, NEW_TOKENS)
    plain = FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1)
    objective = plan_policy(plan)
    for policy in (plain, objective):  # warm-up
        engine.generate(ids[0], params, policy=policy)
    times = {"plain": [], "objective": []}
    with LoadMeter() as load:
        for i, prompt in enumerate(ids[1:]):
            order = (("plain", plain), ("objective", objective))
            for name, policy in order if i % 2 == 0 else order[::-1]:
                times[name].append(decode_ms_per_token(engine.generate(prompt, params, policy=policy)))
    pairs = [(p, o) for p, o in zip(times["plain"], times["objective"]) if p and o]
    if not pairs:
        raise ValueError("no calibration prompt decoded more than one token")
    ratio = speed_ratio([p for p, _ in pairs], [o for _, o in pairs])
    return {"ratio": round(ratio, 4), "prompts": len(pairs), "load": load.result}
