"""The stage-plan and weight-format dimensions of ``yggtree tune`` (issue #25 item 2): candidates
from the worker's threads and the cores, the weight formats this machine and model run, the
overrides, the constraints, the latency model's pricing of a stage plan, and whole tunes of a
tiny random checkpoint (eager backend) whose plans carry the searched ``stages`` and ``weights``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from yggtree.errors import YggError
from yggtree.offline import tune_space as ts
from yggtree.offline import weight_check

transformers = pytest.importorskip("transformers")
optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.usefixtures("one_thread")

from test_compile import save_tiny_checkpoint, tiny_plan  # noqa: E402
from test_tune import load, sqlite, tune_args  # noqa: E402

PLAN = tiny_plan("[2]")


@pytest.fixture
def cores(monkeypatch):
    """Pretend the affinity mask holds ``n`` cores (schedule.resolve_plan's check reads it)."""
    import yggtree.runtime.schedule as schedule

    def set_cores(n: int) -> None:
        monkeypatch.setattr(schedule, "usable_cores", lambda: n)
    return set_cores


def base_plan(**over):
    from yggtree.plan import validate_plan

    return validate_plan(yaml.safe_load(PLAN) | {"target": "default", "verify_widths": [2, 4]} | over)


# ----------------------------------------------------------------------------- stage plans


def test_stage_candidates_follow_the_worker_threads(cores):
    cores(4)
    assert ts.stage_candidates(1) == ("sequential@1", "ahead@1")
    assert ts.stage_candidates(2) == ("sequential@1", "sequential@2", "ahead@1", "ahead@2", "overlap@1+1")
    three = ts.stage_candidates(3)
    assert [x for x in three if x.startswith("overlap")] == ["overlap@1+1", "overlap@1+2", "overlap@2+1"]
    for threads in (1, 2, 3):
        space = ts.default_space(base_plan(), threads)
        assert space.stages == ts.stage_candidates(threads)
        assert all(ts.stage_problem(label, threads) is None for label in space.stages)
        ts.check_space(space, base_plan(), threads)
        # never more threads than the worker has
        assert max(sum(map(int, x.split("@")[1].split("+"))) for x in space.stages) == threads


def test_stage_splits_are_checked_against_cores_and_worker(cores):
    cores(2)
    # the affinity-mask check is schedule.resolve_plan's (one message for the tune and the run)
    assert ts.stage_problem("sequential@3", 4) == "sequential@3: threads 3 exceeds this machine's 2 usable cores"
    assert ts.stage_problem("overlap@2+1", 4) == "overlap@2+1: threads 2+1 exceeds this machine's 2 usable cores"
    assert ts.stage_problem("overlap@1+1", 1) == "overlap@1+1 uses 2 threads, a worker has --threads 1"
    assert ts.stage_problem("sequential@0", 1) == "sequential@0: the target needs >= 1 thread"
    assert ts.stage_problem("overlap@1+1", 2) is None
    space = ts.apply_overrides(ts.default_space(base_plan(), 1), ["stages=overlap@1+1"], "float32", 1)
    with pytest.raises(YggError, match=r"^--space stages: overlap@1\+1 uses 2 threads, a worker has --threads 1$"):
        ts.check_space(space, base_plan(), 1)
    space = ts.apply_overrides(ts.default_space(base_plan(), 2), ["stages=sequential@3"], "float32", 2)
    with pytest.raises(YggError, match="^--space stages: sequential@3: threads 3 exceeds this machine's 2 usable"):
        ts.check_space(space, base_plan(), 2)


def test_overrides_are_spelled_out_or_refused(cores):
    cores(2)
    space = ts.default_space(base_plan(), 2)
    got = ts.apply_overrides(space, ["stages=sequential,overlap,ahead@1,sequential@2",
                                     "weights=int4,float32,int8,int8"], "float32", 2)
    assert got.stages == ("sequential@2", "overlap@1+1", "ahead@1")
    assert got.weights == ("int4@32", "float32", "int8")
    assert got.size() == space.size() // (5 * 5) * (3 * 3)
    assert ts.apply_overrides(space, ["stages=overlap"], "float32", 1).stages == ("overlap@1+1",)
    refused = {
        "stages=auto": "unknown stage plan 'auto'",
        "stages=ahead@1+1": "only overlap has a drafter worker",
        "stages=overlap@x": "thread split 'x'",
        "stages=1,2": "unknown stage plan '1'",
        "stages=,": "no values",
        "weights=int4@7": "groups of 32, 64, 128, 256 columns",
        "weights=bfloat16": "float weights run in the activations' dtype",
        "weights=int3": "unknown weight format 'int3'",
    }
    for item, msg in refused.items():
        with pytest.raises(YggError, match=f"^{re.escape('--space ' + item)}: .*{re.escape(msg)}") as e:
            ts.apply_overrides(space, [item], "float32", 2)
        assert "\n" not in str(e.value)


def test_infeasible_stage_combinations(cores):
    cores(2)
    ok = {"draft_widths": [1, 2], "verify_widths": [2, 4], "d_max": 2, "top_k": 2, "lookup": 2,
          "prefill_chunk": 4, "stages": "overlap@1+1", "weights": "int8"}
    assert ts.infeasible(ok, 96, True, 2) is None
    assert ts.infeasible(ok, 96, False, 2) == "stages overlap@1+1 needs a drafter"
    assert ts.infeasible(ok | {"stages": "ahead@1"}, 96, False, 2) == "stages ahead@1 needs a drafter"
    assert ts.infeasible(ok | {"stages": "sequential@1"}, 96, False, 2) is None
    assert ts.infeasible(ok, 96, True, 1) == "overlap@1+1 uses 2 threads, a worker has --threads 1"
    plan = ts.candidate_plan(base_plan(), ok, "cand", None, None)
    assert (plan.stages, plan.weights) == ("overlap@1+1", "int8")


# ----------------------------------------------------------------------------- valid plans only


def _random_space(draw):
    from hypothesis import strategies as st

    def ints(lo, hi, most):
        return tuple(sorted(draw(st.sets(st.integers(lo, hi), min_size=1, max_size=most))))

    return ts.SearchSpace(draft_widths=ints(1, 6, 3), verify_widths=ints(1, 24, 3), d_max=ints(1, 5, 3),
                          top_k=ints(1, 4, 2), lookup=ints(0, 12, 3), prefill_chunk=ints(1, 40, 2),
                          stages=draw(st.sampled_from([("sequential@1",), ("sequential@1", "ahead@1")])),
                          weights=draw(st.sampled_from([("float32",), ("float32", "int8")])))


def _valid_by_brute_force(space: ts.SearchSpace, max_context: int) -> set:
    """Every (draft set, d_max, verify set, lookup, prefill chunk) of the space's product that
    :func:`infeasible` (the plan schema's mirror) takes."""
    import itertools

    out = set()
    for dw, d, vw, n, c in itertools.product(ts.subsets(space.draft_widths), space.d_max,
                                             ts.subsets(space.verify_widths), space.lookup, space.prefill_chunk):
        f = ts.plan_fields({"draft_widths": dw, "verify_widths": vw, "d_max": d, "top_k": 1, "lookup": n,
                            "prefill_chunk": c, "stages": None, "weights": None}, space)
        if ts.infeasible(f, max_context) is None:
            out.add((dw, d, vw, n, c))
    return out


def test_allowed_leaves_exactly_the_valid_plans():
    """Following :func:`allowed` key by key reaches every valid combination and nothing else, its
    runs of d_max, verify sets and lookup are contiguous (what suggest's index ranges need), and
    :func:`plan_count` counts them; a space with none is refused by check_space in one line."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=100, deadline=None)
    @given(st.data(), st.integers(4, 40))
    def check(data, max_context):
        space = _random_space(data.draw)
        want = _valid_by_brute_force(space, max_context)
        got = set()
        for dw in ts.allowed(space, max_context, "draft_widths", {}):
            for d in ts.allowed(space, max_context, "d_max", {"draft_widths": dw}):
                vws = ts.allowed(space, max_context, "verify_widths", {"draft_widths": dw, "d_max": d})
                for vw in vws:
                    ns = ts.allowed(space, max_context, "lookup", {"verify_widths": vw})
                    for key, run in (("d_max", ts.allowed(space, max_context, "d_max", {"draft_widths": dw})),
                                     ("verify_widths", vws), ("lookup", ns)):
                        full = ts.choices(space, key)
                        i = full.index(run[0])
                        assert full[i:i + len(run)] == run, (key, run)
                    got |= {(dw, d, vw, n, c) for n in ns
                            for c in ts.allowed(space, max_context, "prefill_chunk", {})}
        assert got == want
        rest = len(space.top_k) * len(space.stages) * len(space.weights)
        assert ts.plan_count(space, max_context) == len(want) * rest
        if not want:
            base = base_plan(max_context=max_context, prefill_chunk=1, draft_widths=[1], d_max=1,
                             verify_widths=[1], sampling={"max_new_tokens": 1})
            with pytest.raises(YggError, match="^--space") as e:
                ts.check_space(space, base, 1)
            assert "\n" not in str(e.value)

    check()


def test_every_sampled_plan_is_valid(cores):
    """Many TPE trials (past its random start-up) over random spaces: every plan suggest draws is
    valid (infeasible finds nothing, the plan schema takes it), unconstrained keys keep their
    categorical names, and stage plans can be limited to those the profile prices."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    cores(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data(), st.integers(8, 40), st.integers(0, 2**16))
    def check(data, max_context, seed):
        space = _random_space(data.draw)
        base = base_plan(max_context=max_context, prefill_chunk=1, draft_widths=[1], d_max=1, verify_widths=[1],
                         sampling={"max_new_tokens": 1})
        valid = _valid_by_brute_force(space, max_context)
        if not valid:
            return
        stages = data.draw(st.sampled_from([None, space.stages[-1:]]))  # as if the profile priced one
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, constant_liar=True)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        seen = set()
        for _ in range(30):
            trial = study.ask()
            params = ts.suggest(trial, space, max_context, stages)
            fields = ts.plan_fields(params, space)
            assert ts.infeasible(fields, max_context, True, 1) is None, fields
            ts.candidate_plan(base, fields, "cand", None, None)  # the schema takes it
            key = (params["draft_widths"], params["d_max"], params["verify_widths"], params["lookup"],
                   params["prefill_chunk"])
            assert key in valid
            seen.add(key)
            assert params["stages"] in (stages or space.stages)
            assert ("weights" in trial.params) == (len(space.weights) > 1)
            assert not {"d_max", "verify_widths", "lookup"} & set(trial.params)  # sampled as *_index
            study.tell(trial, fields["d_max"] * max(fields["verify_widths"]) - fields["lookup"])

    check()
    # stage plans limited to some of the space's: a categorical of its own name (one choice set per name)
    space = ts.SearchSpace((1, 2), (2, 4), (1, 2), (2,), (0,), (4,), ("sequential@1", "ahead@1", "overlap@1+1"),
                           ("float32",))
    trial = optuna.create_study().ask()
    assert ts.suggest(trial, space, 96, ("sequential@1", "overlap@1+1"))["stages"] in ("sequential@1", "overlap@1+1")
    assert "stages[sequential@1,overlap@1+1]" in trial.params and "stages" not in trial.params


