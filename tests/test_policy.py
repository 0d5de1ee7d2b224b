"""The step-policy hook: a policy changing (D, W_d, W_v) every step, plain steps included, keeps
greedy output identical to plain decoding; on_step records; widths outside the set are refused."""

from __future__ import annotations

import pytest
import torch

from helpers import sweep
from test_eagle import bigram_head
from test_engine import tiny
from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.policy import FixedPolicy, StepChoice, StepPolicy, StepRecord

NEW = 30
PROMPTS = [list(range(5, 12)), [(7 * i) % 90 + 3 for i in range(23)], [1] * 20]
DRAFT_WIDTHS = (1, 2, 4)
VERIFY_WIDTHS = (2, 4, 8)
D_MAX = 4
TREE = TreeParams(draft_width=4, draft_depth=D_MAX, verify_width=8, top_k=3)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(target, drafter, tree=TREE) -> Engine:
    cfg = EngineConfig(
        mode="reference", max_context=160, prefill_chunk=8, tree=tree,
        draft_widths=DRAFT_WIDTHS, verify_widths=VERIFY_WIDTHS, d_max=D_MAX,
    )
    return Engine(target, cfg, drafter)


class Scripted(StepPolicy):
    """(D, W_d, W_v) from ``pattern`` in turn; the test's on_step advances ``i``."""

    def __init__(self, pattern: list[tuple[int, int, int]]) -> None:
        self.pattern, self.i = pattern, 0

    def choose_draft(self, h_root, committed):
        return StepChoice(*self.pattern[self.i % len(self.pattern)][:2])

    def choose_verify(self, tree, choice, committed):
        return self.pattern[self.i % len(self.pattern)][2]


class Cycling(StepPolicy):
    """A different (D, W_d, W_v) every step, with plain steps (D = 0) and W_v = 1 mixed in."""

    CHOICES = [(2, 1, 2), (0, 1, 1), (4, 4, 8), (1, 2, 4), (0, 4, 1), (0, 2, 1), (3, 2, 1), (4, 1, 4),
               (2, 4, 8), (1, 1, 8)]

    def __init__(self) -> None:
        self.i = 0
        self.asked: list[tuple] = []

    def choose_draft(self, h_root, committed):
        d, wd, _ = self.CHOICES[self.i % len(self.CHOICES)]
        self.asked.append(("draft", committed, tuple(h_root.shape), h_root.dtype))
        return StepChoice(d, wd)

    def see_catch_up(self, behind, remaining):
        self.asked.append(("catch_up", behind, remaining))

    def choose_verify(self, tree, choice, committed):
        wv = self.CHOICES[self.i % len(self.CHOICES)][2]
        self.i += 1
        assert tree.num_nodes == 1 + choice.draft_depth * choice.draft_width
        self.asked.append(("verify", committed))
        return wv

    # a plain step asks choose_draft only: advance there too
    def advance_if_plain(self, rec: StepRecord) -> None:
        if rec.choice.draft_depth == 0:
            self.i += 1


def drafters(target):
    return {
        "self": LMDrafter(target.shared_copy(), "reference"),
        "other-lm": LMDrafter(tiny(seed=1, std=0.25), "reference"),
        "eagle-random": EagleDrafter.random(target, "reference", max_depth=D_MAX),
    }


@pytest.fixture(scope="module")
def target():
    return tiny()


@pytest.fixture(scope="module")
def plain(tiny_plain):
    return [tiny_plain(p, NEW, 160, 8) for p in PROMPTS]


# unit: an LM drafter accepting in part, an EAGLE head accepting much (the self-drafter under
# Cycling: test_policy_observes_every_step)
@pytest.mark.parametrize("kind", sweep(["self", "other-lm", "eagle-random", "eagle-bigram"],
                                       unit=[("other-lm",), ("eagle-bigram",)]))
