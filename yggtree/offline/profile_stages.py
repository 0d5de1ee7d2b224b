"""Stage times in the forms the execution plans run them, for ``yggtree profile``.

Per thread split of this machine's usable cores (``T``: the decoding thread alone with T intra-op
threads; ``T+D``: the target's thread with T and the drafter's worker with D, run together):

- ``T``:   the target's verify per W_v, the drafter's head and one draft step per W_d, and the
  ahead-of-time call (ahead + take) per W_v, each alone in T threads
- ``T+D``: the same verify alone in T threads; the worker's speculation job (the drafter's
  guessed-path head, the next head and the draft levels of a D_max-deep tree at W_d) alone on the
  worker; and every (W_v, W_d) pair overlapped: verify on the decoding thread while the worker runs
  the job, with the pair's wall time and each side's own time under contention (two busy
  threads on shared cores slow each other: measured, never assumed away)

at one context (the profile's first). Recorded in the profile as ``stage_forms``; a profile
without it (made before) has no overlap data and the plan search then considers only the plans it
has data for (:mod:`yggtree.offline.plan_search`).
"""

from __future__ import annotations

import contextlib

import statistics
import time

from .timing import time_ms, time_rounds


def thread_splits(cores: int) -> list[str]:
    """Every split of ``cores``: ``T`` for T = 1..cores and ``T+D`` with T, D >= 1, T + D <= cores."""
    out = [str(t) for t in range(1, cores + 1)]
    out += [f"{t}+{d}" for t in range(1, cores) for d in range(1, cores - t + 1)]
    return out


def random_tree(plan, wd: int, seed: int = 0):
    """A full EGT tree of the plan's envelope depth at width ``wd`` with random proposals."""
    import torch

    from ..runtime.egt import egt_expand, egt_init, egt_select

    g = torch.Generator().manual_seed(seed)
    k = plan.top_k

    def topk(rows):
        lp = torch.log_softmax(torch.randn(rows, 4 * k, generator=g), -1)
        val, idx = torch.topk(lp, k, -1)
        return idx, val

    tok, lp = topk(1)
    state = egt_init(torch.tensor(0), tok[0], lp[0], plan.d_max, wd)
    for s in range(plan.d_max):
        state, fed = egt_select(state, s)
        tok, lp = topk(wd)
        state = egt_expand(state, fed, tok, lp)
    return state


def _median_ms(fn, warmup: int, repeats: int) -> float:
    return statistics.median(time_ms(fn, warmup, repeats))


def _built(fn):
    """``fn`` after one call with compiles allowed. Dynamo guards its graphs on the calling
    thread's intra-op thread count, so a graph warmed up at one count is rebuilt the first time
    it runs at another (inductor also bakes the count into its kernels); the profile's frozen
    stance would refuse that rebuild. The runtime's AOTInductor packages carry no such guard."""
    import torch

    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(recompile_limit=256):
        fn()
    return fn


def form_calls(engine, plan, ctx: int):
    """Thunks of the timed work at committed length ``ctx``: verify(W_v), head(), draft(W_d),
    ahead(W_v) (ahead + take) and spec(W_d) (the worker's job for a D_max-deep tree)."""
    import torch

    from ..runtime.egt import draft_tree
    from ..runtime.prune import prune_topk, subtree
    from ..runtime.tree import ancestor_mask

    drafter, k, d = engine.drafter, plan.top_k, plan.d_max
    layers = drafter.target_layers
    vocab = engine.target.cfg.vocab_size
    L = torch.tensor(ctx)
    h = engine.target.cfg.hidden_size
    dtype = engine.target.embed_tokens.weight.dtype

    def verify(w):
        ar = torch.arange(w)
        anc = ar[None, :] <= ar[:, None]
        bucket = engine.graphs.bucket(ctx + w, w)
        return lambda: engine.graphs.tree_step(ar % vocab, ar, ar, anc, L, layers, bucket)

    def head():
        return drafter.head(torch.tensor(1), L, k)

    def draft(wd):
        n = 1 + d * wd
        ar = torch.arange(wd)
        danc = torch.zeros(wd, n, dtype=torch.bool)
        danc[:, 0] = True
        danc[ar, 1 + ar] = True
        return lambda: drafter.step(ar % vocab, torch.ones_like(ar), 1 + ar, torch.zeros_like(ar), danc, L, k)

    def spec(wd):
        nodes = torch.arange(d + 1)  # a chain guess as deep as the tree: the longest job

        def job():
            with torch.no_grad():
                top = drafter.speculate(nodes % vocab, nodes, d, L, k)
                first = drafter.head(top.token[0, 0], L + d + 1, k)
                draft_tree(drafter, top.token[0, 0], first, d, wd, L + d + 1, k)
        return job

    def ahead(wv):
        big = random_tree(plan, max(plan.draft_widths)).tree
        kept, ok = prune_topk(big, big.logp, wv)
        vt = subtree(big, kept, ok)
        anc = ancestor_mask(vt.parent, vt.depth, vt.valid, d)
        caps = tuple(torch.zeros(wv, h, dtype=dtype) for _ in layers)
        room = max(wv, d + 1)
        path = torch.zeros(d, dtype=torch.int64)

        def call():
            drafter.ahead(vt, anc, vt.token, caps, room, L, k)
            return drafter.take(path, torch.tensor(0), room, L, k)
        return call

    return verify, head, draft, spec, ahead


