"""The execution plan search (offline/plan_search.py): pure predictions from a profile's stage
forms, the choice per shape and overall, hit rates from a calibration table, and old profiles
(no stage forms) meaning no candidates."""

from __future__ import annotations

import pytest

from yggtree.errors import YggError
from yggtree.offline.plan_search import candidates, hit_rate, plan_shapes, predict_ms, search
from yggtree.offline.profile_stages import thread_splits
from yggtree.runtime.schedule import resolve_plan, usable_cores

FORMS = {
    "context": 64, "d_max": 3,
    "splits": {
        "1": {"threads": 1, "verify_ms": {"4": 10.0}, "head_ms": 1.0, "draft_ms": {"2": 2.0},
              "ahead_ms": {"4": 1.5}},
        "2": {"threads": 2, "verify_ms": {"4": 7.0}, "head_ms": 0.8, "draft_ms": {"2": 1.8},
              "ahead_ms": {"4": 0.5}},
        "1+1": {"threads": 1, "draft_threads": 1, "verify_ms": {"4": 10.0}, "spec_ms": {"2": 8.0},
                "pair": {"4,2": {"wall_ms": 12.5, "verify_ms": 12.0, "spec_ms": 9.0}}},
    },
}


def test_thread_splits_cover_the_cores():
    assert thread_splits(1) == ["1"]
    assert thread_splits(2) == ["1", "2", "1+1"]
    assert set(thread_splits(3)) == {"1", "2", "3", "1+1", "1+2", "2+1"}


def test_candidates_are_the_plans_with_data():
    assert candidates(FORMS) == ["sequential@1", "ahead@1", "sequential@2", "ahead@2", "overlap@1+1"]
    assert candidates(None) == [] and candidates({}) == []  # an old profile: no stage forms
    for label in candidates(FORMS):  # every candidate is a plan the runtime takes
        if usable_cores() >= 2:
            assert resolve_plan(label, True).label == label


def test_predictions_follow_the_plan_formulas():
    shape, other = (3, 2, 4), 0.5  # D = 3, W_d = 2, W_v = 4; an LM drafter feeds its leaves: 3 steps
    assert predict_ms("sequential@1", FORMS, shape, other, 0.0, True) == pytest.approx(1 + 3 * 2 + 10 + 0.5)
    assert predict_ms("ahead@2", FORMS, shape, other, 0.0, True) == pytest.approx(3 * 1.8 + 7 + 0.5 + 0.5)
    # overlap: the contended pair (12 ms, job 9 ms at D_max = D), 0.5 ms sync, and the redraft
    # in sequence (7 ms) when the guess misses
    assert predict_ms("overlap@1+1", FORMS, shape, other, 1.0, True) == pytest.approx(12 + 0.5 + 0.5)
    assert predict_ms("overlap@1+1", FORMS, shape, other, 0.25, True) == pytest.approx(13 + 0.75 * 7)
    # a shallower tree: the job scales with its calls (2 heads + D steps), here below verify
    assert predict_ms("overlap@1+1", FORMS, (1, 2, 4), other, 1.0, True) == pytest.approx(12 + 0.5 + 0.5)
    # an EAGLE head skips the last level's step: one call less everywhere
    assert predict_ms("sequential@1", FORMS, shape, other, 0.0, False) == pytest.approx(1 + 2 * 2 + 10 + 0.5)


def test_search_picks_the_lowest_prediction_per_shape_and_overall():
    res = search(FORMS, [(3, 2, 4)], lambda s: 0.5, lambda s: 0.0, True)
    pred = res["per_shape"][0]["predicted_ms"]
    assert set(pred) == set(candidates(FORMS))
    assert res["per_shape"][0]["best"] == min(pred, key=pred.get) == res["chosen"] == "ahead@2"
    sure = search(FORMS, [(3, 2, 4)], lambda s: 0.5, lambda s: 1.0, True)  # every guess used
    assert sure["chosen"] == "overlap@1+1"
    assert search(None, [(3, 2, 4)], lambda s: 0.5, lambda s: 0.0, True) is None


def test_hit_rate_from_a_calibration_table():
    aal = {"1": [[1.6, 1.6], [1.9, 2.0]], "2": [[1.7, 1.8], [2.1, 2.3], [2.4, 2.6]]}
    cols = (2, 4)
    # P(accepted >= 2) at W_d 2, W_v 4 = 2.3 - 1.8; P(top-1 is the bonus) ~ AAL(1 deep, W_v 2) - 1
    assert hit_rate(aal, cols, 2, 2, 4) == pytest.approx(0.5 * 0.6)
    assert hit_rate(aal, cols, 1, 2, 2) == pytest.approx(0.7 * 0.6)
    assert hit_rate(None, cols, 2, 2, 4) == 0.0 and hit_rate(aal, cols, 2, 2, 8) == 0.0


def test_plan_shapes_fit_the_widths():
    class P:
        d_max, draft_widths, verify_widths = 2, (1, 2), (2, 4)

    assert plan_shapes(P) == [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 2, 4)]


def test_plan_stages_field_takes_auto_and_splits(tmp_path):
    from test_compile import tiny_plan

    from yggtree.plan import load_plan

    (tmp_path / "model").mkdir()
    for value, ok in (("auto", True), ("overlap@1+1", True), ("ahead@2", True), ("bogus", False),
                      ("overlap@x", False)):
        (tmp_path / "p.yaml").write_text(tiny_plan() + f"stages: {value}\n")
        if ok:
            assert load_plan(tmp_path / "p.yaml").stages == value
        else:
            with pytest.raises(YggError, match="stages") as e:
                load_plan(tmp_path / "p.yaml")
            assert "\n" not in str(e.value)
