"""What ``yggtree tune`` maximises: decode tokens/s of a candidate plan, at two fidelities.

1. Predicted (cheap, every trial): the latency objective of the candidate's width sets, from the
   machine's profile and the pair's calibration, at every context the calibration prompts pass
   through while generating: per context the best (D, W_d, W_v) or a plain step
   (``ObjectivePolicy.plan_choice``), whose predicted milliseconds per token are plain / speed-up.
   Lookup nodes, top-k and the prefill chunk do not enter the prediction (the calibration is
   measured at one top-k; lookup acceptance depends on the text): the measured fidelity sees them.

   Stage plan (:class:`StageScale`): the profile's curves are ``sequential`` at the profile's
   thread count P. Another stage plan or split scales each step by the compile-time plan
   search's estimate from the profile's stage forms (offline/plan_search.predict_ms):
   step(D, W_d, W_v) x predict(plan) / predict(sequential@P) for a tree step (the tree still
   chosen by the sequential costs, as the runtime's objective chooses it), and a plain step
   by the target's verify at the smallest stage-forms width, T threads over P. A profile
   without stage forms prices ``sequential@P`` only: any other stage plan is not a candidate
   (tune.py does not sample it; a trial given one anyway is refused, the reason in its user
   attributes).

   Weight format: the profile measured one format (its ``plan.weights``; before the field, float
   in the dtype). Its curves do not price another: a trial of another format gets no predicted
   value (user attribute ``unpriced``) and goes to the measured fidelity directly, still pruned
   at its measured rungs, with its envelope tree (its plan names no profile: a plan's latency
   objective refuses a profile of another format). Such a trial costs a compile and a
   measurement whatever its plan.
2. Measured (leading candidates only): the compiled candidate decodes held-out calibration
   prompts (never MT-Bench or HumanEval), greedy, with its latency objective; decode tokens/s
   (prefill excluded) after each rung of prompts (1, 2, 4, ... prompts), so a pruner can stop
   a losing candidate after its first prompts.
3. Confirmed (the best measured trials and the base plan, after the search): the same engines
   (:func:`open_runner`) decode other held-out calibration prompts side by side
   (:func:`measure_side_by_side`), so that the plan written is not merely the luckiest of
   several few-prompt measurements.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


def token_contexts(prompt_lengths: list[int], max_new_tokens: int, max_context: int) -> list[int]:
    """The committed length before every generated token of every prompt (each prompt cut to
    fit ``max_context`` with its generation)."""
    out = []
    for n in prompt_lengths:
        n = min(n, max_context - max_new_tokens - 1)
        out += range(n, n + max_new_tokens)
    return out


@dataclass(frozen=True)
class StageScale:
    """Step time under a stage plan over step time under ``sequential@P`` (the profile's curves):
    per tree shape (D, W_d, W_v) and for a plain step (see the module docstring)."""

    label: str
    step: dict  # (D, W_d, W_v) -> factor
    plain: float


def stage_scale(label: str, forms: dict | None, threads: int, shapes, other_ms, hit,
                feeds_leaves: bool) -> StageScale | None:
    """The :class:`StageScale` of stage plan ``label`` over ``shapes`` from stage ``forms``
    (``other_ms(shape)``, ``hit(shape)`` as offline/plan_search.search takes them); None for
    ``sequential@threads`` (the curves' own). YggError (one line) when the forms cannot price
    it: none recorded, or not this split or these widths."""
    from ..errors import YggError
    from ..runtime.schedule import split_name
    from .plan_search import candidates, predict_ms

    base = f"sequential@{threads}"
    if label == base:
        return None
    if label not in candidates(forms):
        have = "has no stage forms" if not candidates(forms) else "'s stage forms do not measure it"
        raise YggError(f"stages {label} is not a candidate: the profile {have} (it prices {base}"
                       + (")" if not candidates(forms) else f" and {', '.join(candidates(forms))})"))
    try:
        step = {}
        for shape in shapes:
            args = (forms, shape, other_ms(shape), hit(shape), feeds_leaves)
            step[tuple(shape)] = predict_ms(label, *args) / predict_ms(base, *args)
        mine = forms["splits"][str(split_name(label)[1])]["verify_ms"]
        ref = forms["splits"][str(threads)]["verify_ms"]
        w = min(mine, key=int)
        plain = mine[w] / ref[w]
    except (KeyError, ValueError, ZeroDivisionError) as e:
        raise YggError(f"stages {label} is not a candidate: the profile's stage forms lack what it "
                       f"needs ({type(e).__name__}: {e})") from None
    return StageScale(label, step, plain)


def chosen_verify(cost, calib, d: int, wd: int, verify_widths, ctx: int) -> int:
    """The W_v the objective verifies with after drafting (D, W_d) at ``ctx`` (best_verify over
    the calibrated widths, as ObjectivePolicy.plan_choice ranks its rows)."""
    from ..runtime.objective import best_verify

    rows = [(wv, calib.expected_aal(wd, d, wv)) for wv in sorted(verify_widths)]
    rows = [(wv, a) for wv, a in rows if a is not None]
    wv, _ = best_verify([a for _, a in rows], [w for w, _ in rows],
                        [cost.step_ms(d, wd, w, ctx) for w, _ in rows], cost.plain_ms(ctx))
    return wv


def predicted_tokens_per_s(cost, calib, draft_widths, verify_widths, d_max: int,
                           contexts: list[int], scale: StageScale | None = None) -> float:
    """Predicted decode tokens/s of a plan with these width sets over ``contexts`` (see the module
    docstring); plain decoding's when no tree pays anywhere. ``scale``: the plan's stage plan
    (None: ``sequential`` at the profile's threads)."""
    from ..runtime.objective import ObjectivePolicy

    pol = ObjectivePolicy(cost, calib, tuple(sorted(draft_widths)), tuple(sorted(verify_widths)), d_max)
    total_ms = 0.0
    for ctx in contexts:
        choice, speedup = pol.plan_choice(ctx)
        ms = cost.plain_ms(ctx) / max(speedup, 1.0)
        if scale is not None and (choice.draft_depth == 0 or speedup <= 1.0):
            ms *= scale.plain
        elif scale is not None:
            d, wd = choice.draft_depth, choice.draft_width
            ms *= scale.step[(d, wd, chosen_verify(cost, calib, d, wd, verify_widths, ctx))]
        total_ms += ms
    return 1e3 * len(contexts) / total_ms if total_ms > 0 else 0.0


def block_shapes(plan) -> int:
    """Decoder-block graphs ``yggtree compile`` builds for ``plan``, estimated before compiling
    (the Pareto front's cost axis where a trial was not compiled): per context bucket, one per
    distinct width the target runs (prefill chunk, 1, every W_v) and the drafter runs (prefill
    chunk, the head, every W_d). A self-drafter or an EAGLE head shares the target's block
    graphs (same block shape); a standalone drafter LM has its own."""
    from ..runtime.build import drafter_widths, plan_slots
    from ..runtime.eagle import head_widths
    from ..runtime.graphs import context_buckets
    from ..runtime.prepare import drafter_feeds_leaves

    buckets = len(context_buckets(plan_slots(plan)))
    target = set(plan.target_widths)
    if not plan.speculative:
        return buckets * len(target)
    eagle = not drafter_feeds_leaves(plan)  # an EAGLE head; an LM drafter feeds its leaves
    heads = head_widths(plan.d_max) if eagle else (1,)
    drafter = {plan.prefill_chunk, *heads, *drafter_widths(plan)}
    if plan.drafter == "self" or eagle:
        return buckets * len(target | drafter)
    return buckets * (len(target) + len(drafter))


def rungs(n_prompts: int) -> list[int]:
    """Cumulative prompt counts after which a measured trial reports: 1, 2, 4, ..., n."""
    out, k = [], 1
    while k < n_prompts:
        out.append(k)
        k *= 2
    return out + [n_prompts]


@dataclass(frozen=True)
class Measurement:
    """A measured candidate: decode tokens/s over the prompts it ran, and what it took."""

    tokens_per_s: float
    prompts: int
    new_tokens: int
    aal: float | None
    build_s: float
    pruned: bool


@dataclass
class Runner:
    """A built engine ready to decode one plan (see :func:`open_runner`)."""

    plan: object
    engine: object
    kw: dict  # generate()'s policy argument
    params: object  # SamplingParams of a measured request
    build_s: float  # engine build and warm-up


@dataclass(frozen=True)
class Decoded:
    """One measured request: tokens generated, decode seconds (prefill excluded; the first new
    token comes from prefill), verify calls."""

    new_tokens: int
    decode_s: float
    steps: int


def open_runner(plan, artifacts, max_new_tokens: int, warm_ids: list[int], threads: int = 1) -> Runner:
    """The engine of ``plan`` (its compiled ``artifacts``, or None for the eager backend) with
    its lookup and latency objective, greedy, warmed by one untimed request on ``warm_ids``."""
    import torch

    from ..runtime.build import build_plan_engine
    from ..runtime.engine import SamplingParams
    from ..runtime.objective import plan_policy

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    mode = "reference" if plan.backend == "eager" else None
    engine, _ = build_plan_engine(plan, artifacts, mode)
    if engine.drafter is not None:
        engine.set_lookup(plan.lookup)
    policy = plan_policy(plan)
    kw = {"policy": policy} if policy is not None else {}
    engine.generate(warm_ids, SamplingParams(max_new_tokens=min(4, max_new_tokens)), **kw)
    return Runner(plan, engine, kw, SamplingParams(max_new_tokens=max_new_tokens), time.perf_counter() - t0)


def decode_once(runner: Runner, ids: list[int]) -> Decoded:
    """Decode one prompt with ``runner`` and time it (the engine's own decode tokens/s)."""
    s = runner.engine.generate(ids, runner.params, **runner.kw).stats
    n = s["new_tokens"]
    dec = (n - 1) / s["decode_tokens_per_s"] if n > 1 and s.get("decode_tokens_per_s") else 0.0
    return Decoded(n, dec, s.get("verify_calls", n))


def decode_rate(rows: list[Decoded]) -> float:
    """Decode tokens/s over requests: tokens after the first over decode seconds, summed."""
    n = sum(r.new_tokens - 1 for r in rows if r.decode_s > 0)
    t = sum(r.decode_s for r in rows)
    return n / t if t else 0.0


def measure_plan(plan, artifacts, prompt_ids: list[list[int]], max_new_tokens: int,
                 report: Callable[[int, float], bool], threads: int = 1) -> Measurement:
    """Decode ``prompt_ids`` with ``plan`` (its compiled ``artifacts``, or None for the eager
    backend) and its latency objective, greedy. After each rung (:func:`rungs`) ``report(step,
    tokens_per_s)`` is called (step = 1, 2, ...); when it returns True the measurement stops
    (pruned). One untimed request warms the engine first."""
    runner = open_runner(plan, artifacts, max_new_tokens, prompt_ids[0], threads)
    out: list[Decoded] = []
    pruned = False
    for step, upto in enumerate(rungs(len(prompt_ids)), start=1):
        out += [decode_once(runner, ids) for ids in prompt_ids[len(out):upto]]
        if report(step, decode_rate(out)):
            pruned = True
            break
    steps = sum(r.steps for r in out)
    n_new = sum(r.new_tokens for r in out)
    return Measurement(decode_rate(out), len(out), n_new, n_new / steps if steps else None,
                       runner.build_s, pruned)


def rotated(keys: list, i: int) -> list:
    """``keys`` rotated left by ``i`` (the order in which the systems decode prompt ``i``)."""
    k = i % len(keys) if keys else 0
    return keys[k:] + keys[:k]


def measure_side_by_side(plans: dict, prompt_ids: list[list[int]], max_new_tokens: int,
                         threads: int = 1) -> list[dict]:
    """Decode every prompt with every plan (``plans``: key -> (plan, artifacts)): all engines are
    built (each warmed once, untimed) and held, then every plan decodes a prompt before the next
    prompt, the order rotating per prompt (:func:`rotated`), so that the machine's drift falls
    on every plan alike. Returns one row per prompt: ``{key: {"new_tokens", "decode_s"}}`` (the
    rows ``yggtree.bench.paired_ratio`` takes)."""
    runners = {k: open_runner(plan, art, max_new_tokens, prompt_ids[0], threads)
               for k, (plan, art) in plans.items()}
    rows = []
    for i, ids in enumerate(prompt_ids):
        row = {}
        for k in rotated(list(runners), i):
            d = decode_once(runners[k], ids)
            row[k] = {"new_tokens": d.new_tokens, "decode_s": d.decode_s}
        rows.append(row)
    return rows
