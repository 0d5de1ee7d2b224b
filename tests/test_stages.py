"""Stage scheduling: execution plans, their dependency checks, and the ahead-of-time tail and head
draft (exact in greedy, lossless in sampling, the picked-up head equal to a head call, both
caches equal to a causal recompute afterwards)."""

from __future__ import annotations

import os

import pytest
import torch

from yggtree.cli import main as cli_main
from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.schedule import PLANS, resolve_plan, usable_cores

from helpers import assert_cache_equals_causal, perturbed, sweep
from test_engine import PROMPTS, TREES, tiny
from test_lossless_steps import (PROMPT, TREES as SMALL_TREES, chi_square_p, exact_sequences,
                                 sample_counts, target_and_drafter)

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(target, tree, drafter, stages, lookup=0, max_context=200):
    cfg = EngineConfig(mode="reference", max_context=max_context, prefill_chunk=16, tree=tree,
                       lookup=lookup, stages=stages)
    return Engine(target, cfg, drafter)


def counting(drafter):
    """``drafter`` whose head calls are counted in ``drafter.heads``."""
    real = drafter.head
    drafter.heads = 0

    def head(*args):
        drafter.heads += 1
        return real(*args)

    drafter.head = head
    return drafter


# ----------------------------------------------------------------------------- plans


def test_named_plans_resolve():
    for name in (n for n in PLANS if n != "overlap" or usable_cores() >= 2):
        p = resolve_plan(name, True)
        assert p.name == name and (p.ahead, p.overlap) == (name == "ahead", name == "overlap")
    assert resolve_plan("auto", True, recorded="ahead").name == "ahead"
    assert resolve_plan("ahead", False).name == "plain"  # nothing to draft: one plan


@pytest.mark.parametrize("name,message", [
    ("bogus", "unknown stage plan 'bogus'"),
    ("plain", "unknown stage plan 'plain'"),
    ("verify,accept,commit", "unknown stage plan 'verify,accept,commit'"),
])
def test_bad_plans_are_refused_in_one_line(name, message):
    with pytest.raises(YggError, match=message) as e:
        resolve_plan(name, True)
    assert "\n" not in str(e.value)


def test_a_thread_count_above_the_cores_is_refused():
    with pytest.raises(YggError, match="exceeds this machine's"):
        resolve_plan("sequential", True, threads=(os.cpu_count() or 1) + 1)
    with pytest.raises(YggError, match="threads must be"):
        resolve_plan("sequential", True, threads=-1)


@pytest.mark.parametrize("args,message", [
    (["--stages", "bogus"], "unknown stage plan 'bogus'"),
    (["--stages", "verify,accept,commit"], "unknown stage plan"),
    (["--threads", str((os.cpu_count() or 1) + 1)], "exceeds this machine's"),
    (["--stages", f"overlap@{os.cpu_count() or 1}+1"], "exceeds this machine's"),
    (["--stages", "sequential@1+1"], "has no drafter worker"),
])
def test_cli_refuses_bad_stage_input_in_one_line(capsys, args, message):
    code = cli_main(["run", "--prompt", "hi", "--drafter", "self", *args])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and err.count("\n") == 1, err


def test_plain_engine_runs_the_one_stage_plan_and_reports_it():
    eng = Engine(tiny(), EngineConfig(mode="reference", max_context=200, prefill_chunk=16, stages="ahead"))
    res = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=8))
    assert res.stats["stages"] == "plain" and res.stats["verify_calls"] == 7


# ----------------------------------------------------------------------------- ahead-of-time drafting


@pytest.fixture(scope="module")
def plain_outputs(tiny_plain):
    return [tiny_plain(p, 40) for p in PROMPTS]


@pytest.mark.parametrize("tree,kind,lookup", sweep(
    ["chain", "egt", "wide-prune"], ["self", "other-lm", "eagle"], [0, 2],
    unit=[("chain", "self", 0), ("egt", "other-lm", 2), ("wide-prune", "eagle", 2)]))
