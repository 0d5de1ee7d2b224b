"""Every product, the two row attentions and the final norm of the kernel library, on the
instruction set it was built for here: each row of a W-row call (W = 1..16) is bitwise the same row computed alone, over
random shapes (hypothesis), and the tree attention is bitwise the row attention; every other
instruction set this CPU runs is built and checked the same way in a process of its own (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from yggtree.errors import YggError
from yggtree.runtime import kernels

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(bool(kernels.library_missing()),
                       reason=f"the kernel library needs {', '.join(kernels.library_missing())} (AVX2, FMA, F16C)"),
]
W = 16


def rows_alone(product, x: torch.Tensor) -> None:
    """``product`` of every prefix x[:w] (w = 1..len(x)) is bitwise the rows computed one at a time."""
    with torch.no_grad():
        one = torch.cat([product(x[i : i + 1]) for i in range(len(x))])
        for w in range(1, len(x) + 1):
            assert torch.equal(product(x[:w]), one[:w]), w


def layer(kind: str, n: int, k: int, group: int, seed: int):
    from yggtree.runtime.packed import PackedLinear
    from yggtree.runtime.quant import Int4Linear, Int8Linear, quantize_int4
    from yggtree.runtime.w4a8 import W4A8Linear, q4_1_blocks

    kernels.load_library()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind in ("float32", "bfloat16"):
        dtype = getattr(torch, kind)
        return PackedLinear.of(_linear(w.to(dtype)), kernel="tiled"), dtype
    if kind == "int8":
        return Int8Linear(w, None, torch.float32, kernel="tiled"), torch.float32
    if kind == "int4":
        return Int4Linear([quantize_int4(w, group)], None, torch.float32, kernel="tiled"), torch.float32
    return W4A8Linear(q4_1_blocks(w), None, torch.float32), torch.float32


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["float32", "bfloat16", "int8", "int4", "w4a8"]), tiles=st.integers(1, 6),
       blocks=st.integers(1, 6), group=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
def test_every_product_row_is_its_row_alone(kind, tiles, blocks, group, seed):
    k = blocks * group
    lin, dtype = layer(kind, 16 * tiles, k, group, seed)
    x = torch.randn(W, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    rows_alone(lin, x)


def test_the_q8_0_lm_head_rows_are_their_rows_alone():
    """8-bit codes (a GGUF's Q8_0 embedding as the w4a8 LM head) at W = 1..16."""
    from yggtree.runtime.w4a8 import Blocks, W4A8Linear

    g = torch.Generator().manual_seed(5)
    u = torch.randint(0, 256, (64, 96), generator=g, dtype=torch.uint8)
    d = (torch.rand(64, 3, generator=g) / 50).half()
    blocks = Blocks(u, d, (-128 * d.float()).half(), 8)
    rows_alone(W4A8Linear(blocks, None, torch.float32), torch.randn(W, 96, generator=g))


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 800), scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
def test_every_norm_row_is_its_row_alone_and_torchs_up_to_rounding(width, scale, seed):
    """The library's final norm (yggtree::rms_norm): each row of W = 1..16 is bitwise the row alone,
    and every row is torch's eager RMSNorm to float32 rounding (a sum in another order)."""
    from yggtree.runtime.model import RMSNorm

    kernels.load_library()
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g))
    x = torch.randn(W, width, generator=g) * scale
    ref = norm(x)
    norm.native = True
    rows_alone(norm, x)
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-6)
    assert norm(x[None]).shape == (1, W, width)  # [B, W, H] as a step passes it


def test_the_norm_refuses_what_it_cannot_take_and_traces():
    kernels.load_library()
    op = torch.ops.yggtree.rms_norm
    with pytest.raises(RuntimeError, match="weight must be"):
        op(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-5)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(torch.randn(1, 3, 8)), mode.from_tensor(torch.randn(8)), 1e-5)
    assert fake.shape == (1, 3, 8) and fake.dtype == torch.float32


@settings(max_examples=15, deadline=None)
@given(context=st.integers(1, 300), heads=st.sampled_from([(3, 1), (9, 3), (4, 4)]),
       d=st.sampled_from(kernels.HEAD_DIMS), seed=st.integers(0, 2**16))
