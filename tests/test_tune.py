"""``yggtree tune`` on a tiny random checkpoint (eager backend: nothing compiles): the search
space and its constraints, the pruning rules, a whole tune that reuses its profile and
calibration the second time, resumption after a process is killed between and inside trials,
two processes on one SQLite study, a PostgreSQL study (a server started here), and bad input
refused in one line without touching what exists."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from yggtree.errors import YggError
from yggtree.offline import tune_space as ts
from yggtree.offline.tune_objective import rungs, token_contexts
from yggtree.offline.tune_report import pareto_front
from yggtree.offline.tune_study import should_measure, should_stop

transformers = pytest.importorskip("transformers")
optuna = pytest.importorskip("optuna")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # runs yggtree tune end to end

REPO = Path(__file__).resolve().parents[1]
from test_compile import tiny_plan  # noqa: E402

PLAN = tiny_plan("[2]")
# every combination of this space is a valid plan (24 of them)
SPACE = ["--space", "prefill_chunk=4,8", "--space", "lookup=0,2", "--space", "top_k=2",
         "--space", "d_max=1..2"]
DRIVER = textwrap.dedent("""
    import argparse, os, signal, sys, time
    from yggtree.offline.tune import add_arguments, run
    kill_at, kill_from, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(sys.argv[4:])
    args.argv = sys.argv[4:]
    def on_event(name, number):
        if name == "start" and pause:
            time.sleep(pause)  # slow trials: two processes surely overlap
        if name == kill_at and number >= kill_from:
            os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(run(args, on_event))
""")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny checkpoint, its plan and one finished tune (profile and calibration measured)."""
    from test_compile import save_tiny_checkpoint

    from yggtree.cli import main

    root = tmp_path_factory.mktemp("tune")
    save_tiny_checkpoint(root / "model")
    (root / "plan.yaml").write_text(PLAN)
    assert main(tune_args(root, "first", trials=4)) == 0
    return root


def tune_args(root: Path, hw: str, trials: int = 6, storage: str | None = None, study: str | None = None,
              extra: tuple = ()) -> list[str]:
    args = ["tune", "--hw", hw, "--plan", str(root / "plan.yaml"), "--trials", str(trials),
            "--out-dir", str(root / "profiles"), "--compile-root", str(root / "compile"),
            "--measure-prompts", "2", "--confirm-prompts", "3", "--max-new-tokens", "6",
            "--calibration-prompts", "2",
            "--quick-profile", *SPACE, *extra]
    if storage:
        args += ["--storage", storage]
    if study:
        args += ["--study", study]
    return args


def run_driver(args: list[str], kill_at: str = "never", kill_from: int = 0, pause: float = 0.0):
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", DRIVER, kill_at, str(kill_from), str(pause), *args[1:]],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait(p: subprocess.Popen) -> str:
    """The process's stderr once it ends (killed if the test is stopped first)."""
    try:
        return p.communicate(timeout=600)[1]
    finally:
        if p.poll() is None:
            p.kill()


def load(url: str, study: str):
    return optuna.load_study(study_name=study, storage=url)


def sqlite(root: Path, name: str) -> str:
    return f"sqlite:///{root / 'profiles' / name}"


def base_trials(trials) -> list:
    """The trials enqueued as the base plan's (user attribute ``base``)."""
    return [t for t in trials if t.user_attrs.get("base")]


def tiny_base_fields() -> dict:
    import yaml

    from yggtree.plan import validate_plan

    return ts.base_fields(validate_plan(yaml.safe_load(PLAN) | {"target": "default"}), 1)


# ----------------------------------------------------------------------------- pure pieces


