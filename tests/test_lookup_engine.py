"""Lookup candidates in the decode loop (tiny random-weight models): exact greedy output with lookup
on, with every kind of drafter and without one; lossless sampling with lookup nodes in the tree;
lookup-only decoding accepting what repeats."""

from __future__ import annotations

import pytest
import torch

from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.lookup import LookupCalibration
from yggtree.runtime.prune import subtree
from helpers import chi_square_p, sweep
from test_engine import PROMPTS, TREES, exact_pair_distribution, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40
REPEAT = [5, 6, 7, 8, 9, 10, 11] * 6  # a prompt that repeats itself
ALL_PROMPTS = PROMPTS + [REPEAT]


def engine(model, tree=None, drafter=None, lookup=0, chunk=16, mode="reference"):
    cfg = EngineConfig(mode=mode, max_context=200, prefill_chunk=chunk, tree=tree, lookup=lookup)
    return Engine(model, cfg, drafter)


@pytest.fixture(scope="module")
def plain_outputs(tiny_plain):
    return {i: tiny_plain(p, NEW) for i, p in enumerate(ALL_PROMPTS)}


def make_drafter(kind, target):
    if kind == "self":
        return LMDrafter(target.shared_copy(), "reference")
    if kind == "other-lm":
        return LMDrafter(tiny(seed=1, std=0.25), "reference")
    if kind == "eagle":
        return EagleDrafter.random(target, "reference", max_depth=4)
    return None


@pytest.mark.parametrize("tree,drafter,lookup", sweep(
    list(TREES), ["self", "other-lm", "eagle", "none"], [1, 3],
    unit=[("chain", "self", 1), ("egt", "other-lm", 3), ("full-binary", "eagle", 1), ("wide-prune", "none", 3)]))
def test_greedy_with_lookup_equals_plain(plain_outputs, tree, drafter, lookup):
    target = tiny()
    tp = TREES[tree]
    eng = engine(target, tp, make_drafter(drafter, target), lookup=lookup)
    by_source = {"drafter": 0, "lookup": 0, "both": 0}
    for i, p in enumerate(ALL_PROMPTS):
        res = eng.generate(p, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == plain_outputs[i], f"prompt {i}"
        s = res.stats
        assert sum(s["accepted_by_source"].values()) == s["accepted_tokens"]
        for k, v in s["accepted_by_source"].items():
            by_source[k] += v
        if drafter == "none":
            assert s["draft_calls"] == 0
            assert s["lookup_steps"] + s["plain_steps"] == s["verify_calls"]
    assert by_source["lookup"] + by_source["both"] > 0  # lookup nodes were accepted
    if drafter == "none":
        assert by_source["drafter"] == by_source["both"] == 0


def test_lookup_off_reports_no_sources(plain_outputs):
    target = tiny()
    eng = engine(target, TREES["egt"], make_drafter("other-lm", target), lookup=0)
    res = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == plain_outputs[1]
    assert "accepted_by_source" not in res.stats and "lookup_steps" not in res.stats


@pytest.mark.slow
def test_compiled_lookup_matches_reference(plain_outputs):
    target = tiny()
    ref = engine(target, TREES["egt"], make_drafter("other-lm", target), lookup=3)
    target2 = tiny()
    fast = engine(target2, TREES["egt"], make_drafter("other-lm", target2), lookup=3, mode="performance")
    for i in (1, 3):
        a = ref.generate(ALL_PROMPTS[i], SamplingParams(max_new_tokens=NEW))
        b = fast.generate(ALL_PROMPTS[i], SamplingParams(max_new_tokens=NEW))
        assert a.token_ids == b.token_ids == plain_outputs[i]
        assert a.stats["accepted_by_source"] == b.stats["accepted_by_source"]


def test_lookup_flag_refusals():
    target = tiny()
    with pytest.raises(YggError, match="exceeds the verify width"):
        engine(target, TREES["chain"], make_drafter("self", target), lookup=6)  # W_v 5
    with pytest.raises(YggError, match="lookup must be"):
        engine(target, TREES["chain"], make_drafter("self", target), lookup=-1)
    with pytest.raises(YggError, match="speculation needs"):
        engine(target, TREES["chain"], None, lookup=0)


def test_lookup_only_accepts_what_repeats(plain_outputs):
    """Without a drafter, a step's accepted length is exactly the longest path of its verified
    lookup tree that the target's greedy continuation follows (checked against the plain output),
    and once the output repeats a cycle the whole chain is accepted at every step."""
    target = tiny()
    tp = TreeParams(draft_width=1, draft_depth=4, verify_width=5, top_k=1)
    eng = engine(target, tp, None, lookup=4)
    for i, p in enumerate(ALL_PROMPTS):
        recs = []
        res = eng.generate(p, SamplingParams(max_new_tokens=NEW), on_step=recs.append)
        full = list(p) + plain_outputs[i]
        assert res.token_ids == plain_outputs[i]
        period = cycle_start = None
        for per in range(1, 10):  # the plain output's cycle, if it ends in one
            s = next((s for s in range(len(full) - 2 * per) if all(
                full[j] == full[j + per] for j in range(s, len(full) - per))), None)
            if s is not None and len(full) - s >= 3 * per:
                period, cycle_start = per, s
                break
        for rec in recs:
            root = rec.committed  # position of the root token in ``full``
            if rec.tree is None:
                assert rec.n_accepted == 0
                continue
            v = subtree(rec.tree, rec.kept, rec.kept_valid)
            node, n = 0, 0
            while True:  # longest verified path the true continuation follows
                kids = [u for u in range(1, v.num_nodes) if v.valid[u] and v.parent[u] == node
                        and root + n + 1 < len(full) and v.token[u] == full[root + n + 1]]
                if not kids:
                    break
                node, n = kids[0], n + 1
            if root + tp.draft_depth + 1 >= len(full):
                continue  # the walk may run past the plain output's end: its truth is unknown
            assert rec.n_accepted == n, f"prompt {i}, root {root}"
            in_cycle = period is not None and root - period * 2 >= cycle_start + 8
            if in_cycle and root + 5 < len(full):
                assert rec.n_accepted == tp.draft_depth, f"prompt {i}, root {root}"
    assert any(r.stats["lookup_steps"] for r in [res])


def repeating_prompt(target) -> list[int]:
    """[1, 5] and the target's greedy continuation, twice over, cut so that lookup proposes
    the greedy (most likely) continuation again."""
    seq = [1, 5] + engine(target, chunk=8).generate([1, 5], SamplingParams(max_new_tokens=4)).token_ids
    return seq + seq[:3]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("drafter", ["lm", "none"])
def test_sampling_with_lookup_nodes_is_lossless(temperature, top_p, drafter):
    """Chi-square, as test_engine's: the first two emitted tokens follow the target's own
    distribution with lookup nodes in every tree (the prompt repeats, so there are candidates).
    Fixed seeds, 2000 draws, significance 0.001, no retries; lookup nodes must be accepted."""
    target = tiny(vocab=8, hidden=32, layers=1, seed=3, std=0.5)
    lm = LMDrafter(tiny(vocab=8, hidden=32, layers=1, seed=4, std=0.5), "reference") if drafter == "lm" else None
    tp = TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2)
    eng = engine(target, tp, lm, lookup=3, chunk=8)
    prompt = repeating_prompt(target)
    exact = exact_pair_distribution(target, prompt, temperature, top_p).flatten()
    draws = 2000
    counts = torch.zeros(64)
    from_lookup = 0
    for seed in range(draws):
        res = eng.generate(prompt, SamplingParams(2, temperature, top_p, seed))
        a, b = res.token_ids
        counts[a * 8 + b] += 1
        from_lookup += res.stats["accepted_by_source"]["lookup"] + res.stats["accepted_by_source"]["both"]
    assert from_lookup > 40, from_lookup  # the lookup nodes were really in play
    p = chi_square_p(counts, exact)  # asserts first that no impossible pair was emitted
    assert p > 1e-3, f"p = {p:.2e}"


