"""Compiled graphs are built at the intra-op thread count they run at.

Dynamo guards every graph on the calling thread's thread count (its global-state guard), and
inductor bakes the count into the kernels it generates. A performance-mode engine without
AOTInductor packages therefore builds the target's and the drafter's graphs at its plan's thread
count, and the drafter's speculation graphs on the overlap worker at the worker's count; decoding
then never compiles (it runs under ``fail_on_recompile``), whatever the process's own setting."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yggtree.runtime import schedule
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.graphs import Graphs

from test_engine import PROMPTS, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 24
TREE = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)


@pytest.fixture(scope="module")
def plain():
    eng = Engine(tiny(), EngineConfig(mode="reference", max_context=200, prefill_chunk=16))
    return [eng.generate(p, SamplingParams(max_new_tokens=NEW)).token_ids for p in PROMPTS[:2]]


@pytest.fixture
def process_threads():
    """Set the process's (this thread's) count for the test; restored after it."""
    n = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(n)


def drafter_of(kind, model):
    if kind == "eagle":
        return EagleDrafter.random(model, "performance", max_depth=3, seed=1)
    return LMDrafter(model.shared_copy(), "performance")


def compiled_engine(kind, stages, threads=0):
    model = tiny()  # its own copy: compiling patches the blocks of the model it is given
    cfg = EngineConfig(mode="performance", max_context=200, prefill_chunk=16, tree=TREE,
                       stages=stages, threads=threads)
    return Engine(model, cfg, drafter_of(kind, model))


@contextlib.contextmanager
def no_compiles():
    """Fails unless the block builds no graph and recompiles nothing."""
    from torch._dynamo.utils import counters

    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    yield
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles


def decodes_as_plain(eng, plain, **stats):
    for i, p in enumerate(PROMPTS[:2]):
        res = eng.generate(p, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == plain[i], f"prompt {i}"
        for k, v in stats.items():
            assert res.stats[k] == v, k
    return res


# ----------------------------------------------------------------------------- torch's guards


@pytest.mark.slow  # dynamo's guards (torch.compile, a tagging backend): no compiler in the unit run
def test_the_unsafe_stance_tells_graphs_of_two_thread_counts_apart(process_threads):
    """What Graphs.frozen relies on: under skip_guard_eval_unsafe dynamo still evaluates the
    global-state guard (thread count included), so of two graphs of one shape built at 1 and 2
    threads each count runs its own, and a count without a graph is an error, never another
    count's graph."""
    ran = []

    def tagging(gm, example_inputs):
        built_at = torch.get_num_threads()

        def run(*args):
            ran.append(built_at)
            return gm(*args)
        return run

    fn = torch.compile(lambda x: x * 2 + 1, backend=tagging, fullgraph=True, dynamic=False)
    lone = torch.compile(lambda x: x * 3, backend=tagging, fullgraph=True, dynamic=False)
    x = torch.ones(4)
    for n in (1, 2):
        process_threads(n)
        fn(x)
    lone(x)  # at 2 threads only
    ran.clear()
    with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
        for n in (1, 2, 2, 1):
            process_threads(n)
            fn(x)
        assert ran == [1, 2, 2, 1]
        process_threads(1)
        with pytest.raises(RuntimeError, match="Recompilation"):
            lone(x)


def test_graphs_track_built_widths_per_thread_count(process_threads):
    """Eager graphs need no thread count: their widths are one set whatever the count."""
    g = Graphs(tiny(), "reference")
    g.model.setup_cache(1, 64)
    g.warm_up([1, 3], threads=2)
    process_threads(1)
    assert g.widths == {1, 3} and g.widths_at(2) == {1, 3}


def test_build_lifts_dynamo_recompile_limits_while_it_compiles():
    """A process that builds many engines compiles one code object more than dynamo's
    lifetime cap of 256 allows; builds lift both limits, and only while they run."""
    import torch._dynamo.config as dc

    g = Graphs(tiny(), "performance")
    seen = []
    g.build([1, 2], lambda w: seen.append((dc.recompile_limit, dc.accumulated_recompile_limit)))
    assert seen == [(256, 1 << 20)] * 2
    assert (dc.recompile_limit, dc.accumulated_recompile_limit) == (8, 256)


def test_graphs_import_no_compiler_until_they_compile():
    """Graphs arm torch.compile at their first build or call: an engine whose blocks run
    AOTInductor packages, or eager code, never imports the compiler (over a second of a start)."""
    code = ("import sys\nfrom yggtree.runtime.graphs import Graphs\nfrom test_engine import tiny\n"
            "g = Graphs(tiny(), 'performance', scope='block')\n"
            "print('torch._dynamo' in sys.modules)\n"
            "g.build([1], lambda w: None)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent).stdout.split()
    assert out == ["False", "True"]


# ----------------------------------------------------------------------------- engines


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_engine_built_at_other_threads_decodes_at_its_plan_threads(plain, process_threads, kind):
    """Built in a process at 2 threads, decoding sequential@1: every graph was built at 1 thread
    when the engine was made, so the loop compiles nothing and the output equals plain."""
    process_threads(2)
    eng = compiled_engine(kind, "sequential@1")
    assert torch.get_num_threads() == 2  # the build restores the process setting
    with no_compiles():
        decodes_as_plain(eng, plain, threads=1, plan="sequential@1")
    assert eng.graphs.widths_at(1) and not eng.graphs.widths_at(2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_overlap_with_unequal_thread_split_builds_the_workers_graphs_on_the_worker(
        plain, process_threads, monkeypatch, kind):
    """overlap@2+1 in a process at 2 threads: the drafter's speculation graphs are built on the
    worker at its 1 thread, next to the graphs at 2 the decoding thread runs it with (prefill,
    and head and draft after a missed guess); nothing compiles while decoding."""
    monkeypatch.setattr(schedule, "usable_cores", lambda: 3)  # a 2+1 split on a 2-core machine
    process_threads(2)
    eng = compiled_engine(kind, "overlap@2+1")
    with no_compiles():
        res = decodes_as_plain(eng, plain, threads=2, draft_threads=1, plan="overlap@2+1")
    assert res.stats["speculation"]["steps"] > 0
    g = eng.drafter.graphs
    assert g.widths_at(1) and g.widths_at(2) and g.widths_at(1) != g.widths_at(2)
    eng.use_plan("sequential")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm"])
def test_use_plan_switching_thread_counts_builds_what_the_new_count_needs(plain, process_threads, kind):
    """use_plan(stages, threads=...) as scripts/bench_stages.py calls it: a new count's graphs
    are built by use_plan (compile time reported as before), a count built once is not built
    again, and decoding at each count compiles nothing."""
    process_threads(1)
    eng = compiled_engine(kind, "sequential")
    decodes_as_plain(eng, plain)
    before = eng.compile_s
    eng.use_plan("ahead", threads=2)
    assert eng.compile_s > before
    with no_compiles():
        decodes_as_plain(eng, plain, threads=2, plan="ahead@2")
        eng.use_plan("sequential", threads=1)
        decodes_as_plain(eng, plain, threads=1, plan="sequential@1")
        eng.use_plan("sequential", threads=2)
        decodes_as_plain(eng, plain, threads=2, plan="sequential@2")
