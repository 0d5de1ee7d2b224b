"""The static lookup table (yggtree/runtime/static_lookup.py): what it keeps and how it measures its
acceptance, its chains, its file, and engines proposing from it (tiny random-weight models): the
output is plain decoding's, token for token."""

from __future__ import annotations

import json

import pytest

from yggtree.errors import YggError
from yggtree.runtime.build import shipped_table
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams
from yggtree.runtime.static_lookup import DEFAULT_TABLE, SHARES, StaticTable, build_table, propose_static
from test_engine import PROMPTS, TREES, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = {"name": "m.gguf", "size": 1}


def test_the_table_keeps_frequent_continuations_and_scores_them_held_out():
    answers = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [7, 2, 3, 9], [8, 8]]
    t = build_table(answers, [([1], [2, 3, 4, 6]), ([0], [2, 3, 9])], TARGET)
    assert t.next[3] == {(1, 2, 3): (4, 2 / 3)}  # (1 2 3) -> 4 twice of three; (7 2 3) seen once: dropped
    assert t.next[2] == {(1, 2): (3, 1.0), (2, 3): (4, 0.5)}  # (8 8) -> nothing, (3 4) seen once
    assert t.continuation([5, 1, 2, 3]) == (3, 4, 2 / 3) and t.continuation([9, 2, 3]) == (2, 4, 0.5)
    assert t.continuation([4, 4]) is None
    # held out: after (1, 2) the table says 3 (right, order 2, share 1), after (1 2 3) 4 (right, order 3,
    # share 2/3), after (2 3 4) nothing; after (0 2) nothing, after (2, 3) 4 where 9 came (wrong, share 0.5)
    assert t.accept[3] == (0.0, 1.0, 0.0, 0.0, 0.0)
    assert t.accept[2] == (0.0, 0.0, 0.0, 0.0, 1.0)  # the 0.5 bucket: 0 of 1; share 1 (>= 0.9): 1 of 1


def test_a_chain_follows_the_table_to_its_budget_and_depth():
    t = StaticTable({3: {(1, 2, 3): (4, 0.8)}, 2: {(3, 4): (5, 0.6), (4, 5): (6, 0.9)}},
                    {3: (0.1, 0.2, 0.3, 0.4, 0.5), 2: (0.6, 0.7, 0.8, 0.9, 0.95)}, TARGET)
    p = propose_static(t, [9, 1, 2, 3], budget=8, max_depth=6)
    assert p.token == (4, 5, 6) and p.parent == (0, 1, 2) and p.depth == (1, 2, 3) and p.match == 3
    assert p.edge == (0.4, 0.7, 0.95) and p.value == pytest.approx((0.4, 0.28, 0.266))
    assert propose_static(t, [9, 1, 2, 3], budget=2, max_depth=6).token == (4, 5)
    assert propose_static(t, [9, 1, 2, 3], budget=8, max_depth=1).token == (4,)
    empty = propose_static(t, [7, 7], budget=8, max_depth=6)
    assert len(empty) == 0 and empty.match == 0


def test_a_table_file_round_trips_and_a_bad_one_is_one_line(tmp_path):
    t = build_table([[1, 2, 3, 4], [1, 2, 3, 4]], [([1], [2, 3, 4])], TARGET)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_json()))
    back = StaticTable.load(path)
    assert (back.next, back.accept, back.target) == (t.next, t.accept, t.target)
    with pytest.raises(YggError, match="does not exist"):
        StaticTable.load(tmp_path / "none.json")
    bad = t.to_json() | {"accept": {"3": [2.0] * len(SHARES), "2": [0.5] * len(SHARES)}}
    path.write_text(json.dumps(bad))
    with pytest.raises(YggError, match="malformed"):
        StaticTable.load(path)
    path.write_text(json.dumps(t.to_json() | {"kind": "other"}))
    with pytest.raises(YggError, match="malformed"):
        StaticTable.load(path)


def test_the_shipped_table_is_the_embedded_models_only():
    t = StaticTable.load()
    assert t.target["name"].endswith(".gguf") and len(t.next[3]) > 1000
    assert all(0 < max(a) <= 1 for a in t.accept.values())
    assert shipped_table("default") == str(DEFAULT_TABLE) and shipped_table("/some/other/model") is None


@pytest.mark.parametrize("drafter", ["none", "eagle"])
def test_greedy_with_a_table_equals_plain(tmp_path, drafter):
    """A table built from the model's own answers (chains the target often accepts, and wrong ones):
    the output is plain decoding's, and table candidates were accepted."""
    from yggtree.runtime.eagle import EagleDrafter

    target = tiny()
    plain = Engine(target, EngineConfig(mode="reference", max_context=200, prefill_chunk=16))
    new = 40
    answers = [plain.generate(p, SamplingParams(max_new_tokens=new)).token_ids for p in PROMPTS]
    table = build_table(answers, [(p, a) for p, a in zip(PROMPTS, answers)], TARGET)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table.to_json()))
    tree = TREES["egt"]
    accepted = {}
    for table_path in (str(path), None):  # with the table, and the request's own text alone
        cfg = EngineConfig(mode="reference", max_context=200, prefill_chunk=16, tree=tree, lookup=3,
                           static_lookup=table_path)
        eng = Engine(target, cfg, EagleDrafter.random(target, "reference", max_depth=4) if drafter == "eagle" else None)
        assert (eng.static_table is not None) == (table_path is not None)
        accepted[table_path] = 0
        for p, want in zip(PROMPTS, answers):
            res = eng.generate(p, SamplingParams(max_new_tokens=new))
            assert res.token_ids == want
            accepted[table_path] += res.stats["accepted_by_source"]["lookup"] + res.stats["accepted_by_source"]["both"]
    assert accepted[str(path)] > accepted[None]  # the table's candidates were accepted


def test_the_tables_questions_are_none_of_the_evaluation_prompts():
    """The shipped table is built from our open and general questions: distinct, none of them inside an
    evaluation prompt and no evaluation prompt inside one of them; the comparisons' held-out general
    questions are not among those the table is built from."""
    from yggtree.data import evaluation_texts, general_questions, open_questions

    ours = [p.text for p in open_questions(None)] + [p.text for p in general_questions(None)]
    assert len(set(ours)) == len(ours) > 900
    assert not any(q in e or e in q for q in ours for e in evaluation_texts())
    assert general_questions(3) == general_questions(None)[:3] != general_questions(3, seed=1)
