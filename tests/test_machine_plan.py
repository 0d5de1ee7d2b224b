"""This machine's plan (yggtree/machine_plan.py): where it lives, when it counts as built, the
build's lock, and what a default run does before and after it is built."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import torch

from yggtree import machine_plan, run_cmd
from yggtree.machine_plan import LOCK, READY, MachinePlan
from yggtree.runtime.reserve import run_hint
from yggtree.offline.profile_grid import STAGE_CALLS

@pytest.fixture(autouse=True)
def no_real_build(monkeypatch):
    """No test here starts a real build (minutes of compilation in a detached process)."""
    monkeypatch.setattr(machine_plan, "_spawn", lambda cmd, log: pytest.fail(f"a build was started: {cmd}"))


DEVICE = {"kind": "cpu", "name": "Some CPU", "identity": {"vendor": "X", "family": 1, "model": 2}}


def test_the_format_is_the_ggufs_own_where_the_kernel_library_runs():
    assert machine_plan.machine_weights({"avx2", "fma", "f16c", "sse2"}) == "w4a8"
    assert machine_plan.machine_weights({"sse2", "avx"}) is None  # float32


def test_a_float32_plans_drafter_runs_on_the_kernel_library_where_it_runs():
    """A float32 machine plan drafts in w4a8 where the library runs (the target's output unchanged);
    a w4a8 plan's drafter is the target's format, as is a float32 plan's where the library does not run."""
    lib, none = {"avx2", "fma", "f16c", "sse2"}, {"sse2", "avx"}
    assert machine_plan.machine_drafter_weights(None, lib) == "w4a8"
    assert machine_plan.machine_drafter_weights(None, none) is None
    assert machine_plan.machine_drafter_weights("w4a8", lib) is None


def test_one_directory_per_device_identity_threads_and_format(tmp_path):
    a = machine_plan.machine_plan(DEVICE, 2, "w4a8", root=tmp_path)
    other = dict(DEVICE, identity=dict(DEVICE["identity"], model=3))  # same name, another CPU
    assert a.root.parent == tmp_path / "machine" and a.root.name.startswith("cpu-some-cpu-")
    assert len({a.root, machine_plan.machine_plan(other, 2, "w4a8", root=tmp_path).root,
                machine_plan.machine_plan(DEVICE, 1, "w4a8", root=tmp_path).root,
                machine_plan.machine_plan(DEVICE, 2, None, root=tmp_path).root}) == 4


def test_only_a_completed_build_is_ready(tmp_path):
    mp = MachinePlan(tmp_path, "w4a8", 2)
    assert mp.ready_plan() == (None, "not built yet")
    (tmp_path / READY).write_text("{not json")
    path, why = mp.ready_plan()
    assert path is None and why.startswith("its record is unreadable")
    (tmp_path / READY).write_text(json.dumps({"plan": "compile/machine-w4a8/plan.yaml"}))
    path, why = mp.ready_plan()  # the marker points at a plan that is not there
    assert path is None and "unreadable" in why


def _hold_lock(root: Path) -> subprocess.Popen:
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(root / LOCK)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_running_build_is_not_started_twice_and_a_killed_one_frees_its_lock(tmp_path):
    mp = MachinePlan(tmp_path, "w4a8", 2)
    builder = _hold_lock(tmp_path)
    try:
        assert mp.building()
        line = mp.start()  # another run while it builds: nothing is started
        assert line.startswith("this machine's plan is being built in the background")
        with pytest.raises(Exception, match="another process is building"):
            machine_plan.build(mp)
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait()
    assert not mp.building()  # the kernel released the dead builder's lock
    assert not (tmp_path / READY).exists()


def _args(**kw):
    base = dict(model="default", drafter=None, no_speculate=False, speculate=False, mode="performance", max_context=None,
                prefill_chunk=None, top_k=None, draft_width=None, draft_depth=None, verify_width=None,
                weights=None, drafter_weights=None, kv_cache=None, dtype=None, plan=None, threads=0, lookup=None,
                temperature=0.0)
    return argparse.Namespace(**(base | kw))


def test_a_default_run_decodes_uncompiled_while_the_build_starts(monkeypatch, tmp_path):
    started = []
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setattr(MachinePlan, "start", lambda self: started.append(self) or "building")
    args = _args()
    run_cmd._pick_plan(args)
    assert len(started) == 1 and started[0].root.is_relative_to(tmp_path / "yggtree" / "machine")
    assert (args.mode, args.machine_build, args.plan) == ("reference", "pending", None)
    assert args.threads == 0  # every core: the build yields to the run (machine_plan._yield_to_runs)
    assert getattr(args, "quick", None) is None


def test_a_stale_plan_is_rebuilt_with_one_line_saying_why(monkeypatch, tmp_path, capsys):
    """A plan built once but no longer usable (here a package whose checksum differs) is built
    again in the background, and the run's one line names what was wrong with it."""
    started = []
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    why = "compiled graph file X.pt2 is corrupted (its sha256 differs from the manifest's)"
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (None, why))
    monkeypatch.setattr(MachinePlan, "start", lambda self: started.append(self) or "building")
    args = _args()
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err
    assert len(started) == 1 and args.machine_build == "pending"
    assert err.count("\n") == 1 and f"this machine's plan is stale ({why}): building" in err


