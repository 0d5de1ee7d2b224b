"""EGT drafting: equals a plain-Python best-first reference, reproduces chains and full k-ary
trees, survives an exhausted pool, and runs on meta tensors (no host sync)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yggtree.runtime.drafters import TopK
from yggtree.runtime import egt as egt_module
from yggtree.runtime.egt import EGTState, draft_tree, egt_expand, egt_feed_inputs, egt_init, egt_select
from yggtree.runtime.tree import ancestor_mask, check_invariants

# ---------------------------------------------------------------- fake drafter + reference


def fake_topk(gen: torch.Generator, w: int, k: int, ties: bool, vocab: int = 50, dups: bool = False):
    """Random top-k output for w fed nodes: distinct tokens (``dups``: drawn from 2 tokens, so
    siblings repeat tokens, as merged proposals can), log-probs sorted descending."""
    if dups:
        tok = torch.randint(0, 2, (w, k), generator=gen)
    else:
        tok = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(w)])
    if ties:  # coarse values so that equal path scores are common
        lp = -torch.randint(0, 3, (w, k), generator=gen).float()
    else:
        lp = -torch.rand(w, k, generator=gen) * 4
    lp = lp.sort(dim=1, descending=True).values
    return tok, lp


def run_egt(d_max: int, w_d: int, k: int, seed: int, ties: bool, dups: bool = False):
    """Run EGT for d_max steps; return the final state and every drafter output used."""
    gen = torch.Generator().manual_seed(seed)
    root_tok, root_lp = fake_topk(gen, 1, k, ties, dups=dups)
    state = egt_init(torch.tensor(7), root_tok[0], root_lp[0], d_max, w_d)
    outputs = [(root_tok[0], root_lp[0])]
    for step in range(d_max):
        state, fed = egt_select(state, step)
        check_invariants(state.tree)
        # greedy invariant: this step's picks score >= everything left in the pool
        picked = state.tree.logp[fed][state.tree.valid[fed]]
        if picked.numel():
            assert bool(picked.min() >= state.cand_score.max())
        tok, lp = fake_topk(gen, w_d, k, ties, dups=dups)
        outputs.append((tok, lp))
        state = egt_expand(state, fed, tok, lp)
    return state, outputs


def reference_egt(d_max: int, w_d: int, k: int, outputs):
    """Best-first growth in plain Python: each step takes the w_d best pool entries by
    (score descending, pool slot ascending); pool slot = node * k + child rank."""
    f32 = np.float32
    token, parent, logp, valid = [7], [0], [f32(0.0)], [True]
    pool = {}  # slot -> (score, token)
    tok0, lp0 = outputs[0]
    for r in range(k):
        pool[r] = (f32(lp0[r].item()), int(tok0[r]))
    for step in range(d_max):
        ranked = sorted(pool.items(), key=lambda kv: (-kv[1][0], kv[0]))[:w_d]
        fed = []
        for slot, (score, tok) in ranked:
            del pool[slot]
            token.append(tok)
            parent.append(slot // k)
            logp.append(score)
            valid.append(True)
            fed.append(len(token) - 1)
        while len(fed) < w_d:  # pool exhausted: invalid slots
            token.append(0)
            parent.append(0)
            logp.append(f32(-np.inf))
            valid.append(False)
            fed.append(len(token) - 1)
        tok, lp = outputs[step + 1]
        for i, node in enumerate(fed):
            if valid[node]:
                for r in range(k):
                    pool[node * k + r] = (f32(logp[node] + f32(lp[i, r].item())), int(tok[i, r]))
    depth = [0] * len(parent)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1 if valid[i] else 0
    return token, parent, depth, valid, [float(x) for x in logp]


def full_tree_parents(k: int, levels: int) -> list[int]:
    n = sum(k**l for l in range(levels + 1))
    return [0] + [(i - 1) // k for i in range(1, n)]


# ---------------------------------------------------------------- tests


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_matches_best_first_reference(d_max, w_d, k, seed, ties) -> None:
    state, outputs = run_egt(d_max, w_d, k, seed, ties)
    token, parent, depth, valid, logp = reference_egt(d_max, w_d, k, outputs)
    t = state.tree
    assert t.num_nodes == 1 + d_max * w_d
    assert state.cand_score.shape == (t.num_nodes * k,)
    assert t.token.tolist() == token
    assert t.parent.tolist() == parent
    assert t.depth.tolist() == depth
    assert t.valid.tolist() == valid
    assert t.logp.tolist() == logp


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(2, 4), st.integers(0, 2**31 - 1))
def test_duplicate_sibling_tokens_change_nothing(d_max, w_d, k, seed) -> None:
    """Siblings with equal tokens (k children drawn from 2 tokens) are distinct nodes: EGT still
    equals the best-first reference, and greedy acceptance follows the first matching sibling
    and stays on the target's argmax chain."""
    from yggtree.runtime.accept import greedy_accept

    state, outputs = run_egt(d_max, w_d, k, seed, ties=False, dups=True)
    token, parent, depth, valid, logp = reference_egt(d_max, w_d, k, outputs)
    t = state.tree
    assert (t.token.tolist(), t.parent.tolist(), t.valid.tolist()) == (token, parent, valid)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t.num_nodes, 2, generator=gen)  # the target's argmax: token 0 or 1
    acc = greedy_accept(t, logits, max_depth=d_max)
    node = 0
    for u in acc.path[1 : int(acc.n_accepted) + 1].tolist():
        assert parent[u] == node and token[u] == int(logits[node].argmax())
        first = min(i for i in range(1, len(token)) if valid[i] and parent[i] == node and token[i] == token[u])
        assert u == first  # the lowest-index matching sibling
        node = u
    assert acc.emitted()[-1] == int(logits[node].argmax())  # the bonus token: argmax after the path
    nxt = [i for i in range(1, len(token)) if valid[i] and parent[i] == node and token[i] == acc.emitted()[-1]]
    assert nxt == [] or int(acc.n_accepted) == d_max  # stopped only where no child matches


