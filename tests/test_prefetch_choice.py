"""The products' prefetch confirmed by decoding (yggtree/measure/prefetch_choice.py): which setting an
engine takes from its packages' record, and how ``yggtree compile`` records it."""

from __future__ import annotations

import json

import pytest

from yggtree.errors import YggError


def test_a_record_gives_the_library_default_only_for_the_setting_it_judged():
    from yggtree.runtime.build import confirmed_prefetch

    def confirmed(record, setting):
        return confirmed_prefetch({} if record is None else {"prefetch": record}, setting)

    judged = {"choice": "default", "setting": [2048, 8192]}
    assert confirmed(judged, (2048, 8192)) is None  # decoded slower than the default: the default
    assert confirmed(judged, (2048, 0)) == (2048, 0)  # measured again since: not what it judged
    assert confirmed({"choice": "measured", "setting": [2048, 8192]}, (2048, 8192)) == (2048, 8192)
    assert confirmed(None, (512, 0)) == (512, 0) and confirmed({}, (512, 0)) == (512, 0)  # never judged
    assert confirmed(judged, None) is None  # the default already
    forced = {"choice": "default", "forced": "YGGTREE_PREFETCH"}  # told at the compile: any setting
    assert confirmed(forced, (512, 0)) is None and confirmed(forced, (2048, 8192)) is None
    assert confirmed({"choice": "measured", "forced": "YGGTREE_PREFETCH"}, (512, 0)) == (512, 0)


def test_the_prefetch_is_recorded_beside_the_manifests_other_fields(monkeypatch, tmp_path):
    """offline/compile.record_prefetch: the measurement recorded in the packages' manifest, its other
    fields kept; nothing recorded without a manifest or where the engine takes the library's default;
    a failed measurement or an unwritable manifest is one line and no record (runs keep the measured
    setting)."""
    import yggtree.measure.prefetch_choice as prefetch_mod
    import yggtree.offline.compile as compile_mod
    from yggtree.offline.compile import record_prefetch

    measured, said = [], []
    record = {"choice": "default", "setting": [2048, 8192], "stats": {"speedup": 0.93}}
    monkeypatch.setattr(prefetch_mod, "measure_compiled", lambda plan, art, say=None, engine=None: measured.append(art) or record)
    art = tmp_path / "plan"
    art.mkdir()
    assert record_prefetch("plan", art, said.append) is None and measured == []  # no manifest
    (art / "manifest.json").write_text(json.dumps({"threads": 2, "n_slots": 7}))
    got = record_prefetch("plan", art, said.append)
    assert measured == [art] and got["prefetch"] == record and got["n_slots"] == 7
    assert json.loads((art / "manifest.json").read_text()) == got and said == []

    monkeypatch.setattr(prefetch_mod, "measure_compiled", lambda plan, art, say=None, engine=None: None)  # the default already
    (art / "manifest.json").write_text(json.dumps({"threads": 2}))
    assert record_prefetch("plan", art, said.append) is None
    assert json.loads((art / "manifest.json").read_text()) == {"threads": 2}

    def fails(plan, art, say=None, engine=None):
        raise YggError("the measurement decoded no tokens")

    monkeypatch.setattr(prefetch_mod, "measure_compiled", fails)
    assert "prefetch" not in record_prefetch("plan", art, said.append)
    assert said == ["the products' prefetch was not measured by decoding: the measurement decoded no tokens"]

    def unwritable(art, manifest):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prefetch_mod, "measure_compiled", lambda plan, art, say=None, engine=None: record)
    monkeypatch.setattr(compile_mod, "_write_manifest", unwritable)
    assert "prefetch" not in record_prefetch("plan", art, said.append)  # a full disk: one line
    assert said[-1] == "the products' prefetch was not measured by decoding: [Errno 28] No space left on device"


def test_the_decoding_settings_are_measured_prefetch_first_on_one_engine(monkeypatch, tmp_path):
    """offline/compile.record_decoding: the prefetch, then the loops, on one plain engine built on first
    use (never where nothing decodes), the loops at the prefetch runs take after the prefetch's record;
    returns the manifest of the last record."""
    import types

    import yggtree.measure.loops_choice as loops_mod
    import yggtree.measure.prefetch_choice as prefetch_mod
    import yggtree.offline.compile as compile_mod
    import yggtree.runtime.build as build_mod
    from yggtree.runtime.engine import EngineConfig

    built, seen = [], []

    def build(plan, art, speculate=True):
        assert not speculate
        built.append(types.SimpleNamespace(cfg=EngineConfig(prefetch=(2048, 8192))))
        return built[-1], "tok"

    def measure(kind, record):
        def measure_compiled(plan, art, say=None, engine=None):
            eng, tok = engine()
            seen.append((kind, id(eng), eng.cfg.prefetch, tok))
            return record
        return measure_compiled

    monkeypatch.setattr(build_mod, "build_plan_engine", build)
    monkeypatch.setattr(prefetch_mod, "measure_compiled",
                        measure("prefetch", {"choice": "default", "setting": [2048, 8192]}))
    monkeypatch.setattr(loops_mod, "measure_compiled", measure("loops", {"choice": "pool"}))
    (tmp_path / "manifest.json").write_text(json.dumps({"serial_loops": True, "threads": 2}))
    got = compile_mod.record_decoding("plan", tmp_path, print)
    assert got == {"serial_loops": True, "threads": 2, "prefetch": {"choice": "default", "setting": [2048, 8192]},
                   "loops": {"choice": "pool"}}
    assert len(built) == 1 and seen == [("prefetch", id(built[0]), (2048, 8192), "tok"),
                                        ("loops", id(built[0]), None, "tok")]  # the default: judged slower

    built.clear(), seen.clear()  # nothing decodes (the loops forced): no engine is built
    monkeypatch.setattr(prefetch_mod, "measure_compiled", lambda plan, art, say=None, engine=None: None)
    monkeypatch.setattr(loops_mod, "measure_compiled", lambda plan, art, say=None, engine=None: {"choice": "openmp"})
    assert compile_mod.record_decoding("plan", tmp_path, print)["loops"] == {"choice": "openmp"} and built == []
    monkeypatch.setattr(compile_mod, "record_loops", lambda plan, art, say, engine=None: None)  # no loops to measure
    (tmp_path / "manifest.json").write_text(json.dumps({"threads": 2}))
    monkeypatch.setattr(prefetch_mod, "measure_compiled", lambda plan, art, say=None, engine=None: {"choice": "measured"})
    assert compile_mod.record_decoding("plan", tmp_path, print) == {"threads": 2, "prefetch": {"choice": "measured"}}


@pytest.mark.parametrize("value, forced", [("auto", None), ("", None), ("measured", "measured"), ("default", "default")])
def test_the_prefetch_setting_of_the_environment(monkeypatch, value, forced):
    """``YGGTREE_PREFETCH`` forces the record without building an engine or decoding."""
    import yggtree.runtime.build as build_mod
    from yggtree.measure.prefetch_choice import forced as forced_choice
    from yggtree.measure.prefetch_choice import measure_compiled

    monkeypatch.setenv("YGGTREE_PREFETCH", value)
    assert forced_choice() == forced
    if forced is not None:
        monkeypatch.setattr(build_mod, "build_plan_engine", lambda *a, **k: pytest.fail("an engine was built"))
        assert measure_compiled("plan", "art") == {"choice": forced, "forced": "YGGTREE_PREFETCH"}