def test_a_failed_build_is_not_started_again_by_every_run_until_the_code_changes(monkeypatch, tmp_path, capsys):
    """A build that stopped on an error (a kernel library that does not compile here, say) would stop on it
    again: runs stop starting it, say so in one line with the error, and start it once the code changes."""
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    error = "weights w4a8: building the kernel library in K failed (w4a8.cpp:172:23: error: static assertion failed)"

    def failing(mp, say):
        raise machine_plan.YggError(error)

    monkeypatch.setattr(machine_plan, "_build_locked", failing)
    monkeypatch.setattr(machine_plan, "code_key", lambda: "code-1")
    args = _args()
    mp = machine_plan.machine_plan(DEVICE, 2, "w4a8", root=tmp_path)
    with pytest.raises(machine_plan.YggError):
        machine_plan.build(mp)
    assert mp.failed() == error
    monkeypatch.setattr(machine_plan, "machine_plan", lambda *a, **k: mp)
    run_cmd._pick_plan(args)  # the autouse fixture fails the test if a build is spawned
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"this machine's plan failed to build with this code ({error}; log: " in err
    assert (args.machine_build, args.mode) == ("failed", "reference")  # still answers, uncompiled
    spawned = []
    monkeypatch.setattr(machine_plan, "_spawn", lambda cmd, log: spawned.append(cmd) or 1)
    monkeypatch.setattr(machine_plan, "code_key", lambda: "code-2")  # new code: built again
    assert mp.failed() is None and mp.start().startswith("building this machine's plan") and len(spawned) == 1
    monkeypatch.setattr(machine_plan, "_build_locked", lambda mp, say: tmp_path / "plan.yaml")
    machine_plan.build(mp)  # a build that completes clears the record
    assert not (mp.root / machine_plan.FAILED).exists()


def test_the_code_key_follows_the_code_and_the_compilers(monkeypatch):
    key = machine_plan.code_key()
    assert key == machine_plan.code_key() and len(key) == 16
    monkeypatch.setattr("shutil.which", lambda tool: None)  # no compiler on the PATH: another key
    assert machine_plan.code_key() != key


def test_a_default_run_takes_the_built_plan(monkeypatch, tmp_path):
    monkeypatch.setattr(MachinePlan, "speculates", lambda self, sha: machine_plan.Verdict(True, 1.1, 0, 1.1, True))  # its verdict measured
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (self.compile_root / "m" / "plan.yaml", None))
    monkeypatch.setattr(MachinePlan, "start", lambda self: pytest.fail("a built plan is not built again"))
    args = _args()
    run_cmd._pick_plan(args)
    assert args.plan.endswith("/compile/m/plan.yaml") and (args.machine_build, args.mode) == ("done", "performance")


def test_a_ready_record_pointing_outside_the_build_is_not_ready(tmp_path):
    mp = MachinePlan(tmp_path, "w4a8", 2)
    (tmp_path / READY).write_text(json.dumps({"plan": "../elsewhere/m/plan.yaml"}))
    path, why = mp.ready_plan()
    assert path is None and "not a plan of this build" in why


def test_a_plan_built_with_other_fields_than_this_code_builds_is_not_ready(monkeypatch, tmp_path):
    """A package update that changes what the build makes (here the KV cache) rebuilds the plan, with
    the difference named; the same fields go on to the artifact checks."""
    import yggtree.compiled as compiled_mod
    from yggtree.plan import load_plan

    mp = MachinePlan(tmp_path, "w4a8", 2)
    plan_dir = mp.compile_root / mp.name
    plan_dir.mkdir(parents=True)
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in mp.shape.items()}
    (tmp_path / READY).write_text(json.dumps({"plan": f"compile/{mp.name}/plan.yaml"}))
    monkeypatch.setattr(compiled_mod, "check_artifacts", lambda plan, art: ["checked"])
    for kv, why in ((None, "built with kv_cache None, this code builds float16"), ("float16", "checked")):
        doc = {"name": mp.name, "target": "default", "drafter": "default", **fields, "kv_cache": kv}
        (plan_dir / "plan.yaml").write_text(yaml.safe_dump({k: v for k, v in doc.items() if v is not None}))
        assert load_plan(plan_dir / "plan.yaml").kv_cache == kv
        assert mp.ready_plan() == (None, why)


def test_a_plan_whose_kernel_library_is_not_built_for_this_code_is_not_ready(monkeypatch, tmp_path):
    """The kernel sources changed since the build (its packages, which call the ops, still valid): the
    plan is not ready until the build has compiled the library (a run would compile it before its
    first token), the reason named; a float32 plan needs no library where its drafter is float32
    too (a CPU the library does not run on), and needs it where its drafter runs w4a8."""
    import yggtree.compiled as compiled_mod
    from yggtree.runtime import kernels

    built = []
    monkeypatch.setattr(kernels, "library_built", lambda: bool(built))
    monkeypatch.setattr(compiled_mod, "check_artifacts", lambda plan, art: [])
    for weights, flags in (("w4a8", {"avx2", "fma", "f16c"}), (None, {"avx2", "fma", "f16c"}), (None, {"sse2"})):
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: flags)
        mp = MachinePlan(tmp_path / f"{weights}-{len(flags)}", weights, 2)
        plan_dir = mp.compile_root / mp.name
        plan_dir.mkdir(parents=True)
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in mp.shape.items()}
        doc = {"name": mp.name, "target": "default", "drafter": "default", **fields}
        (plan_dir / "plan.yaml").write_text(yaml.safe_dump({k: v for k, v in doc.items() if v is not None}))
        (mp.root / READY).write_text(json.dumps({"plan": f"compile/{mp.name}/plan.yaml"}))
        built.clear()
        needs = weights or mp.shape["drafter_weights"]
        want = (None, "the kernel library is not built for this code") if needs else (plan_dir / "plan.yaml", None)
        assert mp.ready_plan() == want
        built.append(True)
        assert mp.ready_plan() == (plan_dir / "plan.yaml", None)


