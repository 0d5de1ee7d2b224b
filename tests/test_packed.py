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
    PackedConcat, PackedLinear, can_pack, invariant_min_rows, min_rows_of, pack_linears, packed_layers,
    packed_linear, padding_is_invariant,
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


# (in, out) of the default model's packed products: q/k/v and gate/up fused, o, down, LM head
REAL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
THREADS = torch.get_num_threads()  # as the process started (OMP_NUM_THREADS), before one_thread


def brute_invariant(lin, min_rows: int, widths: int = 16, samples: int = 1 << 18) -> bool:
    """Rows of every M-row product, M = 1..``widths``, padded to ``min_rows``, bitwise the padded
    one-row products of the same rows, on at least ``samples`` outputs per M (a bfloat16 kernel
    may differ in one output of a few thousand): what padding_is_invariant checks, without
    reasoning about which row counts reach oneDNN."""
    n = max(widths, -(-samples // lin.out_features))
    x = torch.randn(n, lin.in_features, generator=torch.Generator().manual_seed(5)).to(lin.weight.dtype)
    one = torch.cat([packed_linear(x[i : i + 1], lin.packed, lin.out_features, None, min_rows) for i in range(n)])
    return all(torch.equal(packed_linear(x[i : i + m], lin.packed, lin.out_features, None, min_rows), one[i : i + m])
               for m in range(1, widths + 1) for i in range(0, n - m + 1, m))


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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=lambda s: f"{s[0]}to{s[1]}")
def test_real_shapes_run_at_an_invariant_padding(shape, dtype):
    """The default model's product shapes, M = 1..16, at the thread count the tests run with:
    padding_is_invariant agrees with a brute-force check at every padding compared, and the
    padding an engine would use starting from each (invariant_min_rows) is invariant. Whether 1
    is not asserted: on the AMD EPYC machine the float32 1536 -> 576 product is not
    invariant at 1 row (docs/results.md)."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(4)
    lin = PackedLinear.of(nn.Linear(*shape, bias=False).to(dtype).requires_grad_(False))
    model = nn.ModuleList([lin])
    widths = range(1, 17)
    with torch.no_grad():
        found = {r: padding_is_invariant(model, r, widths) for r in MIN_ROWS}
        assert found == {r: brute_invariant(lin, r, 16) for r in MIN_ROWS}, found
        for start in MIN_ROWS:
            used = invariant_min_rows(model, widths, start)
            assert used is not None and used >= start and brute_invariant(lin, used, 16), (start, used)
            assert all(not found[r] for r in MIN_ROWS if start <= r < used)


def skewed(real, bad):
    """``packed_linear`` whose products that reach oneDNN with R rows (R = max(rows, min_rows))
    are shifted by ``bad(R, y)`` (a kernel made batch-variant on purpose)."""

    def op(x, packed, out, bias=None, min_rows=1):
        y = real(x, packed, out, bias, min_rows)
        return y + bad(max(x.numel() // x.shape[-1], min_rows), y)

    return op


def few_rows(monkeypatch, rows: int = 32) -> None:
    """Batch-invariance checks draw ``rows`` rows per layer, not up to 512: a kernel skewed on
    purpose (``skewed``) shifts every row it shifts, so a few blocks of rows show it; the sample
    size is for a real kernel that rounds otherwise in a few outputs of thousands."""
    import yggtree.runtime.packed as packed

    monkeypatch.setattr(packed, "MAX_SAMPLE_ROWS", rows)


def test_check_finds_the_smallest_invariant_padding(monkeypatch):
    """A kernel whose products of fewer than 4 rows round otherwise by their row count: 4 is
    the smallest invariant padding; one whose 8-row products do: invariant at 1 where no
    product runs 8 rows, else only when every product runs 8 rows; one that depends on the
    row's position: no padding is."""
    import yggtree.runtime.packed as packed

    m = tiny()
    pack_linears(m)
    real, widths = packed.packed_linear, range(1, 17)
    assert invariant_min_rows(m, widths) == 1 and padding_is_invariant(m, 1, widths)  # the real kernel
    few_rows(monkeypatch)
    monkeypatch.setattr(packed, "packed_linear", skewed(real, lambda r, y: 1e-3 * r if r < 4 else 0))
    assert [padding_is_invariant(m, r, widths) for r in (1, 2, 3, 4, 8)] == [False, False, False, True, True]
    assert padding_is_invariant(m, 1, (1,)) and padding_is_invariant(m, 2, (1, 2))  # one kernel run each
    assert invariant_min_rows(m, widths) == 4 and invariant_min_rows(m, widths, start=6) == 6
    monkeypatch.setattr(packed, "packed_linear", skewed(real, lambda r, y: 1e-3 * (r == 8)))
    assert invariant_min_rows(m, (1, 4)) == 1 and invariant_min_rows(m, (1, 4, 8)) == 8
    position = torch.arange(16.0)[:, None]
    monkeypatch.setattr(packed, "packed_linear", skewed(real, lambda r, y: 1e-3 * position[: y.shape[0]]))
    assert invariant_min_rows(m, (1, 4)) is None


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


@pytest.mark.slow
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
    from yggtree.offline.profile_padding import PADDING_ROWS, time_padding

    m = tiny()
    assert time_padding(m, warmup=0, repeats=1) == {"kernel": "torch", "min_rows": 1, "products": 0, "median_ms": {}}
    pack_linears(m)
    pad = time_padding(m, warmup=1, repeats=3)
    assert pad["min_rows"] in PADDING_ROWS and pad["products"] == len(packed_layers(m))
    assert list(pad["median_ms"]) == [str(r) for r in PADDING_ROWS]
    assert all(v > 0 for v in pad["median_ms"].values()) and (pad["warmup"], pad["repeats"]) == (1, 3)
    assert pad["invariant"] == {str(r): True for r in PADDING_ROWS} and pad["widths"] == [1]  # the real kernel
    assert pad["median_ms"][str(pad["min_rows"])] == min(pad["median_ms"].values())


def test_profile_never_records_a_non_invariant_padding(monkeypatch):
    """No padding is fastest, but its one-row products round otherwise than wider ones: the
    profile records that and chooses the fastest invariant padding; when none of its candidates
    is invariant, the smallest invariant padding; when no padding is, it refuses."""
    import yggtree.offline.profile_padding as profile_padding
    import yggtree.runtime.packed as packed
    from yggtree.errors import YggError
    from yggtree.offline.profile_padding import padding_line, time_padding

    m = tiny()
    pack_linears(m)
    real = packed.packed_linear

    def rounds(variants, warmup, repeats):  # the timings, fixed: no padding fastest, then by rows
        for f in variants.values():
            f()
        return {r: [1.0 + 0.5 * (int(r) > 1) + 0.01 * int(r)] * repeats for r in variants}

    monkeypatch.setattr(profile_padding, "time_rounds", rounds)
    few_rows(monkeypatch)
    monkeypatch.setattr(packed, "packed_linear", skewed(real, lambda r, y: 1e-3 * (r == 1)))
    pad = time_padding(m, warmup=1, repeats=3, widths=(6,))
    assert pad["invariant"] == {"1": False, "2": True, "4": True, "8": True} and pad["widths"] == [1, 6]
    assert pad["median_ms"]["1"] < min(v for r, v in pad["median_ms"].items() if r != "1")  # 1 was fastest
    assert pad["min_rows"] != 1 and pad["median_ms"][str(pad["min_rows"])] == min(
        v for r, v in pad["median_ms"].items() if pad["invariant"][r])
    assert "1: " in padding_line(pad) and "not batch-invariant" in padding_line(pad)
    monkeypatch.setattr(packed, "packed_linear", skewed(real, lambda r, y: 1e-3 * (r < 9)))
    pad = time_padding(m, warmup=0, repeats=1, widths=(1, 12))
    assert not any(pad["invariant"].values()) and pad["min_rows"] == 9
    position = torch.arange(16.0)[:, None]
    monkeypatch.setattr(packed, "packed_linear", skewed(real, lambda r, y: 1e-3 * position[: y.shape[0]]))
    with pytest.raises(YggError, match="not batch-invariant on this CPU"):
        time_padding(m, warmup=0, repeats=1, widths=(1, 4))


def test_engine_raises_a_variant_padding_and_speculates_exactly(tmp_path, monkeypatch, capsys):
    """A kernel whose one-row products differ from rows of wider ones (grossly here; by
    rounding on the EPYC CPU at 1536 -> 576): a speculative engine asked to pad to 1 row pads to
    2, says so in one line, and its greedy output is plain decoding's at that padding. Unchecked,
    it would keep 1 row and leave plain decoding."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint

    import yggtree.runtime.build as build
    import yggtree.runtime.packed as packed
    import yggtree.runtime.prepare as prepare
    from yggtree.runtime.engine import SamplingParams, TreeParams

    from safetensors.torch import load_file, save_file

    save_tiny_checkpoint(tmp_path / "m")
    w = load_file(tmp_path / "m" / "model.safetensors")  # larger weights: its greedy tokens vary
    save_file({k: v if "norm" in k else v * 15 for k, v in w.items()}, tmp_path / "m" / "model.safetensors",
              metadata={"format": "pt"})
    few_rows(monkeypatch)
    monkeypatch.setattr(packed, "packed_linear",
                        skewed(packed.packed_linear, lambda r, y: 0.5 * y.flip(-1) * (r == 1)))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)

    def engine(min_rows, drafter=None):
        return build.build_engine(build.EngineSpec(model=str(tmp_path / "m"), drafter=drafter, mode="reference",
                                                   max_context=64, prefill_chunk=4, tree=tree, min_rows=min_rows))[0]

    capsys.readouterr()
    spec = engine(1, "self")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "padding them to 2 rows" in err and min_rows_of(spec.target) == 2
    plain1, plain2 = engine(1), engine(2)
    assert capsys.readouterr().err == ""  # plain engines keep their padding: nothing to verify
    with monkeypatch.context() as mp:
        mp.setattr(prepare, "invariant_padding", lambda *a: None)
        unchecked = engine(1, "self")
    assert min_rows_of(unchecked.target) == 1
    params, left = SamplingParams(max_new_tokens=16), 0
    for prompt in ([5, 6, 7, 8], list(range(10, 22)), [3, 9, 27]):
        assert spec.generate(prompt, params).token_ids == plain2.generate(prompt, params).token_ids, prompt
        left += unchecked.generate(prompt, params).token_ids != plain1.generate(prompt, params).token_ids
    assert left > 0


def test_engine_trusts_the_profiles_check_only_where_it_covers_it(tmp_path, monkeypatch):
    """The profile checked its padding's invariance (threads, widths): an engine at those threads
    and within those widths does not check again at start (it cost ~1 s on the real model); one
    at another thread count, wider widths or without the record does."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint

    import yggtree.runtime.build as build
    import yggtree.runtime.prepare as prepare
    from yggtree.runtime.engine import TreeParams

    save_tiny_checkpoint(tmp_path / "m")
    checks = []
    monkeypatch.setattr(prepare, "invariant_padding", lambda target, widths, threads: checks.append((widths, threads)))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    t = torch.get_num_threads()

    def build_with(checked):
        build.build_engine(build.EngineSpec(model=str(tmp_path / "m"), drafter="self", mode="reference",
                                            max_context=64, prefill_chunk=4, tree=tree, min_rows=2,
                                            padding_checked=checked))
        return len(checks)

    assert build_with((t, (1, 4, 6))) == 0
    assert build_with(None) == 1
    assert build_with((t + 1, (1, 4, 6))) == 2
    assert build_with((t, (1, 4))) == 3 and checks[-1] == ((1, 6), t)


def test_profile_invariance_reads_only_a_recorded_invariant_choice(tmp_path):
    import json

    from yggtree.runtime.padding import profile_invariance

    def prof(pad, threads=2):
        p = tmp_path / "p.json"
        p.write_text(json.dumps({"hardware": {"threads": threads}, "packed_padding": pad}))
        return p

    ok = {"min_rows": 4, "invariant": {"1": False, "4": True}, "widths": [1, 8, 16]}
    assert profile_invariance(prof(ok)) == (2, (1, 8, 16))
    assert profile_invariance(prof(ok | {"min_rows": 1})) is None  # chosen, not invariant
    assert profile_invariance(prof(ok | {"min_rows": 9})) is None  # chosen outside the candidates
    assert profile_invariance(prof({"min_rows": 4})) is None  # an older profile: no record
