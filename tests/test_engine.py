"""The decode loop on tiny random-weight models: exactness, losslessness, static graphs."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import chi_square_p, sweep, tiny_model
from yggtree.errors import YggError
from yggtree.runtime import steps
from yggtree.runtime.accept import filter_probs
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.model import Transformer
from yggtree.runtime.tree import ancestor_mask, build_tree


def tiny(vocab=97, hidden=64, layers=2, seed=0, std=0.3) -> Transformer:
    return tiny_model(vocab, hidden, layers, seed=seed, std=std)


def engine(model, tree=None, drafter=None, mode="reference", chunk=16):
    cfg = EngineConfig(mode=mode, max_context=200, prefill_chunk=chunk, tree=tree)
    return Engine(model, cfg, drafter)


PROMPTS = [list(range(5, 12)), [(7 * i) % 90 + 3 for i in range(23)], [1] * 40]
TREES = {
    "chain": TreeParams(draft_width=1, draft_depth=4, verify_width=5, top_k=1),
    "egt": TreeParams(draft_width=4, draft_depth=3, verify_width=10, top_k=4),
    "full-binary": TreeParams(draft_width=2, draft_depth=3, verify_width=7, top_k=2),
    "wide-prune": TreeParams(draft_width=3, draft_depth=4, verify_width=8, top_k=3),
}


@pytest.fixture(scope="module")
def plain_outputs(tiny_plain):
    return {i: tiny_plain(p, 40) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("tree,drafter", sweep(
    list(TREES), ["self", "other-lm"],
    unit=[("chain", "self"), ("egt", "other-lm"), ("full-binary", "self"), ("wide-prune", "self")]))
def test_greedy_speculation_equals_plain(plain_outputs, tree, drafter):
    target = tiny()
    draft_model = target.shared_copy() if drafter == "self" else tiny(seed=1, std=0.25)
    eng = engine(target, TREES[tree], LMDrafter(draft_model, "reference"))
    for i, p in enumerate(PROMPTS):
        res = eng.generate(p, SamplingParams(max_new_tokens=40))
        assert res.token_ids == plain_outputs[i], f"prompt {i}"
        assert res.stats["verify_calls"] < 40 or drafter == "other-lm"


def test_self_drafter_chain_accepts_every_draft():
    target = tiny()
    tp = TREES["chain"]
    eng = engine(target, tp, LMDrafter(target.shared_copy(), "reference"))
    res = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=41))  # 1 + 8 * (D + 1)
    assert res.finish_reason == "length"
    assert res.stats["verify_calls"] == 8
    assert res.stats["aal"] == tp.draft_depth + 1
    assert res.stats["accept_by_position"] == [1.0] * tp.draft_depth


def test_self_drafter_tree_accepts_its_whole_greedy_chain():
    """With the target drafting for itself, the accepted length of every step is the length of
    the argmax chain inside the verified tree (nothing on it is ever rejected)."""
    target = tiny()
    tp = TREES["egt"]
    eng = engine(target, tp, LMDrafter(target.shared_copy(), "reference"))
    res = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=30))
    # every verify step accepted at least one draft (the root's argmax child is always drafted)
    assert res.stats["accept_by_position"][0] == 1.0


def test_tree_attention_equals_per_path_causal():
    """The target over a flattened tree (tree mask) gives, at every node, the logits of a plain
    causal forward along that node's root-to-leaf path."""
    model = tiny(layers=2)
    prefix = [5, 8, 13, 21, 34]
    #        0(root=40)
    #       /    \
    #     1(7)   2(9)
    #     / \      \
    #  3(11) 4(12)  5(60)
    #   |
    #  6(3)
    parent = [0, 0, 0, 1, 1, 2, 3]
    token = [40, 7, 9, 11, 12, 60, 3]
    tree = build_tree(parent, token, size=8)  # one padded slot
    anc = ancestor_mask(tree.parent, tree.depth, tree.valid, 4)
    model.setup_cache(1, 64)
    n = len(prefix)
    with torch.no_grad():
        buf = torch.tensor([prefix + [0] * 3])
        steps.prefill_chunk(model, buf, torch.tensor(0), torch.tensor(n))
        got, _, _ = steps.tree_step(
            model, tree.token, tree.depth, torch.arange(8), anc, torch.tensor(n)
        )
        for node in range(7):
            path, u = [], node
            while True:
                path.append(token[u])
                if u == 0:
                    break
                u = parent[u]
            seq = prefix + path[::-1]
            ref_model = model.shared_copy()
            ref_model.setup_cache(1, 64)
            m = len(seq)
            pos = torch.arange(m)[None]
            mask = (torch.arange(64)[None, :] <= torch.arange(m)[:, None])[None]
            ref = ref_model.logits(ref_model(torch.tensor([seq]), pos, pos, mask).hidden)[0, -1]
            torch.testing.assert_close(got[node], ref, rtol=1e-4, atol=1e-5)


def exact_pair_distribution(model, prompt, temperature, top_p):
    """P(first two generated tokens) under plain sampling, computed exactly: [V, V]."""
    v = model.cfg.vocab_size

    def probs(seq):
        model.setup_cache(1, 64)
        m = len(seq)
        pos = torch.arange(m)[None]
        mask = (torch.arange(64)[None, :] <= torch.arange(m)[:, None])[None]
        logits = model.logits(model(torch.tensor([seq]), pos, pos, mask).hidden)[0, -1]
        return filter_probs(logits, temperature, top_p)

    with torch.no_grad():
        p1 = probs(prompt)
        return torch.stack([p1[a] * probs(prompt + [a]) for a in range(v)])


