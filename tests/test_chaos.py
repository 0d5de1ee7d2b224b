"""Chaos: ``yggtree profile``, ``calibrate`` and ``train-predictor`` stopped at several points
(a KeyboardInterrupt before writing, half-way through writing a file, just before its rename; one
real SIGKILL of a subprocess between the write and the rename). Every time the next reader refuses
cleanly or the next run repairs: no half-written artifact is ever used. (An interrupted compile and
a truncated package are in tests/test_compile.py.) Also: no shipped manifest holds an absolute path."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from yggtree.cli import main
from yggtree.errors import YggError

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    from helpers import tiny_plan_dir
    from test_profile import PLAN

    return tiny_plan_dir(tmp_path_factory.mktemp("chaos"), PLAN)


def half_write(monkeypatch, name_part: str) -> None:
    """The first text write to a file whose name holds ``name_part`` stops half-way (Ctrl-C)."""
    real = Path.write_text

    def write_text(self, data, *a, **k):
        if name_part in self.name:
            real(self, data[: len(data) // 2], *a, **k)
            raise KeyboardInterrupt
        return real(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_text", write_text)


def stop_before_rename(monkeypatch, name: str) -> None:
    """Ctrl-C after the file was written whole, before it replaces ``name``."""
    real = os.replace

    def replace(src, dst, *a, **k):
        if Path(dst).name == name:
            raise KeyboardInterrupt
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)


def raise_in(monkeypatch, target: str) -> None:
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, stop)


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob(".*partial*")) if d.exists() else []


POINTS = ["before-write", "mid-write", "before-rename"]


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_interrupted_profile_leaves_nothing_half_written(plan_path, tmp_path, monkeypatch, capsys, point):
    from yggtree.plan import load_plan
    from yggtree.runtime.cost import CostModel

    out = tmp_path / "profiles"
    args = ["profile", "--hw", "cpu-test", "--plan", str(plan_path), "--quick", "--out-dir", str(out),
            "--cache-dir", str(tmp_path / "cache")]
    with monkeypatch.context() as m:
        {"before-write": lambda: raise_in(m, "yggtree.offline.fit.fit_profile"),
         "mid-write": lambda: half_write(m, "cpu-test"),
         "before-rename": lambda: stop_before_rename(m, "cpu-test.json")}[point]()
        assert main(args) == 130
    assert capsys.readouterr().err.endswith("yggtree: interrupted\n")
    assert not (out / "cpu-test.json").exists() and leftovers(out) == []
    with pytest.raises(YggError, match="cpu-test.json"):  # a reader refuses: nothing to read
        CostModel.from_profile(out / "cpu-test.json", load_plan(plan_path))
    assert main(args) == 0  # the next run repairs: nothing in the way, no --force needed
    assert CostModel.from_profile(out / "cpu-test.json", load_plan(plan_path)).plain_ms(10) > 0
    assert absolute_paths(out / "cpu-test.json") == []  # (the command was given absolute ones)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-write", "mid-write", "after-write"])
def test_interrupted_calibration_leaves_nothing_half_written(plan_path, tmp_path, monkeypatch, capsys, point):
    from yggtree.plan import load_plan
    from yggtree.runtime.calibration import Calibration

    out = tmp_path / "pair"
    args = ["calibrate", "--plan", str(plan_path), "--prompts", "2", "--max-new-tokens", "6",
            "--out-dir", str(out)]
    with monkeypatch.context() as m:
        {"before-write": lambda: raise_in(m, "yggtree.runtime.artifacts.pair_identity"),
         "mid-write": lambda: half_write(m, "calibration"),
         "after-write": lambda: raise_in(m, "yggtree.offline.fit.plot_calibration")}[point]()
        assert main(args) == 130
    capsys.readouterr()
    if point == "after-write":  # the JSON was complete: it is kept, and loads
        Calibration.load(out / "calibration.json", load_plan(plan_path))
        assert main(args) == 1 and "already exists" in capsys.readouterr().err
        return
    assert not (out / "calibration.json").exists() and leftovers(out) == []
    assert main(args) == 0
    Calibration.load(out / "calibration.json", load_plan(plan_path))
    assert absolute_paths(out / "calibration.json") == []


KILL_BEFORE_RENAME = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    real = os.replace
    def replace(src, dst, *a, **k):
        if Path(dst).name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGKILL)  # the whole file is written, not yet renamed
        return real(src, dst, *a, **k)
    os.replace = replace
    from yggtree.cli import main
    main(sys.argv[2:])
    """
)