def test_turned_off_the_quick_start_runs(monkeypatch):
    monkeypatch.setenv(machine_plan.BUILD_ENV, "0")
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setattr(MachinePlan, "start", lambda self: pytest.fail("turned off"))
    args = _args()
    run_cmd._pick_plan(args)
    assert getattr(args, "machine_build", None) is None and args.mode == "performance"


def test_an_unwritable_data_directory_decodes_plainly_with_one_line(monkeypatch, tmp_path, capsys):
    blocked = tmp_path / "a-file"  # no directory can be made under it, whoever runs the test
    blocked.write_text("")
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(blocked))
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    args = _args()
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be built" in err[0] and args.mode == "reference"
    assert args.machine_build == "unbuildable"  # the summary does not say it is being built



def test_a_full_data_directory_decodes_plainly_with_one_line(monkeypatch, tmp_path, capsys):
    """A disk with no space left (the build's first write fails with ENOSPC): one line, uncompiled decoding."""
    import errno

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setattr(machine_plan.MachinePlan, "start", full)
    args = _args()
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be built" in err[0] and "No space left on device" in err[0]
    assert args.mode == "reference" and args.machine_build == "unbuildable"

def test_no_speculate_keeps_the_format_the_default_chose(monkeypatch, tmp_path):
    """``--no-speculate`` alone decodes plainly on the machine plan's graphs (like for like)."""
    monkeypatch.setattr(MachinePlan, "speculates", lambda self, sha: machine_plan.Verdict(True, 1.1, 0, 1.1, True))  # its verdict measured
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (self.compile_root / "m" / "plan.yaml", None))
    args = _args(no_speculate=True)
    run_cmd._pick_plan(args)
    assert args.plan.endswith("/compile/m/plan.yaml") and args.no_speculate
    monkeypatch.setenv(machine_plan.BUILD_ENV, "0")  # turned off: plain decoding from the flags, as before
    args = _args(no_speculate=True)
    run_cmd._pick_plan(args)
    assert args.plan is None and getattr(args, "quick", None) is None


def test_the_plan_is_the_one_of_the_threads_asked(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(MachinePlan, "speculates", lambda self, sha: machine_plan.Verdict(True, 1.1, 0, 1.1, True))  # its verdict measured
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(MachinePlan, "ready_plan",
                        lambda self: seen.append(self.threads) or (self.compile_root / "m" / "p.yaml", None))
    monkeypatch.setattr(MachinePlan, "start", lambda self: pytest.fail("a built plan is not built again"))
    run_cmd._pick_plan(_args(threads=3))
    assert seen == [3]


def test_a_profile_timed_while_the_machine_was_busy_is_timed_again(monkeypatch, tmp_path):
    """The build's latency profile prices every later step: timed while other processes kept
    cores busy, it is timed again after a wait, and the quietest measurement is kept."""
    import yggtree.offline.compile as compile_mod
    import yggtree.measure.kernel_choice as choice_mod
    import yggtree.offline.profile as profile_mod
    import yggtree.plan as plan_mod
    import yggtree.runtime.build as build_mod
    import yggtree.runtime.padding as padding_mod
    from yggtree.plan import default_plan

    busy = iter([1.2, 0.9, 0.1, 0.0])
    monkeypatch.setattr(choice_mod, "measure_plan", lambda *a, **k: None)  # its own waits: not this test's
    waits, written = [], []
    monkeypatch.setattr(compile_mod, "compile_plan", lambda *a, **k: {})
    monkeypatch.setattr(padding_mod, "cached_padding", lambda plan: None)
    base = default_plan()
    monkeypatch.setattr(plan_mod, "validate_plan", lambda d, *a: base)  # names a profile not written
    monkeypatch.setattr(build_mod, "build_plan_engine", lambda *a, **k: (object(), None))
    monkeypatch.setattr(profile_mod, "measure_profile",
                        lambda *a, **k: {"name": "p", "load": {"other_cores": next(busy)}})
    monkeypatch.setattr(profile_mod, "write_profile", lambda p, d, plot: written.append(p))
    monkeypatch.setattr(machine_plan.time, "sleep", waits.append)
    mp = MachinePlan(tmp_path, "w4a8", 2)
    monkeypatch.setattr("yggtree.offline.build_jobs.warm_compiler", lambda: None)
    machine_plan._build_plan(mp, base, 0.0, lambda line: None)
    assert waits == list(machine_plan.QUIET_WAITS[:2]) and written[0]["load"]["other_cores"] == 0.1
    assert json.loads((tmp_path / READY).read_text())["plan"].startswith("compile/")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_run_pauses_the_build_while_it_decodes(tmp_path):
    """The build's whole session is stopped while a run decodes and continued after (a
    compiler its tools start in a process group of its own too); a recorded id that is not this
    directory's build (a reused id) is never signalled."""
    mp = MachinePlan(tmp_path, "w4a8", 2)
    code = "import sys, time; time.sleep(60)"
    spawner = ("import os, subprocess, sys, time; "  # the build's tools: a compile in a group of its own
               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=os.setpgrp); "
               "print(p.pid, flush=True); time.sleep(60)")
    build = subprocess.Popen([sys.executable, "-c", spawner, "yggtree.machine_plan", str(tmp_path)],
                             start_new_session=True, stdout=subprocess.PIPE, text=True)
    tool = int(build.stdout.readline())
    other = subprocess.Popen([sys.executable, "-c", code, "something else"], start_new_session=True)
    try:
        (tmp_path / machine_plan.PID).write_text(f"{build.pid}\n")
        with mp.paused():
            deadline = time.time() + 5
            while {_state(build.pid), _state(tool)} != {"T"} and time.time() < deadline:
                time.sleep(0.01)
            assert _state(build.pid) == "T" and _state(tool) == "T"
        assert _state(build.pid) != "T" and _state(tool) != "T"
        (tmp_path / machine_plan.PID).write_text(f"{other.pid}\n")
        with mp.paused():
            time.sleep(0.1)
            assert _state(other.pid) != "T"
        (tmp_path / machine_plan.PID).write_text("not a pid\n")
        with mp.paused():
            pass
    finally:
        os.kill(tool, signal.SIGKILL)
        for p in (build, other):
            p.kill()
            p.wait()


