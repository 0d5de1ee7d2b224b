"""A float32 target's KV cache in 16 bits (plan key ``kv_cache``, ``--kv-cache``;
yggtree.shapes.kv_cache_dtype, runtime.model.set_kv_dtype): the cache holds the keys and values
rounded once, attention reads them as float32 in every path (the grouped matmuls, the row-by-row
reference, the library kernel), greedy speculation stays plain decoding of the same engine, and
bad settings are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import need_kernel_library, sweep, tiny_model
from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams
from yggtree.runtime.aoti import block_key
from yggtree.runtime.model import _rows_attention, row_window, set_kv_dtype
from yggtree.shapes import TreeParams, kv_cache_dtype

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)], [1, 2])
TREE = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)


def tiny(seed=0):
    return tiny_model(hidden=64, max_pos=256, seed=seed)  # head dim 16: the library kernel takes it


def greedy(eng: Engine) -> list[list[int]]:
    return [eng.generate(p, SamplingParams(max_new_tokens=32)).token_ids for p in PROMPTS]


@pytest.mark.parametrize("native,kv", sweep([False, True], ["float16", "bfloat16"],
                                             unit=[(False, "float16"), (True, "bfloat16")]))
def test_speculation_over_a_16_bit_cache_is_its_plain_decoding(kv, native):
    """Reference mode, the reference row-by-row attention or the library kernel: the cache is
    allocated in the 16-bit dtype and holds each key rounded once (so not the float32 cache's
    values); a tree-speculating engine emits the plain engine's tokens."""
    if native:
        from yggtree.runtime.kernels import use_rows_attention

        need_kernel_library()
    cfg = dict(mode="reference", max_context=80, prefill_chunk=8)
    models = []
    for seed, kv_cache in ((0, kv), (1, None), (0, None)):
        m = tiny(seed)
        set_kv_dtype(m, kv_cache)
        if native:
            assert use_rows_attention(m) == len(m.layers)
        models.append(m)
    target, draft, float_target = models
    plain, float_plain = Engine(target, EngineConfig(**cfg)), Engine(float_target, EngineConfig(**cfg))
    assert target.kv.kv.dtype == getattr(torch, kv) and float_target.kv.kv.dtype == torch.float32
    want = greedy(plain)
    spec = Engine(target, EngineConfig(**cfg, tree=TREE), LMDrafter(draft, "reference"))
    assert greedy(spec) == want
    # the stored keys are the float32 ones rounded once
    float_plain.generate(PROMPTS[1], SamplingParams(max_new_tokens=4))
    plain.generate(PROMPTS[1], SamplingParams(max_new_tokens=4))
    n = len(PROMPTS[1])  # the prompt's slots: written by the same prefill on both
    torch.testing.assert_close(target.kv.kv[:1, :, :, :, :1], float_target.kv.kv[:1, :, :, :, :1].to(getattr(torch, kv)),
                               rtol=0, atol=0)
    assert not torch.equal(target.kv.kv[:, :, :, :, :n].float(), float_target.kv.kv[:, :, :, :, :n])


@pytest.mark.slow
def test_compiled_engine_over_a_16_bit_cache():
    """Performance mode (dynamo graphs: the cache write's rounding and the grouped prefill's
    float32 copy compiled in): the same greedy tokens as reference mode, speculative = plain."""
    ref_target = tiny()
    set_kv_dtype(ref_target, "float16")
    ref = Engine(ref_target, EngineConfig(mode="reference", max_context=80, prefill_chunk=8))
    target = tiny()
    set_kv_dtype(target, "float16")
    plain = Engine(target, EngineConfig(mode="performance", max_context=80, prefill_chunk=8))
    want = greedy(plain)
    assert want == greedy(ref)
    target2 = tiny()
    set_kv_dtype(target2, "float16")
    spec = Engine(target2, EngineConfig(mode="performance", max_context=80, prefill_chunk=8, tree=TREE),
                  LMDrafter(tiny(1), "performance"))
    assert greedy(spec) == want


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
def test_library_kernel_reads_a_16_bit_cache(kv):
    """yggtree::rows_attention with float32 queries over 16-bit K and V: the reference on the
    same values (to float32 rounding: its sums run in another order), each row its one-row call,
    the same at 1 and 2 threads; a 16-bit q over a float32 cache is refused."""
    need_kernel_library()
    op = torch.ops.yggtree.rows_attention
    gen = torch.Generator().manual_seed(0)
    b, w, h, hkv, d, c = 1, 5, 9, 3, 64, 96
    kv_all = torch.randn(2, b, c, hkv, d, generator=gen).to(kv)
    q = torch.randn(b, w, h, d, generator=gen)
    mask = torch.zeros(b, w, c, dtype=torch.bool)
    for r, n in enumerate([1, 20, 33, 70, 96]):
        mask[0, r, :n] = True
    mask[0, 3, 10:14] = False
    window, head = row_window(mask)
    got = op(q, kv_all[0], kv_all[1], head, window)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _rows_attention(q, kv_all[0], kv_all[1], head, window), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, op(q, kv_all[0].float(), kv_all[1].float(), head, window), rtol=0, atol=0)
    for r in range(w):
        one = op(q[:, r : r + 1], kv_all[0], kv_all[1], head[:, r : r + 1], window[:, r : r + 1])
        assert torch.equal(one[:, 0], got[:, r]), r
    torch.set_num_threads(2)
    try:
        assert torch.equal(op(q, kv_all[0], kv_all[1], head, window), got)
    finally:
        torch.set_num_threads(1)
    with pytest.raises(RuntimeError, match="in q's dtype"):
        op(q.bfloat16(), kv_all[0].float(), kv_all[1].float(), head, window)


