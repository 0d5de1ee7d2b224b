"""The confirmation phase of ``yggtree tune``: the ``--measure-top`` best measured trials and the
base plan's trial decode further held-out calibration prompts side by side, and the fastest over
those prompts is the plan written (the highest of several few-prompt trial measurements alone is
a winner's curse)."""

from __future__ import annotations

from .tune_artifacts import say
from .tune_inputs import Inputs, Setup, objective_files
from .tune_trial import trial_graphs


def confirm(s: Setup, inp: Inputs, rows: list[dict], on_event=None) -> dict:
    """The confirmation: the ``measure_top`` best measured trials and the base plan's trial
    decode the confirmation prompts side by side (every candidate on a prompt before the next,
    the order rotating; :func:`.tune_objective.measure_side_by_side`); the winner is the
    fastest over those prompts. Returns the report's ``confirm`` section."""
    from .tune_objective import measure_side_by_side
    from .tune_report import confirm_candidates, confirm_summary
    from .tune_space import base_fields, candidate_plan

    base = base_fields(s.base, s.threads)
    cands = confirm_candidates(rows, base, s.measure_top)
    base_no = next((r["number"] for r in cands if r["fields"] == base), None)
    ref = base_no if base_no is not None else cands[0]["number"]
    plans = {}
    for r in cands:
        plan = candidate_plan(s.base, r["fields"], s.hw, *objective_files(inp, r["fields"]))
        plans[r["number"]] = (plan, trial_graphs(s, plan, r["number"]))
    say(f"confirming trials {', '.join(map(str, plans))} (base plan: "
        f"{'trial ' + str(base_no) if base_no is not None else 'not a trial'}) side by side on "
        f"{len(inp.confirm_ids)} other held-out calibration prompts x {s.max_new_tokens} tokens")
    if on_event is not None:
        on_event("confirm", ref)
    per_prompt = measure_side_by_side(plans, inp.confirm_ids, s.max_new_tokens, s.threads)
    summ = confirm_summary(per_prompt, list(plans), ref)
    win, c = summ["winner"], summ["candidates"]
    note = None
    if base_no is None:
        note = (f"the base plan is not a trial (not in the search space): ratios are to trial {ref}, "
                "the trial phase's best")
    elif not summ["beat_base"]:
        written = ("is the base plan" if win == ref else f"trial {win} ({c[win]['confirmed_tps']:.1f} vs "
                   f"{c[ref]['confirmed_tps']:.1f} tok/s), is within noise of the base")
        note = (f"no candidate beat the base plan (trial {ref}) beyond its 95% interval over "
                f"{len(per_prompt)} prompts: the plan written {written}")
    say(note or f"confirmed: trial {win} at {c[win]['confirmed_tps']:.1f} tok/s, "
        f"{c[win]['ratio_to_base']:.3f}x the base plan (95% CI {c[win]['ci95'][0]:.3f}-{c[win]['ci95'][1]:.3f})")
    return {"prompts": len(per_prompt), "max_new_tokens": s.max_new_tokens,
            "source": "yggtree.data.calibration_chat_prompts, after the calibration's and the trials'",
            "base_trial": base_no, "reference": ref, "winner": win,
            "beat_base": summ["beat_base"], "note": note,
            "candidates": [{"number": r["number"], "fields": r["fields"], "trial_tps": r["measured_tps"]}
                           | c[r["number"]] for r in cands],
            "per_prompt": [{str(k): v for k, v in row.items()} for row in per_prompt]}
