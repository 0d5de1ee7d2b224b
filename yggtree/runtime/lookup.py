"""Model-free draft candidates: continuations of the request's own text (prompt lookup).

An incremental n-gram index over one request's tokens (prompt + everything emitted) finds the
longest suffix of the text that occurred before (up to ``max_order`` tokens) and proposes what
followed it there, as a small trie of chains rooted at the current root token::

    text  ... a b c x y ... a b c x z ... a b c      longest match "a b c" (n = 3), two earlier
    trie  root -> x (2 of 2) -> y (1 of 2)            occurrences; their continuations share x,
                             -> z (1 of 2)            then split

Each trie edge gets a calibrated acceptance probability ``p`` from the match length it would
have (``n + depth - 1``: the match grows as the chain is accepted) and the share of the
occurrences through the parent that continue with this token (:class:`LookupCalibration`,
fitted offline on calibration prompts by ``scripts/fit_lookup.py``); a node's path value is the
product of ``p`` along its path, so the ``budget`` best nodes form a connected subtree.

Cost: :meth:`LookupIndex.extend` is O(max_order) per new token (one dict append per n-gram
order ending at it, no rescans); :func:`propose` is O(max_order + occurrences x depth), whatever
the context length. Everything here is host-side Python over token ids.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import YggError
from ..files import read_record

__all__ = ["LookupIndex", "LookupCalibration", "Proposal", "propose", "DEFAULT_CALIBRATION",
           "LOOKUP_CALIBRATION_KIND"]

LOOKUP_CALIBRATION_KIND = "yggtree-lookup-calibration"
# the fitted table shipped for the embedded target (scripts/fit_lookup.py writes it)
DEFAULT_CALIBRATION = Path(__file__).resolve().parent.parent / "assets" / "lookup_calibration.json"


class LookupIndex:
    """Every n-gram (n = 1..max_order) of one request's tokens -> the positions where it ends.

    ``extend`` appends tokens; ``longest_match`` is the longest suffix (n <= max_order) of the
    text that also ends at an earlier position, with those earlier end positions."""

    def __init__(self, max_order: int = 8) -> None:
        if max_order < 1:
            raise ValueError(f"LookupIndex: max_order must be >= 1, got {max_order}")
        self.max_order = max_order
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions, ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ints); O(max_order) dict work per token."""
        toks, ends = self.tokens, self._ends
        for t in tokens:
            toks.append(int(t))
            i = len(toks) - 1
            for n in range(1, min(self.max_order, i + 1) + 1):
                ends.setdefault(tuple(toks[i - n + 1 :]), []).append(i)

    def longest_match(self) -> tuple[int, list[int]]:
        """(n, earlier end positions ascending) of the longest suffix that occurred before;
        (0, []) when even the last token is new."""
        toks = self.tokens
        i = len(toks) - 1
        for n in range(min(self.max_order, i), 0, -1):  # an earlier end needs n <= i
            ends = self._ends.get(tuple(toks[i - n + 1 :]))
            if ends is not None and len(ends) > 1:
                return n, ends[:-1]  # the last end is the suffix itself
        return 0, []


