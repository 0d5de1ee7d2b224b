"""scripts/format_accuracy.py (issue #20 item 4) on tiny random-weight models: float32 agrees
with itself, every format yields an agreement record and a finite perplexity."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import load_script
from test_quant import gguf_blocks, tiny
from yggtree.runtime.model import set_kv_dtype
from yggtree.runtime.quant import quantize_linears
from yggtree.shapes import weight_format

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_agreement():
    fa = load_script("format_accuracy")
    a = fa.token_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert a == {"match": 5 / 6, "prefix_mean": 2.0, "identical": 1, "sequences": 2}


def test_formats_measured_against_float32_on_a_tiny_model():
    fa = load_script("format_accuracy")

    def load(fmt):
        m = tiny()
        if fmt == "bfloat16":  # a bfloat16 run: weights and activations
            return m.to(torch.bfloat16)
        name, group = weight_format(fmt, "float32")
        if name != "float32":
            quantize_linears(m, name, group, gguf_blocks(m) if name == "gguf-native" else None)
        return m

    prompts = [[5, 6, 7], [(3 * i) % 90 + 1 for i in range(11)]]
    chunks = [[(5 * i) % 97 for i in range(40)], [1, 2, 3, 4, 5, 6]]
    res = fa.measure(load, ["int8", "int4@32", "gguf-native", "bfloat16", "float32"], prompts, 12, chunks)
    assert list(res) == ["float32", "int8", "int4@32", "gguf-native", "bfloat16"]
    assert fa.run_dtype("bfloat16") == "bfloat16" and fa.run_dtype("int4@32") == "float32"
    assert res["float32"]["agreement"] == {"match": 1.0, "prefix_mean": 12.0, "identical": 2, "sequences": 2}
    for r in res.values():
        assert 0 <= r["agreement"]["match"] <= 1 and math.isfinite(r["perplexity"]) and r["perplexity"] > 1
    assert res["int4@32"]["perplexity"] != res["float32"]["perplexity"]


def test_a_16_bit_cache_entry():
    fa = load_script("format_accuracy")
    assert fa.split_entry("w4a8/kv=float16") == ("w4a8", "float16") and fa.split_entry("int8") == ("int8", None)
    assert fa.run_dtype("bfloat16/kv=bfloat16") == "bfloat16" and fa.run_dtype("float32/kv=float16") == "float32"

    def load(entry):
        fmt, kv = fa.split_entry(entry)
        m = tiny()
        set_kv_dtype(m, kv)
        return m

    prompts = [[5, 6, 7], [(3 * i) % 90 + 1 for i in range(11)]]
    chunks = [[(5 * i) % 97 for i in range(40)]]
    res = fa.measure(load, ["float32/kv=float16", "float32/kv=bfloat16"], prompts, 12, chunks)
    assert list(res) == ["float32", "float32/kv=float16", "float32/kv=bfloat16"]
    ppl = {k: r["perplexity"] for k, r in res.items()}
    assert len(set(ppl.values())) == 3 and all(math.isfinite(p) for p in ppl.values())
