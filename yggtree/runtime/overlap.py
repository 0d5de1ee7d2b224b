"""Cross-core overlap: the next step's draft on the drafter's own worker while the target verifies.

The ``overlap`` execution plan (runtime/schedule.py) adds two stages to the sequential step
(stages.speculate_step)::

    fork   after prune: guess the accepted path (the verified path the drafter scores highest,
           to a verified leaf, then the drafter's top-1 token there as the bonus), and start the
           next step's head and D draft levels from it on the worker
    join   after accept: wait for the worker; the speculation is used only if the acceptance
           returned exactly the guessed path and bonus (and decoding goes on), otherwise the
           drafter's state is restored from the snapshot the worker took and the commit and the
           next step's head and draft run in sequence as usual

Exactness: the target's verify, acceptance and commit never see the worker. The worker touches
only the drafter: it first snapshots the cache rows and small state it will overwrite
(:meth:`Drafter.snapshot`), then leaves the drafter as a commit of the guessed path would
(:meth:`Drafter.speculate`) and drafts. A tree drafted from the guess is a function of the
committed sequence alone (used only when the guess is what was committed), so greedy output equals
plain decoding and sampling stays lossless (tests/test_overlap.py).

Thread budgets: on CPUs ``torch.set_num_threads`` sets the calling thread's OpenMP budget (ATen's
OpenMP back end: ``omp_set_num_threads`` is per thread, and so is MKL's local setting), so the
worker, a long-lived thread, sets its own budget once and the decoding thread keeps the target's
(the worker's setting leaves the main thread's count as it was, and the worker's ops start
no OpenMP team thread). Compiled graphs are guarded on (and their kernels
built for) the thread count they were built at, so a new worker first builds the drafter's graphs
of the speculation job on its own thread at its own count (``Engine._worker``), next to the ones
the decoding thread runs the drafter with at the target's count. On CUDA the same plan maps to streams
(:class:`StreamWorker`): the speculation's kernels go to a side stream, the join makes the main
stream wait for it; it has not run on a GPU.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import YggError
from .drafters import TopK
from .egt import draft_tree
from .merge import SOURCE_LOOKUP
from .tree import Tree


@dataclass(frozen=True)
class Guess:
    """The accepted path the worker drafts from."""

    path: tuple[int, ...]  # verify-tree nodes root..leaf (len n + 1; n = guessed accepted tokens)
    nodes: torch.Tensor  # [n + 1] int64 the same nodes in the drafted tree (drafter slots L + node)
    tokens: torch.Tensor  # [n + 1] int64 their tokens (root first)

    @property
    def n(self) -> int:
        return len(self.path) - 1


@dataclass(frozen=True)
class Speculation:
    """The next step's head and tree, drafted on the worker from a guess."""

    guess: Guess
    bonus: int  # the guessed bonus token: the next step's root
    head: TopK  # [1, k] the drafter's head at the guessed root
    tree: Tree  # the drafted tree (1 + d * wd slots), rooted at ``bonus``
    d: int  # D of the drafted tree
    wd: int  # W_d of the drafted tree
    calls: int  # drafter calls the worker made
    worker_ms: float  # the worker's wall time (concurrent with verify; not a stage of the step)
    snapshot: object  # the drafter state before the worker ran (Drafter.snapshot)

    def matches(self, path: list[int], n_accepted: int, bonus: int) -> bool:
        """Whether the acceptance returned exactly the guessed path and bonus."""
        g = self.guess
        return n_accepted == g.n and list(path[: g.n + 1]) == list(g.path) and bonus == self.bonus


