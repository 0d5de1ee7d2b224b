"""The grid of ``yggtree profile``: which points it measures (:class:`ProfileGrid`, the widths and
contexts), the calls timed at each (the model calls, and the stages: the non-model work of a step)
and their timing in rounds as a decode runs them."""

from __future__ import annotations

from dataclasses import dataclass

from ..progress import stderr_progress
from .timing import time_rounds


@dataclass(frozen=True)
class ProfileGrid:
    """Which points a profile measures: widths up to ``max_width`` (or exactly ``widths``), one
    context per bucket (the first two when ``quick``), ``warmup`` + ``repeats`` calls each."""

    max_width: int = 128
    warmup: int = 3
    repeats: int = 9
    quick: bool = False
    widths: tuple[int, ...] = ()  # non-empty: exactly these verify widths and the plan's draft
    #                               widths (the plan's own shapes: nothing else is compiled)
    stage_forms: bool = True  # also the stage forms (profile_stages.py; the plan search's data)


def grid_widths(plan, max_width: int) -> list[int]:
    """Powers of two, their 1.5x midpoints (3, 6, 12, ...: the curves have kernel-switch kinks
    a sparser grid would miss) and the plan's widths, up to ``max_width``."""
    ws = {m << i for i in range(0, 12) for m in (2, 3) if m << i <= max_width} | {1}
    ws |= {w for w in (*plan.draft_widths, *plan.verify_widths) if w <= max_width}
    return sorted(ws)


def grid_contexts(buckets: list[int], max_context: int, max_width: int) -> list[int]:
    """One committed length per context bucket such that ctx + W stays in that bucket for
    every grid width (the last bucket: the longest context a run can have)."""
    out = []
    for i, b in enumerate(buckets):
        lo = buckets[i - 1] if i else 0
        ctx = min(b - max_width, max_context - 1)
        if ctx > lo or (i == 0 and ctx >= 1):
            out.append(ctx)
    return sorted(set(out))


def summarise(samples: list[float]) -> dict:
    import numpy as np

    a = np.asarray(samples)
    return {
        "median_ms": float(np.median(a)),
        "p10_ms": float(np.percentile(a, 10)),
        "p90_ms": float(np.percentile(a, 90)),
        "repeats": len(samples),
    }


RESYNC_CHUNKS = 4  # prefill chunks of the drafter's catch-up the profile times (its ms per call: cost.resync_per_call)


def model_calls(engine, plan, widths: list[int], contexts: list[int], draft_widths=None):
    """(kind, width, context, bucket, thunk) for every model-call grid point (drafter steps only
    at ``draft_widths`` when given)."""
    import torch

    target, drafter = engine.target, engine.drafter
    layers = drafter.target_layers
    k = plan.top_k
    vocab = target.cfg.vocab_size
    out = []
    for ctx in contexts:
        L = torch.tensor(ctx)
        for w in widths:
            ar = torch.arange(w)
            anc = ar[None, :] <= ar[:, None]  # a chain: the mask's values do not change the cost
            # the row's bucket is the profile's pricing tier (the cost model's curves, one per
            # context bucket); the call runs at its graph's bucket (the whole cache where its
            # attention reads only the visible slots: graphs.call_buckets)
            bucket = engine.graphs.bucket(ctx + w)

            def verify(ar=ar, anc=anc, L=L, n_ctx=engine.graphs.bucket(ctx + w, w)):
                logits, _, _ = engine.graphs.tree_step(ar % vocab, ar, ar, anc, L, layers, n_ctx)
                return logits

            out.append(("verify", w, ctx, bucket, verify))
            n = 1 + plan.d_max * w
            if ctx + n > engine.n_slots or (draft_widths is not None and w not in draft_widths):
                continue  # a draft tree this wide does not fit the cache at this context
            node = 1 + ar
            danc = torch.zeros(w, n, dtype=torch.bool)
            danc[:, 0] = True
            danc[ar, node] = True

            def draft(ar=ar, node=node, danc=danc, L=L):
                return drafter.step(ar % vocab, torch.ones_like(ar), node, torch.zeros_like(ar), danc, L, k)

            dbucket = drafter.graphs.bucket(ctx + n) if hasattr(drafter, "graphs") else bucket
            out.append(("draft", w, ctx, dbucket, draft))
        root = torch.tensor(1)

        # an EAGLE head call after one accepted draft token (the common case: a call's width
        # grows with the tokens the last step accepted, drafter.head_widths)
        typical = 1
        eagle = hasattr(drafter, "pend_n")

        def head(root=root, L=L):
            if eagle:
                drafter.pend_n.fill_(min(typical, drafter.max_depth))
            return drafter.head(root, L, k)

        width = next(w for w in drafter.head_widths if w > typical) if eagle else plan.d_max + 1
        out.append(("head", width, ctx, engine.graphs.bucket(ctx + 1), head))
    return out


STAGE_CALLS = 3  # what the stage timings time: 3, the engine's own calls, an EAGLE head call at its typical
# width; 2, its widest; 1 (or absent), the pruning and the policy on tensors where the engine runs them on the host


class _Instant:
    """A drafter whose calls cost nothing (the same top-k every call)."""

    feeds_leaves = True

    def __init__(self, top) -> None:
        self.top = top

    def step(self, *args):
        return self.top


