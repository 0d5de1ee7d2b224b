"""Acceptance: greedy walks on hand-built trees, top-p filtering by hand, truncation, and
statistical losslessness of sampling (chi-square against exact target probabilities)."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from yggtree.runtime.accept import (
    Accepted,
    argmax,
    filter_probs,
    greedy_accept,
    sample_accept,
    sample_tokens,
    truncate,
    walk,
)
from yggtree.runtime.tree import Tree, build_tree


def onehot_logits(argmaxes: list[int], v: int = 12) -> torch.Tensor:
    lg = torch.zeros(len(argmaxes), v)
    lg[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return lg


def with_tokens(tree: Tree, slots: list[int], tokens: list[int]) -> Tree:
    tok = tree.token.clone()
    tok[slots] = torch.tensor(tokens, dtype=torch.int64)
    return Tree(tok, tree.parent, tree.depth, tree.valid, tree.logp)


# ---------------------------------------------------------------- greedy


def test_greedy_accepts_the_full_chain() -> None:
    tree = build_tree([0, 0, 1, 2], [9, 3, 4, 5])
    acc = greedy_accept(tree, onehot_logits([3, 4, 5, 6]))
    assert acc.emitted() == [3, 4, 5, 6]
    assert int(acc.n_accepted) == 3
    assert acc.path.tolist() == [0, 1, 2, 3]
    assert acc.tokens.tolist() == [3, 4, 5, 6]


def test_greedy_rejects_at_the_root() -> None:
    tree = build_tree([0, 0, 1, 2], [9, 3, 4, 5])
    acc = greedy_accept(tree, onehot_logits([7, 4, 5, 6]))
    assert acc.emitted() == [7]
    assert int(acc.n_accepted) == 0
    assert acc.path.tolist() == [0, 0, 0, 0]
    assert acc.tokens.tolist() == [7, 7, 7, 7]  # padded with the bonus


def test_greedy_picks_the_matching_sibling() -> None:
    #        0[9]
    #      /  |   \
    #   1[3] 2[4] 3[5]
    #         |
    #        4[6]
    tree = build_tree([0, 0, 0, 0, 2], [9, 3, 4, 5, 6])
    acc = greedy_accept(tree, onehot_logits([4, 1, 6, 1, 8]))
    assert acc.emitted() == [4, 6, 8]
    assert acc.path.tolist() == [0, 2, 4, 4, 4]
    acc = greedy_accept(tree, onehot_logits([4, 1, 6, 1, 8]), max_depth=2)
    assert acc.path.tolist() == [0, 2, 4] and acc.emitted() == [4, 6, 8]


def test_greedy_ignores_invalid_children_and_the_root() -> None:
    # padded slots 3, 4 (parent 0) carry the target's argmax token; so does the root itself
    tree = with_tokens(build_tree([0, 0, 1], [9, 3, 4], size=5), [3, 4], [7, 7])
    acc = greedy_accept(tree, onehot_logits([7, 1, 1, 1, 1]))
    assert acc.emitted() == [7] and acc.path.tolist() == [0, 0, 0, 0, 0]
    acc = greedy_accept(tree, onehot_logits([9, 1, 1, 1, 1]))  # root token: not a child
    assert acc.emitted() == [9] and int(acc.n_accepted) == 0
    # the invalid slot's logits are never read
    lg = onehot_logits([3, 4, 2, 1, 1])
    lg[3:] = float("nan")
    assert greedy_accept(tree, lg).emitted() == [3, 4, 2]


def test_greedy_duplicate_children_take_the_lowest_index() -> None:
    tree = build_tree([0, 0, 0, 2], [9, 3, 3, 5])
    acc = greedy_accept(tree, onehot_logits([3, 5, 5, 1]))
    assert acc.path.tolist()[:2] == [0, 1] and acc.emitted() == [3, 5]


def test_greedy_ties_take_the_lowest_token() -> None:
    tree = build_tree([0], [9])
    assert greedy_accept(tree, torch.tensor([[0.0, 2.0, 2.0]])).emitted() == [1]


def python_walk(parent, token, valid, choice):
    u, out = 0, []
    while True:
        kids = [c for c in range(1, len(parent)) if valid[c] and parent[c] == u
                and token[c] == choice[u]]
        if not kids:
            return out + [choice[u]]
        u = kids[0]
        out.append(token[u])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_greedy_matches_a_python_walk(n, n_pad, seed) -> None:
    rng = random.Random(seed)
    parent = [0] + [rng.randrange(i) for i in range(1, n)]
    tree = build_tree(parent, [rng.randrange(3) for _ in range(n)], size=n + n_pad)
    tree = with_tokens(tree, list(range(n, n + n_pad)), [rng.randrange(3) for _ in range(n_pad)])
    lg = torch.randn(n + n_pad, 3, generator=torch.Generator().manual_seed(seed))
    acc = greedy_accept(tree, lg)
    want = python_walk(tree.parent.tolist(), tree.token.tolist(), tree.valid.tolist(),
                       lg.argmax(-1).tolist())
    assert acc.emitted() == want
    assert acc.tokens.shape == (n + n_pad,)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.integers(0, 3), st.integers(0, 2**31 - 1), st.integers(0, 4))
def test_host_walk_equals_the_tensor_walk(n, n_pad, seed, depth_cut) -> None:
    """The CPU's list walk and the device-side tensor walk: the same path, count and tokens,
    padded alike, at any max_depth (shorter than the tree too)."""
    from yggtree.runtime.accept import walk_lists, walk_tensors

    rng = random.Random(seed)
    parent = [0] + [rng.randrange(i) for i in range(1, n)]
    tree = build_tree(parent, [rng.randrange(3) for _ in range(n)], size=n + n_pad)
    tree = with_tokens(tree, list(range(n, n + n_pad)), [rng.randrange(3) for _ in range(n_pad)])
    choice = torch.randint(0, 3, (n + n_pad,), generator=torch.Generator().manual_seed(seed))
    d = max(n + n_pad - 1 - depth_cut, 0)
    a, b = walk_lists(tree, choice, d), walk_tensors(tree, choice, d)
    for x, y in ((a.path, b.path), (a.n_accepted, b.n_accepted), (a.tokens, b.tokens)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_greedy_on_meta() -> None:
    w, v = 6, 11
    m = "meta"
    tree = Tree(*(torch.zeros(w, dtype=torch.long, device=m) for _ in range(3)),
                torch.zeros(w, dtype=torch.bool, device=m), torch.zeros(w, device=m))
    acc = greedy_accept(tree, torch.zeros(w, v, device=m), max_depth=3)
    assert isinstance(acc, Accepted) and acc.path.shape == (4,) and acc.tokens.device.type == m


# ---------------------------------------------------------------- filter_probs and truncate


def test_filter_probs_by_hand() -> None:
    lg = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    torch.testing.assert_close(filter_probs(lg, 1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # mass before 0.15 is exactly 0.8: 0.8 is reached with two tokens
    torch.testing.assert_close(filter_probs(lg, 1.0, 0.8), torch.tensor([0.625, 0.375, 0, 0]))
    torch.testing.assert_close(
        filter_probs(lg, 1.0, 0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95
    )
    torch.testing.assert_close(filter_probs(lg, 1.0, 1e-6), torch.tensor([1.0, 0, 0, 0]))
    # temperature 0.5 squares and renormalises the probabilities
    sq = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    torch.testing.assert_close(filter_probs(lg, 0.5, 1.0), sq / sq.sum())
    # batched, any leading shape; order in the vocabulary does not matter
    lg2 = torch.stack([lg, lg.flip(0)])[None]
    out = filter_probs(lg2, 1.0, 0.8)
    assert out.shape == (1, 2, 4)
    torch.testing.assert_close(out[0, 1], torch.tensor([0, 0, 0.375, 0.625]))
    # ties are ordered by token id
    tie = filter_probs(torch.zeros(4), 1.0, 0.5)
    torch.testing.assert_close(tie, torch.tensor([0.5, 0.5, 0, 0]))
    with pytest.raises(ValueError):
        filter_probs(lg, 0.0, 1.0)
    with pytest.raises(ValueError):
        filter_probs(lg, 1.0, 0.0)


def test_truncate() -> None:
    assert truncate([5, 2, 7], {2}, 10) == ([5, 2], "stop")
    assert truncate([5, 6, 7], {2}, 2) == ([5, 6], "length")
    assert truncate([5, 6, 7], {2}, 3) == ([5, 6, 7], "length")
    assert truncate([5, 6], {2}, 5) == ([5, 6], None)
    assert truncate([5, 6, 2], {2}, 2) == ([5, 6], "length")  # EOS beyond the budget
    assert truncate([5, 2], {2, 3}, 2) == ([5, 2], "stop")  # EOS exactly at the budget
    assert truncate([3, 2], {2, 3}, 9) == ([3], "stop")
    assert truncate([5], {2}, 0) == ([], "length")


def test_sample_tokens_inverts_the_cdf() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.75, 0.0, 0.0]])
    assert sample_tokens(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert sample_tokens(probs, torch.tensor([0.5, 0.2499])).tolist() == [3, 0]
    assert sample_tokens(probs, torch.tensor([0.9999999, 0.25])).tolist() == [3, 1]
    # out-of-contract u = 1 still never yields a zero-probability token
    assert sample_tokens(probs, torch.tensor([1.0, 1.0])).tolist() == [3, 1]
    # midpoint quadrature over [0, 1): the counts are the probabilities (unnormalised rows ok)
    m = 4096
    p = torch.tensor([0.125, 0.0, 0.375, 0.25, 0.25]) * 3
    got = sample_tokens(p.expand(m, 5), (torch.arange(m) + 0.5) / m)
    assert torch.bincount(got, minlength=5).tolist() == [512, 0, 1536, 1024, 1024]


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p mask as filter_probs defines it: each row's full stable descending sort."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.sampled_from([3, 50, 3000]), st.floats(0.01, 0.9999) | st.sampled_from([1 - 1e-7, 1 - 3e-7]),
       st.sampled_from([0.3, 1.0, 2.5]),
       st.sampled_from(["randn", "rounded", "ties", "tail"]), st.integers(0, 2**31 - 1))
def test_the_nucleus_from_the_largest_probabilities_is_the_full_sorts(rows, v, top_p, temperature, kind, seed) -> None:
    """The host path's top-p mask (the entries above a threshold, sorted among themselves) is the full
    stable sort's wherever it settles, and filter_probs returns the same bits either way: rounded
    logits (ties), a block of equal logits, a zero-probability tail."""
    from yggtree.runtime.accept import _nucleus_of_top

    lg = torch.randn(rows, v, generator=torch.Generator().manual_seed(seed)) * 4
    if kind == "rounded":
        lg = lg.round()
    elif kind == "ties":
        lg[:, : v // 2] = lg[:, :1]
    elif kind == "tail":
        lg[:, 2:] = -1e4
    probs = torch.softmax(lg / temperature, dim=-1)
    want = _nucleus_by_full_sort(probs, top_p)
    got = _nucleus_of_top(probs, top_p)
    assert got is None or torch.equal(got, want)
    kept = torch.where(want, probs, 0.0)
    assert torch.equal(filter_probs(lg, temperature, top_p), kept / kept.sum(dim=-1, keepdim=True))


def test_an_entry_past_the_prefix_is_kept_where_the_scans_rounding_says_so(monkeypatch) -> None:
    """A scan's mass before an entry is its scan value less itself in float32, which can sit below the
    prefix's mass: here the prefix of three reaches top_p = 1 - 1e-7 (in float32), yet the fourth entry's
    mass before it (1.0 - 1.6e-7) is below it and the full sort keeps it. The host path must not stop."""
    import yggtree.runtime.accept as accept

    probs = torch.tensor([[0.5504314303398132, 0.41355395317077637, 0.03601449355483055, 1.5697916921908472e-07]
                          + [3.3e-10] * 12])
    want = _nucleus_by_full_sort(probs, 1 - 1e-7)
    assert int(want.sum()) == 4
    got = accept._nucleus_of_top(probs, 1 - 1e-7)
    assert got is None or torch.equal(got, want)
    monkeypatch.setattr(accept, "SCAN_ROUNDING", 0.0)  # the check has teeth: without the margin it stops early
    assert not torch.equal(accept._nucleus_of_top(probs, 1 - 1e-7), want)


def test_a_peaked_distribution_takes_its_nucleus_without_sorting_the_vocabulary(monkeypatch) -> None:
    """A language model's row (a few likely tokens over a long tail) never sorts its vocabulary."""
    lg = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1)) * 2
    lg[:, :20] += 12
    want = filter_probs(lg, 0.7, 0.9)

    def no_sort(*a, **k):
        raise AssertionError("sorted the whole vocabulary")

    monkeypatch.setattr(torch, "sort", no_sort)
    assert torch.equal(filter_probs(lg, 0.7, 0.9), want)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_the_host_draw_is_the_branchless_draw(rows, v, seed) -> None:
    """sample_tokens on the host skips the last-positive scan unless a draw rounds past the top end:
    the same token as the device path's for every row, zero-probability entries and u near 1 included."""
    import yggtree.runtime.accept as accept

    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, v, generator=g) * (torch.rand(rows, v, generator=g) > 0.4)
    probs[:, 0] += 1e-3  # every row has mass
    u = torch.rand(rows, generator=g)
    u[0] = 0.99999994  # the largest float32 below 1
    host = sample_tokens(probs, u)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accept, "_host", lambda t: False)
        assert torch.equal(host, sample_tokens(probs, u))
    assert bool((probs.gather(-1, host[:, None]) > 0).all())


