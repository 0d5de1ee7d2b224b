"""Modules no other test imported: streaming (characters split across tokens), bench (greedy
generation equals transformers', aggregation), offline/fit (isotonic curves, leave-one-out
errors, calibration edges and accepted lengths), all with exact expected values."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from yggtree.streaming import TextStream

pytestmark = pytest.mark.usefixtures("one_thread")

# ----------------------------------------------------------------------------- streaming


class ByteTokenizer:
    """Token i is byte i (what byte-level BPE does to characters outside its merges)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_holds_back_a_character_split_across_tokens():
    out = io.StringIO()
    s = TextStream(ByteTokenizer(), out)
    writes = []
    for chunk in ([ord("a")], [0xC3], [0xA9, ord("b")], [0xF0, 0x9F], [0x8C], [0xB3], [ord("c")]):
        s.push(chunk)
        writes.append(out.getvalue())
    # "é" is 2 bytes, the tree emoji 4: nothing of either is written before its last byte
    assert writes == ["a", "a", "aéb", "aéb", "aéb", "aéb\U0001f333", "aéb\U0001f333c"]
    s.close()
    assert out.getvalue() == "aéb\U0001f333c\n"


def test_stream_close_writes_an_unfinished_character_as_replacement():
    out = io.StringIO()
    s = TextStream(ByteTokenizer(), out)
    s.push([ord("x")])
    s.push([0xE2, 0x82])  # the first 2 of the euro sign's 3 bytes, then the end
    assert out.getvalue() == "x"
    s.close()
    assert out.getvalue() == "x\ufffd\n"


def test_stream_passes_an_invalid_byte_once_text_follows():
    out = io.StringIO()
    s = TextStream(ByteTokenizer(), out)
    s.push([0xFF])
    assert out.getvalue() == ""  # could be the start of a character: wait
    s.push([ord("A")])
    assert out.getvalue() == "\ufffdA"


# ----------------------------------------------------------------------------- bench


def test_interleave_and_aggregate_exact():
    from yggtree.bench import Timing, aggregate
    from yggtree.data import interleave

    prompts = [("mtbench/1", [1]), ("mtbench/2", [2]), ("mtbench/3", [3]), ("humaneval/1", [4])]
    assert [n for n, _ in interleave(prompts)] == ["mtbench/1", "humaneval/1", "mtbench/2", "mtbench/3"]
    t = [Timing([1, 2, 3, 4], total_s=2.0, prefill_s=0.5), Timing([5], total_s=1.0, prefill_s=0.25)]
    assert aggregate(t) == {
        "new_tokens": 5,
        "tok_s": 5 / 3.0,
        "ms_per_token": 1.5 / 3 * 1e3,  # the one-token request has no decode part
        "prefill_ms": 375.0,
    }


