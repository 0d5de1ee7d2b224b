"""Incremental detokenization for streaming output."""

from __future__ import annotations

from typing import TextIO


class TextStream:
    """Writes decoded text as tokens arrive; holds back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = 0

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self._text()
        if text.endswith("\ufffd"):
            return  # a multi-byte character is split across tokens: wait for the rest
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> None:
        text = self._text()
        self.out.write(text[self.printed :] + "\n")
        self.out.flush()
        self.printed = len(text)
