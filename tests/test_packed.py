"""oneDNN-packed linear layers (yggtree.runtime.packed): the same product as ``F.linear``,
batch-invariant rows (an M-row product's row i is bitwise the one-row product of row i), short
products padded to ``min_rows`` with the same bits, through torch.compile and an AOTInductor
package, and greedy speculation on a packed engine equal to plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from test_aoti import tiny
from yggtree.runtime.packed import (
    PackedConcat, PackedLinear, can_pack, min_rows_of, pack_linears, packed_layers, packed_linear,
)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not can_pack(nn.Linear(2, 2)), reason="oneDNN packing unavailable"),
]

DTYPES = [torch.float32] + ([torch.bfloat16] if can_pack(nn.Linear(2, 2).bfloat16()) else [])
MIN_ROWS = [1, 2, 4, 8]  # the paddings ``yggtree profile`` compares (1: none)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear(dtype, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(dtype).requires_grad_(False)
    packed = PackedLinear.of(lin)
    assert packed.weight is lin.weight and set(packed.state_dict()) == set(lin.state_dict())
    for shape in [(1, 96), (5, 96), (1, 7, 96)]:
        x = torch.randn(shape).to(dtype)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(packed(x), nn.functional.linear(x, lin.weight, lin.bias), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [(False, False), (True, True), (True, False)])
def test_packed_concat_is_the_parts_side_by_side(dtype, bias):
    torch.manual_seed(2)
    parts = [nn.Linear(64, n, bias=b).to(dtype).requires_grad_(False) for n, b in zip((96, 32), bias)]
    fused = PackedConcat(parts)
    assert fused.sizes == (96, 32) and not set(fused.state_dict())  # the parts own the weights
    x = torch.randn(2, 5, 64).to(dtype)
    want = torch.cat([nn.functional.linear(x, p.weight, p.bias) for p in parts], -1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused(x), want, **tol)
    rows = [fused(x[:, i : i + 1]) for i in range(5)]  # batch-invariant rows, as PackedLinear's
    assert all(torch.equal(fused(x)[:, i : i + 1], rows[i]) for i in range(5))
    with pytest.raises(ValueError, match="input width"):
        PackedConcat([nn.Linear(64, 8), nn.Linear(32, 8)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_rows_are_batch_invariant(dtype):
    """What makes a verified tree node's logits the ones a plain step computes."""
    torch.manual_seed(1)
    lin = PackedLinear.of(nn.Linear(576, 1536, bias=False).to(dtype).requires_grad_(False))
    x = torch.randn(32, 576).to(dtype)
    rows = [lin(x[i : i + 1]) for i in range(32)]
    for m in (2, 3, 4, 5, 8, 16, 25, 32):
        y = lin(x[:m])
        for i in range(m):
            assert torch.equal(y[i : i + 1], rows[i]), (m, i)


@pytest.mark.parametrize("fuse", [True, False])
def test_pack_linears_swaps_block_linears_and_the_head(fuse):
    m = tiny()
    keys = set(m.state_dict())
    n_floor = len(m.matmul_weights())
    x = torch.tensor([[3, 5, 7]])
    assert min_rows_of(m) is None
    assert pack_linears(m, fuse=fuse, min_rows=4) == 7 * len(m.layers) + 1  # and the LM head
    assert pack_linears(m, fuse=fuse) == 0 and pack_linears(m, fuse=not fuse) == 0  # already packed
    assert min_rows_of(m) == 4 and all(p.min_rows == 4 for p in packed_layers(m))  # kept
    assert len(packed_layers(m)) == (4 if fuse else 7) * len(m.layers) + 1
    assert isinstance(m.lm_head, PackedLinear) and m.lm_head.weight is m.embed_tokens.weight
    assert type(m.embed_tokens) is nn.Embedding and set(m.state_dict()) == keys
    for b in m.layers:
        assert isinstance(b.mlp.down_proj, PackedLinear) and isinstance(b.self_attn.o_proj, PackedLinear)
        if fuse:  # the parts stay plain (state dict, checks); their forward is the concatenation's
            assert isinstance(b.self_attn.qkv, PackedConcat) and isinstance(b.mlp.gate_up, PackedConcat)
            assert type(b.self_attn.q_proj) is nn.Linear and type(b.mlp.up_proj) is nn.Linear
        else:
            assert b.self_attn.qkv is None and b.mlp.gate_up is None
            assert isinstance(b.mlp.up_proj, PackedLinear)
    # the floor times one product per call the forward makes: 4 per layer fused, 7 not, + the head
    assert len(m.matmul_weights()) == (4 if fuse else 7) * len(m.layers) + 1 and n_floor == 7 * len(m.layers) + 1
    ref = tiny()
    m.setup_cache(1, 16)
    ref.setup_cache(1, 16)
    pos, mask = torch.arange(3)[None], torch.ones(1, 3, 16, dtype=torch.bool).tril()
    torch.testing.assert_close(m(x, pos, pos, mask).hidden, ref(x, pos, pos, mask).hidden)
    torch.testing.assert_close(m.logits(m(x, pos, pos, mask).hidden), ref.logits(ref(x, pos, pos, mask).hidden))