def test_changing_policy_keeps_greedy_output(target, plain, kind):
    if kind == "eagle-bigram":
        from test_eagle import tiny as eagle_tiny

        tgt = eagle_tiny()
        ref = Engine(tgt, EngineConfig(mode="reference", max_context=160, prefill_chunk=8))
        want = [ref.generate(p, SamplingParams(max_new_tokens=NEW)).token_ids for p in PROMPTS]
        drafter = bigram_head(tgt, max_depth=D_MAX)
    else:
        tgt, want, drafter = target, plain, drafters(target)[kind]
    eng = make_engine(tgt, drafter)
    for i, p in enumerate(PROMPTS):
        pol = Cycling()
        records: list[StepRecord] = []

        def on_step(rec):
            records.append(rec)
            pol.advance_if_plain(rec)

        res = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=pol, on_step=on_step)
        assert res.token_ids == want[i], f"prompt {i}"
        # one record per step, committed lengths chain up, choices as asked
        assert len(records) == res.stats["verify_calls"]
        committed = len(p)
        for j, rec in enumerate(records):
            d, wd, wv = Cycling.CHOICES[j % len(Cycling.CHOICES)]
            assert rec.committed == committed
            assert rec.choice == StepChoice(d, wd if d else wd)
            assert rec.verify_width == (wv if d else 1)
            assert rec.h_root.shape == (tgt.cfg.hidden_size,) and rec.h_root.dtype == torch.float32
            assert 0 <= rec.n_accepted <= d
            assert set(rec.stage_ms) >= {"head", "draft", "verify", "accept", "commit", "policy"}
            if d:
                assert rec.kept.shape == (wv,) and rec.target_argmax.shape == (wv,)
            committed += 1 + rec.n_accepted
        assert res.stats["plain_steps"] == sum(r.choice.draft_depth == 0 for r in records)
        assert res.stats["resyncs"] >= 1
        # before each step the policy hears the drafter's lag (its prefill is deferred to the first
        # drafted step; a drafted step leaves it in step, a plain one behind) and the tokens left
        # (none where its head call takes the lag in: a resume of at most ``absorbs`` tokens)
        told = [a[1:] for a in pol.asked if a[0] == "catch_up"]
        lag, synced, sync_from, emitted = [], False, 0, 1
        for rec in records:  # a resync redoes the drafter from the last drafted step's root
            behind = rec.committed - sync_from
            deferred = 0 < sync_from and behind <= drafter.absorbs
            lag.append((0 if synced or deferred else behind, NEW - emitted))
            synced = rec.choice.draft_depth > 0
            sync_from = rec.committed if synced else sync_from
            emitted += 1 + rec.n_accepted
        assert told == lag


class Observing(Cycling):
    """Cycling, learning of every finished step through ``observe`` (no on_step callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[StepRecord] = []

    def observe(self, rec: StepRecord) -> None:
        self.seen.append(rec)
        self.advance_if_plain(rec)


def test_policy_observes_every_step(target, plain):
    """A policy with ``observe`` gets one record per step, in order, before the next choice."""
    eng = make_engine(target, LMDrafter(target.shared_copy(), "reference"))
    pol = Observing()
    res = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=NEW), policy=pol)
    assert res.token_ids == plain[0]
    assert len(pol.seen) == res.stats["verify_calls"]
    committed = len(PROMPTS[0])
    for j, rec in enumerate(pol.seen):
        d, wd, wv = Cycling.CHOICES[j % len(Cycling.CHOICES)]
        assert rec.committed == committed and rec.choice.draft_depth == d
        assert rec.verify_width == (wv if d else 1) and rec.target_argmax is None
        committed += 1 + rec.n_accepted


def test_policy_hears_each_request_start_before_its_first_choice(target):
    """``start_request`` (when a policy has it) runs once per generate, before any choice."""
    eng = make_engine(target, LMDrafter(target.shared_copy(), "reference"))

    class Starting(Observing):
        def start_request(self) -> None:
            self.asked.append(("start",))

    pol = Starting()
    for p in PROMPTS[:2]:
        eng.generate(p, SamplingParams(max_new_tokens=5), policy=pol)
    asked = [a[0] for a in pol.asked]
    assert all(asked[i - 1] == "catch_up" for i, a in enumerate(asked) if a == "draft")  # heard first
    asked = [a for a in asked if a != "catch_up"]
    starts = [i for i, a in enumerate(asked) if a == "start"]
    assert len(starts) == 2 and starts[0] == 0 and asked[1] == "draft"
    assert asked[starts[1] - 1] != "start" and asked[starts[1] + 1] == "draft"


def test_h_root_is_the_hidden_state_behind_the_root(target):
    """h_root through the target's LM head gives the root token (greedy)."""
    eng = make_engine(target, LMDrafter(target.shared_copy(), "reference"))
    pol = Cycling()
    recs = []
    res = eng.generate(
        PROMPTS[1], SamplingParams(max_new_tokens=NEW), policy=pol,
        on_step=lambda r: (recs.append(r), pol.advance_if_plain(r)),
    )
    seq = PROMPTS[1] + res.token_ids
    for r in recs:
        root = seq[r.committed]
        assert int(target.logits(r.h_root).argmax()) == root