def test_a_plain_draw_follows_the_filtered_distribution() -> None:
    """choose_token (a plain step's draw: one uniform, the inverse CDF) against the exact law."""
    from yggtree.runtime.stages import choose_token
    from yggtree.shapes import SamplingParams

    lg = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gen = torch.Generator().manual_seed(4)
    counts = np.bincount([choose_token(lg, params, gen) for _ in range(N_DRAWS)], minlength=V)
    assert chi2_pvalue(counts, filter_probs(lg, 0.8, 0.9).double().numpy()) > ALPHA


def test_sample_accept_uses_only_the_given_generator() -> None:
    tree = build_tree([0, 0, 0, 1], [9, 3, 4, 5])
    lg = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    a = [sample_accept(tree, lg, 0.8, 0.95, torch.Generator().manual_seed(5)) for _ in range(2)]
    torch.manual_seed(123)  # the global generator must not matter
    b = sample_accept(tree, lg, 0.8, 0.95, torch.Generator().manual_seed(5))
    assert a[0].tokens.tolist() == a[1].tokens.tolist() == b.tokens.tolist()
    # and it is the walk over inverse-CDF draws from the same uniforms
    u = torch.rand(4, generator=torch.Generator().manual_seed(5))
    c = walk(tree, sample_tokens(filter_probs(lg, 0.8, 0.95), u))
    assert c.tokens.tolist() == b.tokens.tolist()