def test_ahead_greedy_equals_plain_and_picks_up_every_head(plain_outputs, tree, kind, lookup):
    target = tiny()
    if kind == "eagle":
        drafter = EagleDrafter.random(target, "reference", max_depth=4, seed=1)
    else:
        drafter = LMDrafter(target.shared_copy() if kind == "self" else tiny(seed=1, std=0.25), "reference")
    eng = engine(target, TREES[tree], counting(drafter), "ahead", lookup=lookup)
    for i, p in enumerate(PROMPTS):
        drafter.heads = 0
        res = eng.generate(p, SamplingParams(max_new_tokens=40))
        assert res.token_ids == plain_outputs[i], f"prompt {i}"
        s = res.stats
        assert s["stages"] == "ahead" and s["stage_ms"]["ahead"] > 0
        # every step but the last drafts its successor's head ahead of time: one head call only
        assert s["ahead_calls"] == s["verify_calls"] - 1
        assert drafter.heads == 1 and s["resyncs"] == 0


@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_picked_up_head_equals_a_head_call(kind, monkeypatch):
    """After a step of the ahead plan, the head it picked up (tokens and log-probs) is what a
    head call at the next root returns (which also rewrites the root's drafter entry)."""
    target = tiny()
    if kind == "eagle":
        drafter = EagleDrafter.random(target, "reference", max_depth=4, seed=1)
    else:
        drafter = LMDrafter(tiny(seed=1, std=0.25), "reference")
    eng = engine(target, TREES["egt"], drafter, "ahead")
    from yggtree.runtime import stages as st_mod

    picked = []
    real_head = st_mod.head

    def spy(eng_, req, st):
        pending = req.ahead_head
        got = real_head(eng_, req, st)
        if pending is not None:
            fresh = eng_.drafter.head(st.root, st.L, eng_.envelope.top_k)
            picked.append((pending, fresh))
        return got

    monkeypatch.setattr(st_mod, "head", spy)
    eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=30))
    assert len(picked) >= 3
    for pending, fresh in picked:
        assert torch.equal(pending.token, fresh.token)
        torch.testing.assert_close(pending.logp, fresh.logp, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_ahead_sampling_is_lossless(tree):
    target, drafter = target_and_drafter()
    exact = exact_sequences(target.shared_copy(), PROMPT, 4, 1.0, 1.0)
    eng = Engine(target, EngineConfig(mode="reference", max_context=64, prefill_chunk=4,
                                      tree=SMALL_TREES[tree], stages="ahead"), drafter)
    counts, seen = sample_counts(eng, 1.0, 1.0)
    assert seen["multi_step"] > 500
    assert chi_square_p(counts, exact) > 1e-3


def test_both_caches_after_ahead_steps_equal_a_causal_recompute():
    """Partial acceptances under the ahead plan: the target's and the drafter's cache rows of
    the committed sequence equal plain causal forwards over it (the drafter's rows come from
    the ahead call's tail rows and the leaf's head row, moved by ``take``)."""
    target, near = tiny(seed=0), perturbed(tiny(seed=0))
    drafter = LMDrafter(near, "reference")
    eng = engine(target, TreeParams(3, 3, 7, 3), drafter, "ahead", max_context=120)
    prompt = [(7 * i) % 90 + 3 for i in range(19)]
    roots = []
    res = eng.generate(prompt, SamplingParams(max_new_tokens=30), on_step=lambda r: roots.append(r.committed))
    hist = res.stats["accept_by_position"]
    assert hist[0] > 0 and hist[-1] < 1  # partial acceptances happened
    # rows up to the last step's root are final in both caches (the drafter holds the root too)
    committed = (prompt + res.token_ids)[: roots[-1] + 1]
    for model, ref in ((target, tiny(seed=0)), (near, near.shared_copy())):
        assert_cache_equals_causal(model, ref, committed)


@pytest.mark.parametrize("kind,lookup,temperature", sweep(
    ["near", "other-lm"], [0, 2], [0.0, 0.8],
    unit=[("near", 0, 0.0), ("other-lm", 2, 0.8)]))
def test_ahead_and_overlap_equal_the_sequential_step(kind, lookup, temperature):
    """The ahead and overlap plans are the sequential step plus stages that touch the drafter
    alone: with an LM drafter they draft the same trees and draw exactly the uniforms the
    sequential plan draws (one per verified node), so one seed gives the same tokens and the same
    acceptance at every step (the overlap plan over used and discarded guesses: a near drafter's
    greedy guesses hit). An EAGLE head's used guess may change later proposals (design.md
    section 9): its plans are checked against plain decoding, in greedy."""
    plans = ("sequential", "ahead", "overlap@1+1") if usable_cores() >= 2 else ("sequential", "ahead")
    target = tiny()
    runs = {}
    for stages in plans:
        drafter = LMDrafter(perturbed(tiny(seed=0)) if kind == "near" else tiny(seed=1, std=0.25), "reference")
        eng = engine(target, TREES["egt"], drafter, stages, lookup=lookup)
        runs[stages] = []
        for p in PROMPTS:
            accepted = []
            res = eng.generate(p, SamplingParams(30, temperature, 0.95, seed=7),
                               on_step=lambda r: accepted.append(r.n_accepted))
            runs[stages].append((res.token_ids, accepted))
    for stages in plans[1:]:
        assert runs[stages] == runs["sequential"], stages
    if kind == "near" and temperature == 0 and len(plans) == 3:
        assert res.stats["speculation"]["hits"] > 0  # the overlap plan's last request used guesses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_ahead_compiled_equals_plain_with_no_recompiles(plain_outputs, kind):
    """Performance mode: the ahead call's 2 W_v graphs are built at warm-up; decoding then never
    compiles (the loop runs under fail_on_recompile) and greedy output equals plain decoding."""
    from torch._dynamo.utils import counters

    model = tiny()
    tp = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    if kind == "eagle":
        drafter = EagleDrafter.random(model, "performance", max_depth=3, seed=1)
    else:
        drafter = LMDrafter(tiny(seed=1, std=0.25), "performance")
    cfg = EngineConfig(mode="performance", max_context=200, prefill_chunk=16, tree=tp, stages="ahead")
    eng = Engine(model, cfg, drafter)
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    for i, p in enumerate(PROMPTS):
        res = eng.generate(p, SamplingParams(max_new_tokens=40))
        assert res.token_ids == plain_outputs[i]
        assert res.stats["ahead_calls"] > 0
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles


@pytest.mark.parametrize("kind", sweep(["self", "other-lm", "eagle"], unit=[("self",), ("eagle",)]))
def test_ahead_with_a_policy_mixing_plain_and_root_only_steps_equals_plain(kind, tiny_plain):
    """A policy cycling through drafted steps of every width, plain steps (the drafter falls
    behind and resyncs; the picked-up head is dropped) and drafted steps verifying the root
    alone: greedy output under the ahead plan equals plain decoding."""
    from test_policy import D_MAX, NEW, PROMPTS as P, Cycling, make_engine
    from test_policy import TREE as PTREE

    target = tiny()
    want = [tiny_plain(p, NEW, 160, 8) for p in P]  # make_engine's context and prefill chunk
    if kind == "eagle":
        drafter = EagleDrafter.random(target, "reference", max_depth=D_MAX)
    else:
        drafter = LMDrafter(target.shared_copy() if kind == "self" else tiny(seed=1, std=0.25), "reference")
    eng = make_engine(target, drafter, PTREE)
    eng.use_plan("ahead")
    for p, w in zip(P, want):
        pol = Cycling()
        res = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=pol, on_step=pol.advance_if_plain)
        assert res.token_ids == w
        assert res.stats["resyncs"] > 0 and res.stats["ahead_calls"] > 0
