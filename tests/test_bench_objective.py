"""Benchmark summaries (yggtree.bench: ratios of summed times, AAL, shares, equality with plain,
paired bootstrap ratios) and scripts/bench_objective.py's --summarise command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from yggtree.bench import paired_ratio, summarise_systems

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_objective.py"


def row(set_, plain_s, tree_s, tree_steps, tree_plain, same=True):
    tokens = list(range(9))
    return {
        "prompt": f"{set_}/0", "set": set_,
        "plain": {"new_tokens": 9, "decode_s": plain_s, "steps": 8, "tokens": tokens,
                  "pred_plain_ms": 8.0, "pred_step_ms": 8.0, "n_plain_steps": 8,
                  "depth_counts": {"0": 8}},
        "tree": {"new_tokens": 9, "decode_s": tree_s, "steps": tree_steps,
                 "tokens": tokens if same else tokens[::-1],
                 "pred_plain_ms": 12.0, "pred_step_ms": 8.0, "n_plain_steps": tree_plain,
                 "depth_counts": {"0": tree_plain, "1": tree_steps - tree_plain}},
    }


def test_summary_ratios_shares_and_equality():
    rows = [row("a", 0.8, 0.4, 4, 1), row("a", 1.6, 1.6, 8, 8, same=False), row("b", 1.0, 0.5, 4, 0)]
    s = summarise_systems(rows, ["plain", "tree"])
    a = s["a"]["tree"]
    assert a["measured_speedup"] == pytest.approx((0.8 + 1.6) / (0.4 + 1.6))  # summed times, not mean ratios
    assert a["aal"] == pytest.approx(16 / 12) and a["plain_step_share"] == pytest.approx(9 / 12)
    assert a["depth_share"] == {"0": pytest.approx(9 / 12), "1": pytest.approx(3 / 12)}
    assert a["same_as_plain"] == 1 and s["b"]["tree"]["same_as_plain"] == 1
    assert a["predicted_speedup"] == pytest.approx(24 / 16)
    assert a["prediction_error"] == pytest.approx(abs(1.5 - a["measured_speedup"]) / a["measured_speedup"])
    assert s["all"]["tree"]["measured_speedup"] == pytest.approx(3.4 / 2.5)
    assert s["all"]["plain"]["measured_speedup"] == 1.0
    assert "policy_ms_per_step" not in a  # rows from before stage times were kept


def test_policy_time_per_step_is_summed_over_steps():
    rows = [row("a", 0.8, 0.4, 4, 1), row("a", 1.0, 0.5, 6, 0)]
    for r, policy in zip(rows, (2.0, 8.0)):
        r["tree"]["stage_ms"] = {"policy": policy, "verify": 100.0}
        r["plain"]["stage_ms"] = {"verify": 50.0}  # no policy stage recorded: 0
    s = summarise_systems(rows, ["plain", "tree"])["a"]
    assert s["tree"]["policy_ms_per_step"] == pytest.approx(10.0 / 10)
    assert s["plain"]["policy_ms_per_step"] == 0.0


def test_paired_ratio_interval_and_share():
    """The paired ratio is the summarised speed-up of A over B; the bootstrap interval holds it;
    identical systems give exactly 1 with a zero-width interval."""
    rows = [row("a", 1.0, 0.5, 4, 0), row("a", 1.0, 1.25, 8, 8), row("b", 2.0, 1.0, 4, 0)]
    c = paired_ratio(rows, "tree", "plain", n_boot=500)
    s = summarise_systems(rows, ["plain", "tree"])["all"]["tree"]["measured_speedup"]
    assert c["ratio"] == pytest.approx(s) and c["ci95"][0] <= c["ratio"] <= c["ci95"][1]
    assert c["ci95"][0] < c["ci95"][1] and c["a_faster_share"] == pytest.approx(2 / 3)
    same = paired_ratio(rows, "plain", "plain", n_boot=200)
    assert same["ratio"] == 1.0 and same["ci95"] == [1.0, 1.0] and same["a_faster_share"] == 0.0


@pytest.mark.slow
def test_repeated_flags_extend(tmp_path):
    """--compare (like --summarise, --depths, --systems) given twice keeps both, not the last."""
    path = tmp_path / "r.rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [row("a", 1.0, 0.5, 4, 0), row("b", 2.0, 1.0, 4, 0)]))
    out = subprocess.run([sys.executable, str(SCRIPT), "--summarise", str(path), "--compare", "tree:plain",
                          "--compare", "plain:tree,tree:tree"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    pairs = [(c["a"], c["b"]) for c in line["comparisons"] if c["set"] == "all"]
    assert pairs == [("tree", "plain"), ("plain", "tree"), ("tree", "tree")]
    assert len(line["comparisons"]) == 3 * 3  # three pairs x (a, b, all)
