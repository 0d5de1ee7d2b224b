"""The short decodes the compile-time measurements run on a compiled plan (the memory allocator:
``allocator_probe``; the kernel library's loops: ``loops_choice``): which prompts, how many tokens,
and the per-token time they are judged by. One source for both, so the two measure the same work.

Calibration chat prompts only (``data.calibration_chat_prompts``), never evaluation prompts; short
snippets, so that a step's fixed work, which both choices change, dominates.
"""

from __future__ import annotations

PROMPTS = 6  # calibration chat prompts measured (after one warm-up prompt)
NEW_TOKENS = 48
SNIPPET_CHARS = 400


def probe_requests(tok, max_context: int, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS):
    """``(ids, params)``: ``prompts + 1`` calibration chat prompts as token ids (the first is the
    warm-up), each trimmed to its last tokens where the plan's context is small, and the
    SamplingParams that decode ``new_tokens`` (at most a quarter of the context) of each."""
    from ..data import calibration_chat_prompts
    from ..runtime.engine import SamplingParams
    from ..runtime.loading import encode_auto

    new_tokens = max(2, min(new_tokens, max_context // 4))
    room = max_context - new_tokens
    ids = [encode_auto(tok, p.text)[-room:]
           for p in calibration_chat_prompts(prompts + 1, max_snippet_chars=SNIPPET_CHARS)]
    return ids, SamplingParams(max_new_tokens=new_tokens)


def decode_ms_per_token(result) -> float | None:
    """Decode milliseconds per token of a GenerationResult, prefill excluded; None where it decoded
    one token or none (pure)."""
    n = len(result.token_ids) - 1
    if n < 1:
        return None
    return (result.stats["total_ms"] - result.stats["ttft_ms"]) / n
