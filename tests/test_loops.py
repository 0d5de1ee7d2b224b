"""The kernel library's parallel loops on its own thread pool (csrc/loops.cpp, kernels.loop_pool):
every kernel bitwise as on OpenMP, callers at once served, the thread counts restored, a forked
child safe, packages compiled with serial loops where only the library's run, the compile-time
choice's rule, and engines decoding on the pool emitting plain decoding's tokens."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import need_kernel_library
from yggtree.runtime import kernels
from yggtree.runtime.kernels import loop_pool

pytestmark = pytest.mark.usefixtures("one_thread")

need_kernel_library()
from yggtree.runtime import w4a8  # noqa: E402

w4a8.load_kernel()

from test_w4a8 import random_blocks  # noqa: E402
from yggtree.runtime.w4a8 import W4A8Linear  # noqa: E402


def products(gen):
    """A w4a8 layer (4-bit and 8-bit codes), a tiled float32 one, and inputs of 1..12 rows."""
    from yggtree.runtime.packed import PackedLinear

    layers = [W4A8Linear(random_blocks(960, 576, bits, gen), None, torch.float32) for bits in (4, 8)]
    layers.append(PackedLinear.of(nn.Linear(576, 960), kernel="tiled"))
    return layers, [torch.randn(m, 576, generator=gen) for m in (1, 2, 3, 5, 8, 12)]


def attention_inputs(gen):
    from yggtree.runtime.model import row_window

    b, w, h, hkv, d, c = 1, 6, 9, 3, 64, 96
    kv = torch.randn(2, b, c, hkv, d, generator=gen)
    q = torch.randn(b, w, h, d, generator=gen)
    mask = torch.zeros(b, w, c, dtype=torch.bool)
    for r, n in enumerate([1, 7, 33, 40, 90, 96]):
        mask[0, r, :n] = True
    window, head = row_window(mask)
    return q, kv[0], kv[1], head, window


def everything(layers, xs, att):
    with torch.no_grad():
        return [layer(x) for layer in layers for x in xs] + [torch.ops.yggtree.rows_attention(*att)]


def test_every_kernel_on_the_pool_is_bitwise_openmps():
    """w4a8 (4- and 8-bit), tiled and attention results on a pool of 2 and 3 threads, its loops split
    by the threads' speeds or equally, equal those on OpenMP at 2 threads, bit for bit (every
    kernel's rows and columns are independent of the split)."""
    gen = torch.Generator().manual_seed(0)
    layers, xs, att = *products(gen), attention_inputs(gen)
    torch.set_num_threads(2)
    want = everything(layers, xs, att)
    for n in (2, 3):
        for balance in (True, False):
            with loop_pool(n, balance):
                got = everything(layers, xs, att)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (n, balance)


@given(st.lists(st.tuples(st.integers(1, 70), st.integers(1, 12), st.integers(1, 9)), min_size=1, max_size=6),
       st.integers(2, 4))
@settings(max_examples=25, deadline=None)
def test_any_split_the_speeds_choose_covers_every_column_once(shapes, threads):
    """On a pool whose split follows the threads' speeds (which change from loop to loop), products
    of any number of 16-column tiles (1..70, down to fewer tiles than threads), inputs of 32..384
    and 1..9 rows, called back to back, give OpenMP's results bit for bit: every column computed,
    none twice."""
    gen = torch.Generator().manual_seed(len(shapes) * 10 + threads)
    calls = [(W4A8Linear(random_blocks(16 * t, 32 * b, 4, gen), None, torch.float32),
              torch.randn(m, 32 * b, generator=gen)) for t, b, m in shapes]
    torch.set_num_threads(2)
    with torch.no_grad():
        want = [layer(x) for layer, x in calls]
        with loop_pool(threads):
            got = [layer(x) for _ in range(3) for layer, x in calls]
    assert all(torch.equal(a, b) for a, b in zip(got, want * 3))


def test_loop_pool_restores_the_split_it_found():
    """A pool of the same size with the other split replaces the one in use inside the block, and
    the one before is back after (the op returns the setting it replaced: [threads, balance])."""
    with loop_pool(2, balance=False):
        assert list(torch.ops.yggtree.loop_pool(2, True)) == [2, 0]  # in use: 2 threads, equal
        assert list(torch.ops.yggtree.loop_pool(2, False)) == [2, 1]  # put back
        with loop_pool(2, balance=True):
            assert list(torch.ops.yggtree.loop_pool(2, True)) == [2, 1]
        assert list(torch.ops.yggtree.loop_pool(2, False)) == [2, 0]
    assert list(torch.ops.yggtree.loop_pool(0, True)) == [0, 1]  # OpenMP: nothing to restore