def test_packed_block_compiles_and_packages(tmp_path):
    """A packed block whose 3-row products run padded to 4 rows through torch.compile (fullgraph)
    and an AOTInductor package: the padding is a constant of the graph, so the block's kind
    (the package's name) names it, and a block padded otherwise finds no package."""
    from yggtree.errors import YggError
    from yggtree.runtime.aoti import PackageSet, block_key, compile_package, install_packages, package_name

    m, plain = tiny(), tiny()
    m.setup_cache(1, 24)
    plain.setup_cache(1, 24)
    pack_linears(m, min_rows=4)
    pack_linears(plain)
    b = m.layers[0]
    torch.manual_seed(2)
    args = (torch.randn(1, 3, 32), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4),
            torch.arange(3)[None], torch.ones(1, 3, 24, dtype=torch.bool))
    with torch.no_grad():
        want = b(*args)
        assert torch.equal(want, plain.layers[0](*args))  # padding changes no bit
        torch._dynamo.reset()
        got = torch.compile(b, fullgraph=True, dynamic=False)(*args)
        torch.testing.assert_close(got, want)
        key = block_key(b)
        assert key != block_key(plain.layers[0])
        compile_package(b, args, Path(tmp_path) / package_name(key, 3, 24))
        packages = PackageSet.load(Path(tmp_path), [(key, 3, 24)], 24)
        install_packages(m, packages)
        torch.testing.assert_close(m.layers[0](*args), want)
        with pytest.raises(YggError, match="no compiled graph matches this model's blocks"):
            install_packages(plain, packages)


def test_packed_engine_speculates_exactly():
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    target = tiny()
    pack_linears(target)
    plain = Engine(target, EngineConfig(mode="reference", max_context=60, prefill_chunk=8))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    draft = tiny(seed=1)
    pack_linears(draft)
    spec = Engine(target, EngineConfig(mode="reference", max_context=60, prefill_chunk=8, tree=tree),
                  LMDrafter(draft, "reference"))
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert spec.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("min_rows", MIN_ROWS)
def test_short_products_run_padded_with_the_same_bits(dtype, bias, min_rows):
    """Products of fewer than ``min_rows`` rows run padded to that many: bitwise what oneDNN
    gives the unpadded rows, leading dimensions kept; the op's argument and the layers'
    attribute (PackedLinear, PackedConcat) alike."""
    torch.manual_seed(3)
    lin = nn.Linear(576, 160, bias=bias).to(dtype).requires_grad_(False)
    p = PackedLinear.of(lin, min_rows=min_rows)
    parts = [nn.Linear(576, n, bias=bias).to(dtype).requires_grad_(False) for n in (96, 32)]
    cat, cat1 = PackedConcat(parts, min_rows=min_rows), PackedConcat(parts)
    assert p.min_rows == cat.min_rows == min_rows and cat1.min_rows == 1
    shapes = [(n, 576) for n in range(1, 10)] + [(1, 1, 576), (1, 3, 576), (2, 3, 576), (1, 7, 576)]
    for shape in shapes:
        x = torch.randn(shape).to(dtype)
        raw = torch.ops.mkldnn._linear_pointwise.default(x, p.packed, lin.bias, "none", [], "")
        y = packed_linear(x, p.packed, 160, lin.bias, min_rows)
        assert y.shape == (*shape[:-1], 160) and torch.equal(y, raw), shape
        assert torch.equal(p(x), raw), shape
        assert torch.equal(cat(x), cat1(x)), shape


@pytest.mark.parametrize("min_rows", [0, -1, 1.5, True])
def test_min_rows_must_be_a_positive_integer(min_rows):
    with pytest.raises(ValueError, match="min_rows must be an integer >= 1"):
        PackedLinear.of(nn.Linear(8, 8), min_rows=min_rows)
    with pytest.raises(ValueError, match="min_rows must be an integer >= 1"):
        pack_linears(tiny(), min_rows=min_rows)


@pytest.mark.parametrize("min_rows", MIN_ROWS[1:])
def test_padded_model_is_bitwise_the_unpadded_one(min_rows):
    """A whole packed model, every width from plain steps to trees: padding changes no bit."""
    ref, m = tiny(), tiny()
    pack_linears(ref)
    pack_linears(m, min_rows=min_rows)
    assert min_rows_of(ref) == 1 and min_rows_of(m) == min_rows
    ref.setup_cache(1, 16)
    m.setup_cache(1, 16)
    for w in (1, 2, 3, 5, 9):
        x = torch.arange(3, 3 + w)[None]
        pos, mask = torch.arange(w)[None], torch.ones(1, w, 16, dtype=torch.bool).tril()
        a, b = ref(x, pos, pos, mask).hidden, m(x, pos, pos, mask).hidden
        assert torch.equal(a, b) and torch.equal(ref.logits(a), m.logits(b)), w


def test_profile_times_every_padding_of_one_step():
    """The profile's measurement: one row through every packed product of the model per
    variant; which variant wins is the machine's business, the record's shape is not."""
    from yggtree.offline.profile import PADDING_ROWS, time_padding

    m = tiny()
    assert time_padding(m, warmup=0, repeats=1) == {"min_rows": 1, "products": 0, "median_ms": {}}
    pack_linears(m)
    pad = time_padding(m, warmup=1, repeats=3)
    assert pad["min_rows"] in PADDING_ROWS and pad["products"] == len(packed_layers(m))
    assert list(pad["median_ms"]) == [str(r) for r in PADDING_ROWS]
    assert all(v > 0 for v in pad["median_ms"].values()) and (pad["warmup"], pad["repeats"]) == (1, 3)
    assert pad["median_ms"][str(pad["min_rows"])] == min(pad["median_ms"].values())