def test_bench_greedy_generation_equals_transformers(tmp_path):
    """bench's two systems on one tiny checkpoint: transformers' greedy generate and yggtree's
    engine give the same tokens, and the prompt logits agree."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint

    from yggtree.bench import hf_generate, hf_prompt_logits, load_hf_model, time_ygg, ygg_prompt_logits
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.loading import resolve_model

    save_tiny_checkpoint(tmp_path / "m")
    src = resolve_model(str(tmp_path / "m"))
    hf = load_hf_model(src, "float32")
    engine, _ = build_engine(EngineSpec(model=str(tmp_path / "m"), mode="reference", max_context=64,
                                        prefill_chunk=4))
    prompt = [5, 9, 11, 3, 17, 40, 41]
    got = time_ygg(engine, prompt, 20)
    assert got.tokens == hf_generate(hf, prompt, 20, engine.eos_ids)[: len(got.tokens)]
    assert got.total_s > 0 and 0 < got.prefill_s <= got.total_s
    torch.testing.assert_close(ygg_prompt_logits(engine.target, prompt, 4, 64),
                               hf_prompt_logits(hf, prompt), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- offline/fit


def test_isotonic_knots_pool_violators_exactly():
    from yggtree.offline.fit import isotonic_knots

    assert isotonic_knots([4], [2.5]) == ([4.0], [2.5])
    # 1, 3, 2, 4 at x 1..4: the violating pair (3, 2) pools to its mean 2.5
    assert isotonic_knots([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0]) == ([1.0, 2.0, 3.0, 4.0], [1.0, 2.5, 2.5, 4.0])
    # repeated x: one knot at their mean
    assert isotonic_knots([1, 1, 2], [1.0, 3.0, 5.0]) == ([1.0, 2.0], [2.0, 5.0])


def test_fit_curve_and_leave_one_out_errors_exact():
    from yggtree.offline.fit import fit_curve, loo_errors

    pts = [(1, 256, 10.0), (2, 256, 12.0), (4, 256, 16.0), (1, 512, 20.0), (4, 512, 26.0)]
    assert fit_curve(pts) == {"buckets": [256, 512], "xs": [[1.0, 2.0, 4.0], [1.0, 4.0]],
                              "ys": [[10.0, 12.0, 16.0], [20.0, 26.0]]}
    # bucket 256 is linear in W: leaving out W = 2 interpolates it exactly; bucket 512 has no
    # interior point
    (e,) = loo_errors(pts)
    assert e == {"bucket": 256, "width": 2, "ms": 12.0, "pred": 12.0, "rel": 0.0}
    bent = [(1, 256, 10.0), (2, 256, 15.0), (3, 256, 12.0)]  # leave out 15: interpolated 11
    assert loo_errors(bent)[0]["pred"] == 11.0 and loo_errors(bent)[0]["rel"] == pytest.approx(4 / 15)


def test_step_edges_and_measured_aal_on_a_hand_made_tree():
    """Root 0 with children 1 (token 5) and 2 (token 6), node 3 (token 7) under 1, node 4
    (token 8) under 3. The target's argmax: 5 after the root, 7 after node 1, 9 after node 3:
    edges 0->1 and 1->3 are accepted, 3->4 and 0->2 are not."""
    from types import SimpleNamespace

    from yggtree.offline.fit import measured_aal, step_edges
    from yggtree.runtime.tree import build_tree

    lp = [0.0, np.log(0.5), np.log(0.25), np.log(0.5 * 0.8), np.log(0.5 * 0.8 * 0.5)]
    tree = build_tree([0, 0, 0, 1, 3], [4, 5, 6, 7, 8], lp)
    kept = torch.tensor([0, 1, 2, 3, 4])
    rec = SimpleNamespace(tree=tree, kept=kept, kept_valid=torch.ones(5, dtype=torch.bool),
                          target_argmax=torch.tensor([5, 7, 0, 9, 0]))
    e = step_edges(rec, d_max=3)
    np.testing.assert_allclose(e["q"], [0.5, 0.25, 0.8, 0.5], rtol=1e-6)  # conditional probs
    assert e["edge"].tolist() == [True, False, True, False]
    assert e["path"].tolist() == [True, False, True, False]
    assert e["depth"].tolist() == [1, 1, 2, 3]
    # read as an EGT layout with W_d = 2: D = 1 is slots 0-2 (root + node 1 accepted: 2 tokens
    # with either W_v), D = 2 all 5 slots (W_v 2 keeps root + node 1: 2; W_v 5: root, 1, 3: 3)
    assert measured_aal(tree, e["path_ok"], wd=2, d_max=2, widths=[2, 5]) == [[2.0, 2.0], [2.0, 3.0]]


@pytest.mark.slow
def test_calibration_is_refused_once_the_drafter_weights_change(tmp_path, capsys):
    """The calibration identity includes the drafter's weights (sha256), not only their shapes:
    retrained weights of the same size keep the profile (timing identity) but refuse the
    calibration, naming what differs."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint
    from test_profile import PLAN

    from yggtree.cli import main
    from yggtree.errors import YggError
    from yggtree.plan import load_plan
    from yggtree.runtime.artifacts import pair_identity, timing_identity
    from yggtree.runtime.calibration import Calibration

    save_tiny_checkpoint(tmp_path / "model")
    save_tiny_checkpoint(tmp_path / "drafter")
    (tmp_path / "plan.yaml").write_text(PLAN.replace("drafter: self", "drafter: drafter"))
    plan = load_plan(tmp_path / "plan.yaml")
    args = ["calibrate", "--plan", str(tmp_path / "plan.yaml"), "--prompts", "1",
            "--max-new-tokens", "4", "--out-dir", str(tmp_path / "pair")]
    assert main(args) == 0
    capsys.readouterr()
    Calibration.load(tmp_path / "pair" / "calibration.json", plan)
    timing, pair = timing_identity(plan), pair_identity(plan)
    w = tmp_path / "drafter" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1  # one bit of the last weight: same size, other weights
    w.write_bytes(bytes(data))
    assert timing_identity(plan) == timing and pair_identity(plan) != pair
    with pytest.raises(YggError, match="drafter_weights"):
        Calibration.load(tmp_path / "pair" / "calibration.json", plan)