def test_fixed_policy_equals_no_policy(target):
    drafter = LMDrafter(tiny(seed=1, std=0.25), "reference")
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=4, top_k=3)
    eng = make_engine(target, drafter, tree)
    for p in PROMPTS:
        a = eng.generate(p, SamplingParams(max_new_tokens=NEW))
        b = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=FixedPolicy.of(tree))
        assert a.token_ids == b.token_ids
        assert a.stats["accepted_tokens"] == b.stats["accepted_tokens"]
        assert a.stats["verify_calls"] == b.stats["verify_calls"]


class Steady(StepPolicy):
    """The same choice every step, but not a FixedPolicy: the engine must expect plain steps."""

    def __init__(self, d: int, wd: int, wv: int) -> None:
        self.choice, self.wv = StepChoice(d, wd), wv

    def choose_draft(self, h_root, committed):
        return self.choice

    def choose_verify(self, tree, choice, committed):
        return self.wv


@pytest.mark.parametrize("kind", sweep(["other-lm", "eagle-random"], unit=[("other-lm",)]))
def test_a_policy_that_may_decline_absorbs_the_prompt_into_the_drafter_when_it_first_drafts(target, plain, kind):
    """A policy that may choose plain steps leaves the prompt's prefill to the drafter's first
    drafted step (the resync stage, from slot 0): a request decoded in plain steps never runs it,
    and the first drafted step's tree is bitwise the one after an eager prefill (a fixed tree)."""
    drafter = drafters(target)[kind]
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=4, top_k=3)
    eng = make_engine(target, drafter, tree)
    calls = []
    real = drafter.prefill
    drafter.prefill = lambda *a, **k: (calls.append(a[2] if len(a) > 2 else 0), real(*a, **k))[1]
    try:
        for i, p in enumerate(PROMPTS):
            calls.clear()
            res = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=Steady(0, 1, 1))
            assert res.token_ids == plain[i] and calls == [] and res.stats["draft_calls"] == 0
            eager, lazy = [], []
            a = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=FixedPolicy.of(tree), on_step=eager.append)
            calls.clear()
            b = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=Steady(3, 2, 4), on_step=lazy.append)
            assert calls[0] == 0 and b.stats["resyncs"] == 1  # the whole prompt, at the first step
            assert a.token_ids == b.token_ids == plain[i]
            for x, y in zip(eager, lazy):  # the same trees, bit for bit
                assert torch.equal(x.tree.token, y.tree.token) and torch.equal(x.tree.logp, y.tree.logp)
    finally:
        drafter.prefill = real


@pytest.mark.parametrize(
    "choice, wv, match",
    [
        ((2, 3, 4), None, r"draft width 3, not in the compiled set \[1, 2, 4\]"),
        ((5, 1, 4), None, r"draft depth 5, outside the engine's 0..4"),
        ((2, 2, 16), None, r"verify width 16, not in the compiled set \[1, 2, 4, 8\]"),
    ],
)
def test_widths_outside_the_compiled_set_are_refused(target, choice, wv, match):
    eng = make_engine(target, LMDrafter(target.shared_copy(), "reference"))
    pol = FixedPolicy(StepChoice(choice[0], choice[1]), choice[2])
    with pytest.raises(YggError, match=match):
        eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=5), policy=pol)


def test_policy_needs_a_drafter(target):
    eng = Engine(target, EngineConfig(mode="reference", max_context=160, prefill_chunk=8))
    with pytest.raises(YggError, match="needs a speculative engine"):
        eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=5), policy=FixedPolicy(StepChoice(1, 1), 2))


