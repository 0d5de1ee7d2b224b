"""Packages built side by side in forked children (yggtree/offline/build_jobs.py): every package
under its final name only once whole, the same packages as a build in this process, and a
child's failure raised in one line naming its package. (The real packages' build in children is
the default of ``yggtree compile``: tests/test_compile.py's fixtures build that way.)"""

from __future__ import annotations

import os

import pytest

from yggtree.errors import YggError
from yggtree.offline.build_jobs import run_here, run_in_children


class _Progress:
    def update(self, task, **kw):
        pass


def _jobs(n):
    return [(("block", w, 256), "block", f"block-w{w}-c256.pt2") for w in range(1, n + 1)]


def _write(key, scope, path):
    path.write_bytes(f"{scope} {key} built by {os.getpid()}".encode())


def test_children_build_what_this_process_builds(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    done_here = list(run_here(_jobs(5), here, _write, _Progress(), None))
    done_there = list(run_in_children(_jobs(5), there, _write, _Progress(), None, workers=2))
    assert sorted(k for k, _, _ in done_here) == sorted(k for k, _, _ in done_there)
    names = sorted(p.name for p in there.iterdir())
    assert names == sorted(name for _, _, name in _jobs(5))  # no partial file left
    pids = {p.read_text().rsplit(" ", 1)[1] for p in there.iterdir()}
    assert str(os.getpid()) not in pids and len(pids) == 5  # each in a child of its own
    assert all(p.read_text().split(" built")[0] == (here / p.name).read_text().split(" built")[0]
               for p in there.iterdir())


def test_a_failing_child_is_raised_in_one_line_naming_its_package(tmp_path):
    def build(key, scope, path):
        if key[1] == 3:
            path.write_bytes(b"half a package")
            raise RuntimeError("inductor could not lower this\nsecond line of a long trace")
        _write(key, scope, path)

    with pytest.raises(YggError) as e:
        list(run_in_children(_jobs(4), tmp_path, build, _Progress(), None, workers=2))
    assert str(e.value) == ("building package block-w3-c256.pt2 failed: RuntimeError: inductor could not "
                            "lower this")
    assert not (tmp_path / "block-w3-c256.pt2").exists()  # only the partial name holds half a package


def test_children_die_with_their_parent(tmp_path):
    """A build killed outright (SIGKILL: it cannot stop its children) leaves no child building."""
    import signal
    import subprocess
    import sys
    import time

    code = f"""
import time
from pathlib import Path
from yggtree.offline.build_jobs import run_in_children
class P:
    def update(self, task, **kw): pass
def build(key, scope, path):
    Path({str(tmp_path)!r}, f"child-{{key[1]}}").write_text(str(__import__("os").getpid()))
    time.sleep(60)
list(run_in_children([(("b", w, 1), "block", f"b{{w}}.pt2") for w in (1, 2)], Path({str(tmp_path)!r}), build, P(), None, 2))
"""
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 30
    while len(list(tmp_path.glob("child-*"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in tmp_path.glob("child-*")]
    assert len(pids) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
