"""The weights' memory faulted in ahead (``yggtree.runtime.reserve``): a reserve of the hinted size
is taken where the need fits (2 MiB-aligned, the rest given back), refused where it does not, and
the need is recorded as the next run's hint; a missing, corrupt or unwritable hint only means no
reserve. An engine's weights moved into a reserve are the same weights."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from helpers import tiny_model
from yggtree.runtime import hugepages
from yggtree.runtime.hugepages import PAGE, move_to_huge_pages
from yggtree.runtime.kv_cache import KVCache
from yggtree.runtime.reserve import Reserve

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are Linux's")


def hint_of(path) -> int:
    return json.loads(path.read_text())["bytes"]


def test_a_fitting_need_takes_the_reserve_and_records_itself(tmp_path):
    hint = tmp_path / "arena.json"
    hint.write_text(json.dumps({"bytes": 3 * PAGE}))
    r = Reserve.open(hint)
    assert r.nbytes == 3 * PAGE
    t = r.take(PAGE + 7)
    assert t.dtype == torch.uint8 and t.numel() == PAGE + 7 and t.data_ptr() % PAGE == 0
    assert not t.any()  # faulted in as zeros
    t.fill_(3)
    assert int(t.sum()) == 3 * (PAGE + 7)
    assert hint_of(hint) == PAGE + 7  # the next run reserves what this one needed
    assert r.take(PAGE) is None  # taken once


def test_a_larger_need_or_no_hint_makes_its_own_arena(tmp_path):
    hint = tmp_path / "arena.json"
    empty = Reserve.open(hint)  # no hint yet
    assert empty.nbytes == 0 and empty.take(PAGE) is None and hint_of(hint) == PAGE
    small = Reserve.open(hint)
    assert small.take(2 * PAGE) is None and hint_of(hint) == 2 * PAGE


@pytest.mark.parametrize("text", ["", "{", '{"bytes": "x"}', "[1]", '{"other": 1}', '{"bytes": -5}',
                                  '{"bytes": 1000000000000000}'])
def test_a_corrupt_hint_is_no_reserve(tmp_path, text):
    hint = tmp_path / "arena.json"
    hint.write_text(text)
    r = Reserve.open(hint)
    assert r.nbytes == 0 and r.take(100) is None and hint_of(hint) == 100


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_an_unwritable_hint_still_reserves(tmp_path):
    hint = tmp_path / "ro" / "arena.json"
    hint.parent.mkdir()
    hint.write_text(json.dumps({"bytes": PAGE}))
    hint.parent.chmod(0o500)
    try:
        t = Reserve.open(hint).take(100)
        assert t is not None and t.numel() == 100 and hint_of(hint) == PAGE  # kept: not writable
    finally:
        hint.parent.chmod(0o700)


def test_weights_move_into_the_reserve_unchanged(tmp_path, monkeypatch):
    def model():
        m = tiny_model(layers=2)
        m.setup_cache(1, 40)
        return m

    target = model()
    before = {n: t.clone() for n, t in target.state_dict().items()}
    hint = tmp_path / "arena.json"
    need = move_to_huge_pages([model()], skip=(KVCache,))  # the same model's arena size
    hint.write_text(json.dumps({"bytes": need + PAGE}))
    r = Reserve.open(hint)
    monkeypatch.setattr(hugepages, "huge_empty", lambda n: pytest.fail("an arena made beside the reserve"))
    assert move_to_huge_pages([target], skip=(KVCache,), reserve=r) == need
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert target.lm_head.weight is target.embed_tokens.weight
    assert hint_of(hint) == need
    ptrs = [p.data_ptr() for p in target.parameters()]
    assert max(ptrs) - min(ptrs) < need  # one arena: the reserve (no other was made)


def test_a_reserve_closed_early_stops_its_fault_and_a_taken_one_stays(tmp_path):
    """``close`` stops the fault within a chunk and gives the mapping back (a command that fails
    before its engine); the reserve is then no longer taken. A taken reserve's tensor outlives it."""
    import time

    hint = tmp_path / "arena.json"
    hint.write_text(json.dumps({"bytes": 256 * PAGE}))  # 512 MiB: longer to fault than a close takes
    r = Reserve.open(hint)
    t0 = time.perf_counter()
    r.close()
    assert time.perf_counter() - t0 < 5.0 and r.take(PAGE) is None
    r.close()  # twice: nothing left to do
    hint.write_text(json.dumps({"bytes": PAGE}))
    kept = Reserve.open(hint)
    t = kept.take(PAGE)
    kept.close()
    t.fill_(1)
    assert int(t.sum()) == PAGE


def test_a_run_refused_before_its_engine_exits_with_its_line(tmp_path):
    """``yggtree run`` with a bad flag while its reserve still faults in (a large hint in the user
    cache): one line, exit status 1, every time (the process's exit once unmapped the reserve under
    the fault thread: a segmentation fault after the line)."""
    import subprocess

    cache = tmp_path / "cache"
    (cache / "yggtree").mkdir(parents=True)
    (cache / "yggtree" / "run-arena.json").write_text(json.dumps({"bytes": 512 * PAGE}))
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), YGGTREE_ALLOCATOR="system")
    for _ in range(3):
        run = subprocess.run([sys.executable, "-m", "yggtree.launch", "run", "--prompt", "hi", "--weights", "w5"],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
        err = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(err) == 1 and "unknown weight format 'w5'" in err[0], run