def test_settings_parse_and_bad_ones_are_refused():
    assert kv_cache_dtype(None, "float32") is None and kv_cache_dtype("float32", "float32") is None
    assert kv_cache_dtype("bfloat16", "bfloat16") is None
    assert kv_cache_dtype("float16", "float32") == "float16"
    with pytest.raises(YggError, match="must be one of float32, float16, bfloat16, got 'fp8'"):
        kv_cache_dtype("fp8", "float32")
    with pytest.raises(YggError, match="a bfloat16 model keeps its cache in bfloat16"):
        kv_cache_dtype("float16", "bfloat16")
    with pytest.raises(YggError, match="a bfloat16 model keeps its cache in bfloat16"):
        kv_cache_dtype("float32", "bfloat16")


def test_plan_field():
    from yggtree.plan import validate_plan
    from yggtree.runtime.artifacts import pair_identity, timing_identity

    base = {"name": "q", "target": "default", "drafter": "self"}
    plain = validate_plan(base)
    assert plain.kv_cache is None and "kv_cache" not in plain.to_dict() and "kv_cache" not in timing_identity(plain)
    same = validate_plan({**base, "kv_cache": "float32"})
    assert same.kv_cache is None and same.hash() == plain.hash() and same.graph_hash() == plain.graph_hash()
    half = validate_plan({**base, "kv_cache": "float16"})
    assert half.kv_cache == "float16" and half.to_dict()["kv_cache"] == "float16"
    assert half.graph_hash() not in (plain.graph_hash(), validate_plan({**base, "kv_cache": "bfloat16"}).graph_hash())
    assert timing_identity(half)["kv_cache"] == "float16"  # a float32-cache profile does not price it
    assert pair_identity(half) == pair_identity(plain)  # an acceptance calibration serves either cache
    with pytest.raises(YggError, match="key 'kv_cache': KV cache dtype must be one of"):
        validate_plan({**base, "kv_cache": 16})
    with pytest.raises(YggError, match="key 'kv_cache': KV cache float16 with dtype bfloat16"):
        validate_plan({**base, "dtype": "bfloat16", "kv_cache": "float16"})


def test_engine_spec_builds_the_cache(tmp_path, capsys):
    """``EngineSpec.kv_cache`` (a plan's key, ``--kv-cache``) reaches the target's cache; the
    CLI refuses it beside a plan, and in a bfloat16 run, in one line."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint
    from yggtree.cli import main
    from yggtree.runtime.build import EngineSpec, build_engine

    save_tiny_checkpoint(tmp_path / "model", intermediate=64)
    eng, _ = build_engine(EngineSpec(model=str(tmp_path / "model"), mode="reference", max_context=64,
                                     prefill_chunk=8, kv_cache="bfloat16"))
    assert eng.target.kv.kv.dtype == torch.bfloat16
    with pytest.raises(YggError, match="KV cache float16 with dtype bfloat16"):
        build_engine(EngineSpec(model=str(tmp_path / "model"), dtype="bfloat16", kv_cache="float16"))
    capsys.readouterr()
    run = ["run", "--model", str(tmp_path / "model"), "--mode", "reference", "--max-context", "64",
           "--prefill-chunk", "8", "--raw", "--prompt", "t3 t4 t5", "--max-new-tokens", "3", "--drafter", "none"]
    for kv, said in (("float16", "float16"), (None, None)):  # what ran, in the stats and the summary
        assert main(run + ["--json"] + (["--kv-cache", kv] if kv else [])) == 0
        assert json.loads(capsys.readouterr().out)["stats"]["kv_cache"] == said
        assert main(run + (["--kv-cache", kv] if kv else [])) == 0
        assert ("float16 KV cache" in capsys.readouterr().err) == (kv is not None)
    assert main(["run", "--prompt", "hi", "--plan", str(tmp_path / "none.yaml"), "--kv-cache", "float16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-cache and --plan exclude each other" in err[0], err


def test_a_compiled_block_is_keyed_by_its_cache_dtype():
    """A compiled block reads and writes its cache input as the dtype it was compiled for, unchecked: a target
    over a float16 cache and a model of the same shapes over a float32 cache (an EAGLE head's block) must not
    share packages. They did: the head's prompt prefill ran the target's package on its float32 cache and
    filled it with values in the thousands (acceptance fell by a quarter; the output, verified, stayed exact).
    A self-drafter's twin keeps its cache in the weights' dtype, and so packages of its own."""
    target, head = tiny(), tiny(seed=1)
    assert block_key(target.layers[0]) == block_key(head.layers[0])
    set_kv_dtype(target, "float16")
    assert block_key(target.layers[0]) != block_key(head.layers[0])
    twin = target.shared_copy()
    assert block_key(twin.layers[0]) == block_key(head.layers[0])
    twin.setup_cache(1, 16)
    assert twin.kv.kv.dtype == torch.float32
