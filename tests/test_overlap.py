"""Cross-core overlap (runtime/overlap.py): the next step drafted on the drafter's own worker while
the target verifies. Exact in greedy (every drafter kind, hits and misses), lossless in sampling,
both caches equal to a causal recompute, thread budgets per thread, bad splits refused in one line."""

from __future__ import annotations

import pytest
import torch

from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.overlap import guess_path
from yggtree.runtime.schedule import resolve_plan, usable_cores
from yggtree.runtime.tree import Tree

from helpers import assert_cache_equals_causal, perturbed, sweep
from test_engine import PROMPTS, TREES, tiny
from test_lossless_steps import (PROMPT, TREES as SMALL_TREES, chi_square_p, exact_sequences,
                                 sample_counts, target_and_drafter)

pytestmark = pytest.mark.usefixtures("one_thread")
SPLIT = "overlap@1+1"
needs_two = pytest.mark.skipif(usable_cores() < 2, reason="the overlap plan needs 2 usable cores")


def near_target(seed=0, noise=0.03):
    """A drafter model close to ``tiny(seed)``: partial acceptances, so guesses hit and miss."""
    return perturbed(tiny(seed=seed), noise)


def drafter_of(kind, target, mode="reference"):
    if kind == "eagle":
        return EagleDrafter.random(target, mode, max_depth=4, seed=1)
    model = {"self": lambda: target.shared_copy(), "near": near_target,
             "other-lm": lambda: tiny(seed=1, std=0.25)}[kind]()
    return LMDrafter(model, mode)


def engine(target, tree, drafter, stages=SPLIT, lookup=0, max_context=200):
    cfg = EngineConfig(mode="reference", max_context=max_context, prefill_chunk=16, tree=tree,
                       lookup=lookup, stages=stages)
    return Engine(target, cfg, drafter)


@pytest.fixture(scope="module")
def plain_outputs(tiny_plain):
    return [tiny_plain(p, 40) for p in PROMPTS]


# ----------------------------------------------------------------------------- plans


def test_overlap_plan_and_thread_splits():
    p = resolve_plan("overlap@1+1", True) if usable_cores() >= 2 else None
    if p is not None:
        assert p.overlap and (p.threads, p.draft_threads) == (1, 1) and p.label == "overlap@1+1"
        assert p.name == "overlap" and not p.ahead
    assert resolve_plan("sequential@1", True).threads == 1
    assert resolve_plan("overlap@1+1", False).name == "plain"  # nothing to draft: one plan


@pytest.mark.parametrize("name,message", [
    (f"overlap@{usable_cores()}+1", "exceeds this machine's"),
    ("overlap@1+0", "need >= 1 thread each"),
    ("sequential@1+1", "has no drafter worker"),
    ("overlap@x", "thread split"),
])
def test_bad_overlap_input_is_refused_in_one_line(name, message):
    with pytest.raises(YggError, match=message) as e:
        resolve_plan(name, True)
    assert "\n" not in str(e.value)


def test_guess_follows_the_drafters_likeliest_verified_path():
    #        0
    #      1   2        logp: 1 -0.5, 2 -1.0, 3 -0.7 (under 1), 4 -2.0 (under 1), 5 -1.1 (under 2)
    #     3 4   5
    tree = Tree(torch.tensor([9, 10, 11, 12, 13, 14]), torch.tensor([0, 0, 0, 1, 1, 2]),
                torch.tensor([0, 1, 1, 2, 2, 2]), torch.ones(6, dtype=torch.bool),
                torch.tensor([0.0, -0.5, -1.0, -0.7, -2.0, -1.1]))
    kept = torch.tensor([0, 4, 7, 2, 5, 8])  # drafted-tree nodes of the verified ones
    g = guess_path(tree, kept, None)
    assert g.path == (0, 1, 3) and g.n == 2
    assert g.nodes.tolist() == [0, 4, 2] and g.tokens.tolist() == [9, 10, 12]
    src = torch.zeros(9, dtype=torch.int64)
    src[4] = 1  # node 1 came from lookup: the guess follows drafter nodes only
    assert guess_path(tree, kept, src).path == (0, 2, 5)