def test_every_attention_row_is_its_row_alone(context, heads, d, seed):
    """W tree rows (a chain) over ``context`` committed slots: each row's attention is its call alone."""
    kernels.load_library()
    from yggtree.runtime.attention_choice import chain_inputs

    q, k, v, head, window = chain_inputs((*heads, d), W, context, torch.Generator().manual_seed(seed))
    op = torch.ops.yggtree.rows_attention
    one = torch.cat([op(q[:, i : i + 1], k, v, head[:, i : i + 1], window[:, i : i + 1]) for i in range(W)], 1)
    for w in range(1, W + 1):
        assert torch.equal(op(q[:, :w], k, v, head[:, :w], window[:, :w]), one[:, :w]), w


def test_a_head_dim_without_kernels_is_torchs_and_refused_by_the_op():
    """A head dim the library was not built for goes to torch's attention (runs_attention), and the op
    called anyway refuses it naming the dim, never reading past its registers."""
    kernels.load_library()
    from yggtree.runtime.attention_choice import chain_inputs

    assert kernels.runs_attention(64) and not kernels.runs_attention(48) and not kernels.runs_attention(512)
    q, k, v, head, window = chain_inputs((3, 1, 48), 2, 5, torch.Generator().manual_seed(0))
    for op in (torch.ops.yggtree.rows_attention, torch.ops.yggtree.tree_attention):
        with pytest.raises(RuntimeError, match="no kernel for head dim 48"):
            op(q, k, v, head, window)


def tree_inputs(seed: int, width: int, context: int, heads: tuple, d: int, dtypes: tuple, masks: str, head_major: bool):
    """A verify step's attention inputs: ``width`` rows of a random tree (parents first) over ``context``
    committed slots, each row seeing the prefix and its ancestors, split into part 1 and window as the
    model splits them (row_window). ``masks``: "nested" (so), "identical" (every row's part 1 is row 0's),
    "differing" (every row also misses random prefix slots: part 1s that are not nested)."""
    from yggtree.runtime.model import row_window

    h, hkv = heads
    q_dtype, kv_dtype = dtypes
    g = torch.Generator().manual_seed(seed)
    parent = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(width)]
    c = context + width
    seen = torch.zeros(1, width, c, dtype=torch.bool)
    seen[:, :, :context] = True
    for i in range(width):
        j = i
        while j >= 0:
            seen[0, i, context + j] = True
            j = parent[j]
    if masks == "differing":
        seen[0, :, :context] &= torch.rand(width, context, generator=g) < 0.8
    window, head = row_window(seen)
    if masks == "identical":
        head = head[:, :1].expand_as(head)
    q = torch.randn(1, width, h, d, generator=g).to(q_dtype)
    shape = (1, hkv, c, d) if head_major else (1, c, hkv, d)
    k, v = (torch.randn(*shape, generator=g).to(kv_dtype) for _ in range(2))
    if head_major:  # the KV cache's layout (runtime/kv_cache.py): each KV head's slots one run
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return q, k, v, head, window


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
          (torch.float32, torch.bfloat16)]


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, W), context=st.integers(0, 300), heads=st.sampled_from([(3, 1), (9, 3), (4, 4)]),
       d=st.sampled_from(kernels.HEAD_DIMS), dtypes=st.sampled_from(DTYPES),
       masks=st.sampled_from(["nested", "identical", "differing"]), head_major=st.booleans(),
       ahead=st.sampled_from([0, 1, 16]), seed=st.integers(0, 2**16))
def test_tree_attention_is_rows_attention_bit_for_bit(width, context, heads, d, dtypes, masks, head_major, ahead, seed):
    """yggtree::tree_attention (one pass over the cache for all the rows) returns rows_attention's bits,
    and each of its rows is that row's one-row call; how far ahead either fetches the cache's rows
    changes no bit."""
    kernels.load_library()
    q, k, v, head, window = tree_inputs(seed, width, context, heads, d, dtypes, masks, head_major)
    with kernels.attention_prefetch(ahead):
        got = torch.ops.yggtree.tree_attention(q, k, v, head, window)
        fetched = torch.ops.yggtree.rows_attention(q, k, v, head, window)
    assert torch.equal(got, torch.ops.yggtree.rows_attention(q, k, v, head, window)) and torch.equal(fetched, got)
    for r in range(width):
        one = torch.ops.yggtree.tree_attention(q[:, r : r + 1], k, v, head[:, r : r + 1], window[:, r : r + 1])
        assert torch.equal(got[:, r : r + 1], one), r


