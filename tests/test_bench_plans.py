"""scripts/bench_plans.py (issue #25: whole plans against each other) end to end on a tiny random
checkpoint drafting for itself (eager plans, nothing compiled): plain, the quick start (the base
plan with its quick profile from the user cache) and one "tuned" plan, every system's greedy tokens
equal to plain's, the JSON line's structure, a resumed run; and bad input as one line, exit 1.
A smoke test, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("sklearn")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # calibrates and benchmarks a plan

from helpers import load_script  # noqa: E402
from test_compile import save_tiny_checkpoint, tiny_plan  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny checkpoint, its plan and calibration, its quick profile cached under a private
    XDG cache, and a "tuned" plan naming that profile with its own widths and thread split."""
    from yggtree.cli import main
    from yggtree.plan import load_plan
    from yggtree.quickstart import quick_start
    from yggtree.runtime.device import detect_device

    root = tmp_path_factory.mktemp("plans")
    save_tiny_checkpoint(root / "model")
    (root / "plan.yaml").write_text(tiny_plan())
    assert main(["calibrate", "--plan", str(root / "plan.yaml"), "--prompts", "2",
                 "--max-new-tokens", "6", "--out-dir", str(root / "cal")]) == 0
    cal = root / "cal" / "calibration.json"
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
    qs, why = quick_start(load_plan(root / "plan.yaml"), cal, detect_device(), 1)
    assert why is None
    qs.engine(say=lambda line: None)  # measures and caches the quick profile
    (root / "tuned.yaml").write_text(tiny_plan("[4]").replace("name: tiny", "name: tuned")
                                     + f"profile: {qs.profile}\ncalibration: {cal}\nstages: sequential@1\n")
    # no profile and calibration: the plan's largest tree every step (the tiny objective may never
    # speculate, so this one checks drafted trees against plain)
    (root / "fixed.yaml").write_text(tiny_plan().replace("name: tiny", "name: fixed"))
    yield root, cal, qs.profile
    mp.undo()


def argv(root, cal, *more):
    return ["--quick-plan", str(root / "plan.yaml"), "--quick-calibration", str(cal), "--synthetic", "2",
            "--max-new-tokens", "10", "--threads", "1", *more]


def test_plain_quick_and_a_plan_in_one_run(pair, tmp_path, capsys):
    root, cal, _ = pair
    mod = load_script("bench_plans")
    out = tmp_path / "plans.json"
    assert mod.main(argv(root, cal, "--plan", str(root / "tuned.yaml"), "--plan", str(root / "fixed.yaml"),
                         "--out", str(out))) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    line = json.loads(out.read_text())
    assert json.loads(printed) == line
    assert line["command"] == "bench_plans" and line["prompts"] == 2 and line["threads"] == 1
    assert list(line["systems"]) == ["plain", "quick", "tuned", "fixed"]
    sysinfo = line["systems"]
    assert sysinfo["quick"]["kind"] == "quick" and not sysinfo["quick"]["profile_measured"]
    assert "quick profile" in sysinfo["quick"]["said"][0]
    assert sysinfo["tuned"]["stages"] == "sequential@1" and sysinfo["tuned"]["policy"] == "objective"
    assert sysinfo["fixed"]["policy"] == "largest tree"
    for v in sysinfo.values():
        assert v["build_s"] > 0 and v["warmup_s"] > 0
    rows = [json.loads(x) for x in (tmp_path / "plans.json.rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["synthetic/0", "synthetic/1"]
    for r in rows:  # greedy: every system's tokens are plain's
        assert r["quick"]["tokens"] == r["plain"]["tokens"] == r["tuned"]["tokens"] == r["fixed"]["tokens"]
        assert len(r["plain"]["tokens"]) == r["plain"]["new_tokens"] > 0
        assert all(r[n]["threads"] == 1 and r[n]["decode_s"] > 0 and r[n]["steps"] > 0 for n in sysinfo)
        assert r["tuned"]["plan"] == "sequential@1" and r["plain"]["plan"] == "plain"
    assert set(line["sets"]) == {"synthetic", "all"}
    res = line["sets"]["all"]["systems"]
    assert all(v["identical_to_plain"] == 2 and v["decode_tok_s"] > 0 for v in res.values())
    assert "x_plain" not in res["plain"] and res["fixed"]["plain_step_share"] < 1  # trees drafted
    for n in ("quick", "tuned", "fixed"):
        lo, hi = res[n]["ci95"]
        assert lo <= res[n]["x_plain"] <= hi
    assert line["sets"]["all"]["fastest"] in res
    # a stopped run continues: the rows file is kept and only the new prompt runs
    plans = ["--plan", str(root / "tuned.yaml"), "--plan", str(root / "fixed.yaml"), "--out", str(out)]
    assert mod.main(argv(root, cal, *plans)) == 1
    assert "--resume" in capsys.readouterr().err
    assert mod.main(argv(root, cal, *plans[:2], "--out", str(out), "--resume")) == 1  # other systems
    assert "holds another run" in capsys.readouterr().err
    more = argv(root, cal, *plans, "--resume")
    more[more.index("--synthetic") + 1] = "3"
    assert mod.main(more) == 0
    rows = [json.loads(x) for x in (tmp_path / "plans.json.rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["synthetic/0", "synthetic/1", "synthetic/2"]
    assert json.loads(out.read_text())["prompts"] == 3


def test_bad_input_is_one_line(pair, tmp_path, capsys):
    root, cal, profile = pair
    mod = load_script("bench_plans")
    prof = json.loads(Path(profile).read_text())
    prof["hardware"]["device_name"] = "some other cpu"
    (tmp_path / "other.json").write_text(json.dumps(prof))
    (tmp_path / "other.yaml").write_text((root / "tuned.yaml").read_text().replace(
        f"profile: {profile}", f"profile: {tmp_path / 'other.json'}").replace("target: model",
                                                                              f"target: {root / 'model'}"))
    (tmp_path / "split.yaml").write_text(tiny_plan().replace("target: model", f"target: {root / 'model'}")
                                         + "stages: sequential@999\n")
    cases = [
        (["--plan", str(tmp_path / "split.yaml")], "threads 999 exceeds this machine's"),
        (["--plan", str(tmp_path / "missing.yaml")], "plan file not found"),
        (["--plan", str(tmp_path / "other.yaml")], "made on cpu 'some other cpu'"),
        (["--threads", "999"], "exceeds this machine's"),
    ]
    for more, said in cases:
        assert mod.main(argv(root, cal, *more)) == 1  # (the last --threads wins)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("bench_plans: error:") and said in err[0], err
