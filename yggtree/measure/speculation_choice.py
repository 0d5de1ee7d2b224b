"""Whether a compiled plan decodes faster with its latency objective than with plain steps on this
machine, and with how many lookup nodes a step, measured once (the machine plan's build,
yggtree.machine_plan).

The objective declines the trees that do not pay, but keeping the option costs every step a little
(the target's features kept for the drafter, the policy, its probe trees and the drafter's
catch-up before them): where no tree pays on this machine, plain steps are the faster default.
Lookup nodes (runtime/lookup.py: continuations of the prompt and of the text so far, merged into
the drafted tree) cost no model call but take verify rows, which are cheap or not by machine: each
count of :data:`LOOKUPS` the plan's verify widths hold runs the objective as its own system.
All decode the same held-out requests on one engine (never evaluation prompts: half calibration chat
prompts, whose answers quote the snippet they embed, which lookup continues; half open questions
with nothing to quote, ``data.open_questions``), in an order rotated per prompt, after one warm-up
prompt each; a system's ratio is the geometric mean over prompts of plain ms per token over its
own (above 1: faster than plain steps), and the verdict the best system's.

Sampling is timed apart: a drafted token is accepted with the target's probability of it, not
whenever it is the target's argmax, so a tree that pays for greedy requests may not for sampled
ones. The fastest system is timed once more against plain steps with every request sampled at
:data:`SAMPLING` (``sampling_ratio``); runs that sample take that verdict.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .probe_prompts import decode_ms_per_token, probe_requests

PROMPTS = 10  # held-out requests timed (after one warm-up prompt): :func:`verdict_requests`
NEW_TOKENS = 128  # each: whole answers, as a run decodes them (a short probe's openings draft better)
LOOKUPS = (0, 4, 8)  # lookup nodes a step the objective is timed with (those the verify widths hold)
SAMPLING = {"temperature": 0.7, "top_p": 1.0}  # how sampled requests are timed (a common chat setting)
VERSION = 3  # of what a verdict measures (2: lookup counts, half open questions; 3: sampling); another is measured again


def speed_ratio(plain_ms: list[float], objective_ms: list[float]) -> float:
    """The objective's decode speed over plain steps': the geometric mean over prompts of
    ``plain_ms / objective_ms`` (per-token times, paired by prompt; pure)."""
    if not plain_ms or len(plain_ms) != len(objective_ms):
        raise ValueError("speed_ratio needs the same prompts' times for both")
    return math.exp(sum(math.log(p / o) for p, o in zip(plain_ms, objective_ms)) / len(plain_ms))


def lookup_counts(verify_widths) -> tuple[int, ...]:
    """The counts of :data:`LOOKUPS` a plan of ``verify_widths`` can verify (pure)."""
    return tuple(n for n in LOOKUPS if n <= max(verify_widths))


def best_system(ratios: dict[int, float]) -> int:
    """The lookup count of the fastest system (``ratios``: count -> speed over plain steps); the
    fewer lookup nodes among equals (pure)."""
    return min(ratios, key=lambda n: (-ratios[n], n))


def verdict_requests(tok, max_context: int):
    """``(ids, params)``: a warm-up calibration chat prompt, then :data:`PROMPTS` requests taking
    turns between calibration chat prompts and open questions, and the SamplingParams of each."""
    from ..data import open_questions
    from ..runtime.loading import encode_auto

    ids, params = probe_requests(tok, max_context, PROMPTS - PROMPTS // 2, NEW_TOKENS)
    opens = [encode_auto(tok, p.text) for p in open_questions(PROMPTS // 2)]
    return [ids[0], *(x for pair in zip(ids[1:], opens) for x in pair)], params


def measure_speculation(plan, art, threads: int, reserve=None) -> dict:
    """``{"ratio", "lookup", "ratios", "prompts", "load"}`` of ``plan`` (a speculative plan with a
    profile and calibration, its compiled artifacts ``art``) at ``threads`` threads: the decode
    speed over plain steps' of its objective with each count of lookup nodes the plan holds
    (``ratios``), on :func:`verdict_requests`; ``lookup`` the fastest count, ``ratio`` its speed.
    ``reserve`` goes to the engine's build (runtime/reserve.py: it records the arena's size)."""
    from ..offline.timing import LoadMeter
    from ..runtime.build import build_plan_engine
    from ..runtime.objective import plan_policy
    from ..runtime.policy import FixedPolicy, StepChoice

    engine, tok = build_plan_engine(plan, art, threads=threads, reserve=reserve)
    ids, params = verdict_requests(tok, plan.max_context)
    # name -> (lookup nodes, policy); an objective is named by its lookup count and learns its own feedback
    systems = {"plain": (0, FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1))}
    systems |= {n: (n, plan_policy(plan)) for n in lookup_counts(plan.verify_widths)}
    names = list(systems)

    def decode(prompt, name, how) -> float | None:
        n, policy = systems[name]
        engine.set_lookup(n)
        return decode_ms_per_token(engine.generate(prompt, how, policy=policy))

    def timed(names: list, how) -> dict:
        for name in names:  # warm-up
            decode(ids[0], name, how)
        times = {name: [] for name in names}
        for i, prompt in enumerate(ids[1:]):
            for name in names[i % len(names):] + names[: i % len(names)]:
                times[name].append(decode(prompt, name, how))
        return times

    sampled = replace(params, **SAMPLING)
    with LoadMeter() as load:
        times = timed(names, params)
        ratios, counts = {}, []
        for name in names[1:]:
            ratios[name], n = paired_ratio(times["plain"], times[name])
            counts.append(n)
        best = best_system(ratios)
        times = timed(["plain", best], sampled)
        sampling, n = paired_ratio(times["plain"], times[best])
    engine.set_lookup(plan.lookup)
    return {"ratio": ratios[best], "lookup": best, "ratios": {str(n): r for n, r in ratios.items()},
            "sampling_ratio": sampling, "prompts": min(*counts, n), "load": load.result, "version": VERSION}


def paired_ratio(plain_ms: list, objective_ms: list) -> tuple[float, int]:
    """:func:`speed_ratio` over the prompts both systems decoded more than one token of (a time,
    not None), rounded, and how many those were; ValueError where there are none (pure)."""
    pairs = [(p, o) for p, o in zip(plain_ms, objective_ms) if p and o]
    if not pairs:
        raise ValueError("no held-out request decoded more than one token")
    return round(speed_ratio([p for p, _ in pairs], [o for _, o in pairs]), 4), len(pairs)