def test_a_space_without_a_valid_plan_is_refused_before_the_study(tiny, capsys):
    """Each dimension on its own is possible (check_space's per-dimension checks pass) but no
    combination is: lookup 6 needs a verify width >= 6, and 8, the only one, exceeds the largest
    drafted tree (1 + 2 * 2 = 5)."""
    from test_tune import _one_line_error

    from yggtree.plan import load_plan

    space = ts.apply_overrides(ts.default_space(load_plan(tiny / "plan.yaml"), 1),
                               ["verify_widths=2,8", "lookup=6"])
    assert ts.plan_count(space, 96) == 0
    msg = ("--space: no combination of draft widths, d_max, verify widths and lookup makes a valid plan "
           "(each needs max W_v <= 1 + d_max * max W_d < max_context 96 and lookup <= max W_v)")
    _one_line_error(capsys, tune_args(tiny, "none", extra=("--space", "verify_widths=2,8", "--space", "lookup=6")),
                    msg)
    assert not (tiny / "profiles" / "none.study.db").exists()


def test_a_study_of_the_old_parameter_encoding_is_refused(tmp_path):
    from yggtree.offline.tune import STUDY_FORMAT
    from yggtree.offline.tune_study import open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    open_study(url, "old", {"format": 1, "target": "default"})
    with pytest.raises(YggError, match=f"^study 'old' was made by another version of yggtree tune "
                                       f"\\(study format 1, this tune writes {STUDY_FORMAT}: ") as e:
        open_study(url, "old", {"format": STUDY_FORMAT, "target": "default"})
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- weight formats