def test_callers_at_once_are_served_and_equal():
    """Four threads calling the kernels while the pool is on (one holds the pool, the others run
    their loops serially) get the results a lone caller gets, and none waits forever."""
    gen = torch.Generator().manual_seed(1)
    layers, xs, att = *products(gen), attention_inputs(gen)
    want = everything(layers, xs, att)
    outs, errors = {}, []

    def call(i):
        try:
            for _ in range(5):
                outs[i] = everything(layers, xs, att)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with loop_pool(2):
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    assert not errors
    assert all(torch.equal(a, b) for got in outs.values() for a, b in zip(got, want)) and len(outs) == 4


def test_loop_pool_sets_and_restores_the_thread_counts():
    """Inside, the calling thread runs one OpenMP thread and the kernels' loops the pool's count;
    after, both as before (nested blocks too); a count of 1 changes nothing."""
    x = torch.zeros(1)
    torch.set_num_threads(2)
    assert torch.ops.yggtree.w4a8_threads(x) == 2
    with loop_pool(3):
        assert torch.get_num_threads() == 1 and torch.ops.yggtree.w4a8_threads(x) == 3
        with loop_pool(2):
            assert torch.ops.yggtree.w4a8_threads(x) == 2
        assert torch.get_num_threads() == 1 and torch.ops.yggtree.w4a8_threads(x) == 3
    assert torch.get_num_threads() == 2 and torch.ops.yggtree.w4a8_threads(x) == 2
    with loop_pool(1):
        assert torch.get_num_threads() == 2 and torch.ops.yggtree.w4a8_threads(x) == 2


def test_a_forked_child_runs_its_loops_on_openmp():
    """A process forked while the pool is on has none of its workers: its kernels run (on OpenMP)
    and give the parent's results instead of waiting for workers that do not exist."""
    gen = torch.Generator().manual_seed(2)
    layer = W4A8Linear(random_blocks(960, 576, 4, gen), None, torch.float32)
    x = torch.randn(3, 576, generator=gen)
    with torch.no_grad():
        want = layer(x)
        with loop_pool(2):
            layer(x)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                signal.alarm(60)  # a hang ends the child, and the test fails instead of hanging
                ok = torch.equal(layer(x), want) and torch.ops.yggtree.w4a8_threads(x) == 1
                os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_packages_of_library_only_blocks_compile_serial_loops():
    """A block whose products all run on the library (w4a8, the tiled kernel's layers) is one a
    plain plan packages with inductor's loops serial (cpp.threads = 1: the pool must not meet an
    OpenMP team); a block with products on torch's kernels is not, and packages keep inductor's
    threads unless asked."""
    from helpers import tiny_model
    from yggtree.runtime.aoti import library_loops_only, package_config
    from yggtree.runtime.packed import pack_linears
    from yggtree.runtime.quant import quantize_linears

    float_model = tiny_model()
    assert not library_loops_only(float_model.layers[0]) and not library_loops_only(float_model)
    pack_linears(float_model, kernel="torch")
    assert not library_loops_only(float_model.layers[0])
    tiled = tiny_model()
    pack_linears(tiled, kernel="tiled")
    assert library_loops_only(tiled.layers[0])
    for fmt, group in (("int8", None), ("int4", 32)):
        for kernel in ("torch", "tiled"):
            m = tiny_model()
            quantize_linears(m, fmt, group, kernel=kernel)
            assert library_loops_only(m) == (kernel == "tiled"), (fmt, kernel)
    mixed = tiny_model()
    quantize_linears(mixed, "int8", kernel="tiled")
    mixed.layers[0].mlp.down_proj = nn.Linear(64, 32, bias=False)  # one product left on torch's kernels
    assert not library_loops_only(mixed) and library_loops_only(mixed.layers[1])
    q = tiny_model()
    quantize_linears(q, "w4a8")
    assert library_loops_only(q.layers[0])
    assert "cpp.threads" not in package_config(q.layers[0])
    assert package_config(q.layers[0], serial_loops=True)["cpp.threads"] == 1


