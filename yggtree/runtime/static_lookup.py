"""Draft candidates from the target's own writing: a static n-gram table (llama.cpp's lookup
decoding keeps one too, its "static cache").

Where the request's own text has no earlier occurrence of its last tokens (runtime/lookup.py finds
no match, as on most of a chat answer's prose), the table proposes what the target most often wrote
after the same three, else two, tokens in its answers to our own prompts (never evaluation
prompts): a chain, each next token looked up after the ones before it::

    table  (" in", " Python") -> ","  (share 0.62)     ("Python", ",") -> " you" (share 0.55)
    chain  root -> "," -> " you"

A context is kept where its most frequent continuation was seen at least ``MIN_COUNT`` times and
makes at least ``MIN_SHARE`` of what followed it. Each edge's acceptance probability is what the
table's continuations scored on answers held out of it, by the context's order and the
continuation's share (:func:`build_table`); a chain's path values are their products, as lookup
candidates' are, so the latency objective prices a step of them like any lookup step. Token ids are
the target's own: the shipped table, built from the embedded model (its file is named in the table's
``target``), is taken by that model's engines only (``runtime/build.shipped_table``). Candidates never change the output: the target verifies them.

Built by ``scripts/build_lookup_table.py`` (the embedded target's answers to our open and general
questions, ``yggtree.data``); shipped as ``yggtree/assets/lookup_table.json``.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass
from pathlib import Path

from ..errors import YggError
from ..files import read_record
from .lookup import Proposal

__all__ = ["StaticTable", "build_table", "propose_static", "DEFAULT_TABLE", "STATIC_LOOKUP_KIND"]

STATIC_LOOKUP_KIND = "yggtree-static-lookup"
DEFAULT_TABLE = Path(__file__).resolve().parent.parent / "assets" / "lookup_table.json"
ORDERS = (3, 2)  # context lengths, the longest tried first
MIN_COUNT = 2  # a context's best continuation seen at least this often
MIN_SHARE = 0.5  # ... and at least this share of what followed the context
SHARES = (0.5, 0.6, 0.7, 0.8, 0.9)  # lower bounds of the share buckets the acceptance is measured in


@dataclass(frozen=True)
class StaticTable:
    """Context (``order`` tokens) -> (next token, its share), per order; acceptance by bucket."""

    next: dict  # order -> {tuple of order token ids: (next token id, share)}
    accept: dict  # order -> tuple[len(SHARES)] P(the target writes the table's token), held out
    target: dict  # the model's file name and size the table was built from (a record for the reader)
    source: str = ""

    def continuation(self, tokens: list[int]) -> tuple[int, int, float] | None:
        """(order, next token, share) after the last tokens of ``tokens``, None if no context matches."""
        for n in ORDERS:
            if len(tokens) >= n:
                hit = self.next[n].get(tuple(tokens[-n:]))
                if hit is not None:
                    return n, hit[0], hit[1]
        return None

    def edge(self, order: int, share: float) -> float:
        return self.accept[order][_bucket(share)]

    def to_json(self) -> dict:
        return {"kind": STATIC_LOOKUP_KIND, "version": 1, "target": self.target,
                "min_count": MIN_COUNT, "min_share": MIN_SHARE, "shares": list(SHARES),
                "accept": {str(n): list(self.accept[n]) for n in ORDERS},
                "next": {str(n): [[*ctx, t, round(s, 4)] for ctx, (t, s) in sorted(self.next[n].items())]
                         for n in ORDERS}}

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TABLE) -> "StaticTable":
        p = Path(path)
        d = read_record(p, "lookup table", STATIC_LOOKUP_KIND, "scripts/build_lookup_table.py")
        try:
            if d["shares"] != list(SHARES):
                raise ValueError(f"share buckets {d['shares']}, this code's {list(SHARES)}")
            nxt = {n: _contexts_of(d["next"][str(n)], n) for n in ORDERS}
            accept = {n: tuple(float(x) for x in d["accept"][str(n)]) for n in ORDERS}
            if any(len(a) != len(SHARES) or not all(0 <= x <= 1 for x in a) for a in accept.values()):
                raise ValueError("acceptance table shape or values")
            return cls(nxt, accept, dict(d["target"]), str(p))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise YggError(f"lookup table {p} is malformed: {e}") from None


def _contexts_of(rows: list, n: int) -> dict:
    """{context: (next token, share)} of a table file's ``rows`` (``n`` context ids, the next id, its share)."""
    if not all(type(x) is int for row in rows for x in row[:n + 1]) or any(len(row) != n + 2 for row in rows):
        raise ValueError(f"a row of order {n} is not {n + 1} token ids and a share")
    return dict(zip(map(tuple, (row[:n] for row in rows)), ((row[n], float(row[n + 1])) for row in rows)))


def _bucket(share: float) -> int:
    """The share bucket (index into SHARES) ``share`` falls in."""
    return max(bisect.bisect_right(SHARES, share) - 1, 0)


def _contexts(seqs: list[list[int]]) -> dict:
    """order -> {context: Counter of the tokens that followed it} over ``seqs``."""
    seen = {n: collections.defaultdict(collections.Counter) for n in ORDERS}
    for s in seqs:
        for n in ORDERS:
            for i in range(n, len(s)):
                seen[n][tuple(s[i - n:i])][s[i]] += 1
    return seen


def build_table(answers: list[list[int]], held_out: list[tuple[list[int], list[int]]], target: dict) -> StaticTable:
    """The table of ``answers`` (the target's token ids, one list per answer), its acceptance by
    (order, share bucket) measured on ``held_out`` ((context before the answer, answer) pairs, not
    among ``answers``): of the positions of a held-out answer where the table proposes a token,
    the share where it is the token the target wrote (a bucket nothing fell in: 0). Pure."""
    nxt = {n: {} for n in ORDERS}
    for n, table in _contexts(answers).items():
        for ctx, counts in table.items():
            token, k = counts.most_common(1)[0]
            share = k / sum(counts.values())
            if k >= MIN_COUNT and share >= MIN_SHARE:
                nxt[n][ctx] = (token, share)
    table = StaticTable(nxt, {n: (0.0,) * len(SHARES) for n in ORDERS}, dict(target))
    hits = {n: [[0, 0] for _ in SHARES] for n in ORDERS}
    for before, answer in held_out:
        text = list(before)
        for t in answer:
            got = table.continuation(text)
            if got is not None:
                n, token, share = got
                cell = hits[n][_bucket(share)]
                cell[0] += token == t
                cell[1] += 1
            text.append(t)
    accept = {n: tuple(ok / seen if seen else 0.0 for ok, seen in hits[n]) for n in ORDERS}
    return StaticTable(nxt, accept, dict(target))


def propose_static(table: StaticTable, tokens: list[int], budget: int, max_depth: int) -> Proposal:
    """A chain of at most ``min(budget, max_depth)`` of the table's continuations after ``tokens``
    (the request's text, the root last), each looked up after the ones before it; an empty
    Proposal where the table has no continuation. ``match`` is the first context's order."""
    text, tok, edge, value, share = list(tokens), [], [], [], []
    order = 0
    for _ in range(min(budget, max_depth)):
        got = table.continuation(text)
        if got is None:
            break
        n, t, s = got
        order = order or n
        p = table.edge(n, s)
        tok.append(t)
        share.append(s)
        edge.append(p)
        value.append(p * (value[-1] if value else 1.0))
        text.append(t)
    m = len(tok)
    return Proposal(tuple(tok), tuple(range(m)), tuple(range(1, m + 1)), tuple(share), tuple(edge),
                    tuple(value), order if m else 0, {"source": "table"} if m else {})
