"""Plans: schema validation (errors name the key), relative paths, the shipped default plan,
manifests and staleness, refusals. Nothing here compiles a graph (the eager backend writes a
manifest without building anything)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from helpers import tiny_model
from yggtree.compiled import check_artifacts
from yggtree.errors import YggError
from yggtree.offline.compile import compile_plan, prepare_run
from yggtree.plan import DEFAULT_PLAN, default_plan, load_plan, save_plan
from yggtree.runtime import graphs
from yggtree.runtime.artifacts import MANIFEST
from yggtree.runtime.build import fixed_policy, plan_slots, warm_plan
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import Engine, EngineConfig
from yggtree.runtime.model import Transformer

BASE = {
    "name": "t",
    "target": "default",
    "drafter": "self",
    "max_context": 64,
    "prefill_chunk": 8,
    "draft_widths": [1, 2],
    "d_max": 2,
    "top_k": 2,
    "verify_widths": [1, 2, 4],
    "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16},
}


def write(tmp_path: Path, raw, name="plan.yaml") -> Path:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return p


def with_(**kw) -> dict:
    d = json.loads(json.dumps(BASE))
    for k, v in kw.items():
        if "." in k:
            a, b = k.split(".")
            d[a][b] = v
        elif v is ...:
            d.pop(k)
        else:
            d[k] = v
    return d


# ----------------------------------------------------------------------------- validation


def test_default_plan_loads_and_validates():
    p = default_plan()
    assert p.source == DEFAULT_PLAN.resolve()
    assert p.name == "default" and p.target == "default" and p.drafter == "default"
    assert p.backend == "inductor-cpu" and p.stages == "sequential"
    assert max(p.verify_widths) <= p.max_tree
    assert set(p.target_widths) == {p.prefill_chunk, 1, *p.verify_widths}
    assert p.hash() == load_plan(DEFAULT_PLAN).hash()  # deterministic identity


def test_minimal_plan_gets_defaults(tmp_path):
    p = load_plan(write(tmp_path, {"name": "m", "target": "default"}))
    assert p.drafter is None and not p.speculative
    assert p.target_widths == (1, p.prefill_chunk)


BAD = {
    "unknown top-level key": (with_(widht=3), "'widht'"),
    "unknown sampling key": (with_(**{"sampling.temp": 0.5}), "'sampling.temp'"),
    "wrong type int": (with_(max_context="big"), "'max_context'"),
    "bool is not an int": (with_(d_max=True), "'d_max'"),
    "wrong type list": (with_(draft_widths="4"), "'draft_widths'"),
    "list of non-ints": (with_(verify_widths=[2, "x"]), "'verify_widths'"),
    "wrong type float": (with_(**{"sampling.temperature": "hot"}), "'sampling.temperature'"),
    "sampling not a mapping": (with_(sampling=[1]), "'sampling'"),
    "draft width < 1": (with_(draft_widths=[0, 2]), "'draft_widths'"),
    "verify width < 1": (with_(verify_widths=[0]), "'verify_widths'"),
    "duplicate width": (with_(verify_widths=[2, 2]), "'verify_widths'"),
    "d_max < 1": (with_(d_max=0), "'d_max'"),
    "prefill_chunk < 1": (with_(prefill_chunk=0), "'prefill_chunk'"),
    "top_k < 1": (with_(top_k=0), "'top_k'"),
    "W_v beyond the tree": (with_(verify_widths=[6]), "'verify_widths'"),
    "top_p out of range": (with_(**{"sampling.top_p": 0}), "'sampling.top_p'"),
    "negative temperature": (with_(**{"sampling.temperature": -1}), "'sampling.temperature'"),
    "max_new_tokens >= context": (with_(**{"sampling.max_new_tokens": 64}), "'sampling.max_new_tokens'"),
    "unknown backend": (with_(backend="tpu"), "'backend'"),
    "unknown dtype": (with_(dtype="float16"), "'dtype'"),
    "unknown stage plan": (with_(stages="overlap-everything"), "'stages'"),
    "missing name": (with_(name=...), "'name'"),
    "bad name": (with_(name="../x"), "'name'"),
    "missing target": (with_(target=...), "'target'"),
    "drafter not a string": (with_(drafter=3), "'drafter'"),
    "missing profile file": (with_(profile="profiles/nope.json"), "'profile'"),
    "missing predictor file": (with_(predictor="nope/"), "'predictor'"),
    "missing calibration file": (with_(calibration="cal.json"), "'calibration'"),
    "missing target path": (with_(target="models/none"), "'target'"),
    "missing drafter path": (with_(drafter="drafters/none"), "'drafter'"),
    "bad version": (with_(version=2), "'version'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_plans_name_the_key(tmp_path, case):
    raw, key = BAD[case]
    path = write(tmp_path, raw)
    with pytest.raises(YggError) as e:
        load_plan(path)
    msg = str(e.value)
    assert key in msg, msg
    assert str(path) in msg and "\n" not in msg


def test_missing_file_error_names_the_resolved_path(tmp_path):
    with pytest.raises(YggError, match=r"profile.*file not found: .*/sub/profiles/x\.json"):
        load_plan(write(tmp_path, with_(profile="profiles/x.json"), "sub/plan.yaml"))


@pytest.mark.parametrize("text", ["- a\n- b\n", "name: [unclosed\n", ""])
def test_not_a_mapping_or_not_yaml(tmp_path, text):
    with pytest.raises(YggError, match="plan"):
        load_plan(write(tmp_path, text))


def test_plan_file_not_found(tmp_path):
    with pytest.raises(YggError, match="plan file not found"):
        load_plan(tmp_path / "none.yaml")


def test_backends_agree_with_the_runtime():
    from yggtree import plan

    assert plan.BACKENDS == graphs.BACKENDS


# ----------------------------------------------------------------------------- paths


def test_paths_are_relative_to_the_plan_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "hw.json").write_text("{}")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    raw = with_(profile="../profiles/hw.json", target="../m", drafter="../m")
    p = load_plan(write(tmp_path, raw, "plans/plan.yaml"))
    assert p.profile == str(tmp_path / "profiles" / "hw.json")
    assert p.target == p.drafter == str(tmp_path / "m")
    # a copy elsewhere names the same files (written relative to its own directory)
    copy = save_plan(p, tmp_path / "elsewhere" / "deep" / "plan.yaml")
    text = copy.read_text()
    assert "../../profiles/hw.json" in text and str(tmp_path) not in text
    q = load_plan(copy)
    assert q == p and q.hash() == p.hash() and q.source != p.source


def test_keywords_are_not_paths(tmp_path):
    p = load_plan(write(tmp_path, with_(target="default", drafter="self")))
    assert p.target == "default" and p.drafter == "self"
    p = load_plan(write(tmp_path, with_(drafter=None)))
    assert p.drafter is None


# ----------------------------------------------------------------------------- widths


def test_width_choice_must_be_in_the_compiled_set(tmp_path):
    p = load_plan(write(tmp_path, BASE))
    tp = p.tree_params(2, 4, 2)
    assert (tp.draft_width, tp.verify_width, tp.draft_depth, tp.top_k) == (2, 4, 2, 2)
    env = p.tree_params()  # the envelope: largest widths, D_max
    assert (env.draft_width, env.verify_width, env.draft_depth) == (2, 4, 2)
    with pytest.raises(YggError, match=r"^draft width 3 is not in the plan's compiled set \{1, 2\}$"):
        p.tree_params(draft_width=3)
    with pytest.raises(YggError, match=r"^verify width 8 is not in the plan's compiled set \{1, 2, 4\}$"):
        p.tree_params(verify_width=8)
    with pytest.raises(YggError, match="d_max"):
        p.tree_params(draft_depth=3)


def tiny(vocab=97, hidden=32, layers=2) -> Transformer:
    return tiny_model(vocab, hidden, layers, std=None)


def test_plan_engine_slots_widths_and_width_switching(tmp_path, monkeypatch):
    """plan_slots mirrors the Engine built with the plan's envelope (compiled shapes depend on
    it); warm_plan builds every plan width of an engine whose envelope holds them (and refuses
    one that does not); fixed_policy accepts only compiled choices."""
    monkeypatch.setenv("YGGTREE_KERNEL", "torch")  # no product kernel measured on this machine needed
    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.engine import SamplingParams

    p = load_plan(write(tmp_path, BASE))
    spec = EngineSpec.from_plan(p, mode="reference")
    target = tiny()
    cfg = EngineConfig(mode="reference", max_context=p.max_context, prefill_chunk=p.prefill_chunk, tree=spec.tree)
    narrow = Engine(target, cfg, LMDrafter(target.shared_copy(), "reference"))
    with pytest.raises(YggError, match="envelope"):
        warm_plan(narrow, p)
    cfg = EngineConfig(mode="reference", max_context=p.max_context, prefill_chunk=p.prefill_chunk, tree=spec.tree,
                       draft_widths=spec.draft_widths, verify_widths=spec.verify_widths)
    eng = Engine(target, cfg, LMDrafter(target.shared_copy(), "reference"))
    assert eng.n_slots == plan_slots(p)
    warm_plan(eng, p)
    assert eng.graphs.widths == set(p.target_widths)
    assert eng.drafter.graphs.widths == {1, 2, p.prefill_chunk}
    with pytest.raises(YggError, match="not in the plan's compiled set"):
        fixed_policy(eng, p, draft_width=4)
    for wd, wv in [(1, 1), (1, 2), (2, 4)]:
        pol = fixed_policy(eng, p, wd, wv)
        assert (pol.choice.draft_width, pol.verify_width) == (wd, wv)
        seen = []
        eng.generate([3, 4, 5], SamplingParams(max_new_tokens=6), policy=pol,
                     on_step=lambda r: seen.append((r.choice.draft_width, r.verify_width)))
        assert set(seen) == {(wd, wv)}
    small = Engine(tiny(), EngineConfig(mode="reference", max_context=p.max_context, prefill_chunk=8))
    with pytest.raises(YggError, match="cache slots"):
        warm_plan(small, p)


def test_from_plan_modes_and_backends(tmp_path, monkeypatch):
    from yggtree.runtime.build import EngineSpec

    monkeypatch.setenv("YGGTREE_KERNEL", "torch")  # no product kernel measured on this machine needed

    p = load_plan(write(tmp_path, BASE))
    assert EngineSpec.from_plan(p).mode == "performance"
    e = load_plan(write(tmp_path, with_(backend="eager"), "e.yaml"))
    assert EngineSpec.from_plan(e).mode == "reference"
    g = graphs.Graphs(tiny(), "performance", backend="eager")
    assert not g.compiled


# ----------------------------------------------------------------------------- manifests


def eager_plan(tmp_path, **kw) -> Path:
    """A plan over a small fake HF directory (the eager backend never loads it)."""
    m = tmp_path / "model"
    m.mkdir(exist_ok=True)
    if not (m / "config.json").exists():
        (m / "config.json").write_text('{"a": 1}')
        (m / "model.safetensors").write_bytes(b"\0" * 64)
    return write(tmp_path, with_(**{"target": "model", "backend": "eager", **kw}))


def test_manifest_roundtrip_and_copy(tmp_path):
    plan = load_plan(eager_plan(tmp_path))
    out = tmp_path / "compile"
    s = compile_plan(plan, out)
    art = out / "t"
    assert s["status"] == "compiled" and Path(s["dir"]) == art
    m = json.loads((art / MANIFEST).read_text())
    assert m["plan_hash"] == plan.hash() and m["plan"] == plan.to_dict(relative_to=art)
    assert m["plan"]["target"] == "../../model" and str(tmp_path) not in (art / MANIFEST).read_text()
    assert m["versions"]["torch"] == torch.__version__ and m["graphs"] == []
    # model paths relative to the artifact directory: a manifest holds no absolute path of them
    assert {f["path"] for f in m["models"]} == {f"../../model/{n}" for n in ("config.json", "model.safetensors")}
    assert "sha256" in next(f for f in m["models"] if f["path"].endswith("config.json"))
    copy = load_plan(art / "plan.yaml")
    assert copy.hash() == plan.hash()
    assert check_artifacts(plan, art) == [] and check_artifacts(copy, art) == []
    again = compile_plan(plan, out)
    assert again["status"] == "up-to-date"


def test_moved_artifacts_stay_usable(tmp_path):
    """No location enters a plan's identity or its manifest: the whole tree moved, or the compiled
    directory moved alone, is still up to date; a profile's content (not its path) is identity."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "prof.json").write_text("{}")
    plan = load_plan(eager_plan(a, profile="prof.json"))
    compile_plan(plan, a / "compile")
    identity = plan.hash(), plan.graph_hash()
    shutil.move(a, b)  # the checkout moved
    moved = load_plan(b / "plan.yaml")
    assert moved.target == str(b / "model") and (moved.hash(), moved.graph_hash()) == identity
    assert check_artifacts(moved, b / "compile" / "t") == []
    assert check_artifacts(load_plan(b / "compile" / "t" / "plan.yaml"), b / "compile" / "t") == []
    assert compile_plan(moved, b / "compile")["status"] == "up-to-date"
    shutil.move(b / "compile", tmp_path / "elsewhere")  # the compiled directory moved alone
    assert check_artifacts(moved, tmp_path / "elsewhere" / "t") == []
    (b / "prof.json").write_text('{"edited": 1}')  # same path, new content: a new identity
    assert load_plan(b / "plan.yaml").hash() != identity[0]


