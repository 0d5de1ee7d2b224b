"""The worker thread that owns the engine, and the queue of requests it serves.

torch modules, static caches and compiled graphs are not re-entrant across threads, so one thread
builds the engine and runs every request on it; the HTTP side (asyncio) only validates, queues
and reads events. A request is a :class:`Job`: the worker feeds its text back through the job's
asyncio queue (``loop.call_soon_threadsafe``), and the HTTP side cancels it (a disconnect, a
timeout) by setting a flag the worker reads at the next step boundary.

Continuous batching. The engine decodes up to :attr:`Scheduler.capacity` requests at once
(``--max-batch``; runtime/batch.py's :class:`~yggtree.runtime.batch.BatchDecoder`): at every step
boundary the worker admits queued jobs into free slots, drops the running jobs whose client left,
timed out or completed a stop string, and runs one step of every running request (a joining
request's prefill advances one chunk per step beside them). Each step's tokens go to the request's
:class:`Session`, which detokenizes, holds back stop strings and hands the text over.
"""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..errors import YggError
from ..runtime.engine import SamplingParams
from ..streaming import IncrementalDecoder
from .text import StopMatcher

DRAIN_WAIT = 0.005  # seconds a step waits at most for the HTTP side to send its tokens (Scheduler._drain)

class ServeError(Exception):
    """An error answered to one request: HTTP status, one-line message, OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, " ".join(message.split()), type_, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def timeout_error(timeout: float) -> ServeError:
    return ServeError(504, f"the request did not finish within the server's timeout ({timeout:g} s)",
                      "timeout_error")


@dataclass(eq=False)
class Job:
    """One request as the worker sees it. ``events`` receives ``("text", str)`` deltas, then one
    ``("done", finish_reason, usage)`` or ``("error", ServeError)``."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    speculative: bool = True
    stops: list[str] = field(default_factory=list)
    timeout: float = 600.0
    arrival: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: str | None = None  # why the HTTP side gave up on it ("disconnect", "timeout")
    started: float | None = None  # when the worker took it

    @property
    def deadline(self) -> float:
        return self.arrival + self.timeout

    def cancel(self, why: str) -> None:
        self.cancelled = self.cancelled or why

    def put(self, *event) -> None:
        """Hand an event to the HTTP side (from the worker thread); dropped once its loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Backend:
    """An engine, its tokenizer and step policy, the decoder that runs up to ``max_batch``
    requests on it at once, and what requests may ask of them."""

    def __init__(self, engine, tokenizer, policy=None, model_name: str = "default", max_batch: int = 1,
                 packages=None) -> None:
        from ..runtime.batch import BatchDecoder
        from ..runtime.batch_objective import BatchObjective
        from ..runtime.objective import ObjectivePolicy

        self.engine, self.tokenizer, self.policy, self.model_name = engine, tokenizer, policy, model_name
        self.max_context = engine.cfg.max_context
        self.vocab_size = engine.target.cfg.vocab_size
        self.speculative = engine.cfg.tree is not None
        self.max_batch = max_batch
        # several requests at once: the plan's objective chooses their trees jointly every step
        joint = max_batch > 1 and isinstance(policy, ObjectivePolicy)
        # ``packages``: a compiled engine's batch packages (runtime/batch_packages.py)
        self.decoder = BatchDecoder(engine, max_batch, BatchObjective.of(policy) if joint else None,
                                    packages=packages)
        # the HTTP side encodes prompts while the worker decodes text: one tokenizer call at a time
        # (a fast tokenizer's Rust object refuses a call while another one borrows it mutably)
        self.tokenizer_lock = threading.Lock()

    def policy_for(self, job: "Job"):
        """A job's step policy: plain steps for ``"speculative": false`` (draft depth 0, the root
        alone verified, the drafter's prefill skipped), else the plan's policy (one request at a
        time: it learns across them as ``yggtree run`` does; in a batch each request its own copy,
        sharing what it learns, whose choices the joint objective replaces in batched steps), else
        the engine's tree."""
        if not self.speculative:
            return None
        if not job.speculative:
            from ..runtime.batch import plain_policy

            return plain_policy(self.engine)
        if self.max_batch == 1:
            return self.policy
        if self.decoder.objective is not None:
            import copy

            return copy.copy(self.policy)  # its per-request state its own (start_request), the rest shared
        return None

    def admit(self, job: "Job") -> None:
        """``job`` joins the running batch (its prefill starts at the next step)."""
        self.decoder.add(job, job.prompt_ids, job.params, self.policy_for(job))

    def release(self, job: "Job") -> None:
        """``job`` leaves the running batch (a no-op when it is not in it)."""
        self.decoder.remove(job)

    def step(self):
        """One step of every running request: a list of :class:`~yggtree.runtime.batch.Emitted`."""
        return self.decoder.step()


