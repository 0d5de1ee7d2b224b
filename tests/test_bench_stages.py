"""scripts/bench_stages.py (the O4 ablation) end to end on a tiny self-drafting plan: profile with
stage forms, compile with the plan search, then one interleaved run of plain at 1 and 2 threads,
sequential, the searched plan and the best plan per thread split, all identical to plain, with
ratios and predicted vs measured step latency. A smoke test, not a measurement."""

from __future__ import annotations

import json

import pytest

from yggtree.runtime.schedule import usable_cores

transformers = pytest.importorskip("transformers")

from helpers import load_script  # noqa: E402
from test_compile import save_tiny_checkpoint, tiny_plan  # noqa: E402


def test_system_labels_and_best_per_split():
    mod = load_script("bench_stages")
    found = {"chosen": "ahead@2", "mean_ms": {"sequential@1": 9.0, "ahead@1": 8.0, "sequential@2": 7.0,
                                               "ahead@2": 6.0, "overlap@1+1": 6.5}}
    assert mod.best_per_split(found) == {"1": "ahead@1", "2": "ahead@2", "1+1": "overlap@1+1"}
    names = mod.system_labels([1, 2], found, ["overlap@1+1", ""])
    assert list(names) == ["plain@1", "plain@2", "sequential@1", "sequential@2", "ahead@2", "ahead@1",
                           "overlap@1+1"]
    assert names["plain@2"] == ("sequential@2", True) and names["ahead@2"] == ("ahead@2", False)
    assert mod.system_labels([1], None, [""]) == {"plain@1": ("sequential@1", True),
                                                  "sequential@1": ("sequential@1", False)}


@pytest.mark.skipif(usable_cores() < 2, reason="the thread splits need 2 usable cores")
@pytest.mark.slow
def test_o4_run_on_a_tiny_plan(tmp_path, monkeypatch, capsys):
    from yggtree.cli import main

    monkeypatch.chdir(tmp_path)
    save_tiny_checkpoint(tmp_path / "model")
    (tmp_path / "plan.yaml").write_text(tiny_plan())
    assert main(["profile", "--hw", "t", "--plan", "plan.yaml", "--quick", "--out-dir", "profiles",
                 "--cache-dir", "cache"]) == 0
    assert main(["calibrate", "--plan", "plan.yaml", "--prompts", "2", "--max-new-tokens", "6",
                 "--out-dir", "pair"]) == 0
    (tmp_path / "plan.yaml").write_text(tiny_plan() + "profile: profiles/t.json\n"
                                        "calibration: pair/calibration.json\nstages: auto\n")
    assert main(["compile", "plan.yaml"]) == 0  # eager: the manifest alone, with the plan search
    capsys.readouterr()
    mod = load_script("bench_stages")
    # the plan's largest tree every step: the tiny model's objective may find speculation too dear
    assert mod.main(["--plan", "plan.yaml", "--synthetic", "2", "--max-new-tokens", "10", "--policy",
                     "fixed", "--threads", "1,2", "--out", "o4.json"]) == 0
    out = json.loads((tmp_path / "o4.json").read_text())
    manifest = json.loads((tmp_path / "compile" / "tiny" / "manifest.json").read_text())
    assert out["searched"] == manifest["stage_plan"]["chosen"]
    res = out["sets"]["all"]
    systems = res["systems"]
    assert {"plain@1", "plain@2", "sequential@1", "sequential@2", out["searched"],
            *out["best_per_split"].values()} <= set(systems)
    assert all(v["identical_to_plain"] == 2 for v in systems.values())
    for name, v in systems.items():
        if not name.startswith("plain@"):
            acc = v["step_latency"]
            assert acc["steps"] > 0 and acc["predicted_ms"] > 0 and acc["measured_ms"] > 0
    if "overlap@1+1" in systems:
        assert systems["overlap@1+1"]["hit_rate"] is not None  # a self-drafter: guesses are used
    assert any(r["a"] == out["searched"] and r["b"] == "sequential@1" for r in res["ratios"]) \
        or out["searched"] == "sequential@1"
    assert res["fastest_measured"] in systems and res["mean_abs_prediction_error"] is not None