def test_the_chi_square_check_has_power_against_a_biased_lookup_acceptance():
    """Power check: a lookup proposal accepted whenever it is merely possible (not with the
    target's probability) is lossy, and the same test rejects it."""
    target = tiny(vocab=8, hidden=32, layers=1, seed=3, std=0.5)
    prompt = repeating_prompt(target)
    exact = exact_pair_distribution(target, prompt, 1.0, 1.0).flatten()
    gen = torch.Generator().manual_seed(0)
    draws = 2000
    counts = torch.zeros(64)
    la, lb = prompt[3], prompt[4]  # the chain lookup proposes after the prompt
    for _ in range(draws):  # ... taken outright 30% of the time: a lossy acceptance
        idx = torch.multinomial(exact, 1, generator=gen).item()
        a, b = divmod(idx, 8)
        if torch.rand(1, generator=gen).item() < 0.3:
            a, b = la, lb
        counts[a * 8 + b] += 1
    assert chi_square_p(counts, exact) < 1e-3  # the check of the lossless test above rejects it


def test_lookup_calibration_path_is_used(tmp_path):
    cal = LookupCalibration((1,), (0.0,), ((0.5,),))
    f = tmp_path / "cal.json"
    f.write_text(__import__("json").dumps(cal.to_json()))
    target = tiny()
    cfg = EngineConfig(mode="reference", max_context=200, prefill_chunk=16, tree=TREES["chain"],
                       lookup=2, lookup_calibration=str(f))
    assert Engine(target, cfg, None).lookup_calib.table == ((0.5,),)
    bad = EngineConfig(mode="reference", max_context=200, prefill_chunk=16, tree=TREES["chain"],
                       lookup=2, lookup_calibration=str(tmp_path / "none.json"))
    with pytest.raises(YggError, match="does not exist"):
        Engine(target, bad, None)


def test_trace_records_the_lookup_candidates():
    target = tiny()
    eng = engine(target, TREES["egt"], make_drafter("other-lm", target), lookup=3)
    recs = []
    eng.generate(REPEAT, SamplingParams(max_new_tokens=12), trace=recs.append)
    spec = [r for r in recs if "lookup" in r]
    assert spec and all(len(r["tree"]["token"]) == len(r["lookup"]["source"] or r["tree"]["token"]) for r in spec)
    assert any(r["lookup"]["nodes"] > 0 and r["lookup"]["match"] > 0 for r in spec)