def test_stale_detection(tmp_path):
    plan = load_plan(eager_plan(tmp_path))
    art = tmp_path / "compile" / "t"
    assert check_artifacts(plan, art) == [f"no compiled artifacts: {art / MANIFEST} is missing"]
    compile_plan(plan, tmp_path / "compile")
    assert check_artifacts(plan, art) == []
    # torch version
    m = json.loads((art / MANIFEST).read_text())
    m["versions"]["torch"] = "1.0.0"
    (art / MANIFEST).write_text(json.dumps(m))
    (r,) = check_artifacts(plan, art)
    assert "torch version changed: compiled with 1.0.0" in r
    compile_plan(plan, tmp_path / "compile")  # same plan: recompiles without --force
    assert check_artifacts(plan, art) == []
    # yggtree's runtime code (what graphs are traced from)
    m = json.loads((art / MANIFEST).read_text())
    m["versions"]["yggtree_runtime"] = "0" * 16
    (art / MANIFEST).write_text(json.dumps(m))
    (r,) = check_artifacts(plan, art)
    assert r.startswith("yggtree runtime code changed")
    compile_plan(plan, tmp_path / "compile")
    # a model file copied again (a fresh clone, a reinstalled package: a new mtime, the same bytes)
    w = tmp_path / "model" / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert check_artifacts(plan, art) == []
    # a model file changed in place, its size kept
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    (r,) = check_artifacts(plan, art)
    assert "target model file changed" in r and str(w) in r
    compile_plan(plan, tmp_path / "compile")
    # the model directory's documentation is not a model file: editing it keeps the artifacts
    (tmp_path / "model" / "README.md").write_text("# notes written after the compile\n")
    assert check_artifacts(plan, art) == []
    # the plan changed
    other = load_plan(eager_plan(tmp_path, verify_widths=[1, 2]))
    (r,) = check_artifacts(other, art)
    assert "plan changed" in r and "verify_widths" in r
    (art / MANIFEST).write_text("{not json")
    assert "cannot read manifest" in check_artifacts(plan, art)[0]