def test_space_overrides_and_constraints():
    import yaml

    from yggtree.plan import validate_plan

    base = validate_plan(yaml.safe_load(PLAN) | {"target": "default", "verify_widths": [2, 4]})
    space = ts.apply_overrides(ts.default_space(base, 1), ["d_max=1..2", "top_k=2,4", "lookup=0"])
    assert space.d_max == (1, 2) and space.top_k == (2, 4) and space.lookup == (0,)
    assert ts.subsets((1, 2, 4)) == ("1", "2", "1,2", "4", "1,4", "2,4", "1,2,4")
    for bad, msg in ((["d_max=6..2"], "empty range"), (["width=4"], "unknown dimension"),
                     (["top_k=a"], "integers"), (["d_max"], "KEY=V1,V2")):
        with pytest.raises(YggError, match=msg):
            ts.apply_overrides(space, bad)
    with pytest.raises(YggError, match="no valid plan"):  # W_v 64 > 1 + 2 * 2
        ts.check_space(ts.apply_overrides(space, ["verify_widths=64"]), base)
    with pytest.raises(YggError, match="exceeds the limit"):
        ts.check_space(ts.apply_overrides(space, ["top_k=65"]), base)
    ok = {"draft_widths": [1, 2], "verify_widths": [2, 4], "d_max": 2, "top_k": 2, "lookup": 2,
          "prefill_chunk": 4}
    assert ts.infeasible(ok, 96) is None
    assert "1 + d_max" in ts.infeasible(ok | {"verify_widths": [8]}, 96)
    assert "lookup" in ts.infeasible(ok | {"lookup": 8}, 96)
    assert "prefill" in ts.infeasible(ok | {"prefill_chunk": 128}, 96)


def test_base_plan_parameters():
    import yaml

    from yggtree.plan import validate_plan

    base = validate_plan(yaml.safe_load(PLAN) | {"target": "default", "verify_widths": [2, 4]})
    space = ts.apply_overrides(ts.default_space(base, 1), ["d_max=1..2", "top_k=2,4", "lookup=0,2"])
    fields = ts.base_fields(base, 1)
    assert fields["stages"] == "sequential@1" and fields["weights"] == "float32"
    params, why = ts.trial_params(space, base.max_context, fields)
    assert why is None and params["d_max_index"] == 1 and params["top_k"] == 2
    study = optuna.create_study(direction="maximize")  # the sampler draws exactly the base plan
    study.enqueue_trial(params)
    assert ts.plan_fields(ts.suggest(study.ask(), space, base.max_context), space) == fields
    for over, msg in ((["top_k=4,8"], "its top_k 2 is not in the search space"),
                      (["d_max=1"], "its d_max 2 is not in the search space"),  # a fixed dimension
                      (["verify_widths=2"], "its verify_widths 2,4 is not in the search space")):
        assert ts.trial_params(ts.apply_overrides(space, over), base.max_context, fields) == (None, msg)
    assert ts.trial_params(space, base.max_context, fields, ("ahead@1",)) == (
        None, "its stages sequential@1 is not in the search space")  # not a priced stage plan
    auto = validate_plan(yaml.safe_load(PLAN) | {"target": "default", "stages": "auto"})
    assert ts.trial_params(space, base.max_context, ts.base_fields(auto, 1))[0] is None


def test_confirmation_picks_and_compares():
    from yggtree.offline.tune_objective import rotated
    from yggtree.offline.tune_report import confirm_candidates, confirm_summary

    assert [rotated([1, 2, 3], i) for i in range(4)] == [[1, 2, 3], [2, 3, 1], [3, 1, 2], [1, 2, 3]]
    base = {"d_max": 1}
    rows = [{"number": i, "state": st, "measured_tps": v, "fields": f, "infeasible": False}
            for i, st, v, f in ((0, "pruned", 5.0, base), (1, "complete", 9.0, {"d_max": 2}),
                                (2, "complete", 8.0, {"d_max": 3}), (3, "complete", 7.0, {"d_max": 4}),
                                (4, "pruned", None, {"d_max": 5}))]
    assert [r["number"] for r in confirm_candidates(rows, base, 2)] == [1, 2, 0]  # top 2, then the base
    assert [r["number"] for r in confirm_candidates(rows, {"d_max": 3}, 2)] == [1, 2]  # base among them
    assert [r["number"] for r in confirm_candidates(rows, None, 5)] == [1, 2, 3]

    def row(a, b):  # tokens/s of systems 0 and 1 on one prompt, 11 tokens
        return {0: {"new_tokens": 11, "decode_s": 10 / a}, 1: {"new_tokens": 11, "decode_s": 10 / b}}

    noisy = [row(10, 13), row(10, 9), row(20, 22), row(20, 19)]  # 1 is faster overall, within noise
    out = confirm_summary(noisy, [1, 0], ref=0)
    assert out["winner"] == 1 and out["beat_base"] == []
    c = out["candidates"]
    assert c[0]["base"] and c[0]["ratio_to_base"] == 1.0
    assert c[1]["ratio_to_base"] > 1 and c[1]["ci95"][0] < 1 < c[1]["ci95"][1]
    assert c[1]["confirmed_tps"] == pytest.approx(40 / (10 / 13 + 10 / 9 + 10 / 22 + 10 / 19))
    clear = [row(10, 12), row(20, 24), row(15, 18), row(12, 14.4)]  # 1.2x on every prompt
    assert confirm_summary(clear, [0, 1], ref=0)["beat_base"] == [1]


