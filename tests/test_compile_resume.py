"""A build's package cache (offline/compile_packages.py ``seed_packages``): kept for a build of the same
key (a stopped build resumes), emptied for another key, half-written or damaged packages dropped,
and intact packages of another directory linked only when built under the same key."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from helpers import tiny_model

from yggtree.offline.compile_packages import BUILD_KEY, seed_packages
from yggtree.runtime.artifacts import CACHE_SUBDIR

KEY = {"graph_hash": "abc", "min_rows": 4}


def _cache(tmp_path, name, key, files):
    d = tmp_path / name / CACHE_SUBDIR
    d.mkdir(parents=True)
    (d / BUILD_KEY).write_text(json.dumps(key))
    for f in files:  # a finished package has its sha256 beside it (partial ones do not)
        (d / f).write_bytes(f.encode())
        if not f.startswith("partial-"):
            (d / f).with_suffix(".sha256").write_text(hashlib.sha256(f.encode()).hexdigest() + "\n")
    return d


def test_a_build_of_the_same_key_resumes_and_drops_half_written_packages(tmp_path):
    out = _cache(tmp_path, "a", KEY, ["block-x-w1-c256.pt2", "partial-block-x-w4-c256.pt2"])
    assert seed_packages(out, KEY) == 1
    assert sorted(p.name for p in out.glob("*.pt2")) == ["block-x-w1-c256.pt2"]


def test_a_damaged_or_unchecked_package_is_dropped_not_resumed(tmp_path):
    out = _cache(tmp_path, "a", KEY, ["block-x-w1-c256.pt2", "block-x-w4-c256.pt2", "block-x-w8-c256.pt2"])
    (out / "block-x-w1-c256.pt2").write_bytes(b"block-x")  # truncated after it was finished
    (out / "block-x-w4-c256.sha256").unlink()  # renamed into place, its checksum never written
    assert seed_packages(out, KEY) == 1
    assert sorted(p.name for p in out.glob("*.pt2")) == ["block-x-w8-c256.pt2"]


def test_another_key_starts_from_an_empty_cache(tmp_path):
    out = _cache(tmp_path, "a", KEY, ["block-x-w1-c256.pt2"])
    assert seed_packages(out, KEY | {"min_rows": 8}) == 0
    assert json.loads((out / BUILD_KEY).read_text())["min_rows"] == 8


def test_the_runtime_code_hash_is_kept_by_the_sources_bytes(tmp_path, monkeypatch):
    """The hash of the runtime's code, kept in the user cache after one parse: the same as parsed
    now, read back from the cache, and parsed again where the cache cannot be written."""
    from yggtree.runtime import artifacts

    want = hashlib.sha256()
    for name in artifacts.GRAPH_SOURCES:
        want.update(name.encode() + b"\0" + artifacts.code_of((Path(artifacts.__file__).parent / name).read_text()).encode())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert artifacts.runtime_code_hash() == want.hexdigest()[:16]
    kept = list((tmp_path / "cache" / "yggtree" / "code").iterdir())
    assert len(kept) == 1 and kept[0].read_text() == want.hexdigest()[:16]
    monkeypatch.setattr(artifacts, "code_of", lambda text: pytest.fail("parsed again"))
    assert artifacts.runtime_code_hash() == want.hexdigest()[:16]  # from the cache
    monkeypatch.undo()
    (tmp_path / "ro").write_text("")  # a file where the cache directory would be
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    assert artifacts.runtime_code_hash() == want.hexdigest()[:16]


def test_the_runtime_code_hash_sees_code_not_comments_or_docstrings():
    """Compiled packages are keyed by the code they were traced from: a comment or docstring
    edited alone keeps them, any change of code does not."""
    from yggtree.runtime.artifacts import code_of

    base = 'class A:\n    """Doc."""\n\n    def f(self, x):\n        """Doc."""\n        return x + 1  # why\n'
    same = 'class A:\n    """Another doc."""\n\n    def f(self, x):\n        # a new comment\n        return x + 1\n'
    assert code_of(base) == code_of(same)
    for changed in (base.replace("x + 1", "x + 2"), base.replace("return x + 1", "return (x + 1)[0]"),
                    base.replace('"""Doc."""\n        return', 'print("Doc.")\n        return')):
        assert code_of(changed) != code_of(base)


def test_calls_whose_attention_reads_only_the_visible_slots_run_at_the_whole_cache():
    """graphs.call_buckets: a call every attention layer computes row by row on the kernel library
    needs no smaller bucket (one graph instead of one per bucket); wider calls (prefill chunks),
    calls of unknown width and layers on inductor's attention keep the buckets."""
    from yggtree.runtime.graphs import call_buckets, context_buckets

    model = tiny_model(layers=2)
    model.setup_cache(1, 1100)
    every = context_buckets(1100)
    assert every == [256, 512, 1100]
    assert call_buckets(model, 1) == every
    layers = [m for m in model.modules() if hasattr(m, "native_rows")]
    for m in layers:
        m.native_rows, m.invariant_rows = "tree", 63
    assert [call_buckets(model, w) for w in (1, 8, 63, 64, None)] == [[1100]] * 3 + [every] * 2
    layers[1].native_rows = None
    assert call_buckets(model, 1) == every