class Session:
    """One running request on the worker: text, stop strings, timing and the step-boundary checks."""

    def __init__(self, job: Job, backend: Backend, metrics) -> None:
        self.job, self.metrics = job, metrics
        self.decoder = IncrementalDecoder(backend.tokenizer, getattr(backend, "tokenizer_lock", None))
        self.matcher = StopMatcher(job.stops)
        self.tokens = 0  # completion tokens (up to the one that completed a stop string)
        self.first: float | None = None
        self.last: float | None = None
        self.finish: str | None = None

    def deliver(self, ids: list[int]) -> bool:
        """This step's tokens: their text goes to the client; False once the request ends here."""
        now = time.monotonic()
        m, model = self.metrics, self.metrics.model
        if self.first is None:
            self.first = now
            m.ttft.labels(model).observe(now - self.job.arrival)
        elif ids:
            m.itl.labels(model).observe((now - self.last) / len(ids))
        self.last = now
        out = []
        for t in ids:
            self.tokens += 1
            text, stopped = self.matcher.feed(self.decoder.push(t))
            out.append(text)
            if stopped:
                self.finish = "stop"
                break
        text = "".join(out)
        if text:
            self.job.put("text", text)
        return self.finish is None and self.job.cancelled is None and now < self.job.deadline

    def why_not(self) -> str | None:
        """Why the request must end at this step boundary (None: it goes on)."""
        if self.finish is not None:
            return "stop"
        if self.job.cancelled is not None:
            return "cancelled"
        return "timeout" if time.monotonic() >= self.job.deadline else None

    def close(self, engine_finish: str) -> tuple[str, dict]:
        """The finish reason and usage once the engine stopped by itself (EOS or length)."""
        if self.finish is None:
            text, stopped = self.matcher.feed(self.decoder.flush())
            text += self.matcher.flush()
            if text:
                self.job.put("text", text)
            self.finish = "stop" if stopped else engine_finish
        return self.finish, self.usage()

    def usage(self) -> dict:
        p = len(self.job.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": self.tokens, "total_tokens": p + self.tokens}


class Scheduler:
    """Owns the worker thread: it builds the engine (``build()`` -> :class:`Backend`) and serves
    the bounded queue of jobs in arrival order, up to the backend's ``max_batch`` at once.
    ``submit`` raises a 429 :class:`ServeError` when ``max_queue`` jobs are already waiting."""

    def __init__(self, build, metrics_factory, max_queue: int = 64, timeout: float = 600.0) -> None:
        self._build, self._metrics_factory = build, metrics_factory
        self.max_queue, self.timeout = max_queue, timeout
        self.backend: Backend | None = None
        self.metrics = None
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self._sessions: dict[int, Session] = {}  # id(job) -> its session, for the running jobs
        self._cv = threading.Condition()
        self._stop = False
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._service = collections.deque(maxlen=32)  # recent service times, for Retry-After
        self.served = 0
        self.thread = threading.Thread(target=self._main, name="yggtree-engine", daemon=True)

    @property
    def capacity(self) -> int:
        """Requests decoded at once (the backend's batch)."""
        return self.backend.max_batch if self.backend is not None else 1

    # ----------------------------------------------------------------- HTTP side

    def start(self) -> "Scheduler":
        """Start the worker and wait until the engine is built; re-raises a build error."""
        self.thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error
        return self

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and self._build_error is None and self.thread.is_alive() and not self._stop

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop:
                raise ServeError(503, "the server is shutting down", "server_error")
            if len(self.waiting) >= self.max_queue:
                self.metrics.failed.labels(self.metrics.model, "queue_full").inc()
                raise ServeError(429, f"the server's queue is full ({self.max_queue} requests waiting); "
                                 "retry later", "rate_limit_error", headers={"Retry-After": str(self.retry_after())})
            self.waiting.append(job)
            self.metrics.waiting.labels(self.metrics.model).set(len(self.waiting))
            self._cv.notify()

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the recent mean service time over the
        requests served at once, at least 1."""
        mean = sum(self._service) / len(self._service) if self._service else 1.0
        return max(1, min(60, math.ceil(mean / self.capacity)))

    def discard(self, job: Job, why: str) -> None:
        """The client gave up on ``job``: a waiting job leaves the queue now, a running one ends at
        its next step boundary."""
        job.cancel(why)
        with self._cv:
            try:
                self.waiting.remove(job)
            except ValueError:
                return
            self.metrics.waiting.labels(self.metrics.model).set(len(self.waiting))
        self.metrics.failed.labels(self.metrics.model, why).inc()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking jobs, fail the waiting ones (503), end the running ones at the next step, join."""
        with self._cv:
            self._stop = True
            dropped, self.waiting = list(self.waiting), collections.deque()
            self._cv.notify_all()
        for job in dropped:
            job.cancel("shutdown")
            job.put("error", ServeError(503, "the server is shutting down", "server_error"))
        for job in list(self.running):
            job.cancel("shutdown")
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ----------------------------------------------------------------- worker side

    def _main(self) -> None:
        try:
            self.backend = self._build()
            self.metrics = self._metrics_factory(self.backend)
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._build_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve_loop()
        finally:
            for job in list(self.running):  # the server stops: every running job gets its answer
                self._end(job, ServeError(503, "the server is shutting down", "server_error"), "shutdown")

    def _serve_loop(self) -> None:
        """Step boundaries: admit queued jobs into free slots, drop the jobs that must end, run
        one step of every running job, hand out its tokens."""
        m = self.metrics
        while True:
            with self._cv:
                while not self.waiting and not self.running and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                joining = []
                while self.waiting and len(self.running) + len(joining) < self.capacity:
                    joining.append(self.waiting.popleft())
                m.waiting.labels(m.model).set(len(self.waiting))
            for job in joining:
                self._admit(job)
            for job in list(self.running):
                why = self._sessions[id(job)].why_not()
                if why is not None:
                    self._stop_job(job, why)
            if not self.running:
                continue
            try:
                events = self.backend.step()
            except Exception as e:  # noqa: BLE001 - the step failed as a whole: its jobs fail, the server goes on
                traceback.print_exc(file=sys.stderr)
                for job in list(self.running):
                    self._fail(job, e)
                continue
            for ev in events:
                self._event(ev)
            self._drain({job.loop for job in self.running} | {ev.key.loop for ev in events})

    @staticmethod
    def _drain(loops) -> None:
        """Let the HTTP side send this step's tokens before the next step starts: work on its
        thread during a step takes a core from the step's parallel loops, whose threads then wait
        for it at every product. Waits until each loop has run what the step handed it, at most
        DRAIN_WAIT seconds a loop."""
        for loop in loops:
            done = threading.Event()
            try:  # in the loop's thread, after what is queued there: queue the mark behind what that runs
                loop.call_soon_threadsafe(loop.call_soon, done.set)
            except RuntimeError:  # the loop is closed
                continue
            done.wait(DRAIN_WAIT)

    def _admit(self, job: Job) -> None:
        """Start ``job`` (into ``running``), or answer it now: cancelled while queued, timed out,
        or refused by the engine."""
        m, model = self.metrics, self.metrics.model
        job.started = time.monotonic()
        m.queue_time.labels(model).observe(job.started - job.arrival)
        if job.cancelled is not None:  # gave up while queued (its queue slot was freed then)
            return
        if job.started >= job.deadline:
            m.failed.labels(model, "timeout").inc()
            job.put("error", timeout_error(job.timeout))
            return
        try:
            self.backend.admit(job)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self._answer_failure(job, e)
            return
        self._sessions[id(job)] = Session(job, self.backend, m)
        self.running.append(job)
        m.running.labels(model).set(len(self.running))

    def _event(self, ev) -> None:
        """One running job's part of a step: its tokens, its finish or its failure."""
        job = ev.key
        session = self._sessions.get(id(job))
        if session is None:
            return
        if ev.error is not None:
            self._fail(job, ev.error)
            return
        self.metrics.step(ev.verify_width, ev.drafted, ev.accepted)
        if ev.tokens:
            session.deliver(ev.tokens)
        if ev.finish is not None:
            finish, _ = session.close(ev.finish)
            self._end(job)
            self._finished(job, session, finish)
        elif session.finish is not None:  # a stop string: its slot is freed now
            self._stop_job(job, "stop")

    def _stop_job(self, job: Job, why: str) -> None:
        """End a running job at this step boundary: ``stop`` (a stop string), ``cancelled`` or ``timeout``."""
        m, model = self.metrics, self.metrics.model
        session = self._sessions[id(job)]
        self._end(job)
        if why == "stop":
            self._finished(job, session, "stop")
        elif why == "timeout":
            m.failed.labels(model, "timeout").inc()
            job.put("error", timeout_error(job.timeout))
        else:
            m.failed.labels(model, job.cancelled or "cancelled").inc()
            job.put("error", ServeError(499, "the request was cancelled", "cancelled"))

    def _fail(self, job: Job, e: Exception) -> None:
        self._end(job)
        self._answer_failure(job, e)

    def _answer_failure(self, job: Job, e: Exception) -> None:
        m, model = self.metrics, self.metrics.model
        if isinstance(e, YggError):  # a request the engine refuses (the HTTP side checks them first)
            m.failed.labels(model, "invalid").inc()
            job.put("error", ServeError(400, str(e)))
            return
        traceback.print_exception(e, file=sys.stderr)
        m.failed.labels(model, "error").inc()
        job.put("error", ServeError(500, f"internal error while decoding: {type(e).__name__}: {e}", "server_error"))

    def _end(self, job: Job, error: ServeError | None = None, why: str | None = None) -> None:
        """``job`` leaves the batch and ``running`` (its slot is free for the next step)."""
        self.backend.release(job)
        self._sessions.pop(id(job), None)
        with self._cv:
            if job in self.running:
                self.running.remove(job)
        self.metrics.running.labels(self.metrics.model).set(len(self.running))
        if job.started is not None:
            self._service.append(time.monotonic() - job.started)
        self.served += 1
        if error is not None:
            self.metrics.failed.labels(self.metrics.model, why).inc()
            job.put("error", error)

    def _finished(self, job: Job, session: Session, finish: str) -> None:
        m, model = self.metrics, self.metrics.model
        usage = session.usage()
        now = time.monotonic()
        m.success.labels(model, finish).inc()
        m.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
        m.generation_tokens.labels(model).inc(usage["completion_tokens"])
        m.e2e.labels(model).observe(now - job.arrival)
        if session.tokens > 1 and session.first is not None:
            m.tpot.labels(model).observe((session.last - session.first) / (session.tokens - 1))
        job.put("done", finish, usage)