def test_non_graph_fields_keep_the_artifacts(tmp_path):
    """Sampling defaults, profile, calibration, predictor and stages do not change any graph: the
    artifacts stay usable, and compiling the edited plan refreshes the copy without rebuilding."""
    out = tmp_path / "compile"
    plan = load_plan(eager_plan(tmp_path))
    compile_plan(plan, out)
    (tmp_path / "prof.json").write_text("{}")
    edited = load_plan(eager_plan(tmp_path, sampling={"temperature": 0.7, "max_new_tokens": 8}, profile="prof.json"))
    assert edited.hash() != plan.hash() and edited.graph_hash() == plan.graph_hash()
    assert check_artifacts(edited, out / "t") == []
    created = json.loads((out / "t" / MANIFEST).read_text())["created"]
    s = compile_plan(edited, out)
    assert s["status"] == "plan-updated" and s["created"] == created  # nothing rebuilt
    assert load_plan(out / "t" / "plan.yaml").hash() == edited.hash()
    assert compile_plan(edited, out)["status"] == "up-to-date"
    assert check_artifacts(plan, out / "t") == []


def test_profile_padding_flows_to_the_engine_and_the_artifacts(tmp_path, monkeypatch):
    """The padding of short packed products comes from the plan's profile (without one: this
    machine's measurement, yggtree.measure.kernel_choice; a profile older than the measurement: what the
    runtime padded to then), reaches the engine's
    spec, is recorded in the manifest, and a profile padding otherwise makes compiled packages
    stale (they hold it); the eager backend compiles nothing and ignores it."""
    from dataclasses import replace

    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.padding import LEGACY_MIN_ROWS, plan_min_rows, profile_min_rows

    prof = tmp_path / "prof.json"

    def padding(rows):
        prof.write_text(json.dumps({"packed_padding": {"min_rows": rows, "median_ms": {"1": 2.0}}}))

    padding(2)
    plan = load_plan(eager_plan(tmp_path, profile="prof.json"))
    assert plan_min_rows(plan) == 2 and EngineSpec.from_plan(plan).min_rows == 2
    assert EngineSpec.from_plan(plan, min_rows=8).min_rows == 8
    assert plan_min_rows(replace(plan, profile=None)) == 1
    out = tmp_path / "compile"
    compile_plan(plan, out)
    art = out / "t"
    m = json.loads((art / MANIFEST).read_text())
    assert m["packed_min_rows"] == 2
    cpu = replace(plan, backend="inductor-cpu")  # as if compiled for it (the check needs no graph)
    (art / MANIFEST).write_text(json.dumps(m | {"plan": cpu.to_dict(relative_to=art)}))
    assert check_artifacts(cpu, art) == []
    from yggtree.runtime.model import attention_formulation

    now = attention_formulation(plan.prefill_chunk)  # packages hold the attention formulation too
    for was, said in (({"rows_up_to": 1, "logical_window": 32}, "row by row up to 1 rows, logical window 32"),
                      (None, "an earlier one")):
        (art / MANIFEST).write_text(json.dumps(m | {"plan": cpu.to_dict(relative_to=art), "attention": was}))
        assert check_artifacts(cpu, art) == [
            f"the attention formulation changed: compiled with {said}, an engine of this plan uses row by row "
            f"up to {now['rows_up_to']} rows, logical window {now['logical_window']}"]
    (art / MANIFEST).write_text(json.dumps(m | {"plan": cpu.to_dict(relative_to=art)}))
    assert m["packed_kernel"] == "torch" and EngineSpec.from_plan(plan).kernel == "torch"
    assert m["packed_prefetch"] is None and EngineSpec.from_plan(plan).prefetch is None  # the library's default
    prof.write_text(json.dumps({"packed_padding": {"kernel": "tiled", "min_rows": 2, "median_ms": {"tiled": 1.0},
                                                   "prefetch": [1024, 4096]}}))
    assert EngineSpec.from_plan(cpu).kernel == "tiled" and EngineSpec.from_plan(cpu, kernel="torch").kernel == "torch"
    # the setting goes with the kernel: the profile's with its kernel, the caller's with the caller's
    assert EngineSpec.from_plan(cpu).prefetch == (1024, 4096)
    assert EngineSpec.from_plan(cpu, kernel="torch").prefetch is None
    assert EngineSpec.from_plan(cpu, kernel="tiled", prefetch=(512, 0)).prefetch == (512, 0)
    (r,) = check_artifacts(cpu, art)  # the packages call the other product op (a prefetch setting is no package's)
    assert r == "the product kernel changed: compiled with torch, the plan's profile says tiled"
    padding(4)
    (r,) = check_artifacts(cpu, art)
    assert r == "the padding of short packed products changed: compiled with min_rows 2, the plan's profile says 4"
    prof.write_text("{}")  # an older profile
    assert profile_min_rows(prof) == LEGACY_MIN_ROWS
    import yggtree.runtime.kernel_cache as kc

    asked = []  # without a profile: this machine's measurement, at the plan's threads and widths
    monkeypatch.setattr(kc, "cached_choice", lambda src, dtype, weights, widths, threads: asked.append(
        (dtype, weights, widths, threads)) or ({"kernel": "torch", "min_rows": 3}, None, None))
    assert check_artifacts(replace(cpu, profile=None), art) == [
        "the padding of short packed products changed: compiled with min_rows 2, this machine's measurement says 3"]
    assert asked[0][:3] == ("float32", None, (1, *cpu.verify_widths))
    n = len(asked)
    assert plan_min_rows(replace(plan, profile=None)) == 1  # eager: nothing packed, nothing measured
    assert len(asked) == n
    padding(0)
    with pytest.raises(YggError, match=r"packed_padding.min_rows' must be an integer >= 1, got 0"):
        plan_min_rows(plan)
    assert "must be an integer >= 1" in check_artifacts(cpu, art)[0]
    padding(True)
    with pytest.raises(YggError, match="must be an integer >= 1, got True"):
        plan_min_rows(plan)


