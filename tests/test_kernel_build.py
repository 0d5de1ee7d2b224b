"""The kernel library's build guard: a build killed midway must not hang the next run; every
instruction-set variant compiles, whatever the CPU runs."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from yggtree.errors import YggError
from yggtree.runtime import kernel_check, kernels
from yggtree.runtime.kernels import build_lock

HOLD = """
import sys, time
from pathlib import Path
from yggtree.runtime.kernels import build_lock
with build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").write_text("")  # as torch's guard, mid-build
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_build_killed_midway_does_not_hang_the_next(tmp_path):
    """torch's guard is a ``lock`` file that a killed build leaves behind (later builds then wait
    for it forever); ``build_lock`` is an OS lock, exclusive while its holder lives and released
    when it dies, and its holder removes such a leftover."""
    (tmp_path / "lock").write_text("")
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with open(tmp_path / "build.lock", "a") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another build waits while it lives
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / "lock").exists()  # killed midway: torch's file is left
    with open(tmp_path / "build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the OS lock is not
        fcntl.flock(f, fcntl.LOCK_UN)
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_failing_build_falls_back_to_torchs_kernels_in_one_line(monkeypatch, tmp_path, capsys):
    """Where the library cannot be built, the tiled kernel is not offered (its formats run on
    torch's kernels) and one stderr line names the compiler's first error."""
    import torch
    from torch.utils import cpp_extension

    from yggtree.runtime import kernels
    from yggtree.runtime.packed import can_pack

    def broken(**kw):
        raise RuntimeError("Error building extension 'yggtree_kernels'\ntiled_mm.cpp:9: error: no compiler here\n")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(kernels, "load_library", kernels.load_library.__wrapped__)  # uncached
    monkeypatch.setattr(kernels, "library_usable", kernels.library_usable.__wrapped__)
    monkeypatch.setattr(kernels, "library_missing", lambda: [])  # a CPU the library would run on
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    assert not can_pack(model, "tiled")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "(tiled_mm.cpp:9: error: no compiler here)" in err[0]
    assert err[0].startswith("yggtree: building the kernel library in ") and err[0].endswith(
        "; products run on torch's kernels instead")


def test_an_unwritable_cache_builds_in_a_temporary_directory_with_one_line(monkeypatch, tmp_path, capsys):
    """A cache directory that cannot be written (here: under a file, which no user can make a
    directory in) does not stop a run: the library is built in a temporary directory, removed
    once loaded, and one stderr line says so."""
    from yggtree.runtime import kernels

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    built = []

    def build_and_load(build):
        built.append(build)
        assert build.is_dir() and not build.is_relative_to(blocked)
        (build / "yggtree_kernels.so").write_text("")  # what a build leaves there

    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(kernels, "_build_and_load", build_and_load)
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")
    kernels.load_library.__wrapped__()
    err = capsys.readouterr().err.splitlines()
    assert len(built) == 1 and not built[0].exists()  # built there, then removed
    assert len(err) == 1 and err[0].startswith(f"yggtree: the kernel cache {blocked}/yggtree/kernels/")
    assert err[0].endswith("the kernel library is built in a temporary directory, not kept")


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(kernels.ISAS))
def test_every_instruction_set_variant_compiles_whatever_this_cpu_runs(isa):
    """A variant is built only on a CPU that runs it, so one no test machine runs would break
    unseen (the AVX2 path's static_assert once stopped every AVX-512 build): each compiles here."""
    kernel_check.check_sources(isa)


def test_a_variant_that_does_not_compile_names_its_source_and_first_error(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text('static_assert(false, "not on this variant");\n')
    monkeypatch.setattr(kernels, "SOURCES", (bad,))
    with pytest.raises(YggError, match=r"^the kernel library's bad.cpp does not compile for avx2: .*error: static "
                                       r"assertion failed: not on this variant$"):
        kernel_check.check_sources("avx2")
    with pytest.raises(YggError, match=r"^no instruction set 'neon'"):
        kernel_check.check_sources("neon")


def _fake_build(monkeypatch, tmp_path):
    """cpp_extension.load and torch.ops.load_library recorded instead of run: a build writes the
    library file (its bytes then those of ``content``), a load records the path."""
    import torch
    from torch.utils import cpp_extension

    calls = []
    content = {"bytes": b"\x7fELF a library"}

    def build(**kw):
        calls.append("build")
        (tmp_path / "yggtree_kernels.so").write_bytes(content["bytes"])

    def load(path):
        calls.append("load")
        if (tmp_path / "yggtree_kernels.so").read_bytes() != content["bytes"]:
            raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", load)
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")
    return calls, content


def test_a_library_a_build_loaded_whole_is_loaded_again_without_the_build_system(monkeypatch, tmp_path):
    """Each run used to ask torch's cpp_extension (importing setuptools) and ninja whether the library
    was up to date (0.1-0.4 s of its start): now the file a build loaded whole is loaded directly."""
    calls, _ = _fake_build(monkeypatch, tmp_path)
    assert kernels._load_or_build(tmp_path) is False and calls == ["build"]  # built and loaded by the build
    assert (tmp_path / kernels.LOADED).is_file()
    calls.clear()
    assert kernels._load_or_build(tmp_path) is True and calls == ["load"]  # directly


def test_a_library_file_that_changed_or_no_longer_loads_goes_through_the_build(monkeypatch, tmp_path):
    import os

    calls, content = _fake_build(monkeypatch, tmp_path)
    kernels._load_or_build(tmp_path)
    so = tmp_path / "yggtree_kernels.so"
    so.write_bytes(b"\x7fELF another library, half written")  # not the file that loaded
    calls.clear()
    assert kernels._load_or_build(tmp_path) is False and calls == ["build"]
    st = so.stat()
    so.write_bytes(b"\x7fELF a damaged")  # the same size and time as the file that loaded, other bytes
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(b"\x7fELF a damaged") == len(content["bytes"]) == st.st_size
    calls.clear()
    assert kernels._load_or_build(tmp_path) is False and calls == ["load", "build"]  # removed, built again
    assert so.read_bytes() == content["bytes"]
    calls.clear()
    assert kernels._load_or_build(tmp_path) is True and calls == ["load"]
    (tmp_path / kernels.LOADED).write_text("garbage")
    calls.clear()
    assert kernels._load_or_build(tmp_path) is False and calls == ["build"]