def test_pruning_rules_front_and_rungs():
    assert should_measure(5.0, [1.0, 9.0, 8.0], top=3) and not should_measure(5.0, [6, 9, 8], top=3)
    assert not should_stop(1.0, []) and should_stop(1.0, [2.0, 3.0]) and not should_stop(2.5, [2.0, 3.0])
    # too few completed trials to stop anyone: a lone fast base plan does not prune the others
    assert not should_stop(1.0, [2.0], min_completed=3) and not should_stop(1.0, [2.0, 3.0], min_completed=3)
    assert should_stop(1.0, [2.0, 3.0, 4.0], min_completed=3) and not should_stop(3.5, [2.0, 3.0, 4.0], 3)
    # (speed, graphs, id): 3 is beaten by 1 (faster, fewer graphs); 2 and 1 trade off
    assert pareto_front([(10.0, 8, 1), (12.0, 12, 2), (9.0, 9, 3)]) == [1, 2]
    assert rungs(1) == [1] and rungs(5) == [1, 2, 4, 5]
    assert token_contexts([10, 200], 4, 100) == [10, 11, 12, 13, 95, 96, 97, 98]


# ----------------------------------------------------------------------------- whole tunes


def test_tune_writes_plan_report_plots_and_reuses_artifacts(root, capsys):
    from yggtree.cli import main
    from yggtree.plan import load_plan
    from yggtree.runtime.objective import plan_policy

    out = root / "profiles"
    plan = load_plan(out / "first.yaml")
    assert plan.profile == str(out / "first.json") and plan_policy(plan) is not None
    report = json.loads((out / "first.tuning.json").read_text())
    assert report["reused"] == {"profile": "measured", "calibration": "measured"}
    assert report["trials"]["total"] == 4 and report["best"]["measured_tps"] > 0
    # the base plan is trial 0; the confirmation measured the best trials and it again
    trials = load(sqlite(root, "first.study.db"), "first").trials
    assert [t.number for t in base_trials(trials)] == [0]
    assert trials[0].user_attrs["fields"] == tiny_base_fields()
    conf = report["confirm"]
    assert conf["base_trial"] == 0 and conf["reference"] == 0 and conf["prompts"] == 3
    assert 0 in [c["number"] for c in conf["candidates"]] and conf["winner"] == report["best"]["number"]
    assert all(c["confirmed_tps"] > 0 and len(c["ci95"]) == 2 for c in conf["candidates"])
    assert report["best"]["confirmed_tps"] == max(c["confirmed_tps"] for c in conf["candidates"])
    assert "confirm" in report["phases_s"] and report["prompts"]["confirm_prompts"] == 3
    for kind in ("history", "importances", "pareto"):
        assert (out / f"first.{kind}.png").is_file() or report["plots"][kind] is None
    assert (out / "first.pareto.png").is_file() and report["pareto_front"]
    # a second tune of another name on this machine reuses both and says so
    capsys.readouterr()
    assert main(tune_args(root, "second", trials=3)) == 0
    cap = capsys.readouterr()
    assert "reusing profile" in cap.err and "reusing calibration" in cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["reused"] == {"profile": "reused", "calibration": "reused"}
    assert "best trials" in cap.out or "measured trials" in cap.out  # the rich table
    # more trials on the same study continue it: numbers go on, none runs twice
    assert main(tune_args(root, "second", trials=5)) == 0
    trials = load(sqlite(root, "second.study.db"), "second").trials
    assert [t.number for t in trials] == list(range(5))
    assert all(t.state.is_finished() for t in trials)
    assert [t.number for t in base_trials(trials)] == [0]  # enqueued once, not per run