def test_tree_attention_after_calls_with_other_masks_of_the_same_shape():
    """A step's layers pass the step's masks, whose shared part 1 the kernel computes once and keeps; a call
    whose masks or windows differ in any byte (the same tensors changed in place, or others of the same
    shape) gets its own: rows_attention's bits every time."""
    kernels.load_library()
    q, k, v, head, window = tree_inputs(5, 8, 120, (9, 3), 64, DTYPES[0], "nested", True)
    head, window = head.contiguous().clone(), window.contiguous().clone()
    g = torch.Generator().manual_seed(1)
    for change in range(8):
        got = torch.ops.yggtree.tree_attention(q, k, v, head, window)
        assert torch.equal(got, torch.ops.yggtree.rows_attention(q, k, v, head, window)), change
        assert torch.equal(torch.ops.yggtree.tree_attention(q, k, v, head, window), got), change
        r = int(torch.randint(0, 8, (1,), generator=g))
        if change % 2 == 0:  # a prefix slot of one row, in place
            s = int(torch.randint(0, 120, (1,), generator=g))
            head[0, r, s] = ~head[0, r, s]
        else:  # one window entry, in a new tensor
            window = window.clone()
            window[0, r, int(torch.randint(0, window.shape[2], (1,), generator=g))] = -1
    # other shapes whose masks and windows hold the same bytes (rows that see nothing) are other calls too
    for width, slots, t in ((4, 60, 8), (8, 30, 4), (2, 120, 16)):
        q = torch.randn(1, width, 9, 64, generator=g)
        k, v = (torch.randn(1, 3, slots, 64, generator=g).transpose(1, 2) for _ in range(2))
        head, window = torch.zeros(1, width, slots, dtype=torch.bool), torch.full((1, width, t), -1)
        got = torch.ops.yggtree.tree_attention(q, k, v, head, window)
        assert torch.equal(got, torch.ops.yggtree.rows_attention(q, k, v, head, window)) and not got.any()


def test_tree_attention_of_rows_that_see_nothing_or_only_a_window():
    """Edge rows: nothing visible (zeros, as rows_attention), only a window, only part 1; and a fake
    (meta) call gives the output's shape without running the kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernels.load_library()
    q, k, v, head, window = tree_inputs(3, 6, 40, (9, 3), 64, DTYPES[0], "nested", True)
    head, window = head.clone(), window.clone()
    head[0, 0] = False
    window[0, 0] = -1  # row 0 sees nothing
    head[0, 1] = False  # row 1 only its window
    window[0, 2] = -1  # row 2 only its part 1
    got = torch.ops.yggtree.tree_attention(q, k, v, head, window)
    assert torch.equal(got, torch.ops.yggtree.rows_attention(q, k, v, head, window))
    assert not got[0, 0].any()
    with FakeTensorMode() as mode:
        fake = torch.ops.yggtree.tree_attention(*(mode.from_tensor(t) for t in (q, k, v, head, window)))
    assert fake.shape == got.shape and fake.dtype == got.dtype


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(kernels.ISAS))
def test_every_instruction_set_this_cpu_runs_is_checked(isa):
    """The library built for ``isa`` (YGGTREE_KERNEL_ISA) in a fresh process passes this file's
    row tests and the kernels' reference tests: no variant the CPU can run goes untested."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU lacks {', '.join(f for f in kernels.ISAS[isa][0] if f not in kernels.cpu_flags())}")
    if isa == kernels.isa():
        pytest.skip(f"{isa} is the variant this run already tests")
    here = Path(__file__).parent
    env = dict(os.environ, **{kernels.ISA_ENV: isa})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                          str(here / "test_kernel_rows.py"), str(here / "test_tiled.py"), str(here / "test_w4a8.py")],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:]


