"""The w4a8 weight format (yggtree.runtime.w4a8): the kernel against a float64 reference of its
own arithmetic, rows independent of the call's other rows and of the thread count, a GGUF's
blocks held exactly, Q4_1 from float, exact greedy speculation, and refusal in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from helpers import need_kernel_library
from test_quant import gguf_blocks as tiny_gguf_blocks, tiny
from yggtree.errors import YggError
from yggtree.runtime import w4a8
from yggtree.runtime.quant import check_batch_invariant, quant_layers, quantize_linears
from yggtree.runtime.w4a8 import Blocks, W4A8Linear, dequantize_blocks, gguf_blocks, q4_1_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

need_kernel_library()
w4a8.load_kernel()


def reference(x: torch.Tensor, b: Blocks) -> torch.Tensor:
    """The format's arithmetic in float64: activations quantized per row and block of 32 as the
    kernel does (float32 da = amax / 127, qa = round-half-even(a * (1 / da))), times the
    blocks' exact weights."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    da = xb.abs().amax(-1, keepdim=True) / 127
    qa = torch.round(xb * torch.where(da > 0, 1 / da, torch.zeros_like(da)))
    assert qa.abs().max() <= 127
    return (qa.double() * da.double()).view(m, k) @ dequantize_blocks(b).double().T


