"""The tiled product kernel (``yggtree::tiled_mm``, runtime/packed.py's ``tiled``): exactly
``F.linear`` where float32 sums are exact, close to a float64 product elsewhere, rows bitwise
independent of the call's other rows and of the thread count, models packed for it, the
profile's measured choice between it and oneDNN, and exact greedy speculation on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_model
from yggtree.errors import YggError
from yggtree.runtime.kernels import library_missing
from yggtree.runtime.packed import (
    KERNELS, PackedConcat, PackedLinear, kernel_of, pack_linears, packed_layers, padding_is_invariant, tiled_linear,
)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(bool(library_missing()), reason="the kernel library needs AVX2 with FMA and F16C (or AVX-512)"),
]


def tiled(w: torch.Tensor) -> torch.Tensor:
    from yggtree.runtime.packed import pack_weight

    return pack_weight(w, "tiled")


def rows16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized kernels' 16-bit activations (csrc/tiled_mm.cpp), step for step in float32:
    (qa [M, K] int64, da [M] float32)."""
    x = x.float()
    da = x.abs().amax(1) / 32767
    inv = torch.where(da > 0, 1 / da, torch.zeros_like(da))
    return torch.round(x * inv[:, None]).long(), da


def quantized_product(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """The quantized kernels' result in float64 [M, N]: codes ``q`` [N, K], scales ``s`` and
    offsets ``m`` (w = s q + m) [N, K / G] per group, on the rows' 16-bit activations."""
    qa, da = rows16(x)
    g = q.shape[1] // s.shape[1]
    sums = torch.einsum("mbk,nbk->mnb", qa.view(len(qa), -1, g).double(), q.double().view(len(q), -1, g))
    y = da.double()[:, None] * (sums * s.double()).sum(-1)
    if m is not None:
        y = y + x.double().view(len(x), -1, g).sum(-1) @ m.double().T
    return y


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` is ``x @ w.T`` (float64) but for the 16-bit activations' rounding: each activation
    is off by at most da / 2, so each result by at most da / 2 times its column's sum of |w|
    (and float32 sums' rounding: 1e-6 relative)."""
    ref = x.double() @ w.double().T
    bound = rows16(x)[1].double()[:, None] / 2 * w.double().abs().sum(1)[None] + 1e-6 * ref.abs() + 1e-7
    assert ((y.double() - ref).abs() <= bound).all(), ((y.double() - ref).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [16, 97, 160])
def test_integer_products_are_exactly_f_linear(dtype, n):
    """Small integers: every sum is exact (in bfloat16 too: |y| <= 70 + 4 < 2^8), so any
    summation order and rounding gives F.linear's bits."""
    from yggtree.runtime.kernels import load_library

    load_library()
    g = torch.Generator().manual_seed(n)
    top = 8 if dtype == torch.float32 else 1
    w = torch.randint(-top, top + 1, (n, 70), generator=g).to(dtype)
    x = torch.randint(-top, top + 1, (5, 70), generator=g).to(dtype)
    bias = torch.randint(-4, 5, (n,), generator=g).to(dtype)
    t = tiled(w)
    assert t.shape == (-(-n // 16), 70, 16) and t.dtype == dtype
    assert torch.equal(tiled_linear(x, t, n, bias), nn.functional.linear(x, w, bias))
    assert tiled_linear(x[None], t, n).shape == (1, 5, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_products_are_close_to_float64(dtype):
    torch.manual_seed(0)
    w, x = torch.randn(200, 576).to(dtype), torch.randn(9, 576).to(dtype)
    pack_linears  # noqa: B018  (the library loads with the first packing below)
    lin = nn.Linear(576, 200, bias=False).to(dtype)
    lin.weight.data.copy_(w)
    layer = PackedLinear.of(lin, kernel="tiled")
    want = (x.double() @ w.double().T)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-1)
    torch.testing.assert_close(layer(x).double(), want, **tol)
    assert layer(x).dtype == dtype and layer.kernel == "tiled"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent_of_the_call_and_the_threads(dtype):
    """Row i of an M-row product is bitwise the one-row product of row i, for every M up to 40
    (row groups of 8, 4, 2 and 1), at one and at two threads."""
    torch.manual_seed(1)
    lin = nn.Linear(576, 960, bias=True).to(dtype)
    layer = PackedLinear.of(lin, kernel="tiled")
    x = torch.randn(40, 576).to(dtype)
    with torch.no_grad():
        one = torch.cat([layer(x[i : i + 1]) for i in range(40)])
        for m in range(1, 41):
            assert torch.equal(layer(x[:m]), one[:m]), m
        torch.set_num_threads(2)
        try:
            assert torch.equal(layer(x), one)
        finally:
            torch.set_num_threads(1)


def test_kernel_is_checked():
    with pytest.raises(ValueError, match="kernel must be one of torch, tiled"):
        PackedLinear.of(nn.Linear(16, 16), kernel="blas")
    assert KERNELS == ("torch", "tiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_packed_for_the_tiled_kernel(dtype):
    m, ref = tiny_model(dtype=dtype), tiny_model(dtype=dtype)
    keys = set(m.state_dict())
    assert kernel_of(m) is None
    assert pack_linears(m, kernel="tiled") == 7 * len(m.layers) + 1
    assert kernel_of(m) == "tiled" and all(p.kernel == "tiled" for p in packed_layers(m))
    assert isinstance(m.layers[0].self_attn.qkv, PackedConcat) and m.lm_head.weight is m.embed_tokens.weight
    assert m.norm.native == (dtype == torch.float32)  # the final norm on the library too (float32 only)
    assert not any(b.input_layernorm.native for b in m.layers)  # the blocks' norms stay in their graphs
    assert set(m.state_dict()) == keys
    assert padding_is_invariant(m, 1, (1, 3, 12))
    x = torch.tensor([[3, 5, 7, 11]])
    m.setup_cache(1, 16)
    ref.setup_cache(1, 16)
    pos, mask = torch.arange(4)[None], torch.ones(1, 4, 16, dtype=torch.bool).tril()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    with torch.no_grad():
        torch.testing.assert_close(m.logits(m(x, pos, pos, mask).hidden), ref.logits(ref(x, pos, pos, mask).hidden),
                                   **tol)


def test_mixed_kernels_are_refused():
    m = tiny_model()
    pack_linears(m, kernel="tiled")
    m.layers[0].mlp.down_proj.kernel = "torch"
    with pytest.raises(ValueError, match="different kernel"):
        kernel_of(m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [32, 64])
def test_tiled_engine_speculates_exactly(dtype, hidden):
    """Greedy tree speculation on the tiled kernel gives plain decoding's tokens without any
    padding (row-invariant by construction), in float32 and bfloat16; a model whose head dim the
    library's attention takes (16 at hidden 64) runs that attention too, in either dtype."""
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    target = tiny_model(hidden=hidden, max_pos=256, dtype=dtype)
    draft = tiny_model(hidden=hidden, max_pos=256, seed=1, dtype=dtype)
    pack_linears(target, kernel="tiled")
    pack_linears(draft, kernel="tiled")
    native = hidden == 64
    assert all(bool(b.self_attn.native_rows) == native for b in target.layers)
    plain = Engine(target, EngineConfig(mode="reference", max_context=60, prefill_chunk=8))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    spec = Engine(target, EngineConfig(mode="reference", max_context=60, prefill_chunk=8, tree=tree),
                  LMDrafter(draft, "reference"))
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert spec.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want


def test_profile_times_both_kernels_and_records_the_choice():
    from yggtree.offline.profile_padding import PADDING_ROWS, padding_line, time_padding

    m, t = tiny_model(), tiny_model()
    pack_linears(m)
    pack_linears(t, kernel="tiled")
    pad = time_padding(m, warmup=1, repeats=3, widths=(1, 6), tiled=t)
    assert list(pad["median_ms"]) == [*map(str, PADDING_ROWS), "tiled"]
    assert pad["invariant"]["tiled"] is True
    best = min(pad["median_ms"], key=lambda k: pad["median_ms"][k] if pad["invariant"][k] else float("inf"))
    assert pad["kernel"] == ("tiled" if best == "tiled" else "torch")
    assert pad["min_rows"] == (1 if best == "tiled" else int(best))
    assert ("the tiled kernel" in padding_line(pad)) == (best == "tiled")
    if pad["kernel"] == "tiled":  # its time is its fastest prefetch setting's
        from yggtree.runtime.kernels import PREFETCH_CHOICES, prefetch_name

        assert list(pad["prefetch_ms"]) == [prefetch_name(d) for d in PREFETCH_CHOICES]
        near, far = pad["prefetch"]
        assert pad["prefetch_ms"][f"{near}/{far}"] == pad["median_ms"]["tiled"] == min(pad["prefetch_ms"].values())
        assert f"prefetched {near} bytes ahead" in padding_line(pad)
        assert (f"(and {far} into the second-level cache)" in padding_line(pad)) == (far > 0)
    else:
        assert "prefetch" not in pad


@pytest.mark.parametrize("setting", [(0, 0), (64, 0), (512, 0), (16384, 0), (1 << 20, 0), (0, 8192), (1024, 64),
                                     (1024, 16384), (2048, 1 << 20)])
def test_the_prefetch_setting_changes_no_result(setting):
    """Every tiled product (float32, bfloat16 and int8 tiles, 4-bit tiles) gives the same bits at
    any prefetch setting (near and far distances), at 1-9 rows; the setting before is restored
    (w4a8: test_w4a8.py)."""
    from yggtree.runtime import kernels
    from yggtree.runtime.quant import Int4Linear, Int8Linear, quantize_int4

    kernels.load_library()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=g)
    w = torch.randn(48, 96, generator=g)
    q4 = Int4Linear([quantize_int4(torch.randn(48, 96, generator=g), 32)], None, torch.float32, "tiled")
    products = [lambda x, p=tiled(w.to(dt)): torch.ops.yggtree.tiled_mm(x, p, torch.empty(0))
                for dt in (torch.float32, torch.bfloat16)]
    q8 = Int8Linear(w, None, torch.float32, "tiled")
    products += [q8, q4]
    before = torch.ops.yggtree.prefetch(-1, 0)
    want = [[f(x[:m]) for m in range(1, 10)] for f in products]
    with kernels.prefetch(setting):
        assert torch.ops.yggtree.prefetch(-1, 0) == list(setting)
        got = [[f(x[:m]) for m in range(1, 10)] for f in products]
    assert torch.ops.yggtree.prefetch(-1, 0) == before
    for a, b in zip(want, got):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_bad_prefetch_setting_is_refused():
    from yggtree.runtime import kernels

    kernels.load_library()
    before = torch.ops.yggtree.prefetch(-1, 0)
    for near, far, which in ((100, 0, "near"), ((1 << 20) + 64, 0, "near"), (1024, 96, "far"), (1024, -64, "far")):
        with pytest.raises(RuntimeError, match=f"prefetch: the {which} distance must be a multiple of 64 bytes"):
            torch.ops.yggtree.prefetch(near, far)
        assert torch.ops.yggtree.prefetch(-1, 0) == before  # nothing half set
    for bad in (100, [1024], [1024, 100], "1024/0", True, [True, 0]):
        with pytest.raises(ValueError, match="a prefetch setting is .near, far. bytes"):
            kernels.prefetch_setting(bad)


def test_plan_reads_the_profiles_prefetch_setting(tmp_path):
    """A profile's measured setting reaches its plan's engine spec (one distance, as profiles
    recorded before the second level: near only); a profile without one leaves the library's
    default (None); a bad one is refused in one line."""
    from yggtree.runtime.padding import profile_prefetch

    path = tmp_path / "p.json"
    measured, one = {"kernel": "tiled", "min_rows": 1, "prefetch": [1024, 8192]}, {"kernel": "tiled", "prefetch": 4096}
    for pad, want in ((measured, (1024, 8192)), (one, (4096, 0)), ({"kernel": "tiled", "min_rows": 1}, None)):
        path.write_text(json.dumps({"packed_padding": pad}))
        assert profile_prefetch(path) == want
    for bad in (100, -64, "8192", True, [1024, 100], [1024, 0, 0]):
        path.write_text(json.dumps({"packed_padding": {"kernel": "tiled", "min_rows": 1, "prefetch": bad}}))
        with pytest.raises(YggError, match=r"^profile .*: 'packed_padding.prefetch': a prefetch setting is"):
            profile_prefetch(path)


def test_plan_reads_the_profiles_kernel(tmp_path):
    from yggtree.runtime.padding import profile_invariance, profile_kernel

    p = tmp_path / "p.json"
    base = {"hardware": {"threads": 2},
            "packed_padding": {"kernel": "tiled", "min_rows": 1, "widths": [1, 32],
                               "invariant": {"1": False, "4": True, "tiled": True}}}
    p.write_text(json.dumps(base))
    assert profile_kernel(p) == "tiled" and profile_invariance(p) == (2, (1, 32))
    p.write_text(json.dumps({"packed_padding": {"min_rows": 4}}))  # an older profile: oneDNN
    assert profile_kernel(p) == "torch"
    p.write_text(json.dumps({"packed_padding": {"kernel": "blas", "min_rows": 1}}))
    with pytest.raises(YggError, match=r"^profile .*: 'packed_padding.kernel' must be one of torch, tiled, "
                                       r"got 'blas' \(measure it again: yggtree profile --force\)$"):
        profile_kernel(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layers_on_the_tiled_kernel(dtype):
    """int8 weights on the tiled kernel: bitwise its definition (16-bit activations, int32 sums,
    then the column's scale and the row's), rows independent of the call, the padded head cut,
    an odd input width padded; within the activations' rounding of the float64 product; torch's
    kernel stays available and the two are told apart."""
    from yggtree.runtime.quant import Int8Linear, quantize_int8

    g = torch.Generator().manual_seed(3)
    w = torch.randn(97, 64, generator=g)
    x = torch.randn(6, 64, generator=g).to(dtype)
    lin = Int8Linear(w, None, dtype, kernel="tiled")
    assert lin.qweight.shape == (7, 32, 32) and lin.scales.shape == (7, 16) and lin.kernel == "tiled"
    q, s = quantize_int8(w)
    qa, da = rows16(x)
    want = ((qa @ q.long().T).float() * s) * da[:, None]  # one group, one chunk: float32 steps as the kernel's
    assert torch.equal(lin(x), want.to(dtype))
    one = torch.cat([lin(x[i : i + 1]) for i in range(6)])
    assert torch.equal(lin(x), one)
    wf, xf = torch.randn(40, 301, generator=g), torch.randn(3, 301, generator=g)  # two chunks and an odd width
    a = Int8Linear(wf, None, torch.float32, "tiled")
    assert a.qweight.shape == (3, 151, 32)
    qf, sf = quantize_int8(wf)
    torch.testing.assert_close(a(xf).double(), quantized_product(xf, qf, sf[:, None]), rtol=1e-6, atol=1e-6)
    assert_within_rounding(a(xf), xf, qf.double() * sf.double()[:, None])
    with pytest.raises(YggError, match=r"^weights int8: an input width of 301 is not a multiple of 16, which "
                                       r"torch's int8 kernel needs; the tiled kernel takes it \(YGGTREE_KERNEL=tiled\)$"):
        Int8Linear(wf, None, torch.float32, "torch")
    wf, xf = wf[:, :288], xf[:, :288]
    a, b = Int8Linear(wf, None, torch.float32, "tiled"), Int8Linear(wf, None, torch.float32, "torch")
    qf, sf = quantize_int8(wf)
    ref = xf.double() @ (qf.double() * sf.double()[:, None]).T
    torch.testing.assert_close(b(xf).double(), ref, rtol=2e-2, atol=1e-1)  # bfloat16 ones
    assert (a(xf).double() - ref).abs().max() < (b(xf).double() - ref).abs().max() / 10
    with pytest.raises(ValueError, match="kernel must be torch or tiled"):
        Int8Linear(wf, None, torch.float32, "blas")


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int8_codes_with_a_scale_per_group(rows):
    """int8 codes with a float32 scale per group of input columns (a GGUF Q8_0 weight's blocks):
    each group's sum scaled and accumulated in order (its definition to float32 rounding, the
    float64 product to the activations' rounding); rows independent of the call; one group is the
    per-column scale bitwise; a scale that does not divide K is refused."""
    from yggtree.runtime.quant import Int8Linear

    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (37, 96), generator=g, dtype=torch.int8)
    d = torch.rand(37, 3, generator=g) / 64
    lin = Int8Linear(None, None, torch.float32, "tiled", codes=(q, d))
    assert lin.scales.shape == (3, 3, 16) and lin.out_features == 37
    x = torch.randn(rows, 96, generator=g)
    assert lin.qweight.shape == (3, 48, 32)
    torch.testing.assert_close(lin(x).double(), quantized_product(x, q, d), rtol=1e-6, atol=1e-7)
    assert_within_rounding(lin(x), x, q.double() * d.double().repeat_interleave(32, 1))
    assert torch.equal(lin(x), torch.cat([lin(x[i : i + 1]) for i in range(rows)]))
    per_column = Int8Linear(None, None, torch.float32, "tiled", codes=(q, d[:, 0]))
    one_group = torch.ops.yggtree.tiled_mm(x, per_column.qweight, per_column.scales[:, None].contiguous())
    assert torch.equal(one_group[:, :37], per_column(x))
    with pytest.raises(RuntimeError, match=r"tiled_mm: scale must be \[T, 16\], or \[T, B, 16\]"):
        torch.ops.yggtree.tiled_mm(x, lin.qweight, torch.zeros(3, 5, 16))
    with pytest.raises(ValueError, match="a scale per group of inputs run on the tiled kernel only"):
        Int8Linear(None, None, torch.float32, "torch", codes=(q, d))


def test_gguf_q8_0_runs_as_one_int8_stream_on_the_tiled_kernel():
    """gguf-native on the tiled kernel: a Q8_0 weight (the tied head) is one Int8Linear holding
    the blocks exactly (an identity input reads llama.cpp's float32 weights back to the
    activations' rounding),
    the Q4 blocks stay 4-bit planes; on torch's kernel Q8_0 stays two planes."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize, quantize

    from test_quant import gguf_blocks
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
    from yggtree.runtime.quant import Int4Linear, Int8Linear, gguf_int8, int8_pairs, quantize_linears

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = quantize(w, T.Q8_0)
    want = torch.from_numpy(gguf_dequantize(raw, T.Q8_0).reshape(48, 96).copy())
    q, d = gguf_int8("Q8_0", torch.from_numpy(raw))
    assert torch.equal(q.double() * d.double().repeat_interleave(32, 1), want.double())  # the blocks exactly
    lin = Int8Linear(None, None, torch.float32, "tiled", codes=(q, d))
    assert torch.equal(lin.qweight, int8_pairs(q)) and torch.equal(lin.scales.permute(0, 2, 1).reshape(48, 3), d)
    torch.testing.assert_close(lin(torch.eye(96)).T, want, rtol=3e-7, atol=0)  # 1 is 32767 of 1 / 32767
    assert gguf_int8("Q4_1", torch.from_numpy(raw)) is None
    m, t = tiny_model(hidden=64), tiny_model(hidden=64)
    for model, kernel in ((m, "tiled"), (t, "torch")):  # the head tied to the Q8_0 embedding, as in the file
        raw = {k: v for k, v in gguf_blocks(model).items() if k != "lm_head.weight"}
        quantize_linears(model, "gguf-native", raw=raw, kernel=kernel)
    assert isinstance(m.lm_head, Int8Linear) and m.lm_head.scales.dim() == 3
    assert isinstance(t.lm_head, Int4Linear) and t.lm_head.packed.shape[0] == 2
    assert all(isinstance(b.mlp.down_proj, Int4Linear) and b.mlp.down_proj.kernel == "tiled" for b in m.layers)
    plain = Engine(m, EngineConfig(mode="reference", max_context=80, prefill_chunk=8))  # speculation stays exact
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    spec = Engine(m, EngineConfig(mode="reference", max_context=80, prefill_chunk=8, tree=tree),
                  LMDrafter(tiny_model(hidden=64, seed=1), "reference"))
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert spec.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want, prompt


def test_profile_times_int8_kernels():
    from yggtree.offline.profile_padding import kernel_layers, time_padding
    from yggtree.runtime.quant import quantize_linears

    m, t = tiny_model(), tiny_model()
    quantize_linears(m, "int8")
    quantize_linears(t, "int8", kernel="tiled")
    assert len(kernel_layers(m)) == 4 * len(m.layers) + 1
    pad = time_padding(m, warmup=1, repeats=3, widths=(1, 6), tiled=t)
    assert pad["products"] == len(kernel_layers(m)) and "tiled" in pad["median_ms"]
    assert pad["kernel"] in KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_4bit_layers_on_the_tiled_kernel(dtype, group):
    """4-bit planes on the tiled kernel: w = s q + m per group, the planes summed; its definition
    (16-bit activations, int32 sums) to float32 rounding, rows independent of the call, the padded
    columns cut; the float64 product to the activations' rounding."""
    from yggtree.runtime.quant import Int4Codes, Int4Linear, dequantize, quantize_int4

    g = torch.Generator().manual_seed(group)
    n, k = 37, 128
    planes = [Int4Codes(torch.randint(0, 16, (n, k), generator=g).to(torch.uint8),
                        torch.rand(n, k // group, generator=g) + 0.5, torch.randn(n, k // group, generator=g))
              for _ in range(2)]
    x = torch.randn(6, k, generator=g).to(dtype)
    lin = Int4Linear(planes, None, dtype, kernel="tiled")
    assert lin.packed.shape == (2, 3, k // group, 8 * group + 128) and lin.scale_zeros is None  # float32 s, m
    want = sum(quantized_product(x, c.q, c.scale, c.zero - 8 * c.scale) for c in planes)
    if dtype == torch.float32:  # float32's rounding of the terms (their magnitude: |x| @ |w|)
        big = x.abs().double() @ sum(dequantize([c]).abs() for c in planes).double().T
        assert ((lin(x).double() - want).abs() <= 1e-6 * big).all()
    else:
        torch.testing.assert_close(lin(x), want.to(dtype), rtol=1e-2, atol=0)  # one rounding to bfloat16
    one = torch.cat([lin(x[i : i + 1]) for i in range(6)])
    assert torch.equal(lin(x), one)
    c = quantize_int4(torch.randn(50, k, generator=g), group)
    xf = torch.randn(4, k, generator=g)
    assert_within_rounding(Int4Linear([c], None, torch.float32, "tiled")(xf), xf, dequantize([c]))
    with pytest.raises(ValueError, match="kernel must be torch or tiled"):
        Int4Linear([c], None, torch.float32, "blas")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_ggufs_4bit_blocks_keep_their_float16_scales_on_the_tiled_kernel(kind):
    """A GGUF's Q4_0 / Q4_1 blocks on the tiled kernel hold their scales and offsets in float16, the
    file's own (exact: the same bits as float32 ones widened, a sixth less to stream); 4-bit codes
    whose scales float16 cannot hold (int4's, float32) stay float32; mixed dtypes are refused."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize, quantize

    from yggtree.runtime.quant import Int4Linear, dequantize, gguf_codes, quantize_int4

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((40, 96)) * rng.uniform(0.01, 3, (40, 1))).astype(np.float32)
    raw = quantize(w, getattr(T, kind))
    planes = gguf_codes(kind, torch.from_numpy(raw))
    assert torch.equal(dequantize(planes), torch.from_numpy(gguf_dequantize(raw, getattr(T, kind)).reshape(40, 96)))
    lin = Int4Linear(planes, None, torch.float32, "tiled")
    assert lin.packed.shape == (1, 3, 3, 256 + 64)  # float16 s and m: 32 bytes each a group
    from yggtree.runtime.quant import q4_blocks

    c = planes[0]
    s, m = (F.pad(v, (0, 0, 0, 8)) for v in (c.scale, c.zero - 8 * c.scale))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    wide = torch.ops.yggtree.tiled_q4_mm(x, q4_blocks(F.pad(c.q, (0, 0, 0, 8)), s, m))  # float32 s and m
    assert torch.equal(lin(x), wide[:, :40])
    assert Int4Linear([quantize_int4(torch.from_numpy(w), 32)], None, torch.float32, "tiled").packed.shape[-1] == 256 + 128
    for bad in (lin.packed[0][..., :-32], lin.packed[0][..., :200], lin.packed[0].view(torch.int8)):
        with pytest.raises(RuntimeError, match=r"tiled_q4_mm: blocks must be a contiguous \[T, K / G, 8 G \+ 32 e\] uint8"):
            torch.ops.yggtree.tiled_q4_mm(x, bad.contiguous())
    with pytest.raises(RuntimeError, match="tiled_q4_mm: x has 64 columns, the weight 96"):
        torch.ops.yggtree.tiled_q4_mm(x[:, :64], lin.packed[0])


def test_the_4bit_kernels_share_their_code_blocks():
    """The tiled kernel's 4-bit stream is w4a8's for a GGUF's blocks (codes, then float16 s and m per
    block of 32), and both kernels read the same nibbles (quant.nibble_blocks)."""
    from yggtree.runtime.quant import q4_blocks
    from yggtree.runtime.w4a8 import Blocks, pack_blocks

    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (48, 96), generator=g).to(torch.uint8)
    d, m = torch.rand(48, 3, generator=g).half(), torch.randn(48, 3, generator=g).half()
    assert torch.equal(q4_blocks(q, d, m), pack_blocks(Blocks(q, d, m, 4)))


def test_profile_times_4bit_kernels():
    from yggtree.offline.profile_padding import kernel_layers, time_padding
    from yggtree.runtime.quant import Int4Linear, quantize_linears

    m, t = tiny_model(), tiny_model()
    quantize_linears(m, "int4", 32)
    quantize_linears(t, "int4", 32, kernel="tiled")
    assert all(isinstance(x, Int4Linear) for x in kernel_layers(m)) and len(kernel_layers(m)) == 4 * len(m.layers) + 1
    assert {x.kernel for x in kernel_layers(t)} == {"tiled"}
    pad = time_padding(m, warmup=1, repeats=3, widths=(1, 6), tiled=t)
    assert pad["products"] == len(kernel_layers(m)) and pad["kernel"] in KERNELS


@pytest.mark.slow
def test_packing_loads_the_library_in_a_fresh_process(tmp_path):
    """A bfloat16 model packed for the tiled kernel in a process that never loaded the library
    runs (the attention stays inductor's in bfloat16, the products need the library all the same)."""
    import subprocess
    import sys

    code = ("import torch; from helpers import tiny_model; from yggtree.runtime.packed import pack_linears;"
            "m = tiny_model(hidden=64, dtype=torch.bfloat16); pack_linears(m, kernel='tiled');"
            "print(m.lm_head(torch.ones(1, 64, dtype=torch.bfloat16)).shape)")
    tests = str(__import__("pathlib").Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tests, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "torch.Size([1, 97])"


def test_a_manifests_prefetch_setting_is_read_or_refused(tmp_path):
    """A compiled plan without a profile takes its prefetch setting from its manifest: a pair, one
    distance (manifests before the second level: near only) or none; a bad one in one line."""
    from yggtree.runtime.build import manifest_prefetch

    for v, want in (([2048, 16384], (2048, 16384)), (8192, (8192, 0)), (None, None)):
        assert manifest_prefetch({"packed_prefetch": v}, tmp_path) == want
    with pytest.raises(YggError, match=r"packed_prefetch: a prefetch setting is .* \(compile the plan again\)$"):
        manifest_prefetch({"packed_prefetch": [1024, 7]}, tmp_path)