def measure_stage_forms(engine, plan, ctx: int, warmup: int, repeats: int, cores: int) -> dict:
    """The ``stage_forms`` section of a profile (see the module docstring). The engine's drafter
    has its graphs for 2 W_v (the ahead call) already built."""
    import torch

    from ..runtime.overlap import ThreadWorker

    verify, head, draft, spec, ahead = form_calls(engine, plan, ctx)
    wvs, wds = list(plan.verify_widths), list(plan.draft_widths)
    n0 = torch.get_num_threads()
    out: dict = {"context": ctx, "d_max": plan.d_max, "warmup": warmup, "repeats": repeats, "splits": {}}
    try:
        # graphs built at several thread counts coexist: dynamo's global-state guard (thread
        # count included) tells them apart even under the frozen stance (Graphs.frozen)
        for split in thread_splits(cores):
            t, _, dt = split.partition("+")
            torch.set_num_threads(int(t))
            # one thread's calls timed in rounds (timing.time_rounds): a slow stretch of a shared
            # host then touches every call alike instead of one call's block of repeats; each
            # timed call follows an untimed one of its own shape (settle: as in a decode loop)
            fns = {("verify", w): _built(verify(w)) for w in wvs}
            if not dt:
                fns |= {("head", None): _built(head)} | {("draft", w): _built(draft(w)) for w in wds}
                fns |= {("ahead", w): _built(ahead(w)) for w in wvs}
            ms = {key: statistics.median(v) for key, v in time_rounds(fns, warmup, repeats, settle=1).items()}
            rec: dict = {"threads": int(t), "verify_ms": {str(w): ms["verify", w] for w in wvs}}
            if not dt:
                rec |= {"head_ms": ms["head", None], "draft_ms": {str(w): ms["draft", w] for w in wds},
                        "ahead_ms": {str(w): ms["ahead", w] for w in wvs}}
            else:
                worker = ThreadWorker(int(dt))
                # as the engine runs an overlap plan: full guard evaluation (Graphs.frozen)
                drafter_frozen = engine.drafter.frozen(threaded=True) if engine.drafter else contextlib.nullcontext()
                try:
                    with engine.graphs.frozen(threaded=True), drafter_frozen:
                        jobs = {w: worker.result(worker.submit(_built, spec(w))) for w in wds}  # at D threads
                        rec |= {"draft_threads": int(dt),
                                "spec_ms": {str(w): worker.result(worker.submit(_median_ms, jobs[w], warmup, repeats))
                                            for w in wds},
                                "pair": {f"{wv},{wd}": overlapped(verify(wv), spec(wd), worker, warmup, repeats)
                                         for wv in wvs for wd in wds}}
                finally:
                    worker.close()
            out["splits"][split] = rec
    finally:
        torch.set_num_threads(n0)
    return out


def overlapped(main_fn, job, worker, warmup: int, repeats: int) -> dict:
    """Medians of ``main_fn`` on this thread while ``worker`` runs ``job``: the pair's wall time
    and each side's own time (ms)."""
    def timed():
        t = time.perf_counter()
        job()
        return (time.perf_counter() - t) * 1e3

    walls, mains, jobs = [], [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fut = worker.submit(timed)
        main_fn()
        t1 = time.perf_counter()
        job_ms = worker.result(fut)
        if i >= warmup:
            walls.append((time.perf_counter() - t0) * 1e3)
            mains.append((t1 - t0) * 1e3)
            jobs.append(job_ms)
    return {"wall_ms": statistics.median(walls), "verify_ms": statistics.median(mains),
            "spec_ms": statistics.median(jobs)}
