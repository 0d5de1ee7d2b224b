"""Quantized weight formats (yggtree.runtime.quant): the kernels' products, their batch
invariance at the default model's shapes, GGUF blocks represented exactly, greedy tree
speculation equal to plain decoding in every format, and bad input refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import sweep, tiny_model
from yggtree.errors import YggError
from yggtree.runtime.model import Transformer
from yggtree.runtime.quant import (
    Int4Codes, Int4Linear, Int8Linear, check_batch_invariant, check_kernel, dequantize, gguf_codes,
    quant_layers, quantize_int4, quantize_linears,
)
from yggtree.shapes import weight_format

pytestmark = pytest.mark.usefixtures("one_thread")

try:
    check_kernel("int8", torch.float32)
    check_kernel("int4", torch.float32)
except YggError as e:  # pragma: no cover - a torch without the CPU kernels
    pytest.skip(str(e), allow_module_level=True)

# (in, out) of the default model's products: q/k/v fused, o, gate/up fused, down, the LM head
MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
FORMATS = ["int8", "int4@32", "int4@64", "gguf-native"]


def tiny(seed=0) -> Transformer:
    """A random model whose widths the int4 kernel runs (K a multiple of 64); the vocabulary of
    97 is not a multiple of 16, so the head exercises the padded output rows."""
    return tiny_model(hidden=64, max_pos=256, seed=seed)


def gguf_blocks(m: Transformer) -> dict[str, tuple[str, torch.Tensor]]:
    """What loading.gguf_raw_weights returns for ``m`` written as a GGUF file like the embedded
    model's (blocks Q4_1, the tied embedding Q8_0), with the attention in Q4_0 to cover it."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    out = {}
    for name, w in m.state_dict().items():
        if w.dim() != 2:
            continue
        kind = T.Q8_0 if name == "embed_tokens.weight" else T.Q4_0 if "self_attn" in name else T.Q4_1
        out[name] = (kind.name, torch.from_numpy(quantize(w.numpy(), kind)))
    return out


def quantized(fmt: str, seed: int = 0, model: Transformer | None = None) -> Transformer:
    """``model`` (default: ``tiny(seed)``) in format ``fmt``, every linear of it quantized."""
    m = tiny(seed) if model is None else model
    name, group = weight_format(fmt, "float32")
    raw = gguf_blocks(m) if name in ("gguf-native", "w4a8") else None
    assert quantize_linears(m, name, group, raw) == 7 * len(m.layers) + 1
    return m


@pytest.mark.parametrize("kind,dtype", sweep(["int8", "int4"], [torch.float32, torch.bfloat16],
                                              unit=[("int4", torch.bfloat16)]))
