"""The product kernel of engines built from flags: measured once per machine and key, cached,
read back; what `yggtree run` and `yggtree bench` build with."""

from __future__ import annotations

import json

import pytest
import torch

from yggtree.measure import kernel_choice
from yggtree.runtime.build import EngineSpec
from yggtree.runtime.loading import resolve_model
from yggtree.shapes import TreeParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from test_compile import save_tiny_checkpoint

    d = tmp_path_factory.mktemp("kernel_choice") / "model"
    save_tiny_checkpoint(d)
    return d


@pytest.fixture
def counted(monkeypatch):
    """model_padding replaced by a fake that records its calls and answers ``answer``."""
    from yggtree.offline import profile_padding

    calls = []
    answer = {"kernel": "tiled", "min_rows": 1, "products": 3, "median_ms": {"1": 2.0, "tiled": 1.0},
              "invariant": {"1": True, "tiled": True}, "widths": [1], "prefetch": [1024, 4096]}

    def fake(src, dtype, weights, widths, warmup=2, repeats=9):
        calls.append((src.path, dtype, weights, tuple(widths), torch.get_num_threads()))
        return dict(answer, widths=sorted(set(widths)))

    monkeypatch.setattr(profile_padding, "model_padding", fake)
    return calls


def test_measured_once_then_read_from_the_cache(model_dir, tmp_path, counted):
    src = resolve_model(str(model_dir))
    said = []
    first = kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, said.append)
    again = kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, said.append)
    assert first == again and first["kernel"] == "tiled"
    assert len(counted) == 1 and len(said) == 1 and "product kernel measured" in said[0]
    files = list((tmp_path / "kernels").glob("choice-cpu-t1-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["padding"] == first


def loaded(monkeypatch, busy: list[float]) -> None:
    """The load meter replaced by one reporting ``busy[i]`` other cores during measurement i."""
    from yggtree.offline import timing

    busy = iter(busy)

    class Meter:
        def __enter__(self):
            self.result = {"wall_s": 1.0, "other_cores": next(busy), "steal_cores": 0.0}
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(timing, "LoadMeter", Meter)


def test_a_busy_measurement_is_taken_again_after_the_waits_and_the_quietest_kept(model_dir, tmp_path, counted,
                                                                                 monkeypatch):
    loaded(monkeypatch, [1.5, 0.9, 0.1, 3.0])  # other processes' cores during each measurement
    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    src = resolve_model(str(model_dir))
    said = []
    kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, said.append, waits=(30, 60, 120))
    assert len(counted) == 3 and slept == [30, 60]  # quiet at the third: no fourth, no third wait
    (f,) = (tmp_path / "kernels").glob("choice-cpu-t1-*.json")
    assert json.loads(f.read_text())["load"]["other_cores"] == 0.1
    assert "inflated" not in said[0]


def test_without_waits_a_busy_measurement_is_cached_with_a_warning(model_dir, tmp_path, counted, monkeypatch):
    loaded(monkeypatch, [1.5])
    said = []
    kernel_choice.measured_choice(resolve_model(str(model_dir)), "float32", None, (1,), 1, tmp_path, said.append)
    assert len(counted) == 1 and "other processes kept 1.50 cores busy" in said[0]


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(weights="int8"), dict(widths=(1, 8)),
                                    dict(threads=2)])
def test_every_part_of_the_key_measures_again(model_dir, tmp_path, counted, change):
    src = resolve_model(str(model_dir))
    base = dict(dtype="float32", weights=None, widths=(1,), threads=1)
    kernel_choice.measured_choice(src, **base, root=tmp_path, say=lambda _: None)
    kernel_choice.measured_choice(src, **(base | change), root=tmp_path, say=lambda _: None)
    assert len(counted) == 2
    assert counted[1][4] == (base | change)["threads"]  # measured at the engine's threads
    assert torch.get_num_threads() == 1  # ... and the process's count restored


def test_a_changed_model_file_measures_again(model_dir, tmp_path, counted):
    import os

    src = resolve_model(str(model_dir))
    kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, lambda _: None)
    st = os.stat(src.path)
    os.utime(src.path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, lambda _: None)
    assert len(counted) == 2


def test_an_unreadable_cache_file_is_measured_again_and_replaced(model_dir, tmp_path, counted):
    src = resolve_model(str(model_dir))
    kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, lambda _: None)
    (path,) = (tmp_path / "kernels").glob("choice-*.json")
    path.write_text("{not json")
    got = kernel_choice.measured_choice(src, "float32", None, (1,), 1, tmp_path, lambda _: None)
    assert len(counted) == 2 and json.loads(path.read_text())["padding"] == got


