"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread avoids oversubscription on a shared 2-core machine.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Test processes (pytest-xdist, ``--dist loadgroup`` in pyproject's addopts): a module's unit
    tests run in one process (its module fixtures built once), and every slow test in one process,
    one after the other, beside the unit tests: they compile and run with the process's threads,
    and two of them at once oversubscribe a small machine's cores."""
    for item in items:
        group = "slow" if item.get_closest_marker("slow") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every unit test, with the fixtures it sets up, runs on one intra-op thread (the count
    before is restored after it), as the modules using ``one_thread`` already did: tiny models
    gain nothing from a second thread, and on a shared 2-core machine two OpenMP threads per op
    made the unit run several times slower. A test about threads sets its own count; slow tests
    keep the process's, except in a ``one_thread`` module: its module fixtures were built on one
    thread (during its first test), and its later tests must run as they were built (a machine's
    measured attention kernel, part of a compiled block's key, may differ between 1 and 2
    threads: the restore after the first test once left the second on two threads, and its
    blocks matched no package)."""
    n = torch.get_num_threads()
    if not item.get_closest_marker("slow") or "one_thread" in item.fixturenames:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def real_tokenizer():
    """The embedded model's tokenizer (its chat template, a 49k vocabulary), loaded once for the
    run: for tests that drive tiny random targets with real text (its weights are never loaded)."""
    from yggtree.runtime.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("default"))


@pytest.fixture(scope="session")
def tiny_plain():
    """Greedy plain decoding of the tiny target of tests/test_engine.py (``tiny()``: vocabulary 97,
    hidden 64, 2 layers, seed 0), in reference mode: ``tiny_plain(prompt, n, max_context=200,
    prefill_chunk=16)`` is the ``n`` new tokens' ids, each computed once for the whole run at each
    intra-op thread count (the reference several modules compare their speculative engines with)."""
    from helpers import tiny_model
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams

    engines, done = {}, {}

    def plain(prompt, n: int, max_context: int = 200, prefill_chunk: int = 16) -> list[int]:
        key = (tuple(prompt), n, max_context, prefill_chunk, torch.get_num_threads())
        if key not in done:
            if (max_context, prefill_chunk) not in engines:
                cfg = EngineConfig(mode="reference", max_context=max_context, prefill_chunk=prefill_chunk)
                engines[max_context, prefill_chunk] = Engine(tiny_model(97, 64, 2, seed=0, std=0.3), cfg)
            eng = engines[max_context, prefill_chunk]
            done[key] = eng.generate(list(prompt), SamplingParams(max_new_tokens=n)).token_ids
        return list(done[key])

    return plain


@pytest.fixture(scope="module")
def onednn_unpadded():
    """Plans without a profile compile and run on oneDNN's product kernel, unpadded, instead of
    the kernel this machine measures fastest (yggtree.measure.kernel_choice): for modules whose tests
    are about that kernel's padding. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("onednn_unpadded")``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YGGTREE_KERNEL", "torch")  # subprocesses too
        yield


@pytest.fixture(autouse=True, scope="session")
def openmp_loops():
    """No test compile measures where the kernel loops run (yggtree/measure/loops_choice.py: seconds per
    w4a8 plan): they record OpenMP unless a test sets ``YGGTREE_LOOPS`` itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YGGTREE_LOOPS", "openmp")
        yield


@pytest.fixture(autouse=True, scope="session")
def measured_prefetch():
    """No test compile confirms its products' prefetch by decoding (yggtree/measure/prefetch_choice.py:
    seconds per plan): they keep the measured setting unless a test sets ``YGGTREE_PREFETCH`` itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YGGTREE_PREFETCH", "measured")
        yield


@pytest.fixture(autouse=True, scope="session")
def system_allocator():
    """Every test process and the commands tests start run on the system allocator: no test
    compile measures allocators (runtime/allocator.py, seconds per plan), none restarts itself
    with one preloaded. tests/test_allocator.py sets its own value where it tests that."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YGGTREE_ALLOCATOR", "system")
        yield


@pytest.fixture(autouse=True, scope="session")
def no_machine_build():
    """No test run starts this machine's plan build in the background (yggtree/machine_plan.py:
    minutes of compilation in a detached process); tests/test_machine_plan.py sets it itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YGGTREE_MACHINE_BUILD", "0")
        yield


_AOTI_PACKAGES = [0]


def pytest_configure(config):
    """Count AOTInductor packages built in this process (for ``unit_tests_compile_nothing``)."""
    import torch._inductor

    real = torch._inductor.aoti_compile_and_package
    if getattr(real, "counted", False):
        return

    def counted(*args, **kwargs):
        _AOTI_PACKAGES[0] += 1
        return real(*args, **kwargs)

    counted.counted = True
    torch._inductor.aoti_compile_and_package = counted


def _graph_builds() -> int:
    """Graphs dynamo captured (torch.compile, any backend), inductor graphs built or read from its
    cache, and AOTInductor packages built, in this process so far."""
    from torch._dynamo.utils import counters

    return (_AOTI_PACKAGES[0] + counters["stats"]["unique_graphs"]
            + sum(v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")))


@pytest.fixture(autouse=True)
def unit_tests_compile_nothing(request):
    """The unit run (``-m "not slow"``) builds no graph: no torch.compile (dynamo, whatever the
    backend: the eager one traces too), no inductor, no AOTInductor package. A test that does is
    marked slow."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = _graph_builds()
    yield
    assert _graph_builds() == before, "this test builds graphs (torch.compile or inductor): mark it slow"