def test_resync_after_plain_steps_keeps_the_self_drafter_exact(target, plain):
    """The self-drafter proposes the target's own greedy tokens, so a drafted chain is accepted
    whole exactly when the drafter holds the committed sequence: after every run of plain steps
    (resynced incrementally from the last drafted root) each chain must still be accepted whole."""
    # top-k 1 with W_d = 1: each draft step extends the chain (with k > 1 a sibling may win)
    eng = make_engine(target, drafters(target)["self"], TreeParams(draft_width=4, draft_depth=D_MAX,
                                                                   verify_width=8, top_k=1))
    pattern = [(0, 1, 1), (1, 1, 2), (0, 1, 1), (0, 1, 1), (0, 1, 1), (3, 1, 4), (1, 1, 2), (0, 1, 1)]

    for i, p in enumerate(PROMPTS):
        pol, records = Scripted(pattern), []

        def on_step(rec):
            records.append(rec)
            pol.i += 1

        res = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=pol, on_step=on_step)
        assert res.token_ids == plain[i]
        assert res.stats["resyncs"] >= 2
        left = NEW - 1  # the first token comes from the prefill
        for rec in records:
            d = rec.choice.draft_depth
            if d:  # whole chain accepted, unless the token budget cut it short
                assert rec.n_accepted == min(d, left - 1), (i, rec.committed, d, rec.n_accepted)
            left -= 1 + rec.n_accepted


def assert_holds_causal_run(drafter, tgt, tokens: list[int], L: int, n_slots: int) -> None:
    """Every drafter cache entry of slots 1..L equals a causal run of the head over ``tokens`` with
    the target's true features."""
    from test_eagle import true_features

    seq = torch.tensor(tokens)
    feat = drafter.net.fuse_target((true_features(tgt, seq[:L], n_slots),))  # [L, H]
    fresh = bigram_head(tgt, max_depth=D_MAX)
    fresh.setup(n_slots, [8, 1], 8)
    slot = torch.arange(1, L + 1)
    cols = torch.arange(n_slots)
    fresh.net(seq[1 : L + 1], feat, slot - 1, slot, (cols[None, :] >= 1) & (cols[None, :] <= slot[:, None]))
    live = slice(1, L + 1)
    for got, want in zip(drafter.net.caches(), fresh.net.caches(), strict=True):
        torch.testing.assert_close(got.k[:, live], want.k[:, live], atol=1e-5, rtol=1e-4)  # [B, S, H, D]
        torch.testing.assert_close(got.v[:, live], want.v[:, live], atol=1e-5, rtol=1e-4)


def test_a_short_catch_up_is_left_to_the_eagle_heads_call(target):
    """After a few plain steps the EAGLE drafter's catch-up rides on its next head call (Drafter.defer:
    the pairs it lacks pend beside the root's) instead of a prefill chunk's call, which costs a 4-bit
    target's plain step however few of its rows are new; a longer lag still goes through the prefill.
    Output stays the plain decoding's, and every committed drafter cache entry equals a causal run of
    the head over the committed sequence with the target's true features."""
    from test_eagle import tiny as eagle_tiny

    tgt = eagle_tiny()
    ref = Engine(tgt, EngineConfig(mode="reference", max_context=160, prefill_chunk=8))
    drafter = bigram_head(tgt, max_depth=D_MAX)
    assert drafter.absorbs == D_MAX
    eng = make_engine(tgt, drafter)
    # lags of 1 + accepted + plain-run tokens: 2..5 fit the head (D_MAX = 4 pairs besides the root's), 8+ do not
    pattern = [(2, 1, 2), (0, 1, 1), (1, 2, 4), (0, 1, 1), (0, 1, 1), (2, 2, 4), (0, 1, 1), (0, 1, 1), (0, 1, 1),
               (0, 1, 1), (0, 1, 1), (0, 1, 1), (0, 1, 1), (1, 1, 2)]
    calls = {"prefill": [], "defer": []}
    for name in calls:
        def spy(*a, _orig=getattr(drafter, name), _name=name):
            calls[_name].append(int(a[2]) if len(a) > 2 else 0)
            return _orig(*a)
        setattr(drafter, name, spy)
    heads: list[int] = []
    orig_head = drafter.head

    def head(root, committed, k):
        heads.append(int(committed))
        return orig_head(root, committed, k)

    drafter.head = head

    prompt = PROMPTS[1]
    pol = Scripted(pattern)
    res = eng.generate(prompt, SamplingParams(max_new_tokens=40), policy=pol,
                       on_step=lambda rec: setattr(pol, "i", pol.i + 1))
    assert res.token_ids == ref.generate(prompt, SamplingParams(max_new_tokens=40)).token_ids
    assert calls["defer"] and len(calls["prefill"]) >= 2, calls  # the prompt's, and a lag of 8+ tokens
    assert calls["prefill"][0] == 0 and all(s > 0 for s in calls["prefill"][1:] + calls["defer"])

    L = heads[-1]  # the root of the last head call: the drafter holds slots 1..L
    assert_holds_causal_run(drafter, tgt, prompt + res.token_ids, L, eng.n_slots)


