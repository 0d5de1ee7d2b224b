"""Losslessness through the whole decode loop, over several verify steps: the first N generated
tokens of speculative sampling (prefill, then verify steps that accept part of the drafted path,
commit it in both caches and draft again from there) follow the target's own sampling
distribution of N-token continuations, computed exactly by causal recompute. Chi-square over all
V^N sequences (small cells pooled), fixed seeds, no retries, significance 0.001; the same check
rejects a lossy verify step (power check). Also: after a step that accepted part of its path,
the target's KV cache equals a causal recompute of the committed sequence."""

from __future__ import annotations

import itertools

import pytest
import torch

from yggtree.runtime.accept import filter_probs
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

from helpers import assert_cache_equals_causal, chi_square_p, perturbed  # noqa: F401 - chi_square_p: also for test_overlap, test_stages
from test_engine import tiny

pytestmark = pytest.mark.usefixtures("one_thread")

V, N, DRAWS = 4, 4, 1500
PROMPT = [1, 3, 0, 2]
TREES = {
    "chain": TreeParams(draft_width=1, draft_depth=2, verify_width=3, top_k=1),
    "tree": TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2),
}


def target_and_drafter(mode="reference"):
    target = tiny(vocab=V, hidden=32, layers=1, seed=3, std=0.5)
    drafter = LMDrafter(tiny(vocab=V, hidden=32, layers=1, seed=4, std=0.5), mode)
    return target, drafter


def causal_logits(model, seq) -> torch.Tensor:
    """Last-position logits of a plain causal forward over ``seq`` (fresh cache)."""
    model.setup_cache(1, 64)
    m = len(seq)
    pos = torch.arange(m)[None]
    mask = (torch.arange(64)[None, :] <= torch.arange(m)[:, None])[None]
    with torch.no_grad():
        return model.logits(model(torch.tensor([seq]), pos, pos, mask).hidden)[0, -1]


def exact_sequences(model, prompt, n, temperature, top_p) -> torch.Tensor:
    """P(first n generated tokens = s) for every s in V^n (index: base-V digits), exactly."""
    out = torch.zeros(V**n, dtype=torch.float64)

    def walk(seq, p, depth, index):
        if depth == n:
            out[index] = p
            return
        probs = filter_probs(causal_logits(model, prompt + seq), temperature, top_p).double()
        for t in range(V):
            if probs[t] > 0:
                walk(seq + [t], p * probs[t].item(), depth + 1, index * V + t)

    walk([], 1.0, 0, 0)
    return out


def sample_counts(eng, temperature, top_p) -> tuple[torch.Tensor, dict]:
    counts = torch.zeros(V**N, dtype=torch.float64)
    seen = {"multi_step": 0, "partial": 0}
    for seed in range(DRAWS):
        res = eng.generate(PROMPT, SamplingParams(N, temperature, top_p, seed))
        assert len(res.token_ids) == N  # no EOS in these models
        counts[sum(t * V ** (N - 1 - i) for i, t in enumerate(res.token_ids))] += 1
        seen["multi_step"] += res.stats["verify_calls"] >= 2
        by_pos = res.stats["accept_by_position"]  # fraction of steps accepting >= d drafts
        seen["partial"] += by_pos[0] > 0 and by_pos[-1] < 1  # some step stopped inside its path
    return counts, seen


@pytest.mark.parametrize(
    "tree,temperature,top_p,mode",
    [
        pytest.param("chain", 1.0, 1.0, "reference", marks=pytest.mark.slow),  # the unit run: test_accept
        pytest.param("tree", 0.7, 0.9, "reference", marks=pytest.mark.slow),
        pytest.param("tree", 1.0, 1.0, "performance", marks=pytest.mark.slow),
    ],
)
def test_multi_step_speculative_sampling_is_lossless(tree, temperature, top_p, mode):
    target, drafter = target_and_drafter(mode)
    exact = exact_sequences(target.shared_copy(), PROMPT, N, temperature, top_p)
    eng = Engine(target, EngineConfig(mode=mode, max_context=64, prefill_chunk=4, tree=TREES[tree]),
                 drafter)
    counts, seen = sample_counts(eng, temperature, top_p)
    # the draws went through what this test is about: several verify steps per sequence, and
    # steps that accepted part of their drafted path (then committed and drafted from there)
    assert seen["multi_step"] > DRAWS // 2 and seen["partial"] > DRAWS // 10, seen
    p = chi_square_p(counts, exact)
    assert p > 1e-3, f"p = {p:.2e}"


@pytest.mark.slow
def test_the_multi_step_check_rejects_a_lossy_verify_step(monkeypatch):
    """Power check: verify steps that sample at temperature 0.8 while the first token (prefill)
    and the exact distribution use 1.0 differ from the target only after the first token; the
    same test with the same draws rejects them."""
    import yggtree.runtime.stages as stages_mod

    real = stages_mod.sample_choices

    def lossy(logits, temperature, top_p, gen):
        return real(logits, temperature * 0.8, top_p, gen)

    monkeypatch.setattr(stages_mod, "sample_choices", lossy)
    target, drafter = target_and_drafter()
    exact = exact_sequences(target.shared_copy(), PROMPT, N, 1.0, 1.0)
    eng = Engine(target, EngineConfig(mode="reference", max_context=64, prefill_chunk=4,
                                      tree=TREES["chain"]), drafter)
    counts, _ = sample_counts(eng, 1.0, 1.0)
    assert chi_square_p(counts, exact) < 1e-3


def test_kv_cache_after_partial_acceptance_equals_causal_recompute():
    """Greedy, a drafter that agrees with the target only in part: after many steps, several
    accepting part of their path (a commit moves accepted nodes that are not where the path
    ends up), the target's cache rows of the committed sequence equal a plain causal forward over
    it; stale tree rows past it do not matter (never attended)."""
    target = tiny(vocab=97, hidden=64, layers=2, seed=0)
    near = perturbed(tiny(vocab=97, hidden=64, layers=2, seed=0))  # the target, perturbed: agrees often, not always
    drafter = LMDrafter(near, "reference")
    eng = Engine(target, EngineConfig(mode="reference", max_context=120, prefill_chunk=16,
                                      tree=TreeParams(3, 3, 7, 3)), drafter)
    prompt = [(7 * i) % 90 + 3 for i in range(19)]
    roots = []  # the committed length at each step's start: rows 0..L are then final
    res = eng.generate(prompt, SamplingParams(max_new_tokens=30), on_step=lambda r: roots.append(r.committed))
    hist = res.stats["accept_by_position"]
    assert hist[0] > 0 and hist[-1] < 1  # partial acceptances happened
    # the last step (which ended the request) is not committed: compare up to its root's row
    committed = (prompt + res.token_ids)[: roots[-1] + 1]
    assert_cache_equals_causal(target, tiny(vocab=97, hidden=64, layers=2, seed=0), committed)