@pytest.mark.slow  # dynamo traces it (torch.compile, eager backend): no compiler in the unit run
def test_acceptance_traces_as_one_static_graph() -> None:
    """No data-dependent Python control flow or host sync: dynamo captures a single graph."""
    tree = build_tree([0, 0, 0, 1], [9, 3, 4, 5], size=6)
    lg = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    u = torch.rand(6, generator=torch.Generator().manual_seed(1))

    def step(tree: Tree, logits: torch.Tensor, uniform: torch.Tensor):
        greedy = greedy_accept(tree, logits, max_depth=3)
        sampled = walk(tree, sample_tokens(filter_probs(logits, 0.7, 0.9), uniform), 3)
        return greedy.tokens, greedy.n_accepted, sampled.tokens, sampled.path

    torch._dynamo.reset()
    got = torch.compile(step, backend="eager", fullgraph=True)(tree, lg, u)
    want = step(tree, lg, u)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ---------------------------------------------------------------- losslessness

V = 10
PROMPT = (1, 2)
CHAIN = [0, 0, 1, 2]  # root -> 1 -> 2 -> 3
TREE = [0, 0, 0, 0, 1, 1, 4, 2]  # root: 1, 2, 3; 1: 4, 5; 4: 6; 2: 7
N_PAD = 2