def test_shipped_profiles_load_and_set_their_padding():
    """The checkout's profiles load (older ones, from before the padding measurement, with the
    padding their curves were measured with), and an engine of each shipped plan pads its short
    packed products as its profile says."""
    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.padding import LEGACY_MIN_ROWS, PADDING_KEY, profile_min_rows

    root = Path(__file__).resolve().parent.parent / "profiles"
    for p in sorted(root.glob("*.json")):
        measured = json.loads(p.read_text()).get(PADDING_KEY)
        assert profile_min_rows(p) == (measured["min_rows"] if measured else LEGACY_MIN_ROWS), p
    for p in sorted(root.glob("*.yaml")):
        plan = load_plan(p)
        if plan.profile is None:  # a plain plan: its padding is measured where it is compiled
            continue
        assert EngineSpec.from_plan(plan).min_rows == profile_min_rows(plan.profile), p


def test_refuses_to_overwrite_another_plans_artifacts(tmp_path):
    out = tmp_path / "compile"
    compile_plan(load_plan(eager_plan(tmp_path)), out)
    other = load_plan(eager_plan(tmp_path, verify_widths=[1, 2]))
    with pytest.raises(YggError, match=f"{out / 't'} holds the artifacts of a different plan.*--force"):
        compile_plan(other, out)
    assert compile_plan(other, out, force=True)["status"] == "compiled"
    assert json.loads((out / "t" / MANIFEST).read_text())["plan_hash"] == other.hash()