def test_duplicate_sibling_trees_do_occur() -> None:
    """(the property above draws trees like this one: siblings sharing a token)"""
    state, _ = run_egt(3, 4, 4, seed=1, ties=False, dups=True)
    t = state.tree
    kids = [(p, tok) for i, (p, tok, ok) in enumerate(zip(t.parent.tolist(), t.token.tolist(),
                                                           t.valid.tolist())) if i and ok]
    assert len(set(kids)) < len(kids)


def test_k1_w1_is_the_greedy_chain() -> None:
    d_max = 6
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 100, (d_max + 1,), generator=gen)
    state = egt_init(torch.tensor(1), toks[:1], torch.tensor([-0.5]), d_max, 1)
    for step in range(d_max):
        state, fed = egt_select(state, step)
        state = egt_expand(state, fed, toks[step + 1 :][:1][None], torch.tensor([[-0.5]]))
    t = state.tree
    check_invariants(t)
    assert t.parent.tolist() == [0] + list(range(d_max))
    assert t.depth.tolist() == list(range(d_max + 1))
    assert t.token.tolist() == [1] + toks[:d_max].tolist()
    assert torch.allclose(t.logp, -0.5 * torch.arange(d_max + 1).float())


def test_w1_extends_the_best_chain_when_the_drafter_is_confident() -> None:
    """W_d = 1 with k = 3: the top child always beats every sibling, so EGT builds the chain of
    argmax tokens, while the siblings remain in the pool."""
    d_max, k = 5, 3
    lp = torch.tensor([-0.01, -6.0, -7.0])
    state = egt_init(torch.tensor(0), torch.tensor([10, 11, 12]), lp, d_max, 1)
    for step in range(d_max):
        state, fed = egt_select(state, step)
        base = 10 * (step + 2)
        state = egt_expand(state, fed, torch.tensor([[base, base + 1, base + 2]]), lp[None])
    t = state.tree
    assert t.parent.tolist() == [0, 0, 1, 2, 3, 4]
    assert t.token.tolist() == [0, 10, 20, 30, 40, 50]
    assert int(torch.isfinite(state.cand_score).sum()) == 2 * d_max + 3