def test_the_attention_of_several_rows_is_measured_once_and_kept(monkeypatch, tmp_path):
    """attention_choice.attention_kernel: timed per library build, thread count and head shape, every
    answer kept and read back after; ``YGGTREE_ATTENTION`` names one (no timing), a bad
    name is one line."""
    from yggtree.runtime import attention_choice as kernels
    monkeypatch.delenv(kernels.ATTENTION_ENV, raising=False)
    monkeypatch.setattr(kernels, "AHEAD_SHAPE", (256, 4))  # a few small layers: the path, not a machine's answer
    monkeypatch.setattr(kernels, "AHEAD_EVICT", 1 << 20)
    heads, where = (4, 2, 32), tmp_path
    first = kernels.attention_kernel(heads, 1, where)
    assert first["kernel"] in kernels.ATTENTION_KERNELS and set(first["best_ms"]) == {
        f"{k}@{c}" for k in kernels.ATTENTION_KERNELS for c in kernels.ATTENTION_SHAPE[1]} | {
        f"ahead{a}@{kernels.AHEAD_SHAPE[0]}" for a in kernels.ATTENTION_AHEAD}
    assert first["ahead"] in kernels.ATTENTION_AHEAD
    assert len(list(tmp_path.glob("attention-*.json"))) == 1  # every answer is kept (a tie: rows) and read back
    monkeypatch.setattr(kernels, "attention_call", lambda *a: pytest.fail("measured twice"))
    assert kernels.attention_kernel(heads, 1, where) == first
    monkeypatch.setattr(kernels, "attention_call", lambda k, *a: (lambda: time.sleep(0.002 if k == "tree" else 0.001)))
    where = tmp_path / "tie"
    where.mkdir()
    assert kernels.attention_kernel(heads, 1, where)["kernel"] == "rows"  # a clear loss: rows, kept
    assert len(list((tmp_path / "tie").glob("attention-*.json"))) == 1
    monkeypatch.setenv(kernels.ATTENTION_ENV, "tree")
    assert kernels.attention_kernel(heads, 1, where)["kernel"] == "tree"
    monkeypatch.setenv(kernels.ATTENTION_ENV, "fast")
    with pytest.raises(YggError, match="YGGTREE_ATTENTION=fast is not one of rows, tree"):
        kernels.attention_kernel(heads, 1, where)


def test_the_attention_is_chosen_on_the_cache_dtype_it_reads(monkeypatch, tmp_path):
    """A 16-bit cache's choice is timed on 16-bit caches, a layer each as a step reads them, and kept
    apart from a float32 cache's (their tiles are converted or read in place: the kernels rank
    differently); an engine's model asks for its own cache's."""
    from yggtree.runtime import attention_choice as choice

    monkeypatch.delenv(choice.ATTENTION_ENV, raising=False)
    asked = []

    def call(kernel, heads, width, context, kv_dtype=torch.float32, layers=1):
        asked.append((kv_dtype, layers))
        return lambda: time.sleep(0.002 if (kernel == "tree") == (kv_dtype == torch.float32) else 0.001)

    monkeypatch.setattr(choice, "attention_call", call)
    monkeypatch.setattr(choice, "time_ahead", lambda heads, kv_dtype: {0: 1.0, 16: 1.0})
    monkeypatch.setattr(choice, "AHEAD_EVICT", 1 << 16)
    assert choice.attention_kernel((4, 2, 32), 1, tmp_path, torch.float16)["kernel"] == "tree"
    assert set(asked) == {(torch.float16, choice.AHEAD_SHAPE[1])}
    assert choice.attention_kernel((4, 2, 32), 1, tmp_path)["kernel"] == "rows"
    assert sorted(p.name for p in tmp_path.glob("attention-*.json")) == [
        "attention-t1-h4-2-32-kvfloat16.json", "attention-t1-h4-2-32-kvfloat32.json"]
    from test_w4a8 import gguf_like
    from yggtree.runtime.model import set_kv_dtype

    target = gguf_like(0)
    set_kv_dtype(target, "float16")
    assert kernels.kv_dtype(target) == torch.float16
    set_kv_dtype(target, None)
    assert kernels.kv_dtype(target) == torch.float32


