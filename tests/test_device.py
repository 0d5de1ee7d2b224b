"""A device is what it is, not what it is called (issue #60 item 4): two CPUs a KVM guest names
alike (``AMD EPYC``: a Zen 3 with AVX2 only, a Zen 4 with AVX-512) have two identities, and a
profile, kernel choice, compiled package or tuned plan recorded on one is not used on the other;
one line names what differs. Tiny: no model is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import yggtree.runtime.device as device_mod
from yggtree.errors import YggError
from yggtree.runtime.cpuinfo import FEATURES, parse_cpuinfo
from yggtree.runtime.device import device_difference, device_key, device_record

ROOT = Path(__file__).resolve().parent.parent

COMMON = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
          "syscall nx mmxext lm constant_tsc pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave "
          "avx f16c rdrand hypervisor lahf_lm bmi1 avx2 smep bmi2 erms")
AVX512 = "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni"


def cpuinfo(model: int, flags: str, processors: int = 2) -> str:
    block = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
             "model name\t: AMD EPYC\nstepping\t: 1\ncpu MHz\t\t: 2445.406\nflags\t\t: {flags}\n\n")
    return "".join(block.format(n=n, model=model, flags=flags) for n in range(processors))


ZEN3 = parse_cpuinfo(cpuinfo(1, COMMON), 2)  # this project's AVX2-only EPYC guest
ZEN4 = parse_cpuinfo(cpuinfo(17, f"{COMMON} {AVX512}"), 2)  # the EPYC the committed profiles were measured on


def as_device(cpu) -> dict:
    return {"kind": "cpu", "name": cpu.model_name, "identity": cpu.to_dict()}


@pytest.fixture
def on_zen3(monkeypatch):
    """This process on the AVX2-only EPYC (whatever the machine running the test)."""
    monkeypatch.setattr(device_mod, "cpu_identity", lambda: ZEN3)
    assert device_mod.detect_device() == as_device(ZEN3)
    return as_device(ZEN3)


def test_cpuinfo_parses_into_an_identity():
    assert (ZEN3.vendor, ZEN3.family, ZEN3.model, ZEN3.stepping, ZEN3.model_name, ZEN3.cores) == (
        "AuthenticAMD", 25, 1, 1, "AMD EPYC", 2)
    assert ZEN3.features == ("avx2", "fma", "f16c")
    assert ZEN4.features == ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
    assert set(ZEN4.features) <= set(FEATURES) and "sse2" in ZEN4.flags  # every flag kept, out of the identity
    assert json.loads(json.dumps(ZEN4.to_dict())) == ZEN4.to_dict() and "flags" not in ZEN4.to_dict()
    bare = parse_cpuinfo("", 1)  # no /proc/cpuinfo: a name, no features
    assert bare.features == () and bare.cores == 1 and bare.model is None


def test_two_cpus_of_one_name_are_two_devices():
    zen3, zen4 = as_device(ZEN3), as_device(ZEN4)
    assert zen3["name"] == zen4["name"] == "AMD EPYC" and ZEN3 != ZEN4
    assert device_key(zen3) != device_key(zen4)
    assert device_difference(device_record(zen3), zen3) is None
    why = device_difference(device_record(zen4), zen3)
    assert why == ("it was made on another cpu named 'AMD EPYC' (it had avx512f, avx512bw, avx512vl, avx512_vnni, "
                   "avx512_bf16, this CPU has not; model 17 there, 1 here)")
    assert "this CPU has avx512f" in device_difference(device_record(zen3), zen4)
    fewer = parse_cpuinfo(cpuinfo(1, COMMON, processors=4), 1)  # the same CPU, one core usable
    assert device_difference(device_record(as_device(fewer)), zen3) == (
        "it was made on another cpu named 'AMD EPYC' (cores 1 there, 2 here)")
    # a record from before identities were recorded never matches, and says so
    old = {"device": "cpu", "device_name": "AMD EPYC"}
    assert "only by name ('AMD EPYC')" in device_difference(old, zen3)
    assert "made on cuda 'A100'" in device_difference({"device": "cuda", "device_name": "A100"}, zen3)


def test_this_machine_matches_itself():
    here = device_mod.detect_device()
    assert device_difference(device_record(here), here) is None
    assert json.loads(json.dumps(device_record(here))) == device_record(here)


def test_a_profile_of_the_other_epyc_is_refused(on_zen3, tmp_path):
    """The committed epyc-2core profile (measured on an AVX-512 EPYC, recorded by name only) and
    the same profile as it would record the Zen 4 today: neither loads on the Zen 3."""
    from yggtree.plan import load_plan
    from yggtree.runtime.cost import CostModel

    plan = load_plan(ROOT / "profiles" / "epyc-2core.yaml")
    committed = json.loads(Path(plan.profile).read_text())
    assert committed["hardware"]["device_name"] == "AMD EPYC"
    with pytest.raises(YggError, match=r"is not of this machine: it records the cpu only by name \('AMD EPYC'\)"):
        CostModel.from_profile(plan.profile, plan)
    zen4 = committed | {"hardware": committed["hardware"] | device_record(as_device(ZEN4))}
    (tmp_path / "zen4.json").write_text(json.dumps(zen4))
    with pytest.raises(YggError) as e:
        CostModel.from_profile(tmp_path / "zen4.json", plan)
    assert "\n" not in str(e.value) and "it had avx512f, avx512bw, avx512vl, avx512_vnni" in str(e.value)
    zen3 = committed | {"hardware": committed["hardware"] | device_record(on_zen3)}
    (tmp_path / "zen3.json").write_text(json.dumps(zen3))
    assert CostModel.from_profile(tmp_path / "zen3.json", plan).plain_ms(100) > 0  # its own: loads


def test_the_committed_tuned_plan_is_not_taken_on_another_epyc(on_zen3, tmp_path):
    """`yggtree run` without a plan on the Zen 3: the checkout's epyc-2core plan (tuned on the
    Zen 4) is neither taken nor offered for compiling; one line says why."""
    from yggtree.tuned import find_tuned_plan

    lines = []
    found = find_tuned_plan("float32", on_zen3, (ROOT / "profiles",), tmp_path / "compile", say=lines.append)
    assert found == (None, None)
    assert len(lines) == 1 and "not using tuned plan" in lines[0] and "epyc-2core" in lines[0]
    assert "only by name ('AMD EPYC')" in lines[0]
    # the same plan recorded with the Zen 4's identity: not taken, the features named
    for f in ("epyc-2core.yaml", "epyc-2core.json"):
        shutil.copy(ROOT / "profiles" / f, tmp_path / f)
    prof = json.loads((tmp_path / "epyc-2core.json").read_text())
    prof["hardware"] |= device_record(as_device(ZEN4))
    (tmp_path / "epyc-2core.json").write_text(json.dumps(prof))
    cal = ROOT / "yggtree" / "assets" / "predictors" / "default__default__float32"
    text = (tmp_path / "epyc-2core.yaml").read_text()
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(("calibration:", "predictor:")))
    (tmp_path / "epyc-2core.yaml").write_text(f"{text}\ncalibration: {cal / 'calibration.json'}\n")
    lines.clear()
    assert find_tuned_plan("float32", on_zen3, (tmp_path,), tmp_path / "compile", say=lines.append) == (None, None)
    assert len(lines) == 1 and "it had avx512f" in lines[0] and "model 17 there, 1 here" in lines[0]
    # recorded on this very CPU: found (uncompiled: its packages are not built)
    prof["hardware"] |= device_record(on_zen3)
    (tmp_path / "epyc-2core.json").write_text(json.dumps(prof))
    lines.clear()
    assert find_tuned_plan("float32", on_zen3, (tmp_path,), tmp_path / "compile", say=lines.append) == (
        None, tmp_path / "epyc-2core.yaml")
    assert lines == []


def test_a_kernel_choice_of_the_other_epyc_is_measured_again(on_zen3, tmp_path, capsys):
    from yggtree.runtime import kernel_cache as kc

    class Src:
        path = tmp_path / "model.gguf"

    Src.path.write_bytes(b"\0" * 16)
    mine = kc.choice_key(Src, "float32", None, (1, 4), 2, on_zen3)
    theirs = kc.choice_key(Src, "float32", None, (1, 4), 2, as_device(ZEN4))
    path = kc.choice_path(mine, tmp_path)
    assert kc.choice_path(theirs, tmp_path) == path  # one file per setup: found, then refused by name
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": theirs, "padding": {"kernel": "tiled", "min_rows": 1}}))
    choice, where, key = kc.cached_choice(Src, "float32", None, (1, 4), 2, tmp_path)
    assert (choice, where, key) == (None, path, mine)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not using the product-kernel choice" in err[0] and "it had avx512f" in err[0]
    path.write_text(json.dumps({"key": mine, "padding": {"kernel": "torch", "min_rows": 1}}))
    assert kc.cached_choice(Src, "float32", None, (1, 4), 2, tmp_path)[0] == {"kernel": "torch", "min_rows": 1}
    assert capsys.readouterr().err == ""


def test_packages_compiled_on_the_other_epyc_are_stale(on_zen3, tmp_path, monkeypatch):
    from yggtree.compiled import check_artifacts
    from yggtree.plan import load_plan
    from yggtree.runtime.artifacts import MANIFEST

    monkeypatch.setenv("YGGTREE_KERNEL", "torch")
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"a": 1}')
    (tmp_path / "plan.yaml").write_text("name: t\ntarget: model\ndrafter: null\nbackend: inductor-cpu\n")
    plan = load_plan(tmp_path / "plan.yaml")
    art = tmp_path / "compile" / "t"
    art.mkdir(parents=True)

    def reasons(manifest: dict) -> list[str]:
        (art / MANIFEST).write_text(json.dumps(manifest))
        return [r for r in check_artifacts(plan, art) if "not built on this machine" in r]

    assert reasons({"format": 2, "device": device_record(on_zen3)}) == []
    [why] = reasons({"format": 2, "device": device_record(as_device(ZEN4))})
    assert "it had avx512f" in why
    [why] = reasons({"format": 2})  # compiled before the manifest recorded a device
    assert "records no device" in why


def test_the_quick_profile_of_each_cpu_has_its_own_file(tmp_path):
    from yggtree.quickstart import quick_profile_path

    a = quick_profile_path(as_device(ZEN3), 2, "float32", tmp_path)
    b = quick_profile_path(as_device(ZEN4), 2, "float32", tmp_path)
    assert a != b and a.parent == b.parent and a.name.startswith("cpu-amd-epyc-")


def test_a_tune_study_of_the_other_epyc_is_refused(tmp_path):
    pytest.importorskip("optuna")
    from yggtree.offline.tune_study import open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    ident = {"format": 2, "device": "cpu AMD EPYC", "device_identity": ZEN4.to_dict(), "threads": 2}
    open_study(url, "s", ident)
    open_study(url, "s", ident)  # its own device: reopened
    with pytest.raises(YggError) as e:
        open_study(url, "s", ident | {"device_identity": ZEN3.to_dict()})
    assert "timed its trials on another device" in str(e.value) and "it had avx512f" in str(e.value)