def test_a_plan_compiles_serial_loops_where_the_library_runs_every_product_of_both_models(tmp_path):
    """aoti.loops_serial: a plain plan of a library-only target, and a speculative one whose drafter's
    products are the library's too; not where either model keeps a product on torch's kernels. The
    manifest records the choice and a batch build reads it there (one source of truth)."""
    from helpers import tiny_model
    from yggtree.offline.batch_build import _serial_loops
    from yggtree.runtime.aoti import loops_serial
    from yggtree.runtime.quant import quantize_linears

    target, drafter = tiny_model(), tiny_model()
    quantize_linears(target, "w4a8")
    assert loops_serial(target, None) and not loops_serial(drafter, None)
    assert not loops_serial(target, drafter)  # a float drafter's products run on torch's kernels
    quantize_linears(drafter, "w4a8")
    assert loops_serial(target, drafter) and not loops_serial(tiny_model(), drafter)
    art = tmp_path / "plan"
    (art / "graphs").mkdir(parents=True)
    assert not _serial_loops(art / "graphs")  # no manifest: inductor's loops parallel
    for serial in (True, False):
        (art / "manifest.json").write_text(json.dumps({"serial_loops": serial}))
        assert _serial_loops(art / "graphs") is serial


def test_the_pool_is_chosen_when_it_wins_most_prompts():
    from yggtree.measure.loops_choice import decide
    from yggtree.runtime.build import loops_on_pool

    assert decide([(4.0, 3.8), (4.0, 3.9), (4.0, 4.1)])[0] == "pool"
    assert decide([(4.0, 3.0), (4.0, 4.1), (4.0, 4.2)])[0] == "openmp"  # faster on one prompt of three
    assert decide([(4.0, 4.0), (4.0, 4.0)])[0] == "openmp"  # no faster
    choice, stats = decide([(2.0, 1.0), (3.0, 3.0)])
    assert stats["pairs"] == 2 and stats["won"] == 0.5 and choice == "openmp"
    assert loops_on_pool({"loops": {"choice": "pool"}}) and not loops_on_pool({"loops": {"choice": "openmp"}})
    assert not loops_on_pool({})  # a manifest from before the measurement: OpenMP


def test_the_loops_are_recorded_only_where_the_library_runs_every_parallel_loop(monkeypatch, tmp_path):
    """offline/compile.record_loops: the measurement recorded in the packages' manifest, its other
    fields kept; nothing measured without a manifest, for packages with inductor's own parallel loops
    or at one thread; a failed measurement or an unwritable manifest is one line and OpenMP's loops (no record)."""
    import yggtree.measure.loops_choice as loops_mod
    import yggtree.offline.compile as compile_mod
    from yggtree.errors import YggError
    from yggtree.offline.compile import record_loops

    measured, said = [], []
    monkeypatch.setattr(loops_mod, "measure_compiled",
                        lambda plan, art, say=None, engine=None: measured.append(art) or {"choice": "pool", "threads": 2})
    art = tmp_path / "plan"
    art.mkdir()
    assert record_loops("plan", art, said.append) is None  # no manifest
    for other in ({"serial_loops": False, "threads": 2}, {"serial_loops": True, "threads": 1}):
        (art / "manifest.json").write_text(json.dumps(other))
        assert record_loops("plan", art, said.append) is None
        assert json.loads((art / "manifest.json").read_text()) == other
    assert measured == [] and said == []
    (art / "manifest.json").write_text(json.dumps({"serial_loops": True, "threads": 2, "n_slots": 7}))
    got = record_loops("plan", art, said.append)
    assert measured == [art] and got["loops"] == {"choice": "pool", "threads": 2}
    assert json.loads((art / "manifest.json").read_text()) == got and got["n_slots"] == 7

    def fails(plan, art, say=None, engine=None):
        raise YggError("the loops measurement decoded no tokens")

    monkeypatch.setattr(loops_mod, "measure_compiled", fails)
    (art / "manifest.json").write_text(json.dumps({"serial_loops": True, "threads": 2}))
    assert "loops" not in record_loops("plan", art, said.append)
    assert said == ["the kernel loops were not measured: the loops measurement decoded no tokens"]
    assert "loops" not in json.loads((art / "manifest.json").read_text())

    def unwritable(art, manifest):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loops_mod, "measure_compiled", lambda plan, art, say=None, engine=None: {"choice": "pool"})
    monkeypatch.setattr(compile_mod, "_write_manifest", unwritable)
    assert "loops" not in record_loops("plan", art, said.append)  # a full disk: one line, OpenMP's loops
    assert said[-1] == "the kernel loops were not measured: [Errno 28] No space left on device"


@given(st.lists(st.tuples(st.sampled_from([3.0, 4.0, 5.0]), st.sampled_from([3.0, 4.0, 5.0])), min_size=1,
                max_size=18))