# ----------------------------------------------------------------------------- exactness


@needs_two
@pytest.mark.parametrize("tree,kind,lookup", sweep(
    ["chain", "egt", "wide-prune"], ["self", "near", "other-lm", "eagle"], [0, 2],
    unit=[("chain", "self", 0), ("egt", "near", 2), ("egt", "eagle", 2)]))
def test_overlap_greedy_equals_plain(plain_outputs, tree, kind, lookup):
    target = tiny()
    eng = engine(target, TREES[tree], drafter_of(kind, target), lookup=lookup)
    hits = 0
    for i, p in enumerate(PROMPTS):
        res = eng.generate(p, SamplingParams(max_new_tokens=40))
        assert res.token_ids == plain_outputs[i], f"prompt {i}"
        s = res.stats
        assert s["stages"] == "overlap" and s["draft_threads"] == 1
        assert s["speculation"]["steps"] > 0 and s["stage_ms"]["join"] > 0
        hits += s["speculation"]["hits"]
    if kind == "self":  # the target drafting for itself: its guess is what it accepts
        assert hits > 0


@needs_two
def test_near_drafter_hits_and_misses_and_both_caches_equal_a_causal_recompute():
    """Partial acceptances: some guesses used, some discarded (the drafter state restored); after
    decoding, the target's and the drafter's cache rows of the committed sequence equal plain
    causal forwards over it."""
    target, near = tiny(seed=0), near_target()
    eng = engine(target, TreeParams(3, 3, 7, 3), LMDrafter(near, "reference"), max_context=120)
    prompt = [(7 * i) % 90 + 3 for i in range(19)]
    roots = []
    res = eng.generate(prompt, SamplingParams(max_new_tokens=40), on_step=lambda r: roots.append(r.committed))
    spec = res.stats["speculation"]
    assert 0 < spec["hits"] < spec["steps"], spec
    committed = (prompt + res.token_ids)[: roots[-1] + 1]
    for model, ref in ((target, tiny(seed=0)), (near, near.shared_copy())):
        assert_cache_equals_causal(model, ref, committed)


@pytest.mark.slow
@needs_two
@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_overlap_sampling_is_lossless(tree):
    target, drafter = target_and_drafter()
    exact = exact_sequences(target.shared_copy(), PROMPT, 4, 1.0, 1.0)
    eng = Engine(target, EngineConfig(mode="reference", max_context=64, prefill_chunk=4,
                                      tree=SMALL_TREES[tree], stages=SPLIT), drafter)
    counts, seen = sample_counts(eng, 1.0, 1.0)
    assert seen["multi_step"] > 500
    assert chi_square_p(counts, exact) > 1e-3


@needs_two
@pytest.mark.parametrize("kind", sweep(["self", "near", "eagle"], unit=[("near",), ("eagle",)]))
def test_overlap_with_a_policy_mixing_plain_and_root_only_steps_equals_plain(kind, tiny_plain):
    """A policy cycling through every width, plain steps (the drafter falls behind and resyncs)
    and drafted steps verifying the root alone: the speculated (D, W_d) is often not the next
    choice, so used guesses are redrafted too; output equals plain decoding."""
    from test_policy import NEW, PROMPTS as P, Cycling, make_engine
    from test_policy import TREE as PTREE

    target = tiny()
    want = [tiny_plain(p, NEW, 160, 8) for p in P]  # make_engine's context and prefill chunk
    eng = make_engine(target, drafter_of(kind, target), PTREE)
    eng.use_plan(SPLIT)
    for p, w in zip(P, want):
        pol = Cycling()
        res = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=pol, on_step=pol.advance_if_plain)
        assert res.token_ids == w
        assert res.stats["resyncs"] > 0 and res.stats["speculation"]["steps"] > 0