def test_resume_after_kills_between_and_inside_trials(root):
    from optuna.trial import TrialState

    from yggtree.cli import main

    args = tune_args(root, "resume", trials=7)
    url = sqlite(root, "resume.study.db")
    # 1. killed between trials: right after trial 1's result is stored
    p = run_driver(args, "told", 1)
    wait(p)
    assert p.returncode == -9
    study = load(url, "resume")
    assert [t.number for t in study.trials] == [0, 1]
    assert all(t.state.is_finished() for t in study.trials)
    # 2. killed inside a trial: while the first measured trial from number 2 on decodes
    p = run_driver(args, "measure", 2)
    wait(p)
    assert p.returncode == -9
    study = load(url, "resume")
    running = [t for t in study.trials if t.state == TrialState.RUNNING]
    assert len(running) == 1 and running[0].number >= 2
    killed = running[0]
    out = root / "profiles"
    assert not (out / "resume.yaml").exists()  # no plan before the search ends
    assert not [f for f in out.iterdir() if ".partial" in f.name]
    done_before = {t.number: t.params for t in study.trials if t.state.is_finished()}
    # 3. the rerun continues the study to its end, then is killed in the confirmation: no plan
    p = run_driver(args, "confirm", 0)
    wait(p)
    assert p.returncode == -9
    searched = load(url, "resume").trials
    assert len(searched) == 8 and all(t.state.is_finished() for t in searched)
    assert not (out / "resume.yaml").exists()
    assert not [f for f in out.iterdir() if ".partial" in f.name]
    # 4. the last rerun runs no trial, redoes the confirmation and writes the plan
    assert main(args) == 0
    trials = load(url, "resume").trials
    assert len(trials) == 8
    assert [t.number for t in trials] == list(range(len(trials)))  # numbers continue, no gaps
    by_number = {t.number: t for t in trials}
    assert by_number[killed.number].state == TrialState.FAIL
    retries = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
    assert len(retries) == 1 and retries[0].params == killed.params  # re-run once, same plan
    assert retries[0].state.is_finished() and retries[0].number > killed.number
    for n, params in done_before.items():  # nothing completed ran again
        assert by_number[n].params == params and by_number[n].state.is_finished()
    live = [t for t in trials if t.number != killed.number]
    assert len(live) == 7 and all(t.state.is_finished() for t in live)
    assert [t.number for t in base_trials(trials)] == [0]  # enqueued once over four runs
    assert (out / "resume.yaml").is_file()