@pytest.mark.parametrize(
    "k,w_d,d_max,levels",
    [(2, 2, 7, 3), (3, 3, 4, 2), (2, 1, 14, 3), (4, 4, 5, 2), (1, 1, 4, 4)],
)
def test_equal_child_logps_give_a_full_k_ary_tree(k, w_d, d_max, levels) -> None:
    """All child log-probs equal: every level beats every deeper node, so with d_max * w_d =
    k + k^2 + ... + k^levels the tree is the full k-ary tree, in BFS (heap) order.

    (w_d <= k is needed: a step can only pick candidates whose parent was fed in an earlier
    step, so e.g. w_d = 6, k = 2 cannot take grandchildren of the root in one step.)"""
    assert d_max * w_d == sum(k**l for l in range(1, levels + 1))
    c = -float(np.log(k)) if k > 1 else -0.3
    lp = torch.full((k,), c)
    state = egt_init(torch.tensor(0), torch.arange(k), lp, d_max, w_d)
    for step in range(d_max):
        state, fed = egt_select(state, step)
        tok = (fed[:, None] * k + torch.arange(k)) + 1  # token = heap index of the child
        state = egt_expand(state, fed, tok, lp.expand(w_d, k))
    t = state.tree
    check_invariants(t)
    want = full_tree_parents(k, levels)
    assert t.parent.tolist() == want
    assert t.valid.all()
    # the children of node u carry tokens u*k + 1 .. u*k + k, i.e. the heap index (root: 0..k-1)
    assert t.token[k + 1 :].tolist() == list(range(k + 1, len(want)))


def test_exhausted_pool_leaves_invalid_slots() -> None:
    """k = 1, W_d = 3: only one finite candidate per step; the other two slots are invalid and
    the (finite!) drafter outputs fed for them never enter the pool."""
    d_max, w_d = 3, 3
    state = egt_init(torch.tensor(5), torch.tensor([6]), torch.tensor([-0.1]), d_max, w_d)
    for step in range(d_max):
        state, fed = egt_select(state, step)
        assert fed.tolist() == list(range(1 + step * w_d, 1 + (step + 1) * w_d))
        tok = torch.tensor([[20 + step], [90], [91]])
        state = egt_expand(state, fed, tok, torch.full((w_d, 1), -0.1))
        assert int(torch.isfinite(state.cand_score).sum()) == 1
    t = state.tree
    check_invariants(t)
    assert t.valid.tolist() == [True, True, False, False, True, False, False, True, False, False]
    assert t.parent.tolist() == [0, 0, 0, 0, 1, 0, 0, 4, 0, 0]
    assert t.token[t.valid].tolist() == [5, 6, 20, 21]
    assert torch.isinf(t.logp[~t.valid]).all()


def test_no_candidates_at_all() -> None:
    state = egt_init(
        torch.tensor(5), torch.tensor([1, 2]), torch.full((2,), float("-inf")), 2, 2
    )
    for step in range(2):
        state, fed = egt_select(state, step)
        state = egt_expand(state, fed, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2))
    check_invariants(state.tree)
    assert state.tree.valid.tolist() == [True, False, False, False, False]


def test_feed_inputs() -> None:
    state, _ = run_egt(3, 2, 2, seed=3, ties=False)
    fed = torch.tensor([5, 6])
    tok, pos, rows = egt_feed_inputs(state, fed, torch.tensor(40))
    t = state.tree
    assert tok.tolist() == t.token[fed].tolist()
    assert pos.tolist() == (40 + t.depth[fed]).tolist()
    assert torch.equal(rows, ancestor_mask(t.parent, t.depth, t.valid, 3)[fed])


class Replay:
    """A drafter replaying ``run_egt``'s outputs: each step checks what it is fed and returns the
    next recorded top-k."""

    def __init__(self, outputs, feeds_leaves: bool) -> None:
        self.outputs, self.feeds_leaves, self.calls = outputs[1:], feeds_leaves, 0

    def step(self, tokens, pos, fed, parent, rows, L, k):
        tok, lp = self.outputs[self.calls]
        assert tokens.shape == fed.shape == parent.shape == (tok.shape[0],) and rows.shape[0] == tok.shape[0]
        assert bool((pos >= 0).all()) and tok.shape[1] == k
        self.calls += 1
        return TopK(tok, lp)


@pytest.mark.parametrize("feeds_leaves", [True, False])
def test_draft_tree_is_the_egt_loop_with_a_drafter(feeds_leaves) -> None:
    """draft_tree over a drafter replaying recorded proposals builds run_egt's tree; a drafter
    that does not feed leaves is not called for the last level (never picked from)."""
    d_max, w_d, k = 4, 3, 2
    state, outputs = run_egt(d_max, w_d, k, seed=5, ties=False)
    drafter = Replay(outputs, feeds_leaves)
    head = TopK(outputs[0][0][None], outputs[0][1][None])
    tree, calls = draft_tree(drafter, torch.tensor(7), head, d_max, w_d, torch.tensor(30), k)
    assert calls == drafter.calls == d_max - 1 + int(feeds_leaves)
    for name in ("token", "parent", "depth", "valid", "logp"):
        assert torch.equal(getattr(tree, name), getattr(state.tree, name)), name