class ByHeads(Scripted):
    """Scripted, catching the drafter up in head calls whenever it is asked."""

    def __init__(self, pattern) -> None:
        super().__init__(pattern)
        self.asked: list[tuple[int, int]] = []

    def catch_up_by_heads(self, behind, committed):
        self.asked.append((behind, committed))
        return True


def test_a_long_catch_up_in_head_calls_holds_what_a_prefill_would(target):
    """A policy may have the EAGLE drafter catch up a lag longer than its head call holds in head
    calls of D_MAX + 1 new tokens each (Drafter.absorb) instead of prefill chunks: asked only for
    such lags, the output stays the plain decoding's, and every committed drafter cache entry
    equals a causal run of the head over the committed sequence with the target's true features."""
    from test_eagle import tiny as eagle_tiny

    tgt = eagle_tiny()
    ref = Engine(tgt, EngineConfig(mode="reference", max_context=160, prefill_chunk=8))
    drafter = bigram_head(tgt, max_depth=D_MAX)
    eng = make_engine(tgt, drafter)
    # lags: 2..5 fit the head (D_MAX = 4 pairs besides the root's); 8 and 13 take 1 and 2 head calls
    pattern = [(2, 1, 2), (0, 1, 1), (1, 2, 4), *[(0, 1, 1)] * 7, (2, 2, 4), *[(0, 1, 1)] * 12, (1, 1, 2)]
    calls = {"prefill": [], "absorb": [], "head": []}
    for name in calls:
        def spy(*a, _orig=getattr(drafter, name), _name=name):
            calls[_name].append(int(a[2]) if _name != "head" else int(a[1]))
            return _orig(*a)
        setattr(drafter, name, spy)
    prompt = PROMPTS[1]
    pol = ByHeads(pattern)
    res = eng.generate(prompt, SamplingParams(max_new_tokens=60), policy=pol,
                       on_step=lambda rec: setattr(pol, "i", pol.i + 1))
    assert res.token_ids == ref.generate(prompt, SamplingParams(max_new_tokens=60)).token_ids
    assert not calls["prefill"] and calls["absorb"][0] == 0  # the prompt's (deferred to the first tree) too
    assert pol.asked and all(behind > D_MAX for behind, _ in pol.asked)
    assert len(calls["absorb"]) == len(pol.asked) >= 3
    L = calls["head"][-1]  # the root of the last head call: the drafter holds slots 1..L
    assert_holds_causal_run(drafter, tgt, prompt + res.token_ids, L, eng.n_slots)


def test_a_catch_up_in_head_calls_takes_absorbs_plus_one_tokens_a_call(target):
    """Drafter.absorb of m tokens behind: ceil((m - D_MAX) / (D_MAX + 1)) head calls at the
    roots a prefill's grid would not need, the last D_MAX or fewer pending (cost.catch_up_heads
    counts the same calls)."""
    from yggtree.runtime.cost import catch_up_heads

    drafter = EagleDrafter.random(target, "reference", max_depth=D_MAX)
    drafter.setup(64, [1], 8)
    seq, feats = torch.arange(3, 33), (torch.zeros(30, target.cfg.hidden_size),)
    for start, roots in ((30 - D_MAX, []), (30 - D_MAX - 1, [30 - 1]), (12, [16, 21, 26]), (0, [5, 10, 15, 20, 25])):
        heads = []
        drafter.head = lambda root, committed, k, _h=heads: _h.append(int(committed))
        drafter.absorb(seq, feats, start, 3)
        assert heads == roots and catch_up_heads(30 - max(start, 1), D_MAX) == len(roots)
        pend = 30 - (roots[-1] + 1 if roots else max(start, 1))
        assert int(drafter.pend_n) == pend and torch.equal(drafter.pend_tok[:pend], seq[30 - pend:])
    assert catch_up_heads(9, 0) == 0 and catch_up_heads(4, 4) == 0 and catch_up_heads(5, 4) == 1


