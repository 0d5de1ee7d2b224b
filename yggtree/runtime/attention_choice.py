"""Which of the kernel library's two attentions runs a call of several tree rows on this machine, and
how far ahead they fetch the cache's rows.

``yggtree::rows_attention`` computes a call's rows one by one; ``yggtree::tree_attention`` the same
bits from one pass over each KV head's cache for all of them (``runtime/csrc/rows_attention.cpp``).
The shared pass wins where the query vectors fit the registers and loses where they spill; fetching
a step's cold cache rows ahead of the reads wins where one core's stream of them stalls on its misses
and loses where the hardware prefetchers already keep up. So both are timed per machine, thread count,
head shape and KV cache dtype (a float32 cache's tiles are read in place, a 16-bit one's converted:
the two rank the kernels differently), as a step runs them (every layer its own cache, read after a
step's weight stream evicted it), and kept beside the library build they timed. Apart from the
library (runtime/kernels.py), so that how it is measured can change without making compiled
packages stale.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..errors import YggError
from ..files import write_text_atomic
from .model import Attention

ATTENTION_KERNELS = ("rows", "tree")  # the library's attentions of a call's rows: one by one, or one pass
ATTENTION_ENV = "YGGTREE_ATTENTION"  # one of ATTENTION_KERNELS: no measurement
ATTENTION_SHAPE = (8, (256, 1024))  # what the choice is timed on: tree rows, contexts (AHEAD_SHAPE's layers)
ATTENTION_MARGIN = 0.05  # the shared pass must beat the rows by this share to be chosen (and a fetch ahead none)
ATTENTION_AHEAD = (0, 16)  # slots ahead the attentions may fetch K and V rows (csrc/prefetch.h), timed per machine
AHEAD_SHAPE = (1024, 30)  # what the fetch is timed on: one row over this many slots of as many layers' own caches
AHEAD_EVICT = 128 << 20  # bytes written before each timed pass: a step's weight stream, which evicts the caches


def chain_inputs(heads: tuple[int, int, int], width: int, context: int, gen: torch.Generator,
                 kv_dtype: torch.dtype = torch.float32) -> tuple:
    """Random inputs of one layer's library attention for ``heads`` (query heads, KV heads, head
    dim): q [1, W, H, D], k and v [1, C + W, Hkv, D] in ``kv_dtype`` (head-major cache,
    runtime/kv_cache.py), mask [1, W, C + W] bool (the ``context`` committed slots) and window
    [1, W, W] (a chain)."""
    h, hkv, d = heads
    q = torch.randn(1, width, h, d, generator=gen)
    k = torch.randn(1, hkv, context + width, d, generator=gen).to(kv_dtype).transpose(1, 2)
    v = torch.randn(1, hkv, context + width, d, generator=gen).to(kv_dtype).transpose(1, 2)
    mask = torch.zeros(1, width, context + width, dtype=torch.bool)
    mask[:, :, :context] = True
    ar = torch.arange(width)
    window = torch.where(ar[None, :] <= ar[:, None], context + ar[None, :], -1)[None]
    return q, k, v, mask, window


def attention_call(kernel: str, heads: tuple[int, int, int], width: int, context: int,
                   kv_dtype: torch.dtype = torch.float32, layers: int = 1):
    """A call of the library's ``kernel`` attention for each of ``layers`` layers of ``heads``, each
    over its own cache: ``width`` chained tree rows over ``context`` cached slots, random values
    (:func:`chain_inputs`)."""
    gen = torch.Generator().manual_seed(0)
    calls = [chain_inputs(heads, width, context, gen, kv_dtype) for _ in range(layers)]
    op = getattr(torch.ops.yggtree, f"{kernel}_attention")

    def run():
        for args in calls:
            op(*args)
    return run


def attention_kernel(heads: tuple[int, int, int], threads: int, where: Path,
                     kv_dtype: torch.dtype = torch.float32) -> dict:
    """Which attention (:data:`ATTENTION_KERNELS`) runs a call of several rows for layers of
    ``heads`` (query heads, KV heads, head dim) over a ``kv_dtype`` cache at ``threads`` threads on
    this machine, as ``{"kernel": ..., "best_ms": {...}}``: ``$YGGTREE_ATTENTION`` where set, else
    timed (a second or two: both kernels alternately at :data:`ATTENTION_SHAPE`, each pass over
    :data:`AHEAD_SHAPE`'s layers' own caches after :data:`AHEAD_EVICT` bytes of other writes, as a
    step reads them; the best of 15 passes each, as other processes only ever add time) and kept in
    the library's build directory beside the code it timed (``where``: the loaded library's build
    directory, ``kernels.library_dir``). ``tree`` is chosen where it is faster by
    :data:`ATTENTION_MARGIN`, else ``rows`` (a tie too), and every answer is kept: each process of
    this build runs the same kernel (a plan's packages hold the one they were built with) and pays
    for the timing once. The two compute the same bits: the choice is speed only."""
    named = os.environ.get(ATTENTION_ENV, "")
    if named:
        if named not in ATTENTION_KERNELS:
            raise YggError(f"{ATTENTION_ENV}={named} is not one of {', '.join(ATTENTION_KERNELS)}")
        return {"kernel": named, "best_ms": {}, "source": ATTENTION_ENV}
    cache = str(kv_dtype).removeprefix("torch.")  # (files without it were timed warm, on float32 caches only)
    path = where / f"attention-t{threads}-h{'-'.join(map(str, heads))}-kv{cache}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    width, contexts = ATTENTION_SHAPE
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = {(k, c): attention_call(k, heads, width, c, kv_dtype, AHEAD_SHAPE[1])
                 for k in ATTENTION_KERNELS for c in contexts}
        times = cold_best_ms(calls, 15)
        ahead = time_ahead(heads, kv_dtype)
    finally:
        torch.set_num_threads(before)
    best = {f"{k}@{c}": round(ms, 4) for (k, c), ms in times.items()}
    total = {k: sum(best[f"{k}@{c}"] for c in contexts) for k in ATTENTION_KERNELS}
    wins = total["tree"] < (1 - ATTENTION_MARGIN) * total["rows"]
    best |= {f"ahead{a}@{AHEAD_SHAPE[0]}": round(ms, 4) for a, ms in ahead.items()}
    fetch = min(ahead, key=ahead.get)
    choice = {"kernel": "tree" if wins else "rows", "best_ms": best, "width": width, "threads": threads,
              "ahead": fetch if ahead[fetch] < (1 - ATTENTION_MARGIN) * ahead[0] else 0}
    try:
        write_text_atomic(path, json.dumps(choice) + "\n")
    except OSError:
        pass  # an unwritable cache: measured again next time
    return choice


def time_ahead(heads: tuple[int, int, int], kv_dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """The best ms of a decode step's one-row attention (:data:`AHEAD_SHAPE`: every layer its own cache,
    read after :data:`AHEAD_EVICT` bytes of other writes, as in a step) at each :data:`ATTENTION_AHEAD`,
    alternating, at the calling thread's thread count."""
    context, layers = AHEAD_SHAPE
    step = attention_call("rows", heads, 1, context, kv_dtype, layers)
    was = torch.ops.yggtree.attention_prefetch(-1)
    try:
        return cold_best_ms({a: step for a in ATTENTION_AHEAD}, 7, before=torch.ops.yggtree.attention_prefetch)
    finally:
        torch.ops.yggtree.attention_prefetch(was)


def cold_best_ms(calls: dict, rounds: int, before=lambda key: None) -> dict:
    """The best ms of each of ``calls`` (key -> thunk), timed alternately ``rounds`` times, each
    after :data:`AHEAD_EVICT` bytes of other writes (a step's weight stream, which evicts the
    caches); ``before(key)`` runs first, untimed."""
    evict = torch.zeros(AHEAD_EVICT // 4)
    times: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            before(key)
            evict.add_(1.0)
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
    return {key: 1e3 * min(v) for key, v in times.items()}


def set_native_attention(models, kernel: str | None) -> None:
    """Have the layers of ``models`` that run the library's attention run ``kernel`` for tree rows
    (compiled packages call the one they were built with: their names hold it); None leaves them."""
    if kernel is None:
        return
    if kernel not in ATTENTION_KERNELS:
        raise YggError(f"no attention kernel {kernel!r} (one of {', '.join(ATTENTION_KERNELS)})")
    for model in models:
        for m in model.modules():
            if isinstance(m, Attention) and m.native_rows:
                m.native_rows = kernel
