"""The last phase of ``yggtree tune``: the confirmed winner (:mod:`.tune_confirm`) compiled into
``<compile-root>/<hw>`` (its trial's graphs when they match), the report ``<hw>.tuning.json``, its
table and plots, then the plan file ``<hw>.yaml``, written last, whose first line names the study
that wrote it (:func:`plan_owner`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import YggError
from ..files import write_text_atomic
from .tune_artifacts import say
from .tune_confirm import confirm
from .tune_inputs import Inputs, Setup, objective_files
from .tune_trial import adopt_trial_graphs, clean_trial_dirs

MARKER = "# yggtree-tune-study: "  # first line of a plan this command wrote, naming its study


def plan_owner(path: Path) -> str | None:
    """The study key a tuned plan file names in its first line (None: not written by tune)."""
    try:
        first = path.read_text().split("\n", 1)[0]
    except OSError:
        return None
    return first[len(MARKER):].strip() if first.startswith(MARKER) else None


def finish(s: Setup, inp: Inputs, key: str, phases: dict, reuse: dict, on_event=None) -> dict:
    """Compile the best trial, write the plan, its report and plots; returns the summary."""
    from rich.console import Console

    from .compile import compile_plan
    from .tune_report import best_table, complete_rows, pareto_front, trial_rows, write_plots
    from .tune_space import candidate_plan
    from .tune_study import open_study

    study = open_study(s.url, s.study, s.identity)
    rows = trial_rows(study)
    done = complete_rows(rows)
    if not done:
        raise YggError(f"no trial of study {s.study!r} has completed a measurement yet "
                       f"({len(rows)} finished, all pruned); run more trials (--trials)")
    t = time.perf_counter()
    conf = confirm(s, inp, rows, on_event)
    phases["confirm"] = round(time.perf_counter() - t, 2)
    confirmed = {c["number"]: c for c in conf["candidates"]}
    best = next(r for r in rows if r["number"] == conf["winner"]) | {
        k: v for k, v in confirmed[conf["winner"]].items() if k not in ("number", "fields")}
    plan_path = s.out_dir / f"{s.hw}.yaml"
    plan = candidate_plan(s.base, best["fields"], s.hw, *objective_files(inp, best["fields"]))
    t = time.perf_counter()
    reused = adopt_trial_graphs(s, plan, best["number"])
    clean_trial_dirs(s, study)
    say(f"{'using the graphs compiled for' if reused else 'compiling'} the best plan (trial "
         f"{best['number']}) in {s.compile_root / s.hw}")
    if best["fields"]["weights"] != inp.profile_weights:
        say(f"note: the plan runs {best['fields']['weights']} weights, the profile {inp.profile} measured "
            f"{inp.profile_weights}: the plan names no profile or calibration and runs its envelope tree "
            "(profile and calibrate under this plan to give it the latency objective)")
    # check_outputs made sure compile/<hw> is absent, this study's, or --force was given
    summary = compile_plan(plan, s.compile_root, replace=True, console=Console(stderr=True))
    phases["compile"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    front_ids = pareto_front([(r["measured_tps"], r["graphs"], r["number"]) for r in done])
    stem = s.out_dir / s.hw
    plots = write_plots(study, rows, stem)
    report = {
        "kind": "yggtree-tuning-report",
        "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hw": s.hw,
        "study": s.study,
        "storage": key.split(" @ ", 1)[1],
        "identity": s.identity,
        "reused": reuse,
        "phases_s": phases,
        "trials": {"total": len(study.trials), "complete": len(done),
                   "pruned": sum(r["state"] == "pruned" for r in rows),
                   "infeasible": sum(r["infeasible"] for r in rows),
                   "failed_or_killed": len(study.trials) - len(rows)},
        "best": best,
        "confirm": conf,
        "pareto_front": [r for r in done if r["number"] in front_ids],
        "rows": rows,
        "compile": {"dir": summary["dir"], "status": summary["status"], "graphs": summary["n_graphs"],
                    "compile_s": summary["compile_s"], "size_bytes": summary["size_bytes"]},
        "plots": plots,
        "prompts": {"source": "yggtree.data.calibration_chat_prompts",
                    "predicted_contexts": len(inp.contexts), "measured_prompts": len(inp.measure_ids),
                    "confirm_prompts": len(inp.confirm_ids),
                    "max_new_tokens": s.max_new_tokens, "prompt_tokens": s.prompt_tokens},
    }
    write_text_atomic(stem.with_suffix(".tuning.json"), json.dumps(report, indent=1, default=str) + "\n")
    phases["report"] = round(time.perf_counter() - t, 2)
    write_plan_file(plan, plan_path, key, best, report)  # last: a plan exists only when all is done
    console = Console(file=sys.stdout, width=160)
    console.print(best_table(rows, title=f"study {s.study}: best of {len(done)} measured trials, "
                             f"{len(confirmed)} confirmed on {conf['prompts']} prompts", confirmed=confirmed))
    return {"command": "tune", "plan": str(plan_path), "compiled": summary["dir"],
            "best_trial": best["number"], "confirmed_tps": round(best["confirmed_tps"], 2),
            "ratio_to_base": round(best["ratio_to_base"], 4), "ci95": best["ci95"],
            "measured_tps": best["measured_tps"] and round(best["measured_tps"], 2),
            "predicted_tps": best["predicted_tps"], "trials": report["trials"],
            "pareto_front": front_ids, "phases_s": phases, "reused": reuse,
            "report": str(stem.with_suffix(".tuning.json"))}


def write_plan_file(plan, path: Path, key: str, best: dict, report: dict) -> Path:
    """The tuned plan with a header naming its study and what it measured."""
    import yaml

    from ..plan import validate_plan

    body = yaml.safe_dump(plan.to_dict(relative_to=path.parent), sort_keys=False, default_flow_style=None)
    validate_plan(yaml.safe_load(body), path.parent, str(path))  # it loads back
    t = report["trials"]
    head = [
        f"{MARKER}{key}",
        f"# tuned by `yggtree tune --hw {report['hw']}` on {report['identity']['device']} "
        f"({report['identity']['threads']} thread(s)), {report['created']}",
        f"# best trial {best['number']}: {best['confirmed_tps']:.1f} decode tok/s confirmed on "
        f"{report['confirm']['prompts']} held-out calibration prompts, {_vs_base(best)} ({_predicted_text(best)}), "
        f"{t['complete']} measured of {t['total']} trials; report: {path.stem}.tuning.json",
    ]
    return write_text_atomic(path, "\n".join(head) + "\n" + body)


def _predicted_text(best: dict) -> str:
    trial = "" if best.get("measured_tps") is None else f"trial prompts {best['measured_tps']:.1f}, "
    if best.get("predicted_tps") is None:
        return trial + "not predicted: the profile did not measure its weight format"
    return trial + f"predicted {best['predicted_tps']}"


def _vs_base(best: dict) -> str:
    if best["base"]:
        return "the base plan"
    lo, hi = best["ci95"]
    return f"{best['ratio_to_base']:.3f}x the base plan (95% CI {lo:.3f}-{hi:.3f})"
