"""Speculation by default (``yggtree.quickstart``) on a tiny random checkpoint (eager backend): the
first start measures a quick profile on the engine it builds and caches it, the second loads it,
each says so in one line, and the objective's greedy output is plain decoding's."""

from __future__ import annotations

import json

import pytest

from yggtree.quickstart import quick_profile_path, quick_start
from yggtree.runtime.device import detect_device

transformers = pytest.importorskip("transformers")
pytest.importorskip("sklearn")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # calibrates, measures a profile

from helpers import tiny_plan_dir  # noqa: E402
from test_compile import tiny_plan  # noqa: E402

PLAN = tiny_plan()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from yggtree.cli import main
    from yggtree.plan import load_plan

    root = tmp_path_factory.mktemp("quick")
    tiny_plan_dir(root, PLAN)
    assert main(["calibrate", "--plan", str(root / "plan.yaml"), "--prompts", "2",
                 "--max-new-tokens", "6", "--out-dir", str(root / "cal")]) == 0
    return root, load_plan(root / "plan.yaml"), root / "cal" / "calibration.json"


def test_quick_profile_is_measured_once_then_reused(pair):
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import SamplingParams

    root, plan, cal = pair
    device = detect_device()
    qs, why = quick_start(plan, cal, device, 1, root=root / "cache")
    assert why is None and qs.profile == quick_profile_path(device, 1, "float32", root / "cache")
    assert not qs.cached()
    said: list[str] = []
    engine, tok, policy = qs.engine(say=said.append)
    assert len(said) == 1 and "measured a quick latency profile" in said[0] and "yggtree tune" in said[0]
    prof = json.loads(qs.profile.read_text())
    assert prof["hardware"]["device_name"] == device["name"] and prof["grid"]["quick"]
    assert sorted({r["width"] for r in prof["points"] if r["kind"] == "verify"}) == [1, 2, 4]
    assert sorted({r["width"] for r in prof["points"] if r["kind"] == "draft"}) == [1, 2]
    assert qs.cached() and policy is not None
    from yggtree.runtime.packed import min_rows_of

    assert min_rows_of(engine.target) == prof["packed_padding"]["min_rows"]  # built as measured
    plain, _ = build_engine(EngineSpec(model=str(root / "model"), mode="reference", max_context=96,
                                       prefill_chunk=4))
    params = SamplingParams(max_new_tokens=12)
    for prompt in ([5, 6, 7], [9] * 20):
        assert engine.generate(prompt, params, policy=policy).token_ids == plain.generate(prompt, params).token_ids
    said.clear()
    before = qs.profile.stat().st_mtime_ns
    again, _, _ = qs.engine(say=said.append)  # a later start loads the cached profile
    assert len(said) == 1 and "default plan with the quick profile" in said[0]
    assert min_rows_of(again.target) == prof["packed_padding"]["min_rows"]
    assert qs.profile.stat().st_mtime_ns == before


def test_no_calibration_means_plain_with_a_reason(pair):
    root, plan, _ = pair
    qs, why = quick_start(plan, None, detect_device(), 1, root=root / "cache")
    assert qs is None and "no acceptance calibration" in why