def random_blocks(n: int, k: int, bits: int, gen: torch.Generator) -> Blocks:
    u = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) / 64).half()
    return Blocks(u, d, (-(2 ** (bits - 1)) * d.float()).half() if bits == 8 else (torch.randn(n, k // 32, generator=gen) / 8).half(), bits)


# (in, out) of the default model's products and a width the kernel pads (not a multiple of 16)
SHAPES = [(576, 960), (576, 576), (1536, 576), (64, 97)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_its_arithmetic_and_rows_are_independent(bits, dtype):
    """Each output is the float64 reference to within float32 accumulation over K / 32 block
    terms (relative 2^-20 of the sum of |terms|); row i of an M-row product is bitwise its
    1-row product (M = 1..12) and the same at 1 and 2 threads."""
    gen = torch.Generator().manual_seed(bits)
    for k, n in SHAPES:
        b = random_blocks(n, k, bits, gen)
        lin = W4A8Linear(b, None, dtype)
        x = torch.randn(12, k, generator=gen).to(dtype)
        y = lin(x)
        assert y.dtype == dtype and y.shape == (12, n)
        want = reference(x, b)
        scale = (reference(x.abs(), Blocks(b.u, b.d.abs(), b.m.abs(), bits))).abs()
        if dtype == torch.float32:
            assert ((y.double() - want).abs() <= 2 ** -20 * scale + 1e-30).all(), (k, n)
        else:  # the float32 result rounded to bfloat16
            assert ((y.double() - want).abs() <= 2 ** -8 * want.abs() + 2 ** -20 * scale).all(), (k, n)
        rows = [lin(x[i : i + 1]) for i in range(12)]
        for m in range(1, 13):
            ym = lin(x[:m])
            assert all(torch.equal(ym[i : i + 1], rows[i]) for i in range(m)), (k, n, m)
        torch.set_num_threads(2)
        try:
            assert torch.equal(lin(x), y)
        finally:
            torch.set_num_threads(1)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_prefetch_setting_changes_no_result(bits):
    """The w4a8 products give the same bits at every prefetch setting the runtime measures and at
    none (1-9 rows); the setting before is restored."""
    from yggtree.runtime.kernels import PREFETCH_CHOICES, prefetch

    gen = torch.Generator().manual_seed(bits)
    lin = W4A8Linear(random_blocks(96, 576, bits, gen), None, torch.float32)
    x = torch.randn(9, 576, generator=gen)
    want = [lin(x[:m]) for m in range(1, 10)]
    before = torch.ops.yggtree.prefetch(-1, 0)
    for setting in ((0, 0), (0, 8192), *PREFETCH_CHOICES):
        with prefetch(setting):
            assert all(torch.equal(lin(x[:m]), want[m - 1]) for m in range(1, 10)), setting
    assert torch.ops.yggtree.prefetch(-1, 0) == before


def test_the_w4a8_products_prefetch_distance_is_measured():
    """A w4a8 model has no packed product to pad; the measurement times its products at every
    prefetch setting and records the fastest."""
    from yggtree.offline.profile_padding import padding_line, prefetch_words, time_padding
    from yggtree.runtime.kernels import PREFETCH_CHOICES, prefetch_name

    m = nn.Sequential(W4A8Linear(random_blocks(64, 64, 4, torch.Generator().manual_seed(0)), None, torch.float32))
    pad = time_padding(m, warmup=0, repeats=2)
    assert (pad["kernel"], pad["min_rows"], pad["products"], pad["median_ms"]) == ("torch", 1, 0, {})
    assert list(pad["prefetch_ms"]) == [prefetch_name(d) for d in PREFETCH_CHOICES]
    assert pad["prefetch_ms"][prefetch_name(pad["prefetch"])] == min(pad["prefetch_ms"].values())
    assert padding_line(pad) == f"no packed products: no padding; weights prefetched {prefetch_words(pad['prefetch'])}"
    assert prefetch_words([1024, 0]) == "1024 bytes ahead"
    assert prefetch_words([1024, 8192]) == "1024 bytes ahead (and 8192 into the second-level cache)"


def test_kernel_runs_on_torchs_threads():
    """The kernel's tile loop runs on as many threads as torch's intra-op count (a build without
    OpenMP ran it on one thread whatever the count: 2 threads streamed no faster than 1)."""
    w4a8.load_kernel()
    x = torch.zeros(1)
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.ops.yggtree.w4a8_threads(x) == n
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_held_exactly(kind):
    """Dequantized, the blocks are gguf's (llama.cpp's) float32 weights bit for bit; Q8_0 runs
    as 8-bit codes, Q4_0 / Q4_1 as 4-bit ones."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize, quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = quantize(w, T[kind])
    b = gguf_blocks(kind, torch.from_numpy(raw))
    assert b.bits == (8 if kind == "Q8_0" else 4) and int(b.u.max()) < 2 ** b.bits
    want = torch.from_numpy(gguf_dequantize(raw, T[kind]).reshape(48, 96).copy())
    assert torch.equal(dequantize_blocks(b), want)


def test_q4_1_from_float():
    """Per block, codes 0..15 on d = (max - min) / 15 and m = min rounded to float16: every
    weight within half a step (plus m's rounding) of its block's grid; a constant block is exact."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=gen) * torch.rand(32, 1, generator=gen)
    w[3, 32:64] = 0.25
    b = q4_1_blocks(w)
    assert b.bits == 4 and int(b.u.max()) <= 15 and b.d.dtype == b.m.dtype == torch.float16
    err = (dequantize_blocks(b) - w).abs().view(32, 4, 32).amax(-1)
    lo = w.view(32, 4, 32).amin(-1)
    assert (err <= b.d.float() / 2 + (b.m.float() - lo).abs() + 1e-6).all()
    assert torch.equal(dequantize_blocks(b)[3, 32:64], w[3, 32:64])


def gguf_like(seed: int):
    """The tiny model in w4a8 on its GGUF blocks (Q4_0 attention, Q4_1 MLP), the head tied to the
    Q8_0 embedding as the embedded model's."""
    m = tiny(seed)
    raw = tiny_gguf_blocks(m)
    del raw["lm_head.weight"]
    quantize_linears(m, "w4a8", raw=raw)
    return m


def test_w4a8_engine_speculates_exactly():
    """Greedy tree speculation on a w4a8 target and drafter (the tiny model's GGUF blocks:
    Q4_0 attention, Q4_1 MLP, the tied Q8_0 head as 8-bit codes) emits plain decoding's tokens."""
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    target = gguf_like(0)
    assert len(quant_layers(target)) == 4 * len(target.layers) + 1
    assert target.lm_head.bits == 8 and target.layers[0].mlp.down_proj.bits == 4
    assert target.norm.native  # the final norm on the library: every step's rows computed alike
    check_batch_invariant(target, 8)
    cfg = dict(mode="reference", max_context=80, prefill_chunk=8)
    plain = Engine(target, EngineConfig(**cfg))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    spec = Engine(target, EngineConfig(**cfg, tree=tree), LMDrafter(gguf_like(1), "reference"))
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)], [1, 2]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids
        assert spec.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids == want, prompt


def test_a_prefill_chunk_attends_row_by_row_where_the_library_does():
    """Where the layers run the library's row attention, an engine's prefill chunks take it too (it
    reads each row's visible slots, in parallel, where inductor's grouped products read the whole
    context bucket on one thread): invariant rows up to the chunk, one context bucket for the chunk,
    and the chunk's logits and hidden states those of the grouped products to float tolerance;
    plain steps and verify widths stay row by row as before. Without the library kernel the
    chunk keeps the grouped products."""
    from yggtree.runtime import steps
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams
    from yggtree.runtime.model import Attention

    target = gguf_like(0)
    assert target.layers[0].self_attn.native_rows
    eng = Engine(target, EngineConfig(mode="reference", max_context=80, prefill_chunk=8))
    assert {m.invariant_rows for m in target.modules() if isinstance(m, Attention)} == {8}
    assert eng.graphs.buckets(8) == [eng.n_slots] and len(eng.graphs.buckets(None)) >= 1
    prompt = torch.tensor([(7 * i) % 90 + 3 for i in range(13)])

    def prefill(model):
        model.setup_cache(1, eng.n_slots)
        out = []
        for start in (0, 8):
            part = prompt[start : start + 8]
            buf = torch.zeros(1, 8, dtype=torch.int64)
            buf[0, : part.shape[0]] = part
            logits, hidden, _ = steps.prefill_chunk(model, buf, torch.tensor(start), torch.tensor(part.shape[0]))
            out.append((logits, hidden[:, : part.shape[0]]))
        return out

    rows = prefill(target)
    layers = [m for m in target.modules() if isinstance(m, Attention)]
    for m in layers:
        m.invariant_rows = 7  # the chunk on the grouped products, as before
    grouped = prefill(target)
    for m in layers:
        m.invariant_rows = 8
    for (lr, hr), (lg, hg) in zip(rows, grouped, strict=True):
        torch.testing.assert_close(lr, lg, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hr, hg, rtol=1e-4, atol=1e-4)
    assert len(eng.generate(prompt.tolist(), SamplingParams(max_new_tokens=4)).token_ids) == 4
    plain_attention = tiny(0)
    Engine(plain_attention, EngineConfig(mode="reference", max_context=80, prefill_chunk=8))
    assert {m.invariant_rows for m in plain_attention.modules() if isinstance(m, Attention)} == {7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_attention_is_the_reference_and_each_row_its_own(dtype):
    """yggtree::rows_attention (csrc/rows_attention.cpp) against runtime/model.py's
    _rows_attention on rows with prefixes of different lengths, gaps and short windows: close to
    it (float32 sums in another order; a bfloat16 model's q, K and V read as float32 and the
    output rounded once, as the reference does), each row bitwise its one-row call, the same at
    1 and 2 threads and over a wider context bucket (work over the visible slots only)."""
    from yggtree.runtime.model import _rows_attention, row_window

    gen = torch.Generator().manual_seed(0)
    b, w, h, hkv, d, c, s = 1, 6, 9, 3, 64, 96, 130
    kv = torch.randn(2, b, s, hkv, d, generator=gen).to(dtype)
    q = torch.randn(b, w, h, d, generator=gen).to(dtype)
    mask = torch.zeros(b, w, c, dtype=torch.bool)
    for r, n in enumerate([1, 7, 33, 40, 90, 96]):
        mask[0, r, :n] = True
    mask[0, 3, 10:14] = False  # a row that skips slots (a tree node's siblings)
    mask[0, 4, 50:70:3] = False
    window, head = row_window(mask)
    k, v = kv[0][:, :c], kv[1][:, :c]  # strided views of the cache, as Attention passes them
    got = torch.ops.yggtree.rows_attention(q, k, v, head, window)
    want = _rows_attention(q, k, v, head, window)
    assert got.shape == want.shape == (b, w, h * d) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the same float32 result up to its sums' order, then one rounding: at most 1 ulp apart
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()
        assert (got == want).float().mean() > 0.9
    for r in range(w):
        one = torch.ops.yggtree.rows_attention(q[:, r : r + 1], k, v, head[:, r : r + 1], window[:, r : r + 1])
        assert torch.equal(one[:, 0], got[:, r]), r
    wide = torch.nn.functional.pad(head, (0, s - c))  # the same rows in the whole cache
    assert torch.equal(torch.ops.yggtree.rows_attention(q, kv[0], kv[1], wide, window), got)
    torch.set_num_threads(2)
    try:
        assert torch.equal(torch.ops.yggtree.rows_attention(q, k, v, head, window), got)
    finally:
        torch.set_num_threads(1)


def test_float_tensors_and_float_models_become_q4_1():
    """Without GGUF blocks (a float model, an EAGLE head) or for a float GGUF tensor, a linear
    is Q4_1 of its weights; q/k/v and gate/up are one product each."""
    m = tiny()
    raw = tiny_gguf_blocks(m)
    w = m.layers[0].mlp.down_proj.weight.detach().clone()
    raw["layers.0.mlp.down_proj.weight"] = ("F32", w)
    assert quantize_linears(m, "w4a8", raw=raw) == 7 * len(m.layers) + 1
    got = m.layers[0].mlp.down_proj
    assert isinstance(got, W4A8Linear) and torch.equal(got.packed, W4A8Linear(q4_1_blocks(w), None, torch.float32).packed)
    f = tiny()
    assert quantize_linears(f, "w4a8") == 7 * len(f.layers) + 1
    assert f.layers[0].self_attn.q_proj is None and f.layers[0].self_attn.qkv.out_features == 64 + 2 * 32


def test_cpu_without_avx2_is_refused_in_one_line(monkeypatch):
    from yggtree.runtime import kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)  # the variant checks name one; this CPU has none
    monkeypatch.setattr(kernels, "load_library", kernels.load_library.__wrapped__)  # uncached: the format says it
    with pytest.raises(YggError, match=r"^weights w4a8: this CPU lacks avx2, fma, f16c, which yggtree's CPU kernels "
                                       r"need \(AVX2 with FMA and F16C, or AVX-512\)$"):
        w4a8.load_kernel.__wrapped__()


def test_a_failing_build_is_refused_in_one_line(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    from yggtree.runtime import kernels

    def broken(**kw):
        raise RuntimeError("Error building extension 'yggtree_kernels'\nw4a8.cpp:1: error: no compiler here\n")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(YggError, match=r"^building the kernel library in .* failed \(w4a8.cpp:1: error: "
                                       r"no compiler here\); it needs a C\+\+ compiler and ninja$"):
        kernels.load_library.__wrapped__()
    monkeypatch.setattr(kernels, "load_library", kernels.load_library.__wrapped__)  # uncached: the format says it
    with pytest.raises(YggError, match=r"^weights w4a8: building the kernel library in .* failed"):
        w4a8.load_kernel.__wrapped__()


@pytest.mark.parametrize("flags, best", [
    ({"avx2", "fma", "f16c"}, "avx2"),  # an AMD Zen 3, most laptops
    ({"avx2", "fma", "f16c", "avx_vnni"}, "avx2-vnni"),  # an Intel Alder Lake
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, "avx512"),  # an Intel Skylake-SP
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512-vnni"),
])
def test_the_library_builds_for_the_best_instruction_set_the_cpu_runs(monkeypatch, flags, best):
    from yggtree.runtime import kernels

    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    assert kernels.isa() == best and kernels.runnable_isas()[0] == best and kernels.library_missing() == []
    assert "avx2" in kernels.runnable_isas()


def test_a_named_instruction_set_must_exist_and_run_here(monkeypatch):
    from yggtree.runtime import kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv(kernels.ISA_ENV, "avx512-vnni")
    with pytest.raises(YggError, match=r"^YGGTREE_KERNEL_ISA=avx512-vnni: this CPU lacks avx512f, avx512bw, "
                                       r"avx512vl, avx512_vnni$"):
        kernels.isa()
    monkeypatch.setenv(kernels.ISA_ENV, "neon")
    with pytest.raises(YggError, match=r"^YGGTREE_KERNEL_ISA=neon is not one of avx512-vnni, avx512, avx2-vnni, "
                                       r"avx2$"):
        kernels.isa()
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.isa() == "avx2"


def test_width_not_a_multiple_of_32_is_refused():
    m = tiny_model_of_width(48)
    with pytest.raises(YggError, match=r"^weights w4a8: the input width 48 of layers.0.self_attn.qkv is not a "
                                       r"multiple of 32$"):
        quantize_linears(m, "w4a8")


def tiny_model_of_width(hidden: int):
    from helpers import tiny_model

    return tiny_model(hidden=hidden, max_pos=64)


def test_packed_layers_kept_in_the_cache_are_the_layers_packed_again(tmp_path, monkeypatch):
    """A model quantized from the packed layers a run kept (runtime/loading.cached_w4a8_layers)
    holds the same bytes and computes the same bits as one packed from the blocks; a damaged
    cache entry is packed again, never read."""
    from yggtree.runtime.loading import ModelSource, cached_w4a8_layers
    from yggtree.runtime.w4a8 import packed_of

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"stands for the model file")
    src = ModelSource(gguf, "gguf")
    built = []

    def build():
        built.append(1)
        return packed_of(gguf_like(0))

    first = cached_w4a8_layers(src, build)
    again = cached_w4a8_layers(src, build)
    assert len(built) == 1 and set(again) == set(first)
    m = tiny(0)
    quantize_linears(m, "w4a8", packed=again)
    want = gguf_like(0)
    for name, layer in packed_of(want).items():
        got = m.get_submodule(name)
        assert torch.equal(got.packed, layer.data) and (got.out_features, got.in_features, got.bits) == (
            layer.n, layer.k, layer.bits), name
        x = torch.randn(3, layer.k, generator=torch.Generator().manual_seed(1))
        assert torch.equal(got(x), want.get_submodule(name)(x)), name
    (cached,) = (tmp_path / "yggtree" / "weights").glob("*/w4a8-*.safetensors")
    cached.write_bytes(cached.read_bytes()[:100])
    cached_w4a8_layers(src, build)
    assert len(built) == 2
