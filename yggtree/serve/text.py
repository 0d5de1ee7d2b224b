"""Stop strings held back across a server's text deltas (which come from
:class:`yggtree.streaming.IncrementalDecoder`)."""

from __future__ import annotations


class StopMatcher:
    """Holds back text that may begin a stop string, so that no stop string (nor a part of one)
    is ever emitted, wherever the chunk boundaries fall. ``feed`` returns the text safe to emit
    and whether a stop string was completed (the text before it is then emitted, the rest never).
    Generation stops at the first stop string to appear: of several, the one that ends first in
    the text, and of two ending together, the longer (the text before it is the shorter)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        # the stop string generated first: the occurrence that ends first (then the longer one)
        hits = [(i + len(s), i) for s, i in ((s, self.pending.find(s)) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)[1]], "", True
            return out, True
        # keep the longest tail that is a proper prefix of a stop string: a match may start there
        cut = len(self.pending)
        for i in range(max(0, len(self.pending) - max(map(len, self.stops)) + 1), len(self.pending)):
            tail = self.pending[i:]
            if any(s.startswith(tail) for s in self.stops):
                cut = i
                break
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text at the end of generation (no stop string completed it)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