def test_a_deferred_catch_up_is_refused_beyond_what_the_head_holds(target):
    drafter = EagleDrafter.random(target, "reference", max_depth=D_MAX)
    drafter.setup(64, [1], 8)
    seq, feats = torch.arange(3, 23), (torch.zeros(20, target.cfg.hidden_size),)
    drafter.defer(seq, feats, 20 - D_MAX)  # D_MAX pairs: the head's width holds them and the root
    assert int(drafter.pend_n) == D_MAX and torch.equal(drafter.pend_tok[:D_MAX], seq[-D_MAX:])
    for start in (20 - D_MAX - 1, 0):
        with pytest.raises(YggError, match="deferred catch-up"):
            drafter.defer(seq, feats, start)


class AfterHead(Cycling):
    """Asks for a one-call tree before the head, then takes Cycling's (D >= 1, W_d) after it."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def choose_draft(self, h_root, committed):
        d, _, _ = self.CHOICES[self.i % len(self.CHOICES)]
        self.asked.append(("draft", committed))
        return StepChoice(1, 1) if d else StepChoice(0, 1)

    def after_head(self, h_root, head_logp, choice, committed):
        self.asked.append(("head", committed, choice, tuple(head_logp.shape)))
        assert choice == StepChoice(1, 1) and h_root.shape == (self.hidden_size,)
        assert bool((head_logp[:-1] >= head_logp[1:]).all()) and bool((head_logp <= 0).all())
        d, wd, _ = self.CHOICES[self.i % len(self.CHOICES)]
        return StepChoice(d, wd)


@pytest.mark.parametrize("kind", ["other-lm", "eagle-random"])
def test_a_choice_after_the_head_keeps_greedy_output(target, plain, kind):
    """A policy may change (D, W_d) once the head's top-k is known: the tree drafted is the one
    chosen after the head, output stays plain greedy decoding, and it is asked once per tree step,
    after choose_draft and before choose_verify."""
    eng = make_engine(target, drafters(target)[kind])
    for i, p in enumerate(PROMPTS):
        pol, records = AfterHead(target.cfg.hidden_size), []

        def on_step(rec):
            records.append(rec)
            pol.advance_if_plain(rec)

        res = eng.generate(p, SamplingParams(max_new_tokens=NEW), policy=pol, on_step=on_step)
        assert res.token_ids == plain[i], f"prompt {i}"
        for j, rec in enumerate(records):
            d, wd, wv = Cycling.CHOICES[j % len(Cycling.CHOICES)]
            assert rec.choice == StepChoice(d, wd if d else 1)
            if d:
                assert rec.tree.num_nodes == 1 + d * wd and rec.verify_width == wv
        kinds = [a[0] for a in pol.asked if a[0] != "catch_up"]
        assert kinds.count("head") == sum(r.choice.draft_depth > 0 for r in records)
        for a, b in zip(kinds, kinds[1:]):
            assert (a, b) in {("draft", "head"), ("head", "verify"), ("verify", "draft"),
                              ("draft", "draft")}
        assert all(a[3] == (TREE.top_k,) for a in pol.asked if a[0] == "head")


def test_a_plain_step_after_the_head_is_refused(target):
    eng = make_engine(target, LMDrafter(target.shared_copy(), "reference"))

    class Backing(Cycling):
        def choose_draft(self, h_root, committed):
            return StepChoice(1, 1)

        def after_head(self, h_root, head_logp, choice, committed):
            return StepChoice(0, 1)

    with pytest.raises(YggError, match="plain step after the drafter's head ran"):
        eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=5), policy=Backing())
