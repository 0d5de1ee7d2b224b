"""Lookup on the embedded model (slow): a repetitive prompt, greedy float32, plain decoding vs
lookup-only and vs the shipped EAGLE drafter with lookup nodes: the same tokens, and lookup
nodes accepted."""

from __future__ import annotations

import pytest

from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams, TreeParams
from yggtree.runtime.loading import encode_prompt, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow

PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
          "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
NEW = 48


@pytest.fixture(scope="module")
def ids():
    return encode_prompt(load_tokenizer(resolve_model("default")), PROMPT, raw=True)


@pytest.fixture(scope="module")
def plain(ids):
    return build_engine(EngineSpec(mode="reference"))[0].generate(ids, SamplingParams(max_new_tokens=NEW)).token_ids


@pytest.mark.parametrize("drafter,lookup,tree", [
    (None, 8, TreeParams(draft_width=2, draft_depth=6, verify_width=8, top_k=1)),
    ("default", 4, TreeParams(draft_width=4, draft_depth=4, verify_width=16, top_k=4)),
])
def test_lookup_on_the_real_model_equals_plain(ids, plain, drafter, lookup, tree):
    eng = build_engine(EngineSpec(mode="reference", drafter=drafter, tree=tree, lookup=lookup))[0]
    res = eng.generate(ids, SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == plain
    src = res.stats["accepted_by_source"]
    assert sum(src.values()) == res.stats["accepted_tokens"]
    if drafter is None:  # the repeated code is drafted by lookup alone
        assert res.stats["draft_calls"] == 0 and src["drafter"] == src["both"] == 0
        assert src["lookup"] >= NEW // 6
    else:  # the EAGLE head already drafts most of this code: lookup nodes mostly merge with its
        assert src["lookup"] + src["both"] > 0