def test_weight_candidates_and_canonical_forms():
    assert ts.weight_candidates(base_plan()) == ("float32", "int8", "int4@32", "gguf-native", "w4a8")
    assert ts.weight_candidates(base_plan(weights="int4@64")) == (
        "int4@64", "float32", "int8", "int4@32", "gguf-native", "w4a8")
    assert ts.weight_candidates(base_plan(dtype="bfloat16", weights="int8"))[:2] == ("int8", "bfloat16")
    assert ts.plan_weights(base_plan()) == "float32" and ts.plan_weights(base_plan(weights="int4")) == "int4@32"
    space = ts.default_space(base_plan(weights="int8"), 1)
    assert ts.profiled_weights(space, base_plan(weights="int8")) == "int8"
    assert ts.profiled_weights(ts.apply_overrides(space, ["weights=int4,float32"]), base_plan(weights="int8")) == "int4@32"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune-space")
    save_tiny_checkpoint(root / "model")
    (root / "plan.yaml").write_text(PLAN)
    return root


def test_weight_formats_the_model_or_machine_cannot_run_are_left_out(tiny, monkeypatch):
    from yggtree.plan import load_plan
    from yggtree.runtime import quant

    base = load_plan(tiny / "plan.yaml")  # hidden 32, MLP 48: a group of 32 does not divide 48
    space = ts.default_space(base, 1)
    problems = weight_check.weight_problems(base, space.weights, 4)
    assert problems == {"int4@32": "group 32 does not divide the input width 48 of the model",
                        "gguf-native": "the target model is not a GGUF file",
                        "w4a8": "group 32 does not divide the input width 48 of the model"}
    assert ts.runnable_weights(space, problems, given=False).weights == ("float32", "int8")
    with pytest.raises(YggError, match="^--space weights: int4@32 cannot run here: group 32 does not divide"):
        ts.runnable_weights(space, problems, given=True)
    with pytest.raises(YggError, match="no weight format this machine runs is left"):
        ts.check_space(ts.runnable_weights(ts.apply_overrides(space, ["weights=gguf-native"]), problems,
                                           given=False), base, 1)

    def not_invariant(model, rows, what="target"):
        raise YggError(f"the Int8Linear kernel of the {what} is not batch-invariant on this CPU")

    monkeypatch.setattr(quant, "check_batch_invariant", not_invariant)  # quant.py's own check decides
    assert weight_check.weight_problem("int8", base, 4) == "the Int8Linear kernel of the probe layers is not " \
                                                "batch-invariant on this CPU"
    assert weight_check.weight_problem("float32", base, 4) is None  # float weights: nothing to check