def stage_calls(engine, plan):
    """(stage, key, thunk) for the non-model work of a step at the plan's widths."""
    import torch

    from ..runtime import steps
    from ..runtime.accept import argmax, greedy_accept
    from .profile_stages import random_tree
    from ..runtime.drafters import TopK
    from ..runtime.egt import draft_tree
    from ..runtime.calibration import Calibration, tree_aal_by_width
    from ..runtime.objective import best_verify
    from ..runtime.prune import prune_for_verify, prune_topk, subtree

    d, k = plan.d_max, plan.top_k
    vocab = engine.target.cfg.vocab_size
    out = []
    for wd in plan.draft_widths:
        # one level of the drafting loop as a step runs it (draft_tree: on a CPU on the host), its
        # drafter call free: the level's bookkeeping alone (the call is the "draft" stage)
        drafter = _Instant(TopK(torch.zeros(wd, k, dtype=torch.int64), torch.full((wd, k), -1.0)))
        head = TopK(torch.arange(k)[None], torch.full((1, k), -1.0))

        def egt(drafter=drafter, head=head, wd=wd):
            return draft_tree(drafter, torch.tensor(0), head, 1, wd, torch.tensor(100), k)

        out.append(("egt", wd, egt))
    big = random_tree(plan, max(plan.draft_widths)).tree
    calib = Calibration((0.0, 1.0), (0.0, 0.8))
    widths = [1, *plan.verify_widths]
    for wv in plan.verify_widths:
        def prune(wv=wv):  # as the engine prunes (stages.prune)
            return prune_for_verify(big, big.logp, wv, d)

        out.append(("prune", wv, prune))
        kept, ok = prune_topk(big, big.logp, wv)
        vtree = subtree(big, kept, ok)
        logits = torch.randn(wv, vocab)

        def accept(vtree=vtree, logits=logits):
            return greedy_accept(vtree, logits, max_depth=d).emitted()

        out.append(("accept", wv, accept))

    def policy():  # as the policy chooses W_v (ObjectivePolicy.choose_verify)
        aal = tree_aal_by_width(big, calib, d, widths)
        return best_verify(aal, widths, [1.0 + w for w in widths], 1.0)

    out.append(("policy", None, policy))
    plain_logits = torch.randn(1, vocab)
    out.append(("plain_accept", None, lambda: int(argmax(plain_logits[0]))))
    target, drafter = engine.target, engine.drafter
    h = target.cfg.hidden_size
    feats = tuple(torch.zeros(d + 1, h, dtype=target.embed_tokens.weight.dtype)
                  for _ in drafter.target_layers)
    base = max(0, min(100, engine.n_slots - d - 3))  # a realistic committed length that fits
    src = torch.arange(2, d + 2) + base
    dst = torch.arange(1, d + 1) + base
    path_tok = torch.zeros(d + 1, dtype=torch.int64)

    def commit():
        steps.commit(target, src, dst)
        drafter.commit(src, dst, path_tok, torch.tensor(1), feats)

    out.append(("commit", None, commit))
    # the drafter's catch-up after plain steps (the resync stage): absorbing n committed tokens
    n = min(RESYNC_CHUNKS * plan.prefill_chunk, engine.n_slots // 2)
    seq = torch.zeros(n, dtype=torch.int64)
    seq_feats = tuple(torch.zeros(n, h, dtype=target.embed_tokens.weight.dtype) for _ in drafter.target_layers)
    out.append(("resync", n, lambda: drafter.prefill(seq, seq_feats, 0)))
    return out


# what a decode runs right after the target's step, on caches the step's weights have just gone
# through: the drafter's calls and the accepting, committing and choosing (egt and prune follow the
# drafter's calls instead); the profile times each right after a target step, not hot after a call
# of its own
AFTER_TARGET_STEP = ("head", "draft", "accept", "plain_accept", "commit", "policy", "resync")


def timed_calls(engine, plan, widths: list[int], contexts: list[int], drafted: set[int],
                 grid: ProfileGrid) -> tuple[list[dict], dict]:
    """The timed model calls (one row each: kind, width, context, bucket and the summary of its
    times, all timed in rounds, each timed call right after an untimed one of the same shape, as
    in a decode loop: timing.time_rounds; those of AFTER_TARGET_STEP right after a target step
    too) and the median of each stage call (likewise)
    (``stage_ms``: per key where a stage has several)."""
    rows, stages = [], {}
    calls = model_calls(engine, plan, widths, contexts, drafted)
    scalls = stage_calls(engine, plan)
    with stderr_progress() as progress:
        task = progress.add_task("timing", total=grid.warmup + grid.repeats + len(scalls))
        step_at = {ctx: fn for kind, w, ctx, _, fn in calls if kind == "verify" and w == 1}  # by context
        model_before = {i: step_at[ctx] for i, (kind, _, ctx, _, _) in enumerate(calls)
                        if kind in AFTER_TARGET_STEP and ctx in step_at}
        times = time_rounds({i: c[-1] for i, c in enumerate(calls)}, grid.warmup, grid.repeats,
                            on_round=lambda: progress.advance(task), settle=1, before=model_before)
        for i, (kind, w, ctx, bucket, _) in enumerate(calls):
            rows.append({"kind": kind, "width": w, "context": ctx, "bucket": bucket} | summarise(times[i]))
        stage_before = {0: step_at[min(step_at)]} if step_at else None
        for name, key, fn in scalls:
            before = stage_before if name in AFTER_TARGET_STEP else None
            s = summarise(time_rounds({0: fn}, grid.warmup, max(grid.repeats * 3, 10), before=before)[0])
            if key is None:
                stages[name] = s["median_ms"]
            else:
                stages.setdefault(name, {})[str(key)] = s["median_ms"]
            progress.advance(task)
    return rows, stages