@pytest.mark.slow
@needs_two
@pytest.mark.parametrize("kind", ["self", "eagle"])
def test_overlap_compiled_equals_plain_with_no_recompiles(plain_outputs, kind):
    """Performance mode: the worker calls the drafter's compiled graphs from its own thread while
    the target's run on the decoding thread; nothing compiles in the loop."""
    from torch._dynamo.utils import counters

    model = tiny()
    tp = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    drafter = (EagleDrafter.random(model, "performance", max_depth=3, seed=1) if kind == "eagle"
               else LMDrafter(model.shared_copy(), "performance"))
    cfg = EngineConfig(mode="performance", max_context=200, prefill_chunk=16, tree=tp, stages=SPLIT)
    eng = Engine(model, cfg, drafter)
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    for i, p in enumerate(PROMPTS):
        res = eng.generate(p, SamplingParams(max_new_tokens=40))
        assert res.token_ids == plain_outputs[i]
        assert res.stats["speculation"]["steps"] > 0
        assert kind == "eagle" or res.stats["speculation"]["hits"] > 0  # a self-drafter's guesses hit
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles


@pytest.mark.slow
def test_overlap_runs_compiled_graphs_under_full_guard_evaluation():
    """Two threads calling compiled graphs at once miss graphs they have under dynamo's
    skip_guard_eval_unsafe stance (torch 2.13; a garbage collection inside a lookup, reproduced
    with gc.set_threshold(1)): overlap plans hold the full-guard stance on both threads, the
    sequential plan keeps the cheap one. Measured in docs/results.md."""
    from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

    model = tiny()
    tp = TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2)
    drafter = EagleDrafter.random(model, "performance", max_depth=2, seed=1)
    cfg = EngineConfig(mode="performance", max_context=200, prefill_chunk=16, tree=tp, stages=SPLIT)
    eng = Engine(model, cfg, drafter)
    seen = []
    real = eng.drafter.speculate

    def spy(*args):
        seen.append(_is_skip_guard_eval_unsafe_stance())
        return real(*args)

    eng.drafter.speculate = spy
    eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=12))
    assert seen and set(seen) == {False}
    eng.use_plan("sequential")
    real_step = eng.drafter.step
    eng.drafter.step = lambda *a: (seen.append(_is_skip_guard_eval_unsafe_stance()), real_step(*a))[1]
    seen.clear()
    eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=12))
    assert seen and set(seen) == {True}


# ----------------------------------------------------------------------------- thread budgets


def test_a_worker_thread_has_its_own_intra_op_budget():
    """torch.set_num_threads is per thread with ATen's OpenMP back end: a worker set to 2 keeps
    2 while the decoding thread keeps 1, and the other way round."""
    from yggtree.runtime.overlap import ThreadWorker

    for mine, its in ((1, 2), (2, 1)):
        torch.set_num_threads(mine)
        w = ThreadWorker(its)
        try:
            assert w.result(w.submit(torch.get_num_threads)) == its
            assert torch.get_num_threads() == mine
        finally:
            w.close()
    torch.set_num_threads(1)


@needs_two
def test_worker_and_decoding_thread_keep_their_own_thread_budgets():
    target = tiny()
    eng = engine(target, TREES["chain"], drafter_of("self", target), stages="overlap@1+1")
    seen = []
    real = eng.drafter.speculate

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    eng.drafter.speculate = spy
    torch.set_num_threads(2)  # the process setting; the plan's target budget (1) applies while decoding
    try:
        eng.use_plan("overlap@1+1")
        eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=12))
        assert torch.get_num_threads() == 2  # restored after generate
    finally:
        torch.set_num_threads(1)
    assert seen and set(seen) == {1}
    eng.use_plan("sequential")
    assert eng.worker is None  # the worker ends with the plan that needed it
