"""The allocator choice (runtime/allocator.py, yggtree/measure/allocator_choice.py): finding the libraries,
which one a process runs, the decision rule, the cache, and the restart on the chosen one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yggtree.measure.allocator_choice import decide, measure_compiled
from yggtree.errors import YggError
from yggtree.runtime import allocator as a


def _libm() -> str:
    """A shared library every Linux machine has, harmless to preload (stands for an allocator)."""
    maps = Path("/proc/self/maps").read_text()
    for line in maps.splitlines():
        path = line.split()[-1]
        if "/libm.so" in path or "/libm-" in path:
            return path
    pytest.skip("libm is not mapped in this process")


def test_find_and_installed(tmp_path):
    (tmp_path / "b").mkdir()
    assert a.find("jemalloc", [tmp_path]) is None and a.installed([tmp_path]) == {}
    (tmp_path / "b" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    assert a.installed([tmp_path, tmp_path / "b"]) == {"jemalloc": tmp_path / "libjemalloc.so.2",
                                                         "tcmalloc": tmp_path / "b" / "libtcmalloc_minimal.so.4"}


def test_running_and_names():
    line = "7f00-7f10 r-xp 00000000 08:01 123 {}\n"
    assert a.running(line.format("/usr/lib/x86_64-linux-gnu/libc.so.6")) == a.SYSTEM
    assert a.running(line.format("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")) == "jemalloc"
    assert a.running(line.format("/opt/lib/libtcmalloc_minimal.so.4")) == "tcmalloc"
    assert a.running() == a.SYSTEM  # the tests run on the system allocator
    assert a.name_of("/x/libjemalloc.so.2") == "jemalloc" and a.name_of("/x/libtcmalloc.so.4") == "tcmalloc"
    assert a.name_of("/x/libm.so.6") == "libm.so.6"


def test_preload_env_puts_the_library_first_once():
    env = a.preload_env({"LD_PRELOAD": "/x/libfoo.so /y/lib.so", "A": "1"}, "/l/libjemalloc.so.2")
    assert env["LD_PRELOAD"] == "/l/libjemalloc.so.2:/x/libfoo.so:/y/lib.so" and env["A"] == "1"
    assert a.preload_env(env, "/l/libjemalloc.so.2")["LD_PRELOAD"] == env["LD_PRELOAD"]
    assert env[a.LOADED_ENV] == "/l/libjemalloc.so.2"


def test_without_preload_drops_only_what_a_restart_added():
    env = a.preload_env({"LD_PRELOAD": "/x/libfoo.so", "A": "1"}, "/l/libjemalloc.so.2")
    assert a.without_preload(env) == {"LD_PRELOAD": "/x/libfoo.so", "A": "1"}
    assert a.without_preload(a.preload_env({}, "/l/libjemalloc.so.2")) == {}
    assert a.without_preload({"LD_PRELOAD": "/x/libfoo.so"}) == {"LD_PRELOAD": "/x/libfoo.so"}  # the user's own


def test_decide():
    rounds = [{"system": 5.0, "jemalloc": 4.5, "tcmalloc": 5.2}, {"system": 4.0, "jemalloc": 4.2, "tcmalloc": 3.9},
              {"system": 5.0, "jemalloc": 4.6, "tcmalloc": 5.5}]
    choice, stats = decide(rounds)
    assert choice == "jemalloc" and stats["jemalloc"]["won"] == pytest.approx(2 / 3)
    assert stats["jemalloc"]["speedup"] == pytest.approx(5.0 / 4.6)
    # faster by its median but in half of the rounds only: the system's stays
    assert decide([{"system": 5.0, "j": 4.0}, {"system": 5.0, "j": 4.9}, {"system": 5.0, "j": 5.1},
                   {"system": 5.0, "j": 5.2}])[0] == "system"
    assert decide([{"system": 4.0, "j": 4.0}])[0] == "system"  # a tie is no reason to preload
    assert decide([{"system": 4.0}]) == ("system", {})


def test_forced_values(monkeypatch, tmp_path):
    monkeypatch.setenv(a.ALLOCATOR_ENV, "system")
    assert a.forced() == "system" and a.chosen(tmp_path) == "system"
    monkeypatch.setenv(a.ALLOCATOR_ENV, "auto")
    assert a.forced() is None
    monkeypatch.setenv(a.ALLOCATOR_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(YggError, match="no such file"):
        a.forced()
    monkeypatch.setenv(a.ALLOCATOR_ENV, "mimalloc")
    with pytest.raises(YggError, match="must be auto, system, jemalloc, tcmalloc or a library path"):
        a.forced()


def test_chosen_reads_the_cached_measurement(monkeypatch, tmp_path):
    monkeypatch.setenv(a.ALLOCATOR_ENV, "auto")
    assert a.chosen(tmp_path) == "system"  # nothing measured
    record, path, key = a.cached(tmp_path)
    assert record is None
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "choice": "jemalloc", "library": _libm()}))
    assert a.chosen(tmp_path) == _libm()
    path.write_text(json.dumps({"key": {**key, "cpu": "another"}, "choice": "jemalloc", "library": _libm()}))
    assert a.chosen(tmp_path) == "system"  # measured on another machine (or other libraries)


def test_measure_without_other_allocators_caches_the_system(monkeypatch, tmp_path):
    monkeypatch.setenv(a.ALLOCATOR_ENV, "auto")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("yggtree.measure.allocator_choice.installed", lambda: {})
    monkeypatch.setattr("yggtree.runtime.allocator.installed", lambda dirs=None: {})
    record = measure_compiled("unused.yaml", "unused")  # nothing to compare: no child runs
    assert record["choice"] == "system" and record["rounds"] == []
    assert measure_compiled("unused.yaml", "unused") == record  # read from the cache now
    monkeypatch.setenv(a.ALLOCATOR_ENV, "system")
    assert measure_compiled("unused.yaml", "unused") is None  # forced: nothing measured


_SHOW = ("import os, sys; from yggtree.runtime import allocator as a; "
         "a.ensure([sys.executable, '-c', "
         "'import os; print(os.environ.get(\"LD_PRELOAD\"), os.environ.get(\"YGGTREE_ALLOCATOR_EXEC\"))']); "
         "print('not restarted')")


def _show(env: dict) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", a.LOADED_ENV)}
    out = subprocess.run([sys.executable, "-c", _SHOW], env={**base, **env}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_ensure_restarts_once_on_the_chosen_library():
    lib = _libm()
    assert _show({a.ALLOCATOR_ENV: lib}) == f"{lib} {lib}"
    assert _show({a.ALLOCATOR_ENV: lib, a.LOADED_ENV: lib}) == "not restarted"  # the restarted process
    assert _show({a.ALLOCATOR_ENV: "system"}) == "not restarted"


def test_ensure_keeps_an_allocator_the_user_preloaded(monkeypatch):
    calls = []
    monkeypatch.setattr(a.os, "execve", lambda *args: calls.append(args))
    monkeypatch.delenv(a.LOADED_ENV, raising=False)
    monkeypatch.setattr(a, "chosen", lambda root=None: "/l/libjemalloc.so.2")  # measured here
    monkeypatch.setenv(a.ALLOCATOR_ENV, "auto")
    monkeypatch.setattr(a, "running", lambda maps=None: "tcmalloc")  # LD_PRELOAD of the user's own
    a.ensure(["python"])
    assert calls == []
    monkeypatch.setattr(a, "running", lambda maps=None: "jemalloc")  # already on the choice
    a.ensure(["python"])
    assert calls == []
    monkeypatch.setattr(a, "running", lambda maps=None: a.SYSTEM)
    a.ensure(["python", "-m", "yggtree.launch", "run"])
    assert [c[:2] for c in calls] == [("python", ["python", "-m", "yggtree.launch", "run"])]
    assert calls[0][2]["LD_PRELOAD"].split(":")[0] == "/l/libjemalloc.so.2"


def test_launcher_bad_value_is_one_line():
    env = {**os.environ, a.ALLOCATOR_ENV: "mimalloc"}
    out = subprocess.run([sys.executable, "-m", "yggtree.launch", "--help"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "yggtree: error: YGGTREE_ALLOCATOR='mimalloc': must be auto, system, jemalloc, tcmalloc or a library path"]