def test_what_the_feedback_learnt_is_kept_for_the_same_profile_only(tmp_path):
    """A run's objective feedback is kept in the plan's directory and read back by the next run
    on the same profile; a rebuilt plan (another profile) or a damaged file starts afresh."""
    from yggtree.runtime.feedback import Feedback

    mp = MachinePlan(tmp_path, "w4a8", 2)
    assert mp.learnt("sha-a") is None
    fb = Feedback(machine=1.25, spec_extra=1.4, catch_up=0.5, probe_cost=6.5, probe_scale=0.25, _width={4: 1.1},
                  _by_depth={3: (1.0, 2.5)}, _planned=(0.8, 1.2))
    mp.keep_learnt("sha-a", fb.learnt())
    again = Feedback().with_learnt(mp.learnt("sha-a"))
    assert again.learnt() == fb.learnt() and again.step_ms(10.0, 4.0, 4) == fb.step_ms(10.0, 4.0, 4)
    assert (again.probe_cost, again.probe_scale) == (6.5, 0.25)  # the probes' price and share go on
    old = {k: v for k, v in fb.learnt().items() if not k.startswith("probe_")}  # a record kept before them
    assert (Feedback().with_learnt(old).probe_cost, Feedback().with_learnt(old).probe_scale) == (None, 1.0)
    assert mp.learnt("sha-b") is None
    (tmp_path / machine_plan.FEEDBACK).write_text("{not json")
    assert mp.learnt("sha-a") is None


@pytest.mark.parametrize("record", [None, {}, {"machine": "fast"}, {  # the last: a negative factor
    "machine": -1.0, "spec_extra": 1.0, "catch_up": None, "width": {}, "by_depth": {}, "planned": [0, 0]}])
def test_a_learnt_record_that_does_not_read_changes_nothing(record):
    from yggtree.runtime.feedback import Feedback

    assert Feedback().with_learnt(record) == Feedback()


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no autogroups")
def test_the_build_session_yields_to_runs_in_other_sessions():
    """The build's own session (an autogroup) gets the lowest weight: the idle class alone does not
    hold across sessions, which the scheduler shares fairly first."""
    code = ("from yggtree import machine_plan; import json, os; machine_plan._yield_to_runs(); "
            "print(json.dumps([open('/proc/self/autogroup').read(), os.sched_getscheduler(0) == os.SCHED_IDLE]))")

    def build_session(**kw):
        group, idle = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                check=True, **kw).stdout)
        if not group.strip():  # seen on CI: the probe's group applied, the next session's reads empty
            pytest.skip("autogroups do not apply to this session (a CPU cgroup holds it)")
        return group.split()[-1], idle

    probe = ("import pathlib\ntry:\n    pathlib.Path('/proc/self/autogroup').write_text('19')\n"
             "    print('ok' if pathlib.Path('/proc/self/autogroup').read_text().strip() else "
             "'autogroups do not apply (a CPU cgroup holds this process)')\n"
             "except OSError as e:\n    print(e)")
    said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          start_new_session=True).stdout.strip()
    if said != "ok":
        pytest.skip(f"a session's autogroup nice cannot be set here: {said}")
    time.sleep(0.2)  # an unprivileged process may change an autogroup's nice once per 100 ms
    ours = Path("/proc/self/autogroup").read_text()
    assert build_session(start_new_session=True) == ("19", True)
    assert Path("/proc/self/autogroup").read_text() == ours  # a session of its own: the caller's is untouched
    assert build_session()[1] is True and Path("/proc/self/autogroup").read_text() == ours  # by hand: shell's kept


def _built(monkeypatch, tmp_path, verdict, started=None):
    monkeypatch.setenv(machine_plan.BUILD_ENV, "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", lambda *a, **k: (None, None))
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (self.compile_root / "m" / "plan.yaml", None))
    monkeypatch.setattr(MachinePlan, "speculates", lambda self, sha: verdict)
    monkeypatch.setattr(MachinePlan, "building", lambda self: False)
    monkeypatch.setattr(MachinePlan, "start", lambda self: started.append(self) or "building" if started is not None
                        else pytest.fail("a built plan with its verdict is not built again"))


def test_where_plain_steps_measured_faster_the_default_decodes_plainly(monkeypatch, tmp_path, capsys):
    """The build measured the objective slower than plain steps here: a default run decodes the
    plan plainly and says so in its one line; --speculate keeps the objective."""
    _built(monkeypatch, tmp_path, machine_plan.Verdict(False, 0.954, 0, 0.954, False))
    args = _args()
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err
    assert args.no_speculate and args.plan.endswith("/compile/m/plan.yaml")
    assert err.count("\n") == 1 and "plain steps: its latency objective decoded at 0.95x their speed here" in err
    assert "--speculate to use it" in err
    args = _args(speculate=True)
    run_cmd._pick_plan(args)
    assert not args.no_speculate and "latency objective on its own profile" in capsys.readouterr().err