def test_two_processes_share_one_sqlite_study(root):
    from optuna.trial import TrialState

    from yggtree.cli import main

    n = 10
    args = tune_args(root, "pair", trials=n, extra=("--search-only",))
    # two processes started together (the profile and calibration exist: they reuse them)
    procs = [run_driver(args, pause=0.3), run_driver(args, pause=0.3)]
    try:
        errs = [wait(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    trials = load(sqlite(root, "pair.study.db"), "pair").trials
    assert [t.number for t in trials] == list(range(n))  # none lost, none twice
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    pids = {t.user_attrs["owner"]["pid"] for t in trials}
    assert len(pids) == 2  # both processes ran trials
    assert [t.number for t in base_trials(trials)] == [0]  # two workers enqueue it once
    # the coordinating command then finds the budget spent and writes the plan
    assert main(tune_args(root, "pair", trials=n)) == 0
    assert len(load(sqlite(root, "pair.study.db"), "pair").trials) == n
    # --workers 2: local processes started by the command itself
    assert main(tune_args(root, "pair", trials=n + 4, extra=("--workers", "2"))) == 0
    trials = load(sqlite(root, "pair.study.db"), "pair").trials
    assert [t.number for t in trials] == list(range(n + 4))
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    assert [t.number for t in base_trials(trials)] == [0]


def test_confirmation_decides_on_other_prompts(root, monkeypatch, capsys):
    """The trials' winner measured fast on its few prompts but is slow on the confirmation's:
    the plan written is the candidate fastest there, and no prompt is used twice."""
    import hashlib

    import yggtree.data as data
    import yggtree.offline.tune_objective as to
    from yggtree.cli import main
    from yggtree.plan import load_plan
    from yggtree.runtime.loading import encode_auto, load_tokenizer, resolve_model

    def prompts(n, *a, **k):  # distinct token ids per prompt (the tiny vocabulary is t0..t127)
        return [data.Prompt(id=f"calib/{i}", text=f"t{i % 120 + 1} t{i // 120 + 1} t7 t8") for i in range(n)]

    def speed(plan) -> float:  # a fixed, distinct speed per plan on the trials' prompts
        key = repr((plan.draft_widths, plan.verify_widths, plan.d_max, plan.top_k, plan.lookup,
                    plan.prefill_chunk, plan.stages, plan.weights))
        return 20 + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 1000 / 20

    seen = {"trials": [], "confirm": []}
    phase = ["trials"]
    real_side = to.measure_side_by_side

    def side_by_side(*a, **k):
        phase[0] = "confirm"
        return real_side(*a, **k)

    def decode(runner, ids):  # the confirmation reverses the trials' ranking
        v = speed(runner.plan) if phase[0] == "trials" else 100 - speed(runner.plan)
        seen[phase[0]].append((runner.plan, tuple(ids)))
        return to.Decoded(6, 5 / v, 3)

    monkeypatch.setattr(data, "calibration_chat_prompts", prompts)
    monkeypatch.setattr(to, "measure_side_by_side", side_by_side)
    monkeypatch.setattr(to, "decode_once", decode)
    capsys.readouterr()
    assert main(tune_args(root, "conf", trials=6)) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out.strip().splitlines()[-1])
    report = json.loads((root / "profiles" / "conf.tuning.json").read_text())
    conf = report["confirm"]
    cands = {c["number"]: c for c in conf["candidates"]}
    rows = {r["number"]: r for r in report["rows"]}
    done = [r for r in rows.values() if r["state"] == "complete"]
    trial_best = max(done, key=lambda r: r["measured_tps"])["number"]
    assert len(cands) >= 2 and trial_best in cands and conf["base_trial"] == 0 in cands
    assert set(cands) == {r["number"] for r in sorted(done, key=lambda r: -r["measured_tps"])[:3]} | {0}
    # the winner is the candidate slowest on the trials' prompts, fastest on the confirmation's
    expected = min(cands, key=lambda n: rows[n]["measured_tps"])
    assert summary["best_trial"] == conf["winner"] == expected != trial_best
    assert report["best"]["number"] == expected and "confirm" in report["phases_s"]
    for n, c in cands.items():
        assert c["confirmed_tps"] == pytest.approx(100 - rows[n]["measured_tps"])
        assert c["ratio_to_base"] == pytest.approx(c["confirmed_tps"] / cands[0]["confirmed_tps"])
    plan = load_plan(root / "profiles" / "conf.yaml")
    won = rows[expected]["fields"]
    assert (plan.d_max, plan.top_k, plan.lookup, plan.prefill_chunk) == (
        won["d_max"], won["top_k"], won["lookup"], won["prefill_chunk"])
    assert "confirmed on 3 held-out calibration prompts" in (root / "profiles" / "conf.yaml").read_text()
    assert "confirmed tok/s" in cap.out  # the rich table
    # prompts: the calibration's first, then the trials', then the confirmation's; none shared
    calibration = next((root / "profiles").glob("*.calibration/calibration.json"))  # the one reused
    n_cal = json.loads(calibration.read_text())["data"]["prompts"]
    tok = load_tokenizer(resolve_model(str(root / "model")))
    index = {tuple(encode_auto(tok, p.text)): i for i, p in enumerate(prompts(40))}
    trial_prompts = {index[ids] for _, ids in seen["trials"]}
    confirm_prompts = [index[ids] for _, ids in seen["confirm"]]
    assert trial_prompts <= {n_cal, n_cal + 1}
    assert sorted(set(confirm_prompts)) == [n_cal + 2, n_cal + 3, n_cal + 4]
    # every candidate on a prompt before the next prompt, the order rotating
    k = len(cands)
    assert confirm_prompts == [p for p in sorted(set(confirm_prompts)) for _ in range(k)]
    order = [[speed(pl) for pl, _ in seen["confirm"][i * k:(i + 1) * k]] for i in range(3)]
    assert order[1] == order[0][1:] + order[0][:1] and sorted(order[0]) == sorted(order[1])


def test_base_plan_outside_the_space_is_named(root, capsys):
    from yggtree.cli import main

    capsys.readouterr()
    assert main(tune_args(root, "nobase", trials=3, extra=("--space", "prefill_chunk=8"))) == 0
    err = capsys.readouterr().err
    line = "the base plan 'tiny' is not a candidate: its prefill_chunk 4 is not in the search space"
    assert f"tune: {line}" in err.splitlines(), err
    trials = load(sqlite(root, "nobase.study.db"), "nobase").trials
    assert not base_trials(trials) and len(trials) == 3
    conf = json.loads((root / "profiles" / "nobase.tuning.json").read_text())["confirm"]
    assert conf["base_trial"] is None and "not a trial" in conf["note"]


# ----------------------------------------------------------------------------- bad input


def _one_line_error(capsys, argv, match: str) -> None:
    from yggtree.cli import main

    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_bad_input_is_refused_in_one_line(root, capsys):
    out = root / "profiles"
    _one_line_error(capsys, tune_args(root, "bad", storage="postgresql://u@127.0.0.1:1/none"),
                    "cannot open study storage postgresql://u@127.0.0.1:1/none")
    _one_line_error(capsys, tune_args(root, "bad", storage=f"sqlite:///{root}/no/such/dir/s.db"),
                    "does not exist")
    _one_line_error(capsys, tune_args(root, "bad", storage="not a url"), "is not a database URL")
    _one_line_error(capsys, tune_args(root, "bad", extra=("--space", "verify_widths=64")), "no valid plan")
    _one_line_error(capsys, tune_args(root, "bad", extra=("--space", "d_max=5..2")), "empty range")
    # the study of the first tune, asked to tune another target (a copy of the model)
    shutil.copytree(root / "model", root / "model2", dirs_exist_ok=True)
    other = root / "plan2.yaml"
    other.write_text(PLAN.replace("target: model", "target: model2").replace("max_context: 96", "max_context: 80"))
    argv = tune_args(root, "first", storage=sqlite(root, "first.study.db"))
    argv[argv.index(str(root / "plan.yaml"))] = str(other)
    _one_line_error(capsys, argv, "study 'first' tunes another setup")
    # a plan the user wrote is never replaced without --force
    mine = out / "mine.yaml"
    mine.write_text("# my own plan\n" + PLAN)
    _one_line_error(capsys, tune_args(root, "mine"), "was not written by this tune")
    assert mine.read_text() == "# my own plan\n" + PLAN


# ----------------------------------------------------------------------------- PostgreSQL


def _pg_bin() -> Path | None:
    for d in [os.environ.get("PG_BIN"), *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]:
        if d and (Path(d) / "initdb").is_file() and (Path(d) / "pg_ctl").is_file():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found and shutil.which("pg_ctl") else None


@pytest.fixture(scope="module")
def postgres():
    """A throw-away PostgreSQL server on a free local port (as user postgres when run as root)."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'psycopg[binary]')")
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    import tempfile

    as_user: list[str] = []
    top = Path(tempfile.mkdtemp(prefix="yggtree-pg-"))  # outside pytest's root-only directory
    data = top / "data"
    if os.geteuid() == 0:  # initdb refuses to run as root
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: cannot start PostgreSQL as another user")
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server")
        as_user = ["runuser", "-u", "postgres", "--"]
        top.chmod(0o777)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"LC_ALL": "C"}

    def run(*cmd):
        return subprocess.run([*as_user, *cmd], env=env, capture_output=True, text=True, timeout=120)

    r = run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
    if r.returncode != 0:
        shutil.rmtree(top, ignore_errors=True)
        pytest.skip(f"initdb failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    opts = f"-p {port} -k {data} -c listen_addresses=127.0.0.1"
    r = run(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-w", "-l", str(data / "log"), "start")
    if r.returncode != 0:
        pytest.skip(f"PostgreSQL did not start: {r.stderr.strip() or r.stdout.strip()}")
    try:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres",
                             autocommit=True) as con:
            con.execute("CREATE DATABASE tune")
        yield f"postgresql://postgres@127.0.0.1:{port}/tune"
    finally:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(top, ignore_errors=True)


def test_tune_on_postgresql(root, postgres, capsys):
    from optuna.trial import TrialState

    from yggtree.cli import main

    assert main(tune_args(root, "pg", trials=4, storage=postgres, extra=("--workers", "2"))) == 0
    trials = load(postgres, "pg").trials
    assert [t.number for t in trials] == list(range(4))
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["best_trial"] in range(4) and Path(summary["plan"]).is_file()
    # the same study from another tune of another setup: refused in one line
    _one_line_error(capsys, tune_args(root, "pg", trials=4, storage=postgres,
                                      extra=("--space", "lookup=0")), "tunes another setup")
