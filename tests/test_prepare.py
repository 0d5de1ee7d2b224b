"""runtime/prepare.py: the one preparation of an engine's models (build_engine, yggtree compile, the
profiler's product timing): what it sets on the target and the drafter, and that an engine built
from a spec runs the models prepared from it."""

from __future__ import annotations

import pytest
import torch

from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.model import Attention, attention_rows
from yggtree.runtime.packed import min_rows_of
from yggtree.runtime.prepare import prepare_models
from yggtree.shapes import TreeParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint

    d = tmp_path_factory.mktemp("prepare") / "m"
    save_tiny_checkpoint(d)
    return d


def test_prepared_models_carry_every_setting_of_the_spec(model_dir):
    spec = EngineSpec(model=str(model_dir), drafter="self", mode="reference", max_context=64, prefill_chunk=4,
                      tree=TreeParams(2, 3, 6, 2), min_rows=2, kv_cache="bfloat16")
    p = prepare_models(spec, tokenizer=False)
    assert p.tokenizer is None  # a self-drafter needs no vocabulary check
    assert p.target.kv_dtype == torch.bfloat16 and p.drafter.graphs.model.kv_dtype is None
    assert p.min_rows == min_rows_of(p.target) and (p.min_rows is None or p.min_rows >= 2)
    assert {m.invariant_rows for m in p.target.modules() if isinstance(m, Attention)} == {attention_rows(4)}
    plain = prepare_models(EngineSpec(model=str(model_dir), mode="reference", pack=False))
    assert plain.drafter is None and plain.tokenizer is not None and plain.min_rows is None


def test_an_engine_runs_the_models_prepared_from_its_spec(model_dir):
    spec = EngineSpec(model=str(model_dir), drafter="self", mode="reference", max_context=64, prefill_chunk=4,
                      tree=TreeParams(2, 3, 6, 2), min_rows=2)
    engine, tok = build_engine(spec)
    p = prepare_models(spec)
    assert min_rows_of(engine.target) == p.min_rows and tok is not None
    assert engine.n_slots == engine.envelope.slots(64) == 64 + 7 + 1  # context, largest tree (1 + 3 * 2), scratch


def test_a_drafter_computes_row_by_row_where_the_library_attention_reads_only_visible_slots():
    """A drafter's calls up to a prefill chunk take the row attention only where its layers run the
    library's kernel (which reads each row's visible slots): elsewhere the grouped products over
    the context bucket stay."""
    from helpers import tiny_model
    from yggtree.runtime.prepare import drafter_rows

    def rows(m):
        return {a.invariant_rows for a in m.modules() if isinstance(a, Attention)}

    torch_attention = tiny_model(hidden=32, max_pos=64)
    drafter_rows(torch_attention, 8)
    assert rows(torch_attention) == {1}
    library = tiny_model(hidden=32, max_pos=64)
    for a in library.modules():
        if isinstance(a, Attention):
            a.native_rows = "rows"
    drafter_rows(library, 8)
    assert rows(library) == {attention_rows(8, native=True)} == {8}


def test_the_drafter_runs_the_targets_attention_kernel():
    """The attention kernel is chosen per KV cache dtype, and a compiled plan records one (the
    target's) for both models' packages: a drafter whose own cache chose the other kernel runs the
    target's; one on torch's attention is left so."""
    from helpers import tiny_model
    from yggtree.runtime.model import native_attention
    from yggtree.runtime.prepare import drafter_attention

    def on(kernel):
        m = tiny_model(hidden=32, max_pos=64)
        for a in m.modules():
            if isinstance(a, Attention):
                a.native_rows = kernel
        return m

    drafter = on("rows")
    drafter_attention(drafter, on("tree"))
    assert native_attention(drafter) == "tree"
    drafter = on(None)
    drafter_attention(drafter, on("tree"))
    assert native_attention(drafter) is None