@dataclass(frozen=True)
class LookupCalibration:
    """P(target accepts a lookup edge) by (match length, continuation share) cell.

    Row ``i`` holds match lengths ``lengths[i] <= n < lengths[i + 1]`` (the last row: n >=
    lengths[-1]); column ``j`` shares ``shares[j] <= s < shares[j + 1]`` (the last: s >= shares[-1],
    i.e. every occurrence agrees when the last bound is 1)."""

    lengths: tuple[int, ...]  # ascending lower bounds of the match-length rows, lengths[0] = 1
    shares: tuple[float, ...]  # ascending lower bounds of the share columns, shares[0] = 0
    table: tuple[tuple[float, ...], ...]  # [rows][cols] acceptance probability in [0, 1]
    counts: tuple[tuple[int, ...], ...] = ()  # [rows][cols] edges the fit saw (information only)
    source: str = ""

    def prob(self, length: int, share: float) -> float:
        i = max(bisect.bisect_right(self.lengths, length) - 1, 0)
        j = max(bisect.bisect_right(self.shares, share) - 1, 0)
        return self.table[i][j]

    def to_json(self) -> dict:
        return {"kind": LOOKUP_CALIBRATION_KIND, "version": 1, "lengths": list(self.lengths),
                "shares": list(self.shares), "table": [list(r) for r in self.table],
                "counts": [list(r) for r in self.counts]}

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CALIBRATION) -> "LookupCalibration":
        p = Path(path)
        d = read_record(p, "lookup calibration", LOOKUP_CALIBRATION_KIND, "scripts/fit_lookup.py")
        try:
            c = cls(tuple(int(x) for x in d["lengths"]), tuple(float(x) for x in d["shares"]),
                    tuple(tuple(float(v) for v in r) for r in d["table"]),
                    tuple(tuple(int(v) for v in r) for r in d.get("counts", ())), str(p))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise YggError(f"lookup calibration {p} is malformed: {e}") from None
        ok = len(c.lengths) >= 1 and len(c.shares) >= 1 and len(c.table) == len(c.lengths)
        ok = ok and all(len(r) == len(c.shares) and all(0 <= v <= 1 for v in r) for r in c.table)
        if not ok:
            raise YggError(f"lookup calibration {p} is malformed (table shape or values)")
        return c


@dataclass(frozen=True)
class Proposal:
    """Lookup candidates for one step: a trie of M nodes below the root, topologically ordered.

    Node ``i`` (0-based) hangs below ``parent[i]``: 0 is the root, ``j >= 1`` is node ``j - 1``."""

    token: tuple[int, ...] = ()  # [M] token ids
    parent: tuple[int, ...] = ()  # [M] 0 = the root, j = node j - 1
    depth: tuple[int, ...] = ()  # [M] 1 for children of the root
    share: tuple[float, ...] = ()  # [M] occurrences through the node / through its parent
    edge: tuple[float, ...] = ()  # [M] calibrated P(target accepts the edge into the node)
    value: tuple[float, ...] = ()  # [M] P(whole path accepted): product of ``edge`` on the path
    match: int = 0  # length of the suffix match the chains continue (0: no candidates)
    stats: dict = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.token)

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)


def propose(index: LookupIndex, calib: LookupCalibration, budget: int, max_depth: int,
            max_occurrences: int = 16) -> Proposal:
    """The ``budget`` best lookup nodes (path value descending; ties: shallower, then the trie's
    insertion order, i.e. the most recent occurrence first) continuing the longest match, chains
    at most ``max_depth`` deep, from the ``max_occurrences`` most recent earlier occurrences."""
    if budget < 1 or max_depth < 1:
        return Proposal()
    n, ends = index.longest_match()
    if n == 0:
        return Proposal()
    toks = index.tokens
    # trie: key (parent id, token) -> id; ids in insertion order (most recent occurrence first)
    ids: dict[tuple[int, int], int] = {}
    tok, par, dep, cnt = [], [], [], []
    occ = ends[-max_occurrences:][::-1]
    for e in occ:
        node = 0  # 0 = root, j = trie node j - 1
        for j, t in enumerate(toks[e + 1 : e + 1 + max_depth]):
            key = (node, t)
            if key not in ids:
                ids[key] = len(tok) + 1
                tok.append(t)
                par.append(node)
                dep.append(j + 1)
                cnt.append(0)
            node = ids[key]
            cnt[node - 1] += 1
    share, edge, value = [], [], []
    for i in range(len(tok)):
        above = len(occ) if par[i] == 0 else cnt[par[i] - 1]
        share.append(cnt[i] / above)
        p = calib.prob(n + dep[i] - 1, share[i])
        edge.append(p)
        value.append(p * (1.0 if par[i] == 0 else value[par[i] - 1]))
    order = sorted(range(len(tok)), key=lambda i: (-value[i], dep[i], i))[:budget]
    order.sort(key=lambda i: (dep[i], i))  # parents before children
    new = {old + 1: k + 1 for k, old in enumerate(order)}
    new[0] = 0
    return Proposal(
        tuple(tok[i] for i in order), tuple(new[par[i]] for i in order),
        tuple(dep[i] for i in order), tuple(share[i] for i in order), tuple(edge[i] for i in order),
        tuple(value[i] for i in order), n,
    )
