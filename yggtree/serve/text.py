"""Text out of token ids as they arrive: incremental detokenization and stop strings."""

from __future__ import annotations

import contextlib


class IncrementalDecoder:
    """Decodes a growing list of token ids into text deltas whose concatenation is the text of the
    whole list (special tokens skipped). Each push decodes a short window (the ids since the last
    delta, with a few before it for context), not the whole list; a multi-byte character split
    across tokens is held back until it is complete (or until :meth:`flush`)."""

    def __init__(self, tokenizer, lock=None) -> None:
        self.tokenizer = tokenizer
        self.lock = lock or contextlib.nullcontext()  # held around each tokenizer call
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids[prefix:read] decode to text already returned
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character, as the tokenizer decodes it)."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text) :]


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
