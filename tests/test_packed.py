"""oneDNN-packed linear layers (yggtree.runtime.packed): the same product as ``F.linear``,
batch-invariant rows (an M-row product's row i is bitwise the one-row product of row i), through
torch.compile and an AOTInductor package, and greedy speculation on a packed engine equal to
plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from test_aoti import tiny
from yggtree.runtime.packed import PackedConcat, PackedLinear, can_pack, pack_linears

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not can_pack(nn.Linear(2, 2)), reason="oneDNN packing unavailable"),
]

DTYPES = [torch.float32] + ([torch.bfloat16] if can_pack(nn.Linear(2, 2).bfloat16()) else [])


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
    assert pack_linears(m, fuse=fuse) == 7 * len(m.layers) + 1  # and the LM head
    assert pack_linears(m, fuse=fuse) == 0 and pack_linears(m, fuse=not fuse) == 0  # already packed
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
    """A packed block through torch.compile (fullgraph) and an AOTInductor package."""
    from yggtree.runtime.aoti import PackageSet, block_key, compile_package, install_packages, package_name

    m = tiny()
    m.setup_cache(1, 24)
    pack_linears(m)
    b = m.layers[0]
    torch.manual_seed(2)
    args = (torch.randn(1, 3, 32), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4),
            torch.arange(3)[None], torch.ones(1, 3, 24, dtype=torch.bool))
    with torch.no_grad():
        want = b(*args)
        torch._dynamo.reset()
        got = torch.compile(b, fullgraph=True, dynamic=False)(*args)
        torch.testing.assert_close(got, want)
        key = block_key(b)
        compile_package(b, args, Path(tmp_path) / package_name(key, 3, 24))
        install_packages(m, PackageSet.load(Path(tmp_path), [(key, 3, 24)], 24))
        torch.testing.assert_close(m.layers[0](*args), want)


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
def test_short_products_run_padded_with_the_same_bits(dtype, bias):
    """1-3 rows run padded to MIN_ROWS (oneDNN's fast kernels): bitwise what oneDNN gives the
    unpadded rows, leading dimensions kept."""
    from yggtree.runtime.packed import MIN_ROWS, packed_linear

    torch.manual_seed(3)
    lin = nn.Linear(576, 160, bias=bias).to(dtype).requires_grad_(False)
    p = PackedLinear.of(lin)
    for shape in [(1, 576), (2, 576), (3, 576), (1, 1, 576), (1, 3, 576), (MIN_ROWS, 576)]:
        x = torch.randn(shape).to(dtype)
        raw = torch.ops.mkldnn._linear_pointwise.default(x, p.packed, lin.bias, "none", [], "")
        y = packed_linear(x, p.packed, 160, lin.bias)
        assert y.shape == (*shape[:-1], 160) and torch.equal(y, raw), shape