def test_refuses_a_foreign_directory(tmp_path):
    out = tmp_path / "compile"
    (out / "t").mkdir(parents=True)
    (out / "t" / "notes.txt").write_text("mine")
    plan = load_plan(eager_plan(tmp_path))
    with pytest.raises(YggError, match="not empty and has no manifest.json"):
        compile_plan(plan, out)
    compile_plan(plan, out, force=True)
    assert (out / "t" / "notes.txt").read_text() == "mine"  # --force never deletes user files


@pytest.mark.parametrize("backend,hint", [("cuda", "CUDA"), ("npu", "torch_npu")])
def test_unavailable_backend_is_refused(tmp_path, backend, hint):
    if backend == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    plan = load_plan(eager_plan(tmp_path, backend=backend))
    with pytest.raises(YggError, match=hint):
        compile_plan(plan, tmp_path / "compile")
    with pytest.raises(YggError, match=hint):
        prepare_run(plan.source, compile_missing=True, compile_root=tmp_path / "compile")
    assert not (tmp_path / "compile").exists()


def test_prepare_run_refuses_missing_artifacts(tmp_path):
    path = eager_plan(tmp_path, backend="inductor-cpu")
    with pytest.raises(YggError, match=r"are not usable: no compiled artifacts.*yggtree compile.*--compile-missing"):
        prepare_run(path, compile_missing=False, compile_root=tmp_path / "compile")
    eager = eager_plan(tmp_path)  # eager runs need nothing compiled
    assert prepare_run(eager, compile_missing=False, compile_root=tmp_path / "compile").backend == "eager"