# ----------------------------------------------------------------------------- pricing


FORMS = {"context": 64, "d_max": 2, "warmup": 1, "repeats": 1, "splits": {
    "1": {"threads": 1, "verify_ms": {"2": 4.0, "4": 5.0}, "head_ms": 1.0, "draft_ms": {"1": 2.0, "2": 3.0},
          "ahead_ms": {"2": 1.5, "4": 2.5}},
    "2": {"threads": 2, "verify_ms": {"2": 3.0, "4": 3.5}, "head_ms": 0.75, "draft_ms": {"1": 1.5, "2": 2.0},
          "ahead_ms": {"2": 1.0, "4": 2.0}},
    "1+1": {"threads": 1, "draft_threads": 1, "verify_ms": {"2": 4.0, "4": 5.0}, "spec_ms": {"1": 6.0, "2": 7.0},
            "pair": {f"{wv},{wd}": {"wall_ms": 8.0, "verify_ms": 5.0, "spec_ms": 7.5}
                     for wv in (2, 4) for wd in (1, 2)}}}}
SHAPES = [(d, wd, wv) for d in (1, 2) for wd in (1, 2) for wv in (2, 4)]


def test_stage_scale_is_the_plan_search_estimate_over_sequential():
    from yggtree.offline.plan_search import predict_ms
    from yggtree.offline.tune_objective import stage_scale

    def other(shape):
        return 0.5 * shape[0]

    def hit(shape):
        return 0.25

    assert stage_scale("sequential@2", FORMS, 2, SHAPES, other, hit, False) is None
    assert stage_scale("sequential@1", None, 1, SHAPES, other, hit, False) is None
    for label in ("ahead@2", "sequential@1", "overlap@1+1"):
        sc = stage_scale(label, FORMS, 2, SHAPES, other, hit, False)
        for shape in SHAPES:
            want = (predict_ms(label, FORMS, shape, other(shape), 0.25, False)
                    / predict_ms("sequential@2", FORMS, shape, other(shape), 0.25, False))
            assert sc.step[shape] == want
        assert sc.plain == FORMS["splits"][label.split("@")[1].split("+")[0]]["verify_ms"]["2"] / 3.0
    # ahead@2 at (2, 1, 2): 1 draft call (EAGLE: D - 1) + verify + ahead + other, over head + draft + verify + other
    assert stage_scale("ahead@2", FORMS, 2, SHAPES, other, hit, False).step[(2, 1, 2)] == \
        (1.5 + 3.0 + 1.0 + 1.0) / (0.75 + 1.5 + 3.0 + 1.0)
    with pytest.raises(YggError, match=r"^stages ahead@1 is not a candidate: the profile has no stage forms "
                                       r"\(it prices sequential@1\)$"):
        stage_scale("ahead@1", None, 1, SHAPES, other, hit, False)
    with pytest.raises(YggError, match="do not measure it"):
        stage_scale("overlap@2+1", FORMS, 2, SHAPES, other, hit, False)
    with pytest.raises(YggError, match="lack what it needs"):
        stage_scale("ahead@2", FORMS, 2, [(1, 8, 2)], other, hit, False)