def _seeded(ctx: tuple[int, ...], salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(bytes([salt, *ctx])))


class ToyPair:
    """A context -> logits 'target' and a deterministic 'drafter' tree for every context.

    The tree's shape is fixed; node u's children get the top tokens of a noisy copy of the
    target at u's context, so acceptance is frequent but far from certain. Padded slots carry
    the target's most likely root token, to catch walks into invalid nodes."""

    def __init__(self, parent: list[int]):
        self.parent = parent
        self._logits: dict = {}
        self._tree: dict = {}

    def target(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self._logits:
            self._logits[ctx] = 2.0 * torch.randn(V, generator=_seeded(ctx, 1))
        return self._logits[ctx]

    def draft(self, ctx: tuple[int, ...]) -> tuple[Tree, torch.Tensor]:
        if ctx in self._tree:
            return self._tree[ctx]
        n = len(self.parent)
        token = [ctx[-1]] + [0] * (n - 1)
        path = {0: ctx}
        for u in range(n):
            kids = [c for c in range(1, n) if self.parent[c] == u]
            if kids:
                q = self.target(path[u]) + torch.randn(V, generator=_seeded(path[u], 2))
                for c, t in zip(kids, q.argsort(descending=True).tolist()):
                    token[c] = t
                    path[c] = path[u] + (t,)
        tree = build_tree(self.parent, token, size=n + N_PAD)
        top = int(self.target(ctx).argmax())
        tree = with_tokens(tree, list(range(n, n + N_PAD)), [top] * N_PAD)
        logits = torch.stack([self.target(path[u]) for u in range(n)] + [torch.zeros(V)] * N_PAD)
        self._tree[ctx] = (tree, logits)
        return tree, logits


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; zero-probability cells must be empty, cells with expected
    count < 5 are pooled into one."""
    counts, probs = counts.ravel().astype(float), probs.ravel().astype(float)
    assert counts[probs == 0].sum() == 0, "a token the target cannot emit was emitted"
    n = counts.sum()
    exp = probs / probs.sum() * n
    big, small = (probs > 0) & (exp >= 5), (probs > 0) & (exp < 5)
    obs, e = list(counts[big]), list(exp[big])
    if small.any():
        obs.append(counts[small].sum())
        e.append(exp[small].sum())
    return float(chisquare(obs, e).pvalue)


N_DRAWS = 12000
ALPHA = 1e-3


@pytest.mark.parametrize(
    "shape,temperature,top_p,seed",
    [(CHAIN, 1.0, 1.0, 11), pytest.param(TREE, 1.0, 1.0, 12, marks=pytest.mark.slow),
     pytest.param(CHAIN, 0.7, 0.9, 13, marks=pytest.mark.slow), pytest.param(TREE, 0.7, 0.9, 14, marks=pytest.mark.slow)],
    ids=["chain-T1", "tree-T1", "chain-T0.7-p0.9", "tree-T0.7-p0.9"],
)
def test_sampling_is_lossless(one_thread, shape, temperature, top_p, seed) -> None:
    """The first emitted token, and the first two jointly (spanning a second decoding step when
    only the bonus was emitted), follow the target's filtered distribution exactly."""
    pair = ToyPair(shape)
    gen = torch.Generator().manual_seed(seed)
    first = np.zeros(V)
    joint = np.zeros((V, V))
    accepted_any = 0  # draws whose first step accepted at least one draft token
    for _ in range(N_DRAWS):
        ctx, out = PROMPT, []
        while len(out) < 2:
            tree, logits = pair.draft(ctx)
            acc = sample_accept(tree, logits, temperature, top_p, gen, max_depth=3)
            em = acc.emitted()
            accepted_any += len(out) == 0 and len(em) > 1
            out += em
            ctx = ctx + tuple(em)
        first[out[0]] += 1
        joint[out[0], out[1]] += 1

    p1 = filter_probs(pair.target(PROMPT), temperature, top_p).double().numpy()
    p2 = np.stack([
        filter_probs(pair.target(PROMPT + (x,)), temperature, top_p).double().numpy()
        for x in range(V)
    ])
    assert chi2_pvalue(first, p1) > ALPHA
    assert chi2_pvalue(joint, p1[:, None] * p2) > ALPHA
    # the test is only meaningful if the tree is actually used
    assert accepted_any > N_DRAWS // 10


def test_the_chi_square_check_catches_a_lossy_scheme() -> None:
    """Power check for the test above: a classic bug (rejected siblings are not removed
    before sampling the bonus) shifts the first-token law enough to fail at N_DRAWS."""
    p = filter_probs(ToyPair(TREE).target(PROMPT), 1.0, 1.0).double().numpy()
    children = np.argsort(-p)[:3]  # a good drafter proposes the three likeliest tokens
    lossy = np.zeros(V)
    reach = 1.0
    for c in children:
        lossy[c] += reach * p[c]
        reach *= 1 - p[c]
    lossy += reach * p  # bug: the bonus is drawn from p, rejected children included
    counts = np.random.default_rng(0).multinomial(N_DRAWS, lossy)
    assert chi2_pvalue(counts, p) < 1e-6
    assert chi2_pvalue(np.random.default_rng(0).multinomial(N_DRAWS, p), p) > ALPHA


def test_argmax_is_torch_argmax_on_ties_nans_and_every_shape():
    """accept.argmax (numpy on the CPU) picks what torch.argmax picks: the first maximum, a NaN
    first, an all -inf row's first entry, over 1-D, 2-D and strided logits of either float."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 300, generator=gen)
    rows[1, [7, 200]] = 9.0  # a tie: the first
    rows[2, [3, 250]] = float("nan")  # NaN counts as the maximum, the first one
    rows[3] = float("-inf")
    rows[4, :] = 1.0
    rows[5, ::3] = rows[5].max() + 1
    for x in (rows, rows[1], rows[:, ::2], rows.t(), rows.double(), rows.half(), rows[:0]):
        got = argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), x.shape
