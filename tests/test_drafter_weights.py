"""A drafter in a weight format of its own (``drafter_weights``: plan.py, runtime/prepare.py
``quantize_models``): the target keeps its format, the output stays the target's."""

from __future__ import annotations

import pytest
from test_quant_compiled import _w4a8_problem

from yggtree.errors import YggError
from yggtree.plan import validate_plan

BASE = {"name": "p", "target": "default", "drafter": "default"}


def test_a_plan_names_its_drafters_format_apart_from_the_targets():
    plan = validate_plan(BASE | {"drafter_weights": "w4a8"})
    assert plan.drafter_weights == "w4a8" and plan.weights is None
    assert validate_plan(BASE | {"drafter_weights": "int4"}).drafter_weights == "int4@32"  # spelled out
    # the target's own format, or absent: no field (the plan keeps the identity it had before the field)
    same = [validate_plan(BASE | extra) for extra in ({}, {"drafter_weights": "float32"})]
    assert all(p.drafter_weights is None and "drafter_weights" not in p.to_dict() for p in same)
    assert same[0].graph_hash() == same[1].graph_hash() != plan.graph_hash()
    assert validate_plan(BASE | {"weights": "w4a8", "drafter_weights": "w4a8"}).drafter_weights is None
    # a float drafter beside a quantized target is a format of its own too
    assert validate_plan(BASE | {"weights": "w4a8", "drafter_weights": "float32"}).drafter_weights == "float32"


@pytest.mark.parametrize("raw, words", [
    ({"name": "p", "target": "default", "drafter_weights": "w4a8"}, "has no drafter"),
    (BASE | {"drafter": "self", "drafter_weights": "w4a8"}, "drafter 'self' is the target's own weights"),
    (BASE | {"drafter_weights": "w5"}, "key 'drafter_weights'"),
    (BASE | {"drafter_weights": "gguf-native"}, "needs a GGUF drafter"),
])
def test_a_drafter_format_that_cannot_be_is_one_line(raw, words):
    with pytest.raises(YggError, match=words):
        validate_plan(raw)


@pytest.mark.parametrize("fmt", ["int8", pytest.param("w4a8", marks=pytest.mark.skipif(
    _w4a8_problem() is not None, reason=str(_w4a8_problem())))])
def test_a_quantized_drafter_speculates_for_a_float_target_exactly(fmt, tmp_path):
    """A float32 target with a drafter in ``fmt``: the drafter's linears are quantized, the target's
    stay float, and speculative decoding emits the float target's plain tokens."""
    from test_compile import save_tiny_checkpoint
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import SamplingParams, TreeParams
    from yggtree.runtime.quant import Int8Linear
    from yggtree.runtime.w4a8 import W4A8Linear

    save_tiny_checkpoint(tmp_path / "target", intermediate=64)  # every width a multiple of a 32-weight block
    save_tiny_checkpoint(tmp_path / "drafter", intermediate=64)
    common = dict(model=str(tmp_path / "target"), mode="reference", max_context=64, prefill_chunk=8)
    plain, _ = build_engine(EngineSpec(**common))
    spec, _ = build_engine(EngineSpec(**common, drafter=str(tmp_path / "drafter"), drafter_weights=fmt,
                                      tree=TreeParams(2, 3, 6, 2)))
    kind = {"int8": Int8Linear, "w4a8": W4A8Linear}[fmt]
    drafted = spec.drafter.graphs.model
    assert isinstance(drafted.layers[0].mlp.down_proj, kind) and isinstance(drafted.lm_head, kind)
    assert not any(isinstance(m, kind) for m in spec.target.modules())
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=16)).token_ids
        got = spec.generate(prompt, SamplingParams(max_new_tokens=16))
        assert got.token_ids == want and got.stats["aal"] > 1.0


def test_the_drafter_self_keeps_the_targets_format():
    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.prepare import check_spec

    with pytest.raises(YggError, match="drafter 'self' is the target's own weights"):
        check_spec(EngineSpec(drafter="self", drafter_weights="w4a8"))
    assert check_spec(EngineSpec(drafter="self", weights="w4a8", drafter_weights="w4a8")) == "w4a8"


def test_run_drafts_in_the_format_its_flag_names(tmp_path, capsys):
    """``yggtree run --drafter-weights FMT``: the flags' plan drafts in FMT, the output the float
    target's plain one; with ``--plan`` (which names its own) or a format that cannot be, one line."""
    import json

    from test_compile import save_tiny_checkpoint
    from yggtree.cli import main

    save_tiny_checkpoint(tmp_path / "target", intermediate=64)
    save_tiny_checkpoint(tmp_path / "drafter", intermediate=64)
    run = ["run", "--model", str(tmp_path / "target"), "--mode", "reference", "--max-context", "64",
           "--prefill-chunk", "8", "--raw", "--prompt", "t3 t4 t5", "--max-new-tokens", "6", "--json"]
    assert main(run + ["--no-speculate"]) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(run + ["--drafter", str(tmp_path / "drafter"), "--drafter-weights", "int8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == want and out["stats"]["speculative"]
    # refused in one line: with a plan (it names its own), a format that cannot be (with or without a
    # drafter named), a drafter's format where nothing drafts (a model without a shipped drafter)
    for argv, words in (
        (["run", "--prompt", "hi", "--plan", str(tmp_path / "none.yaml"), "--drafter-weights", "int8"],
         "--drafter-weights and --plan exclude each other"),
        (run + ["--drafter", str(tmp_path / "drafter"), "--drafter-weights", "w5"], "--drafter-weights: "),
        (run + ["--drafter-weights", "w5"], "--drafter-weights: "),
        (run + ["--drafter-weights", "int8"], "--drafter-weights names the drafter's format, but nothing drafts"),
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert main(run + ["--drafter-weights", "int8", "--no-speculate"]) == 0  # plain: no drafter to format
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
