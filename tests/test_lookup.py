"""The lookup source (n-gram index, proposals) against brute force, and its merge into the tree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yggtree.errors import YggError
from yggtree.runtime.lookup import LookupCalibration, LookupIndex, propose
from yggtree.runtime.merge import SOURCE_BOTH, SOURCE_DRAFTER, SOURCE_LOOKUP, merge_lookup, root_tree
from yggtree.runtime.prune import prune_topk
from yggtree.runtime.tree import build_tree, check_invariants

CAL = LookupCalibration(lengths=(1, 2, 4), shares=(0.0, 0.5, 1.0),
                        table=((0.1, 0.2, 0.3), (0.3, 0.4, 0.6), (0.5, 0.7, 0.9)))

streams = st.lists(st.integers(0, 3), min_size=1, max_size=60)


def brute_match(toks: list[int], k: int) -> tuple[int, list[int]]:
    """Longest n <= k such that the last n tokens also end at an earlier position."""
    i = len(toks) - 1
    for n in range(min(k, i), 0, -1):
        suffix = toks[i - n + 1 :]
        ends = [e for e in range(n - 1, i) if toks[e - n + 1 : e + 1] == suffix]
        if ends:
            return n, ends
    return 0, []


@settings(max_examples=100, deadline=None)
@given(streams, st.integers(1, 6), st.integers(1, 4))
def test_index_matches_brute_force_at_every_prefix(toks, k, chunk):
    idx = LookupIndex(max_order=k)
    for start in range(0, len(toks), chunk):  # fed in pieces, as a decode loop emits
        idx.extend(toks[start : start + chunk])
        seen = toks[: start + chunk]
        assert idx.longest_match() == brute_match(seen, k)


def brute_proposal(toks, calib, budget, depth, occ, k):
    """Continuation counts over the occurrences, path values, best ``budget`` nodes."""
    n, ends = brute_match(toks, k)
    if n == 0:
        return {}
    ends = ends[-occ:]
    conts = [tuple(toks[e + 1 : e + 1 + depth]) for e in ends]
    nodes = {}  # prefix tuple -> count
    for c in conts:
        for j in range(1, len(c) + 1):
            nodes[c[:j]] = nodes.get(c[:j], 0) + 1
    value = {}
    for pre in sorted(nodes, key=len):
        above = len(conts) if len(pre) == 1 else nodes[pre[:-1]]
        p = calib.prob(n + len(pre) - 1, nodes[pre] / above)
        value[pre] = p * (value[pre[:-1]] if len(pre) > 1 else 1.0)
    best = sorted(value.values(), reverse=True)[:budget]
    return {"values": best, "all": value}


@settings(max_examples=100, deadline=None)
@given(streams, st.integers(1, 8), st.integers(1, 5), st.integers(1, 5), st.integers(1, 6))
def test_proposals_match_brute_force(toks, budget, depth, occ, k):
    idx = LookupIndex(max_order=k)
    idx.extend(toks)
    prop = propose(idx, CAL, budget, depth, max_occurrences=occ)
    want = brute_proposal(toks, CAL, budget, depth, occ, k)
    if not want:
        assert len(prop) == 0
        return
    assert len(prop) == min(budget, len(want["all"]))
    assert sorted(prop.value, reverse=True) == pytest.approx(want["values"])
    paths = []  # every node's token path from the root: a real continuation, with its value
    for i in range(len(prop)):
        par = prop.parent[i]
        assert par <= i  # parents come first (0 = the root)
        path = (paths[par - 1] if par else ()) + (prop.token[i],)
        paths.append(path)
        assert prop.depth[i] == len(path)
        assert prop.value[i] == pytest.approx(want["all"][path])
    assert len(set(paths)) == len(paths)  # distinct continuations: no duplicate siblings


def test_longest_match_first_and_distinct_continuations():
    idx = LookupIndex(max_order=4)
    idx.extend([9, 1, 2, 3, 5, 6, 1, 2, 3, 5, 7, 0, 2, 3])  # "2 3" then 5 twice; "1 2 3" absent at the end
    n, ends = idx.longest_match()
    assert (n, ends) == (2, [3, 8])
    prop = propose(idx, CAL, budget=8, max_depth=3)
    assert prop.match == 2
    assert prop.token[0] == 5  # both occurrences agree on the first token
    kids = [prop.token[i] for i in range(len(prop)) if prop.parent[i] == 1]
    assert sorted(kids) == [6, 7]  # then they split


def test_no_match_no_candidates():
    idx = LookupIndex()
    idx.extend([1, 2, 3, 4])
    assert len(propose(idx, CAL, 4, 4)) == 0
    assert idx.longest_match() == (0, [])


def test_calibration_cells_and_refusals(tmp_path):
    assert CAL.prob(1, 0.2) == 0.1 and CAL.prob(3, 0.7) == 0.4 and CAL.prob(9, 1.0) == 0.9
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "nope"}')
    with pytest.raises(YggError, match="malformed"):
        LookupCalibration.load(bad)
    with pytest.raises(YggError, match="does not exist"):
        LookupCalibration.load(tmp_path / "missing.json")
    good = tmp_path / "c.json"
    good.write_text(__import__("json").dumps(CAL.to_json()))
    assert LookupCalibration.load(good).table == CAL.table


def test_the_shipped_calibration_loads():
    c = LookupCalibration.load()
    assert all(0 < v < 1 for row in c.table for v in row)


# ------------------------------------------------------------------------------- merge


def test_merge_grafts_and_merges_duplicates():
    # drafted: 0 -> a(1) -> b(2); 0 -> d(3); one padded slot
    tree = build_tree([0, 0, 1, 0], [100, 1, 2, 4], logp=[0.0, -0.5, -1.5, -2.0], size=5)
    idx = LookupIndex()
    idx.extend([7, 1, 3, 7])  # match "7": continuation 1 3
    prop = propose(idx, CAL, 4, 3)
    assert prop.token == (1, 3, 7)
    merged, src = merge_lookup(tree, prop, [-0.1, -0.2, -0.3], budget=4)
    check_invariants(merged)
    assert merged.num_nodes == 9
    assert src.tolist() == [SOURCE_DRAFTER, SOURCE_BOTH, SOURCE_DRAFTER, SOURCE_DRAFTER, SOURCE_DRAFTER,
                            SOURCE_LOOKUP, SOURCE_LOOKUP, SOURCE_DRAFTER, SOURCE_DRAFTER]
    assert merged.parent.tolist()[5:7] == [1, 5] and merged.token.tolist()[5:7] == [3, 7]
    lp = merged.logp.tolist()
    assert lp[1] == pytest.approx(-0.1)  # the better edge of the two
    assert lp[2] == pytest.approx(-1.1)  # the drafted child follows its re-valued parent
    assert lp[5] == pytest.approx(-0.3) and lp[6] == pytest.approx(-0.6)
    assert not merged.valid[4] and not merged.valid[7:].any()
    kept, ok = prune_topk(merged, merged.logp, 4)
    assert sorted(kept[ok].tolist()) == [0, 1, 5, 6]  # lookup nodes beat the weaker drafted ones


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=30), st.integers(1, 6))
def test_merge_onto_the_root_is_the_trie(toks, budget):
    idx = LookupIndex()
    idx.extend(toks)
    prop = propose(idx, CAL, budget, 4)
    merged, src = merge_lookup(root_tree(torch.tensor(toks[-1])), prop, [-1.0] * len(prop), budget)
    check_invariants(merged)
    assert merged.valid.sum().item() == 1 + len(prop)
    assert (src[1 : 1 + len(prop)] == SOURCE_LOOKUP).all()
    assert merged.token[1 : 1 + len(prop)].tolist() == list(prop.token)
    assert merged.depth[1 : 1 + len(prop)].tolist() == list(prop.depth)