def test_a_sampled_run_takes_the_verdict_timed_on_sampled_requests(monkeypatch, tmp_path, capsys):
    """The objective paid on greedy requests and not on sampled ones: a run that samples decodes
    plainly and says why in its one line (--speculate keeps the objective); a greedy run speculates."""
    _built(monkeypatch, tmp_path, machine_plan.Verdict(True, 1.2, 4, 0.96, False))
    args = _args(temperature=0.7)
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err
    assert args.no_speculate and err.count("\n") == 1
    assert "plain steps: its latency objective decoded sampled requests at 0.96x their speed here" in err
    args = _args(temperature=0.7, speculate=True)
    run_cmd._pick_plan(args)
    assert not args.no_speculate and args.lookup == 4
    args = _args()
    run_cmd._pick_plan(args)
    assert not args.no_speculate and args.lookup == 4 and "4 lookup nodes a step" in capsys.readouterr().err
    args = _args()
    del args.temperature  # `yggtree serve`'s flags: each request brings its own sampling
    run_cmd._pick_plan(args)
    assert not args.no_speculate and args.lookup == 4


def test_where_the_objective_measured_faster_the_default_speculates(monkeypatch, tmp_path, capsys):
    _built(monkeypatch, tmp_path, machine_plan.Verdict(True, 1.08, 0, 1.08, True))
    args = _args()
    run_cmd._pick_plan(args)
    assert not args.no_speculate and args.lookup == 0
    assert "latency objective on its own profile)" in capsys.readouterr().err


def test_the_default_runs_the_lookup_count_its_objective_was_fastest_with(monkeypatch, tmp_path, capsys):
    """The verdict's lookup count becomes the run's (its one line says so); --lookup N keeps N."""
    _built(monkeypatch, tmp_path, machine_plan.Verdict(True, 1.25, 4, 1.25, True))
    args = _args()
    run_cmd._pick_plan(args)
    assert args.lookup == 4 and "latency objective on its own profile, 4 lookup nodes a step" in capsys.readouterr().err
    args = _args(lookup=0)
    run_cmd._pick_plan(args)
    assert args.lookup == 0
    args = _args(no_speculate=True)
    run_cmd._pick_plan(args)
    assert args.lookup is None


def test_a_namesake_devices_tuned_plan_is_not_mentioned_where_the_machine_plan_runs(monkeypatch, tmp_path, capsys):
    """Another CPU of the same name tuned a plan: where this machine's own plan runs, the run's one
    line names it alone; the passed-over plan is said only where the quick start runs instead."""
    _built(monkeypatch, tmp_path, machine_plan.Verdict(True, 1.08, 0, 1.08, True))

    def namesake(*a, say=None, **k):
        say("not using tuned plan profiles/other.yaml: it records another cpu")
        return None, None

    monkeypatch.setattr("yggtree.tuned.find_tuned_plan", namesake)
    run_cmd._pick_plan(_args())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not using tuned plan" not in err
    monkeypatch.setattr(run_cmd, "_machine_plan", lambda *a: False)
    run_cmd._pick_plan(_args(no_speculate=True))
    assert "not using tuned plan profiles/other.yaml" in capsys.readouterr().err


def test_a_built_plan_without_a_verdict_starts_the_build_to_measure_it(monkeypatch, tmp_path):
    """A plan built before the verdict existed (or whose profile changed): the run speculates as
    before and starts the build, which only measures the verdict (machine_plan._build_locked)."""
    started = []
    _built(monkeypatch, tmp_path, None, started)
    args = _args()
    run_cmd._pick_plan(args)
    assert len(started) == 1 and not args.no_speculate


def test_speculate_and_no_speculate_exclude_each_other():
    from yggtree.cli import build_parser
    from yggtree.errors import YggError

    args = build_parser().parse_args(["run", "--prompt", "x", "--speculate", "--no-speculate"])
    with pytest.raises(YggError, match="^--speculate and --no-speculate exclude each other$"):
        run_cmd.build_from_args(args)


def test_the_verdict_is_kept_for_its_profile_only(tmp_path):
    from yggtree.measure.speculation_choice import VERSION

    mp = MachinePlan(tmp_path, "w4a8", 2)
    assert mp.speculates("abc") is None
    (tmp_path / machine_plan.SPECULATION).write_text(json.dumps({"profile": "abc", "ratio": 0.95, "speculate": False}))
    assert mp.speculates("abc") is None  # measured before lookup counts were: measured again
    (tmp_path / machine_plan.SPECULATION).write_text(json.dumps(
        {"profile": "abc", "ratio": 0.95, "speculate": False, "lookup": 4, "version": 1}))
    assert mp.speculates("abc") is None  # another measurement's verdict: measured again
    (tmp_path / machine_plan.SPECULATION).write_text(json.dumps(
        {"profile": "abc", "ratio": 0.95, "speculate": False, "lookup": 4, "version": 2}))
    assert mp.speculates("abc") is None  # measured before sampled requests were: measured again
    (tmp_path / machine_plan.SPECULATION).write_text(json.dumps(
        {"profile": "abc", "ratio": 0.95, "speculate": False, "lookup": 4, "version": VERSION,
         "sampling_ratio": 1.02, "speculate_sampling": True}))
    assert mp.speculates("abc") == machine_plan.Verdict(False, 0.95, 4, 1.02, True) and mp.speculates("def") is None
    (tmp_path / machine_plan.SPECULATION).write_text("{not json")
    assert mp.speculates("abc") is None