@pytest.mark.slow
@pytest.mark.parametrize(  # (chain, 1.0, 1.0) and (tree, 0.7, 0.9): test_lossless_steps, over more steps
    "tree,temperature,top_p", [("tree", 1.0, 1.0), ("chain", 0.7, 0.9)],
)
def test_speculative_sampling_is_lossless(one_thread, tree, temperature, top_p):
    """Chi-square: the first two emitted tokens of speculative sampling (the second one always
    comes out of a verify step) follow the target's own sampling distribution exactly.
    Fixed seeds, 2000 draws, significance level 0.001, no retries."""
    target = tiny(vocab=8, hidden=32, layers=1, seed=3, std=0.5)
    drafter = LMDrafter(tiny(vocab=8, hidden=32, layers=1, seed=4, std=0.5), "reference")
    tp = (
        TreeParams(draft_width=1, draft_depth=2, verify_width=3, top_k=1)
        if tree == "chain"
        else TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2)
    )
    eng = engine(target, tp, drafter, chunk=8)
    prompt = [1, 5, 2, 7]
    exact = exact_pair_distribution(target, prompt, temperature, top_p).flatten()
    draws = 2000
    counts = torch.zeros(64)
    for seed in range(draws):
        res = eng.generate(prompt, SamplingParams(2, temperature, top_p, seed))
        a, b = res.token_ids
        counts[a * 8 + b] += 1
    p = chi_square_p(counts, exact)  # asserts first that no impossible pair was emitted
    assert p > 1e-3, f"p = {p:.2e}"


def test_impossible_trees_are_refused_before_models_run():
    target = tiny()
    drafter = LMDrafter(target.shared_copy(), "reference")
    with pytest.raises(YggError, match="exceeds the drafted tree"):
        engine(target, TreeParams(draft_width=2, draft_depth=2, verify_width=6), drafter)
    with pytest.raises(YggError, match="draft-width must be >= 1"):
        engine(target, TreeParams(draft_width=0), drafter)
    with pytest.raises(YggError, match="verify-width must be >= 1"):
        engine(target, TreeParams(verify_width=0), drafter)


def test_drafter_vocabulary_mismatch_is_refused():
    target = tiny(vocab=97)
    with pytest.raises(YggError, match="vocabulary"):
        engine(target, TREES["chain"], LMDrafter(tiny(vocab=50), "reference"))


def test_bad_prompts_are_refused():
    eng = engine(tiny())
    with pytest.raises(YggError, match="empty"):
        eng.generate([], SamplingParams())
    with pytest.raises(YggError, match="context window"):
        eng.generate([1] * 150, SamplingParams(max_new_tokens=100))
    with pytest.raises(YggError, match="outside the vocabulary"):
        eng.generate([1, 500], SamplingParams())


def test_eos_inside_a_multi_token_emission(tiny_plain):
    """EOS stops decoding even in the middle of an accepted path (self-drafter: long paths)."""
    target = tiny()
    plain = tiny_plain(PROMPTS[1], 40)
    eos = plain[9]
    first = plain.index(eos)
    cfg = EngineConfig(mode="reference", max_context=200, prefill_chunk=16, tree=TREES["chain"])
    eng = Engine(target, cfg, LMDrafter(target.shared_copy(), "reference"), eos_ids=(eos,))
    res = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=40))
    assert res.token_ids == plain[: first + 1]
    assert res.finish_reason == "stop"


@pytest.mark.slow
def test_compiled_matches_reference_with_no_recompiles():
    """Performance mode: identical greedy tokens; after warm-up no graph is ever compiled again,
    across prompt lengths, temperatures and accepted lengths (the decode loop also runs under
    torch.compiler's fail_on_recompile stance, so a recompile would raise)."""
    from torch._dynamo.utils import counters

    tp = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    ref_model = tiny()
    ref = engine(ref_model, tp, LMDrafter(tiny(seed=1, std=0.25), "reference"))
    model = tiny()
    eng = engine(model, tp, LMDrafter(tiny(seed=1, std=0.25), "performance"), mode="performance")
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    recompiles = sum(counters["recompiles"].values())
    hist = set()
    for p, temperature in itertools.product(PROMPTS, (0.0, 0.7)):
        params = SamplingParams(max_new_tokens=30, temperature=temperature, seed=1)
        got = eng.generate(p, params)
        want = ref.generate(p, params)
        if temperature == 0:
            assert got.token_ids == want.token_ids
        hist.update(int(round(a * got.stats["verify_calls"])) for a in got.stats["accept_by_position"])
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup
    assert sum(counters["recompiles"].values()) == recompiles
    assert counters["graph_break"] == {} or sum(counters["graph_break"].values()) == 0


def test_drafter_with_another_tokenizer_is_refused():
    from yggtree.runtime.drafters import check_pair

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    same = {"a": 0, "b": 1}
    check_pair(2, 2, Tok(same), Tok(dict(same)), "d")  # identical vocabularies pass
    with pytest.raises(YggError, match="different tokenizer"):
        check_pair(2, 2, Tok(same), Tok({"a": 1, "b": 0}), "d")
    with pytest.raises(YggError, match="vocabulary size 3"):
        check_pair(2, 3, Tok(same), Tok(same), "d")