def test_the_attention_fetches_ahead_where_that_is_clearly_faster_here(monkeypatch, tmp_path):
    """The fetch ahead is this machine's choice beside the kernel's: the distance timed fastest where
    it beats none by ATTENTION_MARGIN, else none; an engine decodes with it set, restored after, and a
    model without the library's attention sets nothing."""
    from yggtree.runtime import attention_choice as choice

    monkeypatch.delenv(choice.ATTENTION_ENV, raising=False)
    monkeypatch.setattr(choice, "AHEAD_EVICT", 1 << 16)  # the kernels' timing is not what this test checks
    monkeypatch.setattr(choice, "attention_call", lambda *a: (lambda: None))
    for i, (timed, want) in enumerate([({0: 1.0, 16: 0.9}, 16), ({0: 1.0, 16: 0.97}, 0), ({0: 0.9, 16: 1.0}, 0)]):
        monkeypatch.setattr(choice, "time_ahead", lambda heads, kv_dtype, timed=timed: timed)
        (tmp_path / str(i)).mkdir()
        assert choice.attention_kernel((4, 2, 32), 1, tmp_path / str(i))["ahead"] == want


def test_an_engine_decodes_with_the_attention_fetch_of_this_machine(monkeypatch):
    from test_w4a8 import gguf_like
    from yggtree.runtime import attention_choice as choice
    from yggtree.runtime.engine import Engine, EngineConfig

    target = gguf_like(0)
    kernels.use_rows_attention(target, "rows")
    monkeypatch.setattr(choice, "attention_kernel", lambda *a: {"kernel": "rows", "ahead": 16})
    eng = Engine(target, EngineConfig(mode="reference", max_context=32, prefill_chunk=4))
    before = torch.ops.yggtree.attention_prefetch(-1)
    with eng.library(1):
        assert torch.ops.yggtree.attention_prefetch(-1) == 16 != before
    assert torch.ops.yggtree.attention_prefetch(-1) == before
    assert kernels.attention_ahead(torch.nn.Linear(2, 2), 1) is None


@pytest.mark.parametrize("kernel", ["rows", "tree"])
def test_a_model_on_either_attention_computes_the_same_steps(kernel):
    """A w4a8 engine whose tree rows run yggtree::tree_attention emits, greedily, the tokens of one
    on yggtree::rows_attention, plain and speculative alike (the two kernels compute the same bits)."""
    from test_w4a8 import gguf_like

    from yggtree.runtime import kernels
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    target, other = gguf_like(0), gguf_like(0)
    kernels.use_rows_attention(target, kernel)
    kernels.use_rows_attention(other, "rows")
    assert {b.self_attn.native_rows for b in target.layers} == {kernel}
    cfg = dict(mode="reference", max_context=80, prefill_chunk=8)
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    want = Engine(other, EngineConfig(**cfg))
    got = Engine(target, EngineConfig(**cfg, tree=tree), LMDrafter(gguf_like(1), "reference"))
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        p = SamplingParams(max_new_tokens=24)
        assert got.generate(prompt, p).token_ids == want.generate(prompt, p).token_ids, prompt


def test_an_engine_on_packages_runs_the_attention_they_were_built_with():
    """Package names hold the attention kernel their blocks call: the installer sets the one the
    manifest records on every library-attention layer, whatever this machine measures now."""
    from test_w4a8 import gguf_like

    from yggtree.runtime.attention_choice import set_native_attention
    from yggtree.runtime.model import Attention, native_attention

    m = gguf_like(0)
    kernels.use_rows_attention(m, "rows")
    set_native_attention([m], "tree")
    assert native_attention(m) == "tree" and all(
        a.native_rows == "tree" for a in m.modules() if isinstance(a, Attention))
    set_native_attention([m], None)  # an older manifest: left as measured
    assert native_attention(m) == "tree"
    with pytest.raises(YggError, match="no attention kernel 'fast'"):
        set_native_attention([m], "fast")