def test_the_build_has_the_steps_first_then_the_drafter_calls_then_the_blocks(monkeypatch):
    """Every package of a build, the longest first: the target's step packages (every layer) at
    every context bucket a step width fits, the drafter's call packages (one layer each), every
    recorded block shape."""
    import types

    import yggtree.runtime.aoti as aoti
    from yggtree.offline.compile_packages import _package_jobs

    monkeypatch.setattr(aoti, "step_key", lambda target, capture: "step")
    monkeypatch.setattr(aoti, "drafter_call_key", lambda drafter, kind, k, nodes: kind)
    plan = types.SimpleNamespace(top_k=4, max_tree=13, draft_widths=(1, 2), step_widths=(1, 4), prefill_chunk=64,
                                 speculative=True, stages="sequential")
    rec = types.SimpleNamespace(examples={("blk", 1, 256): None, ("blk", 64, 512): None})
    uses = [("target", "prefill", ("blk", 64, 512)), ("drafter", "warm-up", ("blk", 1, 256))]
    drafter = types.SimpleNamespace(calls=None, head_widths=(1, 2, 7))
    target = tiny_model()
    target.setup_cache(1, 512)
    calls = [("head", 1, 512), ("head", 2, 512), ("head", 7, 512), ("draft", 1, 512), ("draft", 2, 512)]
    jobs, kept = _package_jobs(plan, rec, uses, target, drafter, (29,), 512)
    steps = [("step", w, c) for w in (1, 4) for c in (256, 512)]
    # the drafter's one-row block: its head and draft calls of one row run their whole-call packages
    assert list(jobs) == [*steps, *calls, ("blk", 64, 512)] and kept == uses[:1]
    assert set(jobs.values()) == {"step", "head", "draft", "block"} and jobs[("blk", 64, 512)] == "block"
    # steps whose attention runs row by row on the kernel library: the whole cache alone
    for m in target.modules():
        if hasattr(m, "native_rows"):
            m.native_rows, m.invariant_rows = "rows", 63
    jobs, _ = _package_jobs(plan, rec, uses, target, drafter, (29,), 512)
    assert list(jobs) == [("step", 1, 512), ("step", 4, 512), *calls, ("blk", 64, 512)]


def test_a_block_package_is_built_only_where_a_run_calls_the_block():
    """A target's tree step that a whole-step package runs and an EAGLE drafter's call that a
    whole-call package runs need no block package: the prefill chunk always does, and so does
    every shape a use without a whole package shares (a self-drafter's steps; a draft width
    whose call has no package)."""
    import types

    from yggtree.offline.compile_packages import _block_uses
    from yggtree.runtime.eagle import block_widths

    assert block_widths([1, 2, 64], (1, 2, 4, 7), 64, set()) == [1, 2, 4, 7, 64]
    served = {("head", 1), ("head", 2), ("head", 4), ("head", 7), ("draft", 1), ("draft", 2)}
    assert block_widths([1, 2, 64], (1, 2, 4, 7), 64, served) == [64]
    # a width both a head and a draft call: served only when both calls are
    assert block_widths([1, 2, 64], (1, 2, 4, 7), 64, served - {("draft", 2)}) == [2, 64]
    assert block_widths([1, 8, 64], (1, 2, 4, 7), 64, served) == [8, 64]  # an ahead call's width
    assert block_widths([1, 64], (1, 64), 64, {("head", 64)}) == [1, 64]  # the chunk: its prefill

    plan = types.SimpleNamespace(draft_widths=(1, 2), prefill_chunk=64, speculative=True, stages="sequential")
    jobs = {("s", 1, 512): "step", ("s", 4, 512): "step", **{("h", w, 512): "head" for w in (1, 2, 4, 7)},
            **{("d", w, 512): "draft" for w in (1, 2)}}
    uses = [("target", "plain", ("b", 1, 512)), ("target", "verify", ("b", 4, 512)),
            ("target", "verify", ("b", 4, 256)),  # a bucket with no whole step
            ("target", "prefill", ("b", 64, 256)), ("target", "prefill+verify", ("b", 4, 512)),
            ("drafter", "prefill+head", ("b", 64, 512)), ("drafter", "head+draft", ("b", 2, 512)),
            ("drafter", "head", ("b", 7, 512))]
    eagle = types.SimpleNamespace(head_widths=(1, 2, 4, 7))
    assert _block_uses(plan, uses, jobs, eagle) == [uses[2], uses[3], uses[4], uses[5]]
    # without whole-call packages (a self-drafter, a standalone LM) every drafter use runs its blocks
    no_calls = {k: v for k, v in jobs.items() if v == "step"}
    assert _block_uses(plan, uses, no_calls, eagle) == [uses[2], uses[3], uses[4], *uses[5:]]