def test_nothing_is_measured_off_cpus(model_dir, tmp_path, counted, monkeypatch):
    from yggtree.runtime import device

    monkeypatch.setattr(device, "detect_device", lambda: {"kind": "cuda", "name": "some GPU"})
    got = kernel_choice.measured_choice(resolve_model(str(model_dir)), "float32", None, (1,), 1, tmp_path)
    assert got["kernel"] == "torch" and got["min_rows"] == 1 and not counted
    assert not (tmp_path / "kernels").exists()


def test_measured_spec_takes_the_engines_widths_and_threads(model_dir, tmp_path, counted):
    plain = kernel_choice.measured_spec(EngineSpec(model=str(model_dir)), tmp_path, lambda _: None)
    assert (plain.kernel, plain.min_rows, plain.padding_checked, plain.prefetch) == ("tiled", 1, (1, (1,)), (1024, 4096))
    spec = EngineSpec(model=str(model_dir), drafter="self", tree=TreeParams(2, 4, 8, 2), threads=1)
    spec = kernel_choice.measured_spec(spec, tmp_path, lambda _: None)
    assert counted[-1][3] == (1, 8) and spec.padding_checked == (1, (1, 8))
    unpacked = EngineSpec(model=str(model_dir), pack=False)
    assert kernel_choice.measured_spec(unpacked, tmp_path) is unpacked and len(counted) == 2


def test_the_real_measurement_on_a_tiny_model(model_dir, tmp_path):
    """No fake: the tiny model's products timed on each kernel this CPU runs, cached."""
    src = resolve_model(str(model_dir))
    got = kernel_choice.measured_choice(src, "float32", None, (1, 4), 1, tmp_path, lambda _: None)
    from yggtree.runtime.packed import KERNELS

    assert got["kernel"] in KERNELS and got["invariant"][got["kernel"] if got["kernel"] == "tiled"
                                                          else str(got["min_rows"])]
    assert kernel_choice.measured_choice(src, "float32", None, (1, 4), 1, tmp_path) == got


@pytest.mark.slow
def test_yggtree_run_with_flags_builds_on_the_measured_kernel(model_dir, tmp_path, monkeypatch, capsys):
    """`yggtree run --no-speculate` (an engine from flags): the kernel measured and cached on the
    first run, read on the second; the output is plain greedy decoding's either way."""
    from yggtree.cli import main
    from yggtree.runtime import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels = []
    real = build.build_engine
    monkeypatch.setattr(build, "build_engine", lambda spec, *a, **k: kernels.append(spec.kernel) or real(spec, *a, **k))
    args = ["run", "--model", str(model_dir), "--raw", "--prompt", "t3 t4 t5", "--max-new-tokens", "6",
            "--no-speculate", "--json", "--max-context", "64", "--prefill-chunk", "4"]
    outs = []
    for _ in range(2):
        assert main(args) == 0
        cap = capsys.readouterr()
        outs.append((json.loads(cap.out)["token_ids"], cap.err))
    assert outs[0][0] == outs[1][0]
    assert "product kernel measured" in outs[0][1] and "product kernel measured" not in outs[1][1]
    assert len(set(kernels)) == 1 and len(list((tmp_path / "yggtree" / "kernels").glob("choice-*.json"))) == 1


@pytest.mark.parametrize("value", ["torch", "tiled"])
def test_the_environment_forces_a_kernel_without_measuring(model_dir, tmp_path, counted, monkeypatch, value):
    monkeypatch.setenv("YGGTREE_KERNEL", value)
    got = kernel_choice.measured_choice(resolve_model(str(model_dir)), "float32", None, (1,), 1, tmp_path)
    assert (got["kernel"], got["min_rows"]) == (value, 1) and not counted
    spec = kernel_choice.measured_spec(EngineSpec(model=str(model_dir)), tmp_path)
    assert spec.kernel == value and spec.padding_checked is None


def test_a_bad_forced_kernel_is_refused_in_one_line(model_dir, tmp_path, monkeypatch):
    from yggtree.errors import YggError

    monkeypatch.setenv("YGGTREE_KERNEL", "blas")
    with pytest.raises(YggError, match=r"^YGGTREE_KERNEL='blas': must be auto, torch or tiled$"):
        kernel_choice.measured_choice(resolve_model(str(model_dir)), "float32", None, (1,), 1, tmp_path)


def test_a_measurement_beside_other_work_says_so(model_dir, tmp_path, counted, monkeypatch):
    from yggtree.offline import timing

    class Busy:
        result = {"wall_s": 1.0, "other_cores": 1.5, "steal_cores": 0.0}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(timing, "LoadMeter", Busy)
    said = []
    kernel_choice.measured_choice(resolve_model(str(model_dir)), "float32", None, (1,), 1, tmp_path, said.append)
    (path,) = (tmp_path / "kernels").glob("choice-*.json")
    assert "other processes kept 1.50 cores busy" in said[0] and "delete the file to measure again" in said[0]
    assert json.loads(path.read_text())["load"]["other_cores"] == 1.5