# ----------------------------------------------------------------------------- whole tunes


def tune(root: Path, hw: str, space: list[str], trials: int, out: str = "profiles") -> list:
    from yggtree.cli import main

    args = tune_args(root, hw, trials=trials, extra=tuple(a for item in space for a in ("--space", item)))
    args[args.index("--out-dir") + 1] = str(root / out)
    assert main(args) == 0
    return load(f"sqlite:///{root / out / (hw + '.study.db')}", hw).trials


@pytest.fixture(scope="module")
def q(tiny):
    """A tune of int8 weights only (so the profile measures int8) over sequential@1 and ahead@1."""
    return tune(tiny, "q", ["stages=sequential@1,ahead@1", "weights=int8"], trials=5)


@pytest.mark.slow
def test_tune_searches_stages_and_weights_into_a_plan_that_loads(tiny, q):
    from yggtree.offline.tune_artifacts import envelope_plan, profile_covers
    from yggtree.plan import load_plan

    out = tiny / "profiles"
    trials = q
    prof = json.loads((out / "q.json").read_text())
    assert prof["plan"]["weights"] == "int8"  # the only format in the space: the profile measured it
    assert set(prof["stage_forms"]["splits"]) >= {"1"}
    assert {t.params["stages"] for t in trials} == {"sequential@1", "ahead@1"}
    assert "weights" not in trials[0].params  # one value: fixed, no optuna parameter
    for t in trials:
        assert t.user_attrs["fields"]["weights"] == "int8"
        assert "predicted_tps" in t.user_attrs and "unpriced" not in t.user_attrs
        assert t.user_attrs["stage_pricing"].startswith(t.params["stages"] + ":")
    report = json.loads((out / "q.tuning.json").read_text())
    assert report["identity"]["space"]["stages"] == ["sequential@1", "ahead@1"]
    assert report["identity"]["space"]["weights"] == ["int8"]
    best = report["best"]["fields"]
    plan = load_plan(out / "q.yaml")  # the written plan round-trips through plan.py
    assert (plan.stages, plan.weights) == (best["stages"], "int8")
    assert yaml.safe_load((out / "q.yaml").read_text())["weights"] == "int8"
    # the profile prices int8 only: a float envelope does not reuse it
    base = load_plan(tiny / "plan.yaml")
    space = ts.apply_overrides(ts.default_space(base, 1), ["weights=float32"])
    why = profile_covers(out / "q.json", envelope_plan(base, space, "x"), 1)
    assert why.endswith("q.json measured int8 weights, plan 'x-envelope' runs float32: each weight format "
                        "has its own curves; run `yggtree profile --plan ...` for this plan"), why


@pytest.mark.slow
def test_a_format_the_profile_did_not_measure_is_measured_not_predicted(tiny):
    from optuna.trial import TrialState

    from yggtree.plan import load_plan

    trials = tune(tiny, "mix", ["stages=sequential@1", "weights=float32,int8"], trials=6, out="mix")
    out = tiny / "mix"
    assert json.loads((out / "mix.json").read_text())["plan"]["weights"] == "float32"
    kinds = {t.params["weights"] for t in trials}
    assert kinds == {"float32", "int8"}
    for t in trials:
        a = t.user_attrs
        if t.params["weights"] == "int8":
            assert a["unpriced"] == ("weights int8: the profile measured float32 weights; no prediction, "
                                     "measured directly with the envelope tree")
            assert "predicted_tps" not in a and 0 not in t.intermediate_values
            assert a.get("pruned_at") != "predicted" and "infeasible" not in a
            assert t.state == TrialState.COMPLETE or "duplicate_of" in a or a["pruned_at"].startswith("measured")
        else:
            assert "unpriced" not in a and a["predicted_tps"] == round(t.intermediate_values[0], 3)
    rows = json.loads((out / "mix.tuning.json").read_text())["rows"]
    assert {r["number"]: bool(r["unpriced"]) for r in rows} == {
        t.number: t.params["weights"] == "int8" for t in trials}
    plan = load_plan(out / "mix.yaml")
    best = json.loads((out / "mix.tuning.json").read_text())["best"]["fields"]
    assert (plan.stages, ts.plan_weights(plan)) == ("sequential@1", best["weights"])
    # a plan's objective refuses a profile of another format: an int8 winner names none
    assert (plan.profile is None and plan.calibration is None) == (best["weights"] == "int8")