class Recording(Replay):
    """Replay that records every call's inputs."""

    def __init__(self, outputs, feeds_leaves=True):
        super().__init__(outputs, feeds_leaves)
        self.inputs = []

    def step(self, tokens, pos, fed, parent, rows, L, k):
        self.inputs.append(tuple(t.clone() for t in (tokens, pos, fed, parent, rows)))
        return super().step(tokens, pos, fed, parent, rows, L, k)


@settings(max_examples=150, deadline=None)
@given(d_max=st.integers(1, 5), w_d=st.integers(1, 4), k=st.integers(1, 4), seed=st.integers(0, 10**6),
       ties=st.booleans(), dups=st.booleans(), feeds_leaves=st.booleans())
def test_the_host_loop_builds_the_device_loops_tree_and_calls(d_max, w_d, k, seed, ties, dups, feeds_leaves) -> None:
    """On a CPU draft_tree keeps the EGT state in numpy: the same tree bit for bit and the same
    drafter inputs at every level as the tensor functions, ties, duplicates and exhausted pools
    included."""
    gen = torch.Generator().manual_seed(seed)
    outputs = [fake_topk(gen, 1 if i == 0 else w_d, k, ties, dups=dups) for i in range(d_max + 1)]
    head = TopK(outputs[0][0], outputs[0][1])
    runs = []
    for loop in (egt_module._draft_tree_host, egt_module._draft_tree_device):
        drafter = Recording(outputs, feeds_leaves)
        tree, calls = loop(drafter, torch.tensor(7), head, d_max, w_d, torch.tensor(30), k)
        runs.append((tree, calls, drafter.inputs))
    (t_host, c_host, in_host), (t_dev, c_dev, in_dev) = runs
    assert c_host == c_dev and len(in_host) == len(in_dev)
    for name in ("token", "parent", "depth", "valid", "logp"):
        a, b = getattr(t_host, name), getattr(t_dev, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for a, b in zip(in_host, in_dev):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_device_side_on_meta() -> None:
    """The whole drafting loop runs on meta tensors: it never branches on tensor values."""
    d_max, w_d, k = 3, 2, 4
    m = "meta"
    state = egt_init(
        torch.tensor(1, device=m), torch.zeros(k, dtype=torch.long, device=m),
        torch.zeros(k, device=m), d_max, w_d,
    )
    for step in range(d_max):
        state, fed = egt_select(state, step)
        egt_feed_inputs(state, fed, torch.tensor(3, device=m))
        state = egt_expand(
            state, fed, torch.zeros(w_d, k, dtype=torch.long, device=m),
            torch.zeros(w_d, k, device=m),
        )
    assert isinstance(state, EGTState)
    assert state.tree.token.device.type == "meta" and state.tree.token.shape == (7,)


@pytest.mark.slow  # dynamo traces it (torch.compile, eager backend): no compiler in the unit run
def test_drafting_and_pruning_trace_as_one_static_graph() -> None:
    """D EGT steps + top-k pruning + re-indexing: dynamo captures one graph (no host sync)."""
    from yggtree.runtime.prune import prune_topk, subtree

    def draft(root, tk, tl, step_tok, step_lp):
        state = egt_init(root, tk, tl, 3, 2)
        for step in range(3):
            state, fed = egt_select(state, step)
            state = egt_expand(state, fed, step_tok[step], step_lp[step])
        kept, ok = prune_topk(state.tree, state.tree.logp.exp(), 4)
        sub = subtree(state.tree, kept, ok)
        return sub.token, sub.parent, sub.valid

    g = torch.Generator().manual_seed(0)
    args = (torch.tensor(1), torch.tensor([2, 3]), torch.tensor([-0.1, -2.0]),
            torch.randint(0, 9, (3, 2, 2), generator=g), -torch.rand(3, 2, 2, generator=g))
    torch._dynamo.reset()
    got = torch.compile(draft, backend="eager", fullgraph=True)(*args)
    for a, b in zip(got, draft(*args)):
        assert torch.equal(a, b)


def test_select_rejects_bad_step() -> None:
    state = egt_init(torch.tensor(1), torch.tensor([2]), torch.tensor([0.0]), 2, 1)
    with pytest.raises(ValueError, match="step 2 outside"):
        egt_select(state, 2)