def test_kernel_rows_are_batch_invariant_at_the_model_shapes(kind, dtype):
    """Row i of an M-row product is bitwise the 1-row product of row i, M = 1..40: what makes a
    verified tree node's logits the ones a plain step computes."""
    gen = torch.Generator().manual_seed(0)
    for k, n in MODEL_SHAPES:
        if kind == "int8":
            lin = Int8Linear(torch.randn(n, k, generator=gen), None, dtype)
        else:  # codes drawn directly: no float copy of the 49152 x 576 head
            g = 32
            codes = Int4Codes(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                              torch.rand(n, k // g, generator=gen) / 8, torch.randn(n, k // g, generator=gen) / 8)
            lin = Int4Linear([codes], None, dtype)
        x = torch.randn(40, k, generator=gen).to(dtype)
        rows = [lin(x[i : i + 1]) for i in range(40)]
        for m in range(1, 41):
            y = lin(x[:m])
            assert all(torch.equal(y[i : i + 1], rows[i]) for i in range(m)), (k, n, m)
        check_batch_invariant(torch.nn.Sequential(lin), 16)


def _bf16_product_bound(y, x, w, b):
    """The kernels' products are x and the scales in bfloat16, accumulated in float32, the result
    rounded to bfloat16, then the bias added in float32: each output within 1/2 bfloat16 ulp
    (2^-8 relative) of the exact product of the rounded inputs, plus float32 accumulation (2^-16
    of sum |x w|, K <= 128) and the bias's addition (2^-23 relative)."""
    xb = x.bfloat16().double()
    xw = torch.nn.functional.linear(xb, w.double())
    ref = xw if b is None else xw + b.double()
    bound = 2 ** -8 * xw.abs() + 2 ** -16 * (xb.abs() @ w.double().abs().T) + 2 ** -23 * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("bias", [False, True])
def test_products_are_the_dequantized_weights_product(bias):
    """Whatever the run's dtype, a quantized product is the kernel's on bfloat16 activations and
    scales, cast to the run's dtype: a float32 run computes bitwise what a bfloat16 run does
    (then the bias in float32), within bfloat16 rounding of the dequantized weights' product."""
    torch.manual_seed(1)
    w, b = torch.randn(97, 128), torch.randn(97) if bias else None
    x = torch.randn(2, 3, 128)
    lin8 = Int8Linear(w, b, torch.float32)
    y = lin8(x)
    assert y.dtype == torch.float32 and lin8.scales.dtype == torch.bfloat16
    y0 = Int8Linear(w, None, torch.float32)(x)
    assert torch.equal(y0, Int8Linear(w, None, torch.bfloat16)(x.bfloat16()).float())
    assert torch.equal(y, y0 if b is None else y0 + b)
    _bf16_product_bound(y, x, lin8.qweight.float() * lin8.scales.float()[:, None], b)
    for g in (32, 64, 128):
        codes = quantize_int4(w, g)
        assert codes.group == g and int(codes.q.max()) <= 15
        assert (dequantize([codes]) - w).abs().max() <= codes.scale.max() / 2 + 1e-6  # within half a step
        lin4 = Int4Linear([codes], b, torch.float32)
        assert lin4.packed.shape == (1, 112, 64)  # 97 rows padded to 112
        y = lin4(x)
        assert y.shape == (2, 3, 97) and y.dtype == torch.float32
        y0 = Int4Linear([codes], None, torch.float32)(x)
        assert torch.equal(y0, Int4Linear([codes], None, torch.bfloat16)(x.bfloat16()).float())
        assert torch.equal(y, y0 if b is None else y0 + b)
        rounded = Int4Codes(codes.q, codes.scale.bfloat16().float(), codes.zero.bfloat16().float())
        _bf16_product_bound(y, x, dequantize([rounded]), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_run_as_llama_cpp_blocks_with_bfloat16_scales(kind, dtype):
    """The planes hold the GGUF blocks exactly: dequantized they are gguf's (llama.cpp's)
    float32 weights bit for bit. The kernel multiplies by (q - 8) * scale + zero with the scale
    and zero rounded to bfloat16 (one fused rounding to float32), its output rounded to
    bfloat16 (an identity input reads the weights back so), in float32 and bfloat16 runs alike;
    a Q8_0 weight's two planes are summed in the run's dtype."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize, quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = quantize(w, T[kind])
    want = torch.from_numpy(gguf_dequantize(raw, T[kind]).reshape(48, 96).copy())
    planes = gguf_codes(kind, torch.from_numpy(raw))
    assert len(planes) == (2 if kind == "Q8_0" else 1) and all(p.group == 32 for p in planes)
    assert torch.equal(dequantize(planes), want)
    read = 0
    for c in planes:
        s, z = (t.bfloat16().double().repeat_interleave(32, 1) for t in (c.scale, c.zero))
        read = read + ((c.q.double() - 8) * s + z).float().bfloat16().to(dtype)
    assert torch.equal(Int4Linear(planes, None, dtype)(torch.eye(96, dtype=dtype)).T, read)


# unit: the int8 kernel, and the int4 kernel on gguf-native's planes (groups of 32; quantize_int4 at
# groups of 32, 64 and 128: test_products_are_the_dequantized_weights_product)
@pytest.mark.parametrize("fmt", sweep(FORMATS, unit=[("int8",), ("gguf-native",)]))
def test_quantized_engine_speculates_exactly(fmt):
    """Greedy tree speculation on a quantized target (and a quantized drafter) emits plain
    decoding's tokens in every format, and the format changes the model (it is not float)."""
    from yggtree.runtime.drafters import LMDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    target = quantized(fmt)
    assert not any(type(m) is torch.nn.Linear for m in target.layers.modules())
    check_batch_invariant(target, 8)
    plain = Engine(target, EngineConfig(mode="reference", max_context=80, prefill_chunk=8))
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    spec = Engine(target, EngineConfig(mode="reference", max_context=80, prefill_chunk=8, tree=tree),
                  LMDrafter(quantized(fmt, seed=1), "reference"))
    float_plain = Engine(tiny(), EngineConfig(mode="reference", max_context=80, prefill_chunk=8))
    differs = False
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)], [1, 2]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids
        assert spec.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids == want, prompt
        differs |= float_plain.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids != want
    assert differs or fmt == "int8"  # 4-bit weights move a random tiny model's argmax somewhere


def test_fused_layers_replace_their_parts():
    m = quantized("int4@32")
    for b in m.layers:
        assert isinstance(b.self_attn.qkv, Int4Linear) and b.self_attn.qkv.out_features == 64 + 2 * 32
        assert b.self_attn.q_proj is None and b.mlp.gate_proj is None and isinstance(b.mlp.down_proj, Int4Linear)
    assert isinstance(m.lm_head, Int4Linear) and type(m.embed_tokens) is torch.nn.Embedding
    assert len(quant_layers(m)) == 4 * len(m.layers) + 1
    assert quantize_linears(m, "int8") == 0  # nothing float is left


def test_gguf_native_keeps_float_tensors_float():
    m = tiny()
    raw = gguf_blocks(m)
    raw["layers.0.mlp.down_proj.weight"] = ("F32", m.layers[0].mlp.down_proj.weight)
    assert quantize_linears(m, "gguf-native", raw=raw) == 7 * len(m.layers)
    assert type(m.layers[0].mlp.down_proj) is torch.nn.Linear


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("weights, dtype, match", [
    ("int3", "float32", "unknown weight format 'int3'"),
    ("int4@16", "float32", "runs groups of 32, 64, 128, 256 columns, not '16'"),
    ("int4@x", "float32", "not 'x'"),
    ("int8@32", "float32", "only int4 takes a group size"),
    ("bfloat16", "float32", "float weights run in the activations' dtype"),
])
def test_bad_formats_are_refused_in_one_line(weights, dtype, match):
    with pytest.raises(YggError, match=match) as e:
        weight_format(weights, dtype)
    assert "\n" not in str(e.value)


def test_formats_parse():
    assert weight_format(None, "bfloat16") == ("bfloat16", None)
    assert weight_format("float32", "float32") == ("float32", None)
    assert weight_format("int4", "float32") == ("int4", 32)
    assert weight_format("int4@128", "bfloat16") == ("int4", 128)
    assert weight_format("gguf-native", "float32") == ("gguf-native", None)


def test_group_not_dividing_a_width_is_refused():
    with pytest.raises(YggError, match=r"int4@128: the group size does not divide the input width 64 "
                                       r"of layers.0.self_attn.qkv"):
        quantize_linears(tiny(), "int4", 128)


def test_gguf_native_needs_gguf_blocks(tmp_path):
    from yggtree.runtime.loading import ModelSource, gguf_raw_weights

    with pytest.raises(YggError, match="gguf-native need a GGUF model"):
        quantize_linears(tiny(), "gguf-native")
    with pytest.raises(YggError, match="gguf-native need a GGUF model, .* is a hf directory"):
        gguf_raw_weights(ModelSource(tmp_path, "hf"), tiny().cfg)
    with pytest.raises(YggError, match="stored as Q6_K; the int4 kernel runs Q4_0, Q4_1 and Q8_0"):
        gguf_codes("Q6_K", torch.zeros(4, 210, dtype=torch.uint8), "lm_head.weight")


def test_missing_kernel_is_refused(monkeypatch):
    import yggtree.runtime.quant as q

    def broken(*a, **k):
        raise RuntimeError("_weight_int4pack_mm_cpu: not compiled for this CPU\nmore")

    monkeypatch.setattr(q.Int4Linear, "forward", broken)
    with pytest.raises(YggError, match=r"^weights int4: this torch/CPU cannot run aten._weight_int4pack_mm_for_cpu "
                                       r"on bfloat16 activations \(_weight_int4pack_mm_cpu: not compiled"):
        quantize_linears(tiny(), "int4", 32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_format_this_machine_cannot_run_is_refused_before_loading(fmt, tmp_path, monkeypatch, capsys):
    """`yggtree run --weights FMT` where the kernel does not run (here: made to fail) says so in
    one line and exits 1 before any model loads."""
    pytest.importorskip("transformers")
    import yggtree.runtime.loading as loading
    import yggtree.runtime.prepare as prepare
    import yggtree.runtime.quant as q
    from test_compile import save_tiny_checkpoint
    from yggtree.cli import main

    def no_kernel(self, x):
        raise RuntimeError("the kernel is not compiled for this CPU\nsecond line")

    save_tiny_checkpoint(tmp_path / "model", intermediate=64)
    monkeypatch.setattr(q.Int8Linear if fmt == "int8" else q.Int4Linear, "forward", no_kernel)
    for where in (loading, prepare):  # prepare binds load_model by name
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    argv = ["run", "--model", str(tmp_path / "model"), "--raw", "--prompt", "t5 t6", "--max-new-tokens", "2",
            "--mode", "reference"]
    assert main([*argv, "--weights", fmt]) == 1
    name = "_weight_int8pack_mm" if fmt == "int8" else "_weight_int4pack_mm_for_cpu"
    assert capsys.readouterr().err == (f"yggtree: error: weights {fmt}: this torch/CPU cannot run aten.{name} "
                                       "on bfloat16 activations (the kernel is not compiled for this CPU)\n")


def test_a_kernel_that_is_not_batch_invariant_refuses_speculation(monkeypatch):
    m = quantized("int8")
    real = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: real(self, x) * (1 + 1e-6 * (x.shape[0] > 1)))
    with pytest.raises(YggError, match=r"Int8Linear kernel of the target is not batch-invariant on this CPU "
                                       r"\(row 0 of a 4-row product differs"):
        check_batch_invariant(m, 4)


def test_plan_field(tmp_path):
    from yggtree.plan import validate_plan
    from yggtree.runtime.artifacts import GRAPH_SOURCES

    base = {"name": "q", "target": "default", "drafter": "self"}
    plain = validate_plan(base)
    assert plain.weights is None and "weights" not in plain.to_dict()
    same = validate_plan({**base, "weights": "float32"})
    assert same.weights is None and same.hash() == plain.hash() and same.graph_hash() == plain.graph_hash()
    q4 = validate_plan({**base, "weights": "int4"})
    assert q4.weights == "int4@32" and q4.to_dict()["weights"] == "int4@32"
    assert q4.graph_hash() != plain.graph_hash() and q4.graph_hash() != validate_plan({**base, "weights": "int8"}).graph_hash()
    assert validate_plan({**base, "weights": "gguf-native"}).weights == "gguf-native"
    with pytest.raises(YggError, match="key 'weights': unknown weight format"):
        validate_plan({**base, "weights": "fp8"})
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(YggError, match="key 'weights': gguf-native needs a GGUF target"):
        validate_plan({**base, "target": str(hf), "weights": "gguf-native"})
    assert "quant.py" in GRAPH_SOURCES and "w4a8.py" in GRAPH_SOURCES


def test_speculation_with_quantized_weights_is_plain_decoding(tmp_path, capsys):
    """A speculative engine with int8 weights emits the same format's plain decoding token for
    token (row-by-row attention over a logical window, model._rows_attention; the real model in
    every format: docs/results.md, issue #20) and no longer warns that it might not."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.shapes import TreeParams

    save_tiny_checkpoint(tmp_path / "model", intermediate=64)
    spec = dict(model=str(tmp_path / "model"), mode="reference", max_context=64, prefill_chunk=8, weights="int8")
    capsys.readouterr()
    plain, _ = build_engine(EngineSpec(**spec))
    fast, _ = build_engine(EngineSpec(**spec, drafter="self", tree=TreeParams(2, 3, 6, 2)))
    assert "note: speculative output" not in capsys.readouterr().err
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        got = fast.generate(prompt, SamplingParams(max_new_tokens=24))
        assert got.token_ids == want and got.stats["verify_calls"] < len(want), prompt  # trees verified