def test_the_measurement_stops_only_where_the_rest_cannot_change_the_choice(pairs):
    """Wherever ``settled`` stops the measurement after a prefix of the pairs, every completion
    decides as the prefix says (the pool having won more than half of them, or not)."""
    from yggtree.measure.loops_choice import decide
    from yggtree.measure.paired_decode import settled

    n = len(pairs)
    for k in range(n + 1):
        if settled(pairs[:k], n):
            won = sum(a > b for a, b in pairs[:k])
            assert decide(pairs)[0] == ("pool" if 2 * won > n else "openmp")
    assert settled(pairs, n)  # all pairs in: settled
    assert not settled([], 2) and settled([(4.0, 3.0), (4.0, 3.0)], 3) and settled([(3.0, 4.0)], 2)


def spy_on(monkeypatch, name: str) -> list:
    """The arguments ``kernels.<name>`` is called with during the test (it still runs): each call's
    one argument, or the tuple of its arguments."""
    seen, real = [], getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *args: seen.append(args[0] if len(args) == 1 else args) or real(*args))
    return seen


def test_engines_on_the_pool_decode_plain_decodings_tokens(monkeypatch):
    """A w4a8 target (plain and speculating with a w4a8 drafter) decoding with its kernels' loops
    on the pool at 2 threads, split by the threads' speeds (the default) or equally, emits the
    tokens plain decoding on OpenMP emits."""
    from test_w4a8 import gguf_like
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    target = gguf_like(0)
    cfg = dict(mode="reference", max_context=80, prefill_chunk=8, threads=2)
    plain = Engine(target, EngineConfig(**cfg))
    pooled = Engine(target, EngineConfig(**cfg, loop_pool=True))
    equal = Engine(target, EngineConfig(**cfg, loop_pool=True, loop_balance=False))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    spec = Engine(target, EngineConfig(**cfg, tree=tree, loop_pool=True), LMDrafter(gguf_like(1), "reference"))
    seen = spy_on(monkeypatch, "loop_pool")
    params = SamplingParams(max_new_tokens=12)  # at 2 threads: slow whenever the other core is busy
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, params).token_ids
        assert pooled.generate(prompt, params).token_ids == want, prompt
        assert equal.generate(prompt, params).token_ids == want, prompt
        assert spec.generate(prompt, params).token_ids == want, prompt
    # the pooled engines decoded on the pool (each at its split), the plain one did not
    assert seen == [(2, True), (2, False), (2, True)] * 2
    assert torch.ops.yggtree.w4a8_threads(torch.zeros(1)) == torch.get_num_threads()  # the pool off again


def test_an_engine_decodes_at_its_prefetch_setting(monkeypatch):
    """``EngineConfig.prefetch`` is the library's setting while the engine decodes, the setting
    before restored after; None leaves the library's own; the tokens are the same."""
    from test_w4a8 import gguf_like
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams

    target = gguf_like(0)
    cfg = dict(mode="reference", max_context=48, prefill_chunk=8, threads=2)
    before = torch.ops.yggtree.prefetch(-1, 0)
    seen = spy_on(monkeypatch, "prefetch")
    settings = (None, (8192, 0), (0, 0), (1024, 16384))
    engines = [Engine(target, EngineConfig(**cfg, prefetch=d)) for d in settings]
    tokens = [e.generate([5, 6, 7], SamplingParams(max_new_tokens=8)).token_ids for e in engines]
    assert seen == list(settings) and all(t == tokens[0] for t in tokens)
    assert torch.ops.yggtree.prefetch(-1, 0) == before
    with kernels.prefetch((2048, 8192)):  # kernels.prefetch_now: the setting now, unchanged by asking
        assert kernels.prefetch_now() == (2048, 8192) == kernels.prefetch_now()
    assert kernels.prefetch_now() == tuple(before)


@pytest.mark.parametrize("name, choices", [("YGGTREE_LOOPS", "auto, openmp or pool"),
                                           ("YGGTREE_PREFETCH", "auto, measured or default")])
def test_a_bad_decoding_setting_is_refused_before_compiling(monkeypatch, tmp_path, capsys, name, choices):
    """``YGGTREE_LOOPS`` or ``YGGTREE_PREFETCH`` (the settings measured by decoding a compiled plan)
    other than its choices: one line naming it, a non-zero exit, before anything is built."""
    from yggtree.cli import main

    monkeypatch.setenv(name, "fast")
    plan = tmp_path / "plan.yaml"
    plan.write_text("name: p\ntarget: default\nbackend: eager\n")
    assert main(["compile", str(plan), "--out", str(tmp_path / "c")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name}='fast'" in err[0] and choices in err[0]
    assert not (tmp_path / "c").exists()