def test_the_verdict_is_timed_again_while_the_machine_is_busy(monkeypatch, tmp_path):
    """Timed while other processes kept the cores busy, the verdict is timed again after a wait
    and the quietest measurement kept; recorded under the plan's profile."""
    import yggtree.compiled as compiled_mod
    import yggtree.measure.speculation_choice as choice_mod
    import yggtree.plan as plan_mod

    busy = iter([(1.2, 1.3), (0.1, 0.97), (0.0, 2.0)])

    def measure(plan, art, threads, reserve=None):
        assert reserve.nbytes == 0 and reserve.take(12345) is None  # the engine's arena: recorded only
        load, ratio = next(busy)
        return {"ratio": ratio, "lookup": 0, "ratios": {"0": ratio, "4": ratio - 0.01}, "prompts": 6,
                "sampling_ratio": ratio - 0.1, "load": {"other_cores": load}, "version": choice_mod.VERSION}

    waits, said = [], []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(choice_mod, "measure_speculation", measure)
    monkeypatch.setattr(plan_mod, "load_plan", lambda path: object())
    monkeypatch.setattr(compiled_mod, "artifact_dir", lambda plan: tmp_path)
    monkeypatch.setattr(machine_plan, "profile_sha", lambda path: "sha")
    monkeypatch.setattr(machine_plan.time, "sleep", waits.append)
    mp = MachinePlan(tmp_path, "w4a8", 2)
    machine_plan._measure_speculation(mp, tmp_path / "plan.yaml", said.append)
    assert waits == [machine_plan.QUIET_WAITS[0]]
    assert json.loads(run_hint().read_text()) == {"bytes": 12345}  # for the run after the build
    assert mp.speculates("sha") == machine_plan.Verdict(False, 0.97, 0, 0.87, False)
    assert said[-1] == ("the latency objective decodes at 0.970x plain steps here with 0 lookup nodes a step "
                        "(0.960x with 4), 0.870x on sampled requests, 6 held-out prompts: runs decode plainly, "
                        "sampled ones decode plainly")