def guess_path(vtree: Tree, kept: torch.Tensor, src: torch.Tensor | None) -> Guess:
    """The verified path the drafter scores highest: from the root, the drafter-proposed verified
    child with the largest path log-probability, down to a node without one. Pure."""
    parent, valid, logp = vtree.parent.tolist(), vtree.valid.tolist(), vtree.logp.tolist()
    own = [True] * len(parent) if src is None else (src[kept] != SOURCE_LOOKUP).tolist()
    children: dict[int, list[int]] = {}
    for v in range(1, len(parent)):
        if valid[v] and own[v]:
            children.setdefault(parent[v], []).append(v)
    path = [0]
    while path[-1] in children:
        path.append(max(children[path[-1]], key=lambda v: logp[v]))
    idx = torch.tensor(path, dtype=torch.int64)
    return Guess(tuple(path), kept[idx], vtree.token[idx])


def speculate(drafter, guess: Guess, L: torch.Tensor, d: int, wd: int, k: int, n_slots: int
              ) -> Speculation:
    """The worker's job: snapshot what it overwrites, commit the guessed path inside the drafter,
    guess the bonus (the drafter's top-1 at the path's leaf), run the head there and draft."""
    t0 = time.perf_counter()
    with torch.no_grad():  # grad mode is per thread
        n = guess.n
        hi = min(n_slots - 1, int(L) + n + 2 + d * wd)  # the rows this job writes end below hi
        snap = drafter.snapshot(int(L) + 1, hi)
        leaf = drafter.speculate(guess.tokens, guess.nodes, n, L, k)
        bonus = leaf.token[0, 0]
        L1 = L + n + 1
        head = drafter.head(bonus, L1, k)
        tree, calls = draft_tree(drafter, bonus, head, d, wd, L1, k)
    return Speculation(guess, int(bonus), head, tree, d, wd, calls + 2,
                       (time.perf_counter() - t0) * 1e3, snap)


def fits(committed: int, n: int, d: int, wd: int, n_slots: int) -> bool:
    """Whether a speculation from a guess of ``n`` tokens fits the cache (rows below the scratch)."""
    return committed + n + 2 + d * wd <= n_slots - 1


# ----------------------------------------------------------------------------- workers


class ThreadWorker:
    """One long-lived Python thread with its own intra-op thread budget (CPU)."""

    threaded = True  # its compiled calls run beside the decoding thread's (Graphs.frozen)

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise YggError(f"the drafter's worker needs >= 1 thread, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(1, "yggtree-drafter", initializer=torch.set_num_threads,
                                        initargs=(threads,))
        self._last: Future | None = None

    def submit(self, fn, *args) -> Future:
        self._last = self._pool.submit(fn, *args)
        return self._last

    def result(self, fut: Future):
        """The job's result (its error re-raised here)."""
        return fut.result()

    def drain(self) -> None:
        """Wait for the job under way (its errors are the joiner's to report)."""
        if self._last is not None:
            try:
                self._last.exception()
            finally:
                self._last = None

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


class StreamWorker:
    """The overlap plan on CUDA: the speculation's kernels are queued on a side stream right away
    (the drafting loop has no host sync), the join makes the current stream wait for it. Not run
    here (no GPU); ``threads`` is meaningless on a GPU and ignored."""

    threaded = False  # the side stream is fed from the decoding thread

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise YggError("the overlap plan on CUDA needs a CUDA device; none is available")
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.threads = 0
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # it reads the step so far
        with self._lock, torch.cuda.stream(self.stream):
            try:
                res = fn(*args)
            except Exception as e:  # noqa: BLE001 (re-raised by the joiner)
                fut.set_exception(e)
                return fut
        done = torch.cuda.Event()
        done.record(self.stream)
        fut.set_result((res, done))
        return fut

    def result(self, fut: Future):
        """The job's result; the current stream waits for the side stream's kernels from here."""
        res, done = fut.result()
        torch.cuda.current_stream(self.device).wait_event(done)
        return res

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        self.drain()


def make_worker(threads: int, device: torch.device):
    """The worker the overlap plan runs the drafter's stages on, for ``device``."""
    if device.type == "cuda":
        return StreamWorker(device)
    return ThreadWorker(threads)