def test_compile_cli_errors_are_one_line(tmp_path, capsys):
    from yggtree.offline.compile import main

    bad = write(tmp_path, with_(widht=1))
    assert main([str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'widht'" in err


def test_find_tuned_plan_picks_a_compiled_plan_for_this_device(tmp_path):
    """`yggtree run` without --plan looks for a plan tuned for this device and dtype: usable
    artifacts make it ``ready``, missing ones ``uncompiled``; other devices, dtypes, targets or
    plans without a profile and calibration never match."""
    from yggtree.runtime.device import detect_device, device_record
    from yggtree.tuned import find_tuned_plan

    here = detect_device()
    (tmp_path / "here.json").write_text(json.dumps({"hardware": device_record(here)}))
    (tmp_path / "there.json").write_text(json.dumps({"hardware": {"device": "cuda", "device_name": "A100"}}))
    (tmp_path / "cal.json").write_text("{}")
    body = ("name: {name}\ntarget: {target}\ndrafter: default\ndtype: {dtype}\nbackend: {backend}\n"
            "profile: {prof}\ncalibration: cal.json\n")

    def plan(file, name, prof="here.json", dtype="bfloat16", backend="eager", target="default"):
        (tmp_path / file).write_text(body.format(name=name, prof=prof, dtype=dtype, backend=backend, target=target))

    plan("a_other_device.yaml", "a", prof="there.json")
    plan("b_other_dtype.yaml", "b", dtype="float32")
    plan("c_other_target.yaml", "c", target="model.gguf")
    plan("d_uncompiled.yaml", "d", backend="inductor-cpu")
    (tmp_path / "e_broken.yaml").write_text("name: [")
    assert find_tuned_plan("bfloat16", here, (tmp_path,), tmp_path / "compile") == (None, tmp_path / "d_uncompiled.yaml")
    plan("f_ready.yaml", "f")  # the eager backend needs no artifacts
    assert find_tuned_plan("bfloat16", here, (tmp_path,), tmp_path / "compile") == (
        tmp_path / "f_ready.yaml", tmp_path / "d_uncompiled.yaml")
    assert find_tuned_plan("float32", here, (tmp_path,)) == (tmp_path / "b_other_dtype.yaml", None)
    assert find_tuned_plan("bfloat16", {"kind": "npu", "name": "x"}, (tmp_path,)) == (None, None)
    # a quantized plan computes another model: never taken for a float run
    (tmp_path / "g_int8.yaml").write_text(body.format(name="g", prof="here.json", dtype="bfloat16", backend="eager",
                                                     target="default") + "weights: int8\n")
    assert find_tuned_plan("bfloat16", here, (tmp_path,), tmp_path / "compile")[0] == tmp_path / "f_ready.yaml"
    # so does a 16-bit KV cache (first by name, ready: still not taken)
    (tmp_path / "a0_kv16.yaml").write_text(body.format(name="h", prof="here.json", dtype="float32", backend="eager",
                                                      target="default") + "kv_cache: float16\n")
    assert find_tuned_plan("float32", here, (tmp_path,)) == (tmp_path / "b_other_dtype.yaml", None)


def test_find_tuned_plan_prefers_the_fastest_measured_plain_step(tmp_path):
    """Of several ready tuned plans, the one whose profile measured the fastest plain step (its
    width-1 verify point at the shortest context) is taken, whatever the file names' order; a
    profile without that point comes last."""
    from yggtree.runtime.device import detect_device, device_record
    from yggtree.tuned import find_tuned_plan

    here = detect_device()
    hw = device_record(here)
    (tmp_path / "cal.json").write_text("{}")
    for name, pts in (("a", None), ("b", [(1, 224, 9.0), (1, 480, 1.0), (2, 224, 0.5)]), ("c", [(1, 224, 4.0)])):
        points = [{"kind": "verify", "width": w, "context": c, "median_ms": ms} for w, c, ms in pts or ()]
        (tmp_path / f"{name}.json").write_text(json.dumps({"hardware": hw, "points": points}))
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\ntarget: default\ndrafter: default\ndtype: float32\n"
                                               f"backend: eager\nprofile: {name}.json\ncalibration: cal.json\n")
    assert find_tuned_plan("float32", here, (tmp_path,)) == (tmp_path / "c.yaml", None)


def test_tuned_plans_are_found_in_the_user_data_dir_and_the_checkout(tmp_path, monkeypatch):
    """An installed yggtree finds tuned plans in the user's data directory; run from a checkout
    (as this test is), in the checkout's profiles/ after it."""
    from yggtree.runtime.device import detect_device, device_record
    from yggtree.tuned import find_tuned_plan, tuned_plan_dirs

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    user = tmp_path / "data" / "yggtree" / "profiles"
    assert tuned_plan_dirs() == (user, Path(__file__).resolve().parent.parent / "profiles")
    user.mkdir(parents=True)
    here = detect_device()
    (user / "here.json").write_text(json.dumps({"hardware": device_record(here)}))
    (user / "cal.json").write_text("{}")
    (user / "mine.yaml").write_text("name: mine\ntarget: default\ndrafter: default\ndtype: bfloat16\n"
                                    "backend: eager\nprofile: here.json\ncalibration: cal.json\n")
    assert find_tuned_plan("bfloat16", here, compile_root=tmp_path / "compile") == (user / "mine.yaml", None)
    monkeypatch.delenv("XDG_DATA_HOME")
    assert tuned_plan_dirs()[0] == Path.home() / ".local" / "share" / "yggtree" / "profiles"


def test_run_without_plan_takes_a_tuned_plan_only_when_nothing_else_is_asked(monkeypatch, tmp_path):
    """`yggtree run --prompt ...`: the default plan fills unset flags; a ready tuned plan is used
    only when no model, drafter, tree or context flag says otherwise (``--no-speculate`` runs it
    plainly)."""
    import yggtree.tuned as tuned_mod
    from yggtree.cli import build_parser
    from yggtree.run_cmd import _pick_plan

    ready = tmp_path / "tuned.yaml"
    monkeypatch.setattr(tuned_mod, "find_tuned_plan", lambda dtype, device, *a, **k: (ready, None))
    parse = build_parser().parse_args
    args = parse(["run", "--prompt", "hi"])
    _pick_plan(args)
    assert args.plan == str(ready) and args.dtype == "float32"
    args = parse(["run", "--prompt", "hi", "--no-speculate"])  # the same plan, decoded plainly (like for like)
    _pick_plan(args)
    assert args.plan == str(ready) and args.no_speculate
    for extra in (["--max-context", "512"], ["--drafter", "self"],
                  ["--top-k", "2"], ["--mode", "reference"], ["--model", "x.gguf"]):
        args = parse(["run", "--prompt", "hi", *extra])
        _pick_plan(args)
        assert args.plan is None, extra
        assert (args.max_context, args.prefill_chunk) == ((512 if "512" in extra else 1024), 64)
    monkeypatch.setattr(tuned_mod, "find_tuned_plan", lambda dtype, device, *a, **k: (None, ready))
    args = parse(["run", "--prompt", "hi", "--dtype", "bfloat16"])
    _pick_plan(args)
    assert args.plan is None and "yggtree compile" in args.no_default_note and args.dtype == "bfloat16"
