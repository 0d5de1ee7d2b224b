"""`yggtree run --lookup N`: with a plan's objective, with --drafter none, the plan field, and the
one-line refusals."""

from __future__ import annotations

import json

import pytest

from test_objective import tiny_objective_plan
from yggtree.errors import YggError
from yggtree.plan import validate_plan

PROMPT = "t3 t4 t5 t6 t3 t4 t5 t6 t3 t4"  # repeats itself: lookup has candidates


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_objective_plan(tmp_path_factory.mktemp("lookup_cli"), "lk")


def run(main, capsys, args):
    code = main(args)
    cap = capsys.readouterr()
    return code, (json.loads(cap.out) if code == 0 and cap.out.strip() else None), cap.err


def test_run_with_lookup_equals_plain(plan_dir, capsys):
    from yggtree.cli import main

    base = ["run", "--raw", "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]
    plan = ["--plan", str(plan_dir / "plan.yaml"), "--no-feedback"]
    _, plain, _ = run(main, capsys, base + plan + ["--no-speculate"])
    _, obj, _ = run(main, capsys, base + plan + ["--lookup", "2"])
    assert obj["token_ids"] == plain["token_ids"]
    assert (obj["stats"]["lookup"], plain["stats"]["lookup"]) == (2, 0)  # what ran, in the stats
    src = obj["stats"]["accepted_by_source"]
    assert set(src) == {"drafter", "lookup", "both"} and sum(src.values()) == obj["stats"]["accepted_tokens"]
    _, off, _ = run(main, capsys, base + plan)  # the plan's default: no lookup
    assert off["token_ids"] == plain["token_ids"] and "accepted_by_source" not in off["stats"]
    model = ["--model", str(plan_dir / "model"), "--mode", "reference", "--max-context", "64", "--prefill-chunk", "4"]
    _, only, _ = run(main, capsys, base + model + ["--drafter", "none", "--lookup", "3", "--verify-width", "4",
                                                  "--draft-depth", "3"])
    assert only["token_ids"] == plain["token_ids"] and only["stats"]["lookup"] == 3
    assert only["stats"]["draft_calls"] == 0 and only["stats"]["lookup_steps"] > 0
    assert only["stats"]["accepted_by_source"]["drafter"] == 0


@pytest.mark.parametrize("extra,msg,code", [
    (["--lookup", "-1"], "argument --lookup: must be >= 0, got -1", 2),
    (["--lookup", "x"], "argument --lookup: expected an integer", 2),
    (["--lookup", "5", "PLAN"], "--lookup 5 exceeds the verify width (4)", 1),
    (["--lookup", "17", "--drafter", "none"], "--lookup 17 exceeds the verify width (16)", 1),
    (["--drafter", "none", "PLAN"], "--drafter none and --plan exclude each other", 1),
    (["--draft-depth", "3", "--verify-width", "4", "--model", "MODEL"],
     "--draft-depth and --verify-width shape a speculative tree, but nothing drafts it", 1),
    (["--draft-width", "2", "--drafter", "none"], "--draft-width shapes a speculative tree", 1),
])
def test_bad_lookup_flags_get_one_line(plan_dir, capsys, extra, msg, code):
    from yggtree.cli import main

    plan = ["--plan", str(plan_dir / "plan.yaml")] if "PLAN" in extra else []
    extra = [str(plan_dir / "model") if x == "MODEL" else x for x in extra if x != "PLAN"] + plan
    with pytest.raises(SystemExit) if code == 2 else _nothing():
        got = main(["run", "--raw", "--prompt", PROMPT, "--json", *extra])
        assert got == code
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plan_field_lookup():
    p = validate_plan({"name": "x", "target": "default", "drafter": "self", "verify_widths": [4, 8], "lookup": 8})
    assert p.lookup == 8 and p.to_dict()["lookup"] == 8
    assert "lookup" not in validate_plan({"name": "x", "target": "default"}).to_dict()  # identity kept
    for raw, msg in (({"lookup": 9}, "exceeds the largest verify width 8"), ({"lookup": -1}, "must be >= 0"),
                     ({"lookup": 2, "drafter": None}, "a plan without a drafter")):
        with pytest.raises(YggError, match=msg):
            validate_plan({"name": "x", "target": "default", "drafter": "self", "verify_widths": [4, 8]} | raw)
