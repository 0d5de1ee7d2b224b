"""``yggtree profile`` and ``yggtree calibrate`` end to end on a tiny random checkpoint (eager
backend: nothing compiles): the files they write load back for their plan through the runtime's
checks, nothing is overwritten without --force, and profile names that claim other hardware are
refused."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from yggtree.errors import YggError
from yggtree.offline.profile import check_hw_name
from yggtree.runtime.device import detect_device

transformers = pytest.importorskip("transformers")

from helpers import tiny_plan_dir  # noqa: E402
from test_compile import tiny_plan  # noqa: E402

PLAN = tiny_plan()


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    return tiny_plan_dir(tmp_path_factory.mktemp("prof"), PLAN)


def test_hw_names_are_file_names():
    for name in ("cpu-2core", "a100", "my.box_1"):
        check_hw_name(name)  # a label: the profile records the device it measured
    for name in ("../etc", "", "a b"):
        with pytest.raises(YggError, match="use letters, digits"):
            check_hw_name(name)


@pytest.mark.slow
def test_profile_writes_a_loadable_profile_and_never_overwrites(plan_path, tmp_path, capsys):
    from yggtree.cli import main
    from yggtree.plan import load_plan
    from yggtree.runtime.cost import CostModel

    out = tmp_path / "profiles"
    args = ["profile", "--hw", "cpu-test", "--plan", str(plan_path), "--quick", "--out-dir", str(out),
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["device"] == detect_device()["name"] and summary["points"] > 0
    prof = json.loads((out / "cpu-test.json").read_text())
    assert prof["hardware"]["device_name"] == detect_device()["name"]
    from yggtree.runtime.allocator import running

    assert prof["hardware"]["allocator"] == running()  # what the curves were measured on
    assert {r["kind"] for r in prof["points"]} == {"verify", "draft", "head"}
    pad = prof["packed_padding"]  # measured first; the curves ran padded so, as plan engines do
    assert pad["min_rows"] in (1, 2, 4, 8) and summary["packed_min_rows"] == pad["min_rows"]
    from yggtree.runtime.kernels import library_missing  # the tiled kernel is timed where it runs

    tiled = set() if library_missing() else {"tiled"}
    assert set(pad["median_ms"]) == {"1", "2", "4", "8"} | tiled and pad["products"] > 0
    assert summary["packed_kernel"] == pad["kernel"] and pad["kernel"] in ("torch", *tiled)
    assert (out / "cpu-test.csv").is_file() and (out / "cpu-test.png").is_file()
    cost = CostModel.from_profile(out / "cpu-test.json", load_plan(plan_path))
    assert cost.t_verify(4, 10) > 0 and cost.plain_ms(10) > 0
    (n, ms), = prof["stage_ms"]["resync"].items()  # the drafter's catch-up of n tokens, priced per token
    assert int(n) >= 1 and ms > 0 and cost.resync_per_call(1) == pytest.approx(ms / int(n))
    check_stage_forms(prof["stage_forms"], replace(load_plan(plan_path), profile=str(out / "cpu-test.json")),
                      tmp_path)
    before = (out / "cpu-test.json").read_text()
    assert main(args) == 1  # exists: refused, file untouched
    assert "already exists (pass --force" in capsys.readouterr().err
    assert (out / "cpu-test.json").read_text() == before
    assert main(["profile", "--hw", "../x", "--plan", str(plan_path), "--out-dir", str(out)]) == 1
    assert "use letters, digits" in capsys.readouterr().err
    assert not (out.parent / "x.json").exists()


def check_stage_forms(forms, plan, tmp):
    """Every thread split measured: alone (verify, head, draft, the ahead call) and overlapped
    (every W_v, W_d pair); the plan search reads them and picks one of its candidates."""
    from yggtree.offline.compile import compile_plan
    from yggtree.offline.plan_search import candidates, search_plan
    from yggtree.runtime.build import searched_stages
    from yggtree.offline.profile_stages import thread_splits
    from yggtree.runtime.schedule import usable_cores

    assert sorted(forms["splits"]) == sorted(thread_splits(usable_cores()))
    for split, rec in forms["splits"].items():
        assert set(rec["verify_ms"]) == {"2", "4"}
        if "+" in split:
            assert set(rec["pair"]) == {f"{wv},{wd}" for wv in (2, 4) for wd in (1, 2)}
            assert all(p["wall_ms"] > 0 and p["spec_ms"] > 0 for p in rec["pair"].values())
        else:
            assert set(rec["ahead_ms"]) == {"2", "4"} and rec["head_ms"] > 0
    found = search_plan(plan)
    assert found["candidates"] == candidates(forms) and found["chosen"] in found["candidates"]
    assert all(set(r["predicted_ms"]) == set(found["candidates"]) for r in found["per_shape"])
    # compile records the search in the manifest; `--stages auto` of a `stages: auto` plan runs it
    summary = compile_plan(replace(plan, stages="auto"), tmp / "compile")
    assert summary["stage_plan"] == found and searched_stages(summary["dir"]) == found["chosen"]
    # a profile made before stage forms existed: no candidates, the runtime runs sequential
    old = json.loads(Path(plan.profile).read_text())
    del old["stage_forms"]
    (tmp / "old.json").write_text(json.dumps(old))
    summary = compile_plan(replace(plan, stages="auto", profile=str(tmp / "old.json")), tmp / "compile-old")
    assert summary["stage_plan"] is None and searched_stages(summary["dir"]) == "sequential"


@pytest.mark.slow
def test_calibrate_writes_a_loadable_calibration(plan_path, tmp_path, capsys):
    from yggtree.cli import main
    from yggtree.plan import load_plan
    from yggtree.runtime.calibration import Calibration

    out = tmp_path / "pair"
    args = ["calibrate", "--plan", str(plan_path), "--prompts", "2", "--max-new-tokens", "6",
            "--out-dir", str(out)]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 2 and summary["edges"] > 0
    cal = Calibration.load(out / "calibration.json", load_plan(plan_path))
    # the self-drafter's greedy proposals are the target's: its top-1 edges are always accepted
    # so a one-call chain (W_d 1, D 1, W_v 2) accepts its drafted token at every step: AAL 2
    assert cal.expected_aal(1, 2, 4) is not None and cal.expected_aal(1, 1, 2) == 2.0
    assert main(args) == 1 and "already exists" in capsys.readouterr().err


@pytest.mark.slow  # dynamo's guards (torch.compile, eager backend): no compiler in the unit run
def test_stage_forms_rebuild_a_graph_for_another_thread_count():
    """Dynamo guards a graph on the thread count: a profile that times a split at another count
    must rebuild it first (``_built``) or its frozen stance refuses the call."""
    import torch

    from yggtree.offline.profile_stages import _built

    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    x = torch.ones(3)
    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        f(x)
        torch.set_num_threads(2)
        with torch.compiler.set_stance("fail_on_recompile"):
            with pytest.raises(RuntimeError, match="recompil"):
                f(x)
            _built(lambda: f(x))
            assert torch.equal(f(x), x * 2 + 1)
    finally:
        torch.set_num_threads(n0)


def test_time_rounds_interleaves_the_calls():
    """Warm-up rounds untimed, then every call once per timed round, in order: a slow stretch of
    the machine touches all calls of a round alike (timing.time_rounds)."""
    from yggtree.offline.timing import time_ms, time_rounds

    log, rounds = [], []
    fns = {k: (lambda k=k: log.append(k)) for k in ("a", "b", "c")}
    times = time_rounds(fns, warmup=2, repeats=3, on_round=lambda: rounds.append(len(log)))
    assert log == ["a", "b", "c"] * 5
    assert rounds == [3, 6, 9, 12, 15]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    calls = []
    assert len(time_ms(lambda: calls.append(1), 1, 4)) == 4 and len(calls) == 5


def test_time_rounds_settles_each_timed_call_with_one_of_its_own(monkeypatch):
    """With ``settle``, each timed call comes right after that many untimed calls of the same
    function, and only the timed call's time is recorded (a fake clock: settle calls take 1 s,
    timed ones 2 ms)."""
    from types import SimpleNamespace

    from yggtree.offline import timing

    clock, log = [0.0], []

    def call(k):  # a key's calls alternate: settle, timed
        clock[0] += 1.0 if log.count(k) % 2 == 0 else 0.002
        log.append(k)

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    times = timing.time_rounds({k: (lambda k=k: call(k)) for k in ("a", "b")}, warmup=1, repeats=2, settle=1)
    assert log == ["a", "a", "b", "b"] * 3
    assert times == {"a": pytest.approx([2.0, 2.0]), "b": pytest.approx([2.0, 2.0])}


def test_time_rounds_runs_a_keys_before_call_last_before_its_timed_one(monkeypatch):
    """With ``before``, a key's timed call comes right after its ``before`` call (which follows the
    settling calls and is not timed: it takes 1 s on a fake clock, the timed call 2 ms); keys
    without one are timed as before."""
    from types import SimpleNamespace

    from yggtree.offline import timing

    clock, log = [0.0], []

    def call(name, dt):
        clock[0] += dt
        log.append(name)

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    fns = {"draft": lambda: call("draft", 0.002), "verify": lambda: call("verify", 0.002)}
    times = timing.time_rounds(fns, warmup=0, repeats=2, settle=1, before={"draft": lambda: call("target", 1.0)})
    assert log == ["draft", "target", "draft", "verify", "verify"] * 2
    assert times == {"draft": pytest.approx([2.0, 2.0]), "verify": pytest.approx([2.0, 2.0])}


@pytest.mark.slow
def test_profile_of_a_weight_format_prices_that_format_only(tmp_path, capsys, monkeypatch):
    """`yggtree profile` of a plan with ``weights: int8``, naming the profile it writes, times the
    quantized engine (its int8 products on each kernel, never padded) and records the format; the cost
    model takes it for that plan only, and a float plan's profile is refused for it."""
    import yggtree.runtime.quant as quant
    from yggtree.cli import main
    from yggtree.plan import load_plan
    from yggtree.runtime.cost import CostModel

    formats, real = [], quant.quantize_linears
    monkeypatch.setattr(quant, "quantize_linears", lambda m, fmt, *a, **k: formats.append(fmt) or real(m, fmt, *a, **k))
    out = tmp_path / "profiles"
    # the plan names the profile this command writes (it does not exist yet), as a per-format plan does
    plan_path = tiny_plan_dir(tmp_path, PLAN + f"weights: int8\nprofile: {out / 'cpu-int8.json'}\n")
    assert main(["profile", "--hw", "cpu-int8", "--plan", str(plan_path), "--quick", "--out-dir", str(out),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prof = json.loads((out / "cpu-int8.json").read_text())
    assert prof["plan"]["weights"] == summary["weights"] == "int8"
    # the kernel measurement's two models (torch's kernel, the tiled one where it runs), then the
    # timed engine's target and drafter
    from yggtree.runtime.kernels import library_missing

    tiled = not library_missing()
    assert formats == ["int8"] * (4 if tiled else 3)
    pad = prof["packed_padding"]  # the int8 products timed on each kernel, never padded
    assert pad["products"] > 0 and summary["packed_min_rows"] == pad["min_rows"] == 1
    assert set(pad["median_ms"]) == ({"1", "tiled"} if tiled else {"1"})
    assert summary["packed_kernel"] == pad["kernel"]
    int8 = load_plan(plan_path)  # its profile exists now
    assert CostModel.from_profile(out / "cpu-int8.json", int8).t_verify(4, 10) > 0
    float_plan = replace(int8, weights=None)
    with pytest.raises(YggError, match=r"cpu-int8.json measured int8 weights, plan 'tiny' runs float32: "
                                       r"each weight format has its own curves") as e:
        CostModel.from_profile(out / "cpu-int8.json", float_plan)
    assert "\n" not in str(e.value)
    del prof["plan"]["weights"]  # a profile without the record measured float weights in its dtype
    (out / "float.json").write_text(json.dumps(prof))
    assert CostModel.from_profile(out / "float.json", float_plan).t_verify(4, 10) > 0
    with pytest.raises(YggError, match=r"float.json measured float32 weights, plan 'tiny' runs int8"):
        CostModel.from_profile(out / "float.json", int8)


@pytest.mark.slow
def test_load_meter_sees_other_work_and_the_warning_names_it():
    """A busy loop in another process shows as ~1 core of other work (this process idles);
    the warning names the measurement and the cores; a quiet result gives no warning."""
    import subprocess
    import sys
    import time

    from yggtree.offline.timing import LoadMeter, load_warning

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(0.5)
        with LoadMeter() as m:
            time.sleep(1.5)
    finally:
        spin.kill()
    assert 0.6 <= m.result["other_cores"] <= os.cpu_count()
    line = load_warning("profile x", m.result)
    assert line.startswith("profile x: while timing, other processes kept") and "\n" not in line
    assert load_warning("profile x", {"wall_s": 1.0, "other_cores": 0.1, "steal_cores": 0.0}) is None
    assert load_warning("profile x", None) is None