@pytest.mark.slow
def test_without_stage_forms_only_sequential_at_the_threads_is_sampled(tiny, q, capsys):
    """A profile made before stage forms (the key dropped from q's): it prices sequential@1 only,
    so ahead@1 is not sampled (said once, with the reason) and no trial is spent on it."""
    (tiny / "legacy").mkdir()
    prof = json.loads((tiny / "profiles" / "q.json").read_text())
    del prof["stage_forms"]
    (tiny / "legacy" / "old.json").write_text(json.dumps(prof))
    shutil.copytree(tiny / "profiles" / "q.calibration", tiny / "legacy" / "old.calibration")
    capsys.readouterr()
    trials = tune(tiny, "nf", ["stages=sequential@1,ahead@1", "weights=int8"], trials=6, out="legacy")
    err = capsys.readouterr().err
    assert ("stages ahead@1 not sampled: stages ahead@1 is not a candidate: the profile has no stage "
            "forms (it prices sequential@1)") in err
    assert len(trials) == 6 and not any("stages" in t.params for t in trials)  # one stage plan left: fixed
    for t in trials:
        assert t.user_attrs["fields"]["stages"] == "sequential@1" and "infeasible" not in t.user_attrs
        assert t.user_attrs["stage_pricing"] == (
            "sequential@1: the profile's curves; the profile has no stage forms, so sequential@1 is "
            "the only stage plan it prices")
    assert not (tiny / "legacy" / "nf.json").exists()  # the old profile was reused


def test_impossible_stage_and_weight_overrides_are_one_line(tiny, capsys):
    from test_tune import _one_line_error

    for item, msg in (("stages=overlap@1+1", "--space stages: overlap@1+1 uses 2 threads, a worker has --threads 1"),
                      ("stages=auto", "--space stages=auto: unknown stage plan 'auto'"),
                      ("weights=int4@32", "--space weights: int4@32 cannot run here: group 32 does not divide "
                                          "the input width 48 of the model"),
                      ("weights=gguf-native", "--space weights: gguf-native cannot run here: the target model "
                                              "is not a GGUF file"),
                      ("weights=bfloat16", "float weights run in the activations' dtype")):
        _one_line_error(capsys, tune_args(tiny, "refused", extra=("--space", item)), msg)
    assert not (tiny / "profiles" / "refused.study.db").exists()  # refused before anything ran


@pytest.mark.slow
def test_a_stage_scale_scales_the_predicted_time(tiny, q):
    """Every step (tree or plain) twice as long: exactly half the predicted tokens/s; the
    stage-forms scale of sequential@1 is the curves' own (None)."""
    from yggtree.offline.tune_objective import StageScale, predicted_tokens_per_s, stage_scale
    from yggtree.plan import load_plan
    from yggtree.runtime.calibration import Calibration
    from yggtree.runtime.cost import CostModel

    plan = load_plan(tiny / "profiles" / "q.yaml")
    cost = CostModel.from_profile(plan.profile, plan)
    calib = Calibration.load(plan.calibration, plan)
    contexts = list(range(10, 40))
    shapes = [(d, wd, wv) for d in (1, 2) for wd in (1, 2) for wv in (2,)]
    twice = StageScale("ahead@1", dict.fromkeys(shapes, 2.0), 2.0)
    args = (cost, calib, (1, 2), (2,), 2, contexts)
    assert predicted_tokens_per_s(*args, twice) == predicted_tokens_per_s(*args) / 2
    forms = json.loads(Path(plan.profile).read_text())["stage_forms"]
    assert stage_scale("sequential@1", forms, 1, shapes, lambda s: 0.0, lambda s: 0.0, True) is None
    real = stage_scale("ahead@1", forms, 1, shapes, lambda s: 0.0, lambda s: 0.0, True)
    assert real.plain == 1.0 and set(real.step) == set(shapes)  # same threads: plain steps unchanged