@pytest.mark.slow
def test_sigkilled_calibration_is_repaired_by_the_next_run(plan_path, tmp_path):
    """A real SIGKILL between writing calibration.json's temporary file and its rename: the
    temporary stays behind (nothing can clean up after SIGKILL), calibration.json does not exist,
    and the next run writes it whole."""
    from yggtree.plan import load_plan
    from yggtree.runtime.calibration import Calibration

    out = tmp_path / "pair"
    args = ["calibrate", "--plan", str(plan_path), "--prompts", "2", "--max-new-tokens", "6",
            "--out-dir", str(out)]
    r = subprocess.run([sys.executable, "-c", KILL_BEFORE_RENAME, "calibration.json", *args],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not (out / "calibration.json").exists()
    assert leftovers(out) == [".calibration.partial.json"]
    with pytest.raises(YggError, match="calibration.json"):
        Calibration.load(out / "calibration.json", load_plan(plan_path))
    assert main(args) == 0
    assert leftovers(out) == []  # the next run's write replaced the stale temporary
    Calibration.load(out / "calibration.json", load_plan(plan_path))


@pytest.fixture
def records(tmp_path):
    from test_predictor import two_record_files

    plan, plan_path, a, b, _ = two_record_files(tmp_path)
    return plan, plan_path, a, b


def half_safetensors(monkeypatch, name_part: str) -> None:
    import safetensors.torch as st

    real = st.save_file

    def save_file(tensors, filename, *a, **k):
        real(tensors, filename, *a, **k)
        if name_part in Path(filename).name:
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            raise KeyboardInterrupt

    monkeypatch.setattr(st, "save_file", save_file)


# unit: train-predictor stopped inside its manifest's write, and a safetensors file (the records)
# stopped half-way; train-predictor stopped inside its predictor files' writes: slow
@pytest.mark.parametrize("point", [pytest.param("mlp-mid-write", marks=pytest.mark.slow),
                                   pytest.param("baseline-mid-write", marks=pytest.mark.slow),
                                   "manifest-mid-write", "records-mid-write"])
def test_interrupted_train_predictor_is_refused_then_repaired(records, tmp_path, monkeypatch, capsys, point):
    from yggtree.offline.predictor_records import load_records
    from yggtree.offline.train_predictor import main as train_main
    from yggtree.runtime.predictor import MANIFEST_FILE, load_predictor

    plan, plan_path, a, b = records
    out = tmp_path / "out"
    argv = ["--plan", str(plan_path), "--records", str(a), str(b), "--epochs", "3", "--holdout", "3",
            "--out-dir", str(out)]
    if point == "records-mid-write":  # the records file itself (save_records) stops half-way
        from test_predictor import synthetic

        from yggtree.offline.predictor_records import save_records

        with monkeypatch.context() as m:
            half_safetensors(m, ".c.partial")
            with pytest.raises(KeyboardInterrupt):
                save_records(tmp_path / "c.safetensors", synthetic(n_prompts=2, steps=5), {})
        assert not (tmp_path / "c.safetensors").exists() and leftovers(tmp_path) == []
        with pytest.raises(YggError, match="c.safetensors"):
            load_records(tmp_path / "c.safetensors")
        return
    with monkeypatch.context() as m:
        if point == "manifest-mid-write":
            half_write(m, "depth_manifest")
        else:
            half_safetensors(m, {"mlp": "depth_predictor", "baseline": "depth_baseline"}[point.split("-")[0]])
        with pytest.raises(KeyboardInterrupt):  # (this entry point lets Ctrl-C through)
            train_main(argv)
    capsys.readouterr()
    assert not (out / MANIFEST_FILE).exists() and leftovers(out) == []
    with pytest.raises(YggError, match=re.escape(MANIFEST_FILE)):  # nothing half-made is loaded
        load_predictor(out, plan)
    code = train_main(argv)  # the files written whole before the stop are in the way ...
    if code == 1:
        assert "already exists (pass --force" in capsys.readouterr().err
        code = train_main(argv + ["--force"])  # ... and --force replaces them
    assert code == 0
    assert load_predictor(out, plan).d_max == 6


# ----------------------------------------------------------------------------- absolute paths

ABSOLUTE = re.compile(r"(^|[\s=:'\"(,])(/(root|home|work|tmp|Users|usr|opt|mnt|var|private)/|~/|[A-Za-z]:\\)")


def _strings(x):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)
    elif isinstance(x, str):
        yield x


def absolute_paths(path: Path) -> list[str]:
    return [s for s in _strings(json.loads(path.read_text())) if ABSOLUTE.search(s)]


def shipped_manifests() -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.json", "*.yaml", "*.yml"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if not f.startswith("reports/")]


def test_the_scan_finds_absolute_paths():
    assert ABSOLUTE.search("profile /work/main/profiles/x.json")
    assert ABSOLUTE.search('{"path": "/root/.cache/x"}') and ABSOLUTE.search("--out /tmp/x")
    assert not ABSOLUTE.search("records/p00.safetensors") and not ABSOLUTE.search("a/b, W_d 4/8")


def test_no_shipped_manifest_holds_an_absolute_path():
    import yaml

    files = shipped_manifests()
    assert "yggtree/assets/predictors/default__default__float32/depth_manifest.json" in files
    bad = []
    for f in files:
        text = (ROOT / f).read_text()
        data = json.loads(text) if f.endswith(".json") else yaml.safe_load(text)
        bad += [f"{f}: {s[:80]}" for s in _strings(data) if ABSOLUTE.search(s)]
    assert bad == []


def test_written_manifests_hold_no_absolute_path(records, tmp_path, capsys):
    """train-predictor given absolute paths records them relative to its output directory."""
    from yggtree.offline.train_predictor import main as train_main
    from yggtree.runtime.predictor import MANIFEST_FILE

    _, plan_path, a, b = records
    out = tmp_path / "deep" / "out"
    assert a.is_absolute()
    assert train_main(["--plan", str(plan_path), "--records", str(a), str(b), "--epochs", "2",
                       "--holdout", "3", "--out-dir", str(out)]) == 0
    man = json.loads((out / MANIFEST_FILE).read_text())
    assert man["data"]["records"] == ["../../a.safetensors", "../../b.safetensors"]
    assert [s for s in _strings(man) if ABSOLUTE.search(s)] == []
