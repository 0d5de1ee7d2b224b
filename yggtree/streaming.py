"""Incremental detokenization: text deltas as token ids arrive (``yggtree run``'s stream, the server's)."""

from __future__ import annotations

import contextlib
from typing import TextIO


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


class TextStream:
    """Writes decoded text to ``out`` as tokens arrive (:class:`IncrementalDecoder`)."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.out = out

    def push(self, new_ids: list[int]) -> None:
        text = "".join(self.decoder.push(t) for t in new_ids)
        if text:
            self.out.write(text)
            self.out.flush()

    def close(self) -> None:
        self.out.write(self.decoder.flush() + "\n")
        self.out.flush()