def test_the_verdict_takes_turns_between_chat_prompts_and_open_questions(monkeypatch):
    """Half its requests quote nothing (open questions), half embed a snippet; never evaluation prompts."""
    from yggtree.data import evaluation_texts, open_questions
    from yggtree.measure import speculation_choice as sc

    chat, calls = [[1], [2], [3], [4], [5], [6]], []

    def probe(tok, max_context, prompts, new_tokens):
        calls.append((prompts, new_tokens))
        return chat[: prompts + 1], "params"

    monkeypatch.setattr(sc, "probe_requests", probe)
    monkeypatch.setattr("yggtree.runtime.loading.encode_auto", lambda tok, text: text)
    ids, params = sc.verdict_requests(None, 1024)
    opens = [p.text for p in open_questions(sc.PROMPTS // 2)]
    assert calls == [(sc.PROMPTS - sc.PROMPTS // 2, sc.NEW_TOKENS)] and params == "params"
    assert len(ids) == sc.PROMPTS + 1 and ids[0] == [1]
    assert ids[1::2] == chat[1 : sc.PROMPTS // 2 + 1] and ids[2::2] == opens
    assert len(set(opens)) == len(opens) and not any("```" in t or "\n" in t for t in opens)
    assert not any(t in e for t in opens for e in evaluation_texts())
    assert [p.text for p in open_questions(4, seed=1)] != [p.text for p in open_questions(4)]


def test_the_fastest_lookup_count_is_chosen_the_fewer_among_equals():
    from yggtree.measure.speculation_choice import LOOKUPS, best_system, lookup_counts

    assert best_system({0: 1.10, 4: 1.25, 8: 1.20}) == 4
    assert best_system({0: 1.2, 4: 1.2, 8: 1.1}) == 0
    assert lookup_counts([4, 8]) == tuple(n for n in LOOKUPS if n <= 8) and lookup_counts([1]) == (0,)


def test_speed_ratio_is_the_geometric_mean_of_paired_speedups():
    from yggtree.measure.speculation_choice import speed_ratio

    assert speed_ratio([2.0, 8.0], [1.0, 8.0]) == pytest.approx(2 ** 0.5)
    assert speed_ratio([5.0], [5.0]) == 1.0
    with pytest.raises(ValueError):
        speed_ratio([1.0], [])


def _timed(tmp_path, monkeypatch, kernel=0.0, profile=0.0, verdict=0.0) -> tuple[MachinePlan, Path]:
    """A machine plan whose ready plan's kernel choice, profile and verdict were timed with
    ``kernel``, ``profile`` and ``verdict`` other cores busy."""
    import yggtree.measure.kernel_choice as choice_mod
    from yggtree.measure.speculation_choice import VERSION
    from yggtree.plan import default_plan, save_plan

    mp = MachinePlan(tmp_path, "w4a8", 2)
    (tmp_path / "profile.json").write_text(json.dumps({"load": {"other_cores": profile, "steal_cores": 0.0},
                                                      "stage_calls": STAGE_CALLS}))
    path = tmp_path / "compile" / "m" / "plan.yaml"
    path.parent.mkdir(parents=True)
    save_plan(default_plan().__class__(**{**default_plan().__dict__, "profile": str(tmp_path / "profile.json")}), path)
    monkeypatch.setattr(choice_mod, "choice_record",
                        lambda plan: {"padding": {}, "load": {"other_cores": kernel, "steal_cores": 0.0}})
    sha = machine_plan.profile_sha(path)
    (tmp_path / machine_plan.SPECULATION).write_text(json.dumps(
        {"profile": sha, "ratio": 1.1, "speculate": True, "lookup": 0, "version": VERSION,
         "load": {"other_cores": verdict, "steal_cores": 0.0}}))
    return mp, path


@pytest.mark.parametrize("busy,what", [({}, None), ({"kernel": 1.51}, "the product kernel"),
                                       ({"profile": 0.8}, "the profile"), ({"verdict": 0.6}, "the speculation verdict")])
def test_a_measurement_timed_while_busy_is_named(monkeypatch, tmp_path, busy, what):
    mp, path = _timed(tmp_path, monkeypatch, **busy)
    said = mp.unsettled(path)
    if what is None:
        assert said is None
    else:
        load = next(iter(busy.values()))
        assert said.line == f"{what}: while timing, other processes kept {load:.2f} cores busy"
        assert said.kernel == (what == "the product kernel")
        (tmp_path / machine_plan.REMEASURED).write_text(json.dumps({"builds": machine_plan.REMEASURES}))
        assert mp.unsettled(path) is None  # measured again as often as it may be: kept


def test_a_profile_timing_other_stage_calls_is_measured_again(monkeypatch, tmp_path):
    mp, path = _timed(tmp_path, monkeypatch)
    (tmp_path / "profile.json").write_text(json.dumps({"load": {"other_cores": 0.0, "steal_cores": 0.0}}))
    assert mp.unsettled(path) == machine_plan.Unsettled(
        "its profile timed other stage calls than the engine runs (pruning, policy, head width)")


def test_a_run_on_a_plan_timed_while_busy_measures_it_again_in_the_background(monkeypatch, tmp_path, capsys):
    started = []
    _built(monkeypatch, tmp_path, machine_plan.Verdict(True, 1.08, 0, 1.08, True), started)
    monkeypatch.setattr(MachinePlan, "unsettled", lambda self, path: machine_plan.Unsettled(
        "the profile: while timing, other processes kept 0.80 cores busy"))
    args = _args()
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err
    assert len(started) == 1 and not args.no_speculate and err.count("\n") == 1
    assert "the profile: while timing, other processes kept 0.80 cores busy: measuring it again in the background" in err


def test_the_build_measures_a_busy_plan_again_and_forgets_a_busy_kernel_choice(monkeypatch, tmp_path):
    """A complete plan whose kernel choice was timed while busy: the build deletes that choice
    (measured again before its packages are compiled: the same choice keeps them) and builds
    the plan and measures the verdict again, counting the builds; a quiet plan is left as it is."""
    import yggtree.measure.kernel_choice as choice_mod
    import yggtree.quickstart as quick_mod

    mp, path = _timed(tmp_path, monkeypatch, kernel=1.51)
    (tmp_path / "calibration.json").write_text("{}")  # named, never read here
    monkeypatch.setattr(quick_mod, "shipped_calibration", lambda plan: tmp_path / "calibration.json")
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (path, None))
    forgot, phases, verdicts, said = [], [], [], []
    monkeypatch.setattr(choice_mod, "forget_choice", lambda plan: forgot.append(plan.name))
    monkeypatch.setattr(machine_plan, "_build_plan", lambda mp_, plan, *a: phases.append(plan.name) or path)
    monkeypatch.setattr(machine_plan, "_measure_speculation", lambda mp_, copy, say: verdicts.append(copy))
    after = []  # what ran after the verdict, in order
    monkeypatch.setattr(machine_plan, "_measure_decoding", lambda copy, say: after.append(("decoding", copy, len(verdicts))))
    monkeypatch.setattr(machine_plan, "_measure_allocator", lambda mp_, copy, say: after.append(("allocator", copy)))
    monkeypatch.setattr(machine_plan, "_build_serving", lambda copy, say: after.append(("serving", copy)))
    assert machine_plan._build_locked(mp, said.append) == path
    assert forgot == [mp.name] and phases == [mp.name] and verdicts == [path]
    # after the verdict the settings measured by decoding (prefetch, loops), then the allocator, last the server's batched graphs
    assert after == [("decoding", path, 1), ("allocator", path), ("serving", path)]
    assert mp.remeasured() == 1 and "measuring again (1 of at most 3)" in said[0]
    monkeypatch.setattr(choice_mod, "choice_record", lambda plan: {"load": {"other_cores": 0.0, "steal_cores": 0.0}})
    phases.clear()
    assert machine_plan._build_locked(mp, said.append) == path and phases == []  # quiet now: nothing to do


def test_the_plan_keeps_its_own_copy_of_the_shipped_calibration(monkeypatch, tmp_path):
    """The plan a build compiles names a copy of the package's acceptance calibration in the machine
    plan's directory, not the package's file: the checkout or environment that built it may be gone
    when another install of the same code loads the plan."""
    mp = MachinePlan(tmp_path / "machine", "w4a8", 2)
    built = _plans_built(monkeypatch, tmp_path, mp, '{"shipped": 1}')
    copy = mp.root / machine_plan.CALIBRATION
    assert built[0].calibration == str(copy) and copy.read_text() == '{"shipped": 1}'


def _plans_built(monkeypatch, tmp_path, mp: MachinePlan, calibration: str) -> list:
    """The plans a build of ``mp`` (not built yet) compiles, the package shipping ``calibration``;
    nothing compiled or measured."""
    import yggtree.quickstart as quick_mod

    mp.root.mkdir(parents=True)
    shipped = tmp_path / "checkout" / "calibration.json"
    shipped.parent.mkdir()
    shipped.write_text(calibration)
    monkeypatch.setattr(quick_mod, "shipped_calibration", lambda plan: shipped)
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (None, machine_plan.NOT_BUILT))
    built = []
    monkeypatch.setattr(machine_plan, "_build_plan", lambda mp_, plan, *a: built.append(plan) or tmp_path / "p.yaml")
    monkeypatch.setattr(machine_plan, "_measure_speculation", lambda mp_, copy, say: None)
    monkeypatch.setattr(machine_plan, "_build_serving", lambda copy, say: None)
    monkeypatch.setattr(machine_plan, "_measure_allocator", lambda mp_, copy, say: None)
    monkeypatch.setattr(machine_plan, "_measure_decoding", lambda copy, say: None)
    machine_plan._build_locked(mp, lambda line: None)
    return built


@pytest.mark.parametrize("weights, kv_cache", [("w4a8", "float16"), (None, None)])
def test_a_quantized_plan_keeps_its_kv_cache_in_float16(monkeypatch, tmp_path, weights, kv_cache):
    """The plan a build compiles: in a quantized format, a float16 KV cache (as llama.cpp runs a
    GGUF); in float32, the float model's own cache."""
    built = _plans_built(monkeypatch, tmp_path, MachinePlan(tmp_path / "machine", weights, 2), "{}")
    assert built[0].kv_cache == kv_cache and built[0].weights == weights


def test_the_servers_batched_graphs_that_fail_to_build_are_one_line(monkeypatch, tmp_path):
    """The build's last phase (the batched graphs of ``yggtree serve``): a plan that cannot load
    or a package that cannot be built is one line, and the build still ends ready."""
    said = []
    machine_plan._build_serving(tmp_path / "missing-plan.yaml", said.append)
    assert len(said) == 1 and "its first start builds them" in said[0] and "\n" not in said[0]


def test_tree_flags_run_one_fixed_tree_on_the_built_plan_where_it_compiles_it(monkeypatch, tmp_path, capsys):
    """A default run with tree flags (and --drafter default or none named) runs that tree on this machine's
    plan where the plan compiles its widths, whatever the verdict; a tree it does not compile, or no plan
    built yet, leaves the flags' own plan to run (nothing set), with one line where the plan is built."""
    from yggtree.plan import validate_plan

    _built(monkeypatch, tmp_path, machine_plan.Verdict(False, 0.95, 8, 0.95, False))
    plan = validate_plan({"name": "m", "target": "default", "drafter": "default", "draft_widths": [1, 2],
                          "verify_widths": [4, 8], "d_max": 6})
    monkeypatch.setattr("yggtree.plan.load_plan", lambda path: plan)
    for drafter in (None, "default"):
        args = _args(draft_depth=3, draft_width=1, verify_width=4, drafter=drafter)
        run_cmd._pick_plan(args)
        assert args.plan.endswith("/compile/m/plan.yaml") and not args.no_speculate and args.lookup is None
        assert "one fixed tree" in capsys.readouterr().err
    args = _args(verify_width=16)
    run_cmd._pick_plan(args)
    err = capsys.readouterr().err
    assert args.plan is None and err.count("\n") == 1 and "does not compile this tree" in err
    monkeypatch.setattr(MachinePlan, "ready_plan", lambda self: (None, machine_plan.NOT_BUILT))
    args = _args(draft_depth=3)
    run_cmd._pick_plan(args)
    assert args.plan is None and getattr(args, "quick", None) is None and capsys.readouterr().err == ""


def test_a_run_beside_the_build_says_where_it_is_and_about_how_long_is_left(monkeypatch, tmp_path):
    """The build writes its last log line and start (status.json) as it goes, and how long it took
    once complete (took.json); a run that finds it building quotes the step, the time it has run
    and, where a build here finished before, about what is left at that pace."""
    mp = MachinePlan(tmp_path / "machine", "w4a8", 2)
    monkeypatch.setattr(machine_plan, "_build_locked", lambda mp_, say: say("compiling machine-w4a8's packages "
                                                                            "(w4a8 weights) into /x") or tmp_path)
    monkeypatch.setattr(machine_plan.time, "time", lambda: 1000.0)
    assert machine_plan.build(mp) == tmp_path
    status = json.loads((mp.root / machine_plan.STATUS).read_text())
    assert status == {"line": "compiling machine-w4a8's packages (w4a8 weights) into /x", "started": 1000.0}
    assert mp.progress(now=1047.0) == "47 s in, last: compiling machine-w4a8's packages"
    (mp.root / machine_plan.TOOK).write_text('{"build_s": 137.2}')
    assert mp.progress(now=1047.0) == ("47 s in, last: compiling machine-w4a8's packages; about 90 s left, "
                                       "as the last build here took 137 s")
    assert mp.progress(now=1200.0) == "200 s in, last: compiling machine-w4a8's packages"  # past the estimate
    (mp.root / machine_plan.STATUS).write_text("{")
    assert mp.progress() is None
    monkeypatch.setattr(MachinePlan, "building", lambda self: True)
    (mp.root / machine_plan.STATUS).write_text('{"line": "started", "started": 990}')
    monkeypatch.setattr(machine_plan.time, "time", lambda: 1000.0)
    assert mp.start().startswith("this machine's plan is being built in the background (10 s in, last: started; "
                                 "about 127 s left")


def test_a_complete_build_records_how_long_it_took(monkeypatch, tmp_path):
    mp = MachinePlan(tmp_path / "machine", "w4a8", 2)
    _plans_built(monkeypatch, tmp_path, mp, "{}")
    assert json.loads((mp.root / machine_plan.TOOK).read_text())["build_s"] >= 0
