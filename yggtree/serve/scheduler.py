"""The worker thread that owns the engine, and the queue of requests it serves.

torch modules, static caches and compiled graphs are not re-entrant across threads, so one thread
builds the engine and runs every request on it; the HTTP side (asyncio) only validates, queues
and reads events. A request is a :class:`Job`: the worker feeds its text back through the job's
asyncio queue (``loop.call_soon_threadsafe``), and the HTTP side cancels it (a disconnect, a
timeout) by setting a flag the worker reads at the next step boundary.

Step boundaries. ``Engine.generate`` runs the whole decode loop itself (it is not a generator),
but calls ``on_tokens`` exactly once per verify step, with the tokens that step emitted (and once
after prefill, with the first token). :class:`Session` is that hook: it detokenizes, holds back
stop strings, hands the text over, and then decides whether the request goes on; when it does not
(a stop string, a cancel, a deadline) it raises :class:`EndRequest`, which unwinds ``generate``
at that step (the engine resets its per-request state when the next request starts: its caches
are rewritten from slot 0 by prefill, the drafter worker is drained in ``decode``'s ``finally``).

Continuous batching (several requests a step, batch-aware trees) slots in here: the loop in :meth:`Scheduler._serve_loop`
admits jobs into ``running`` at step boundaries up to :attr:`Scheduler.capacity` (1 today, because
the engine holds one request's KV cache). A batched engine would expose ``step(sessions)``
advancing every running request by one verify step and return each one's tokens, which go to the
same :meth:`Session.deliver`; a False from it (or a finish) frees that slot for the next queued
job at the next step boundary, exactly as the exception does today.
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


class EndRequest(Exception):
    """Raised from the engine's per-step hook to end a request at this step boundary."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why  # "stop" (a stop string) | "cancelled" | "timeout"


@dataclass
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
    """An engine, its tokenizer and step policy, and what requests may ask of them."""

    def __init__(self, engine, tokenizer, policy=None, model_name: str = "default") -> None:
        self.engine, self.tokenizer, self.policy, self.model_name = engine, tokenizer, policy, model_name
        self.max_context = engine.cfg.max_context
        self.vocab_size = engine.target.cfg.vocab_size
        self.speculative = engine.cfg.tree is not None
        # the HTTP side encodes prompts while the worker decodes text: one tokenizer call at a time
        # (a fast tokenizer's Rust object refuses a call while another one borrows it mutably)
        self.tokenizer_lock = threading.Lock()

    def plain_policy(self):
        """Plain steps on a speculative engine (``"speculative": false``): draft depth 0, the root
        alone verified; the drafter's prefill is skipped too (``Engine._may_skip_drafting``)."""
        from ..runtime.policy import FixedPolicy, StepChoice

        return FixedPolicy(StepChoice(0, self.engine.envelope.draft_widths[0]), 1)

    def generate(self, job: Job, on_tokens, on_step):
        """Decode ``job`` on the engine (on the worker thread), ``on_tokens`` once per step."""
        kw = {}
        if self.speculative:
            kw["on_step"] = on_step
            kw["policy"] = self.policy if job.speculative else self.plain_policy()
        return self.engine.generate(job.prompt_ids, job.params, on_tokens=on_tokens, **kw)


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

    def on_tokens(self, ids: list[int]) -> None:
        if not self.deliver(ids):
            raise EndRequest("stop" if self.finish else "cancelled" if self.job.cancelled else "timeout")

    def on_step(self, rec) -> None:
        self.metrics.step(rec.verify_width, rec.choice.draft_depth > 0, rec.n_accepted)

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
    the bounded queue of jobs in arrival order. ``submit`` raises a 429 :class:`ServeError` when
    ``max_queue`` jobs are already waiting."""

    capacity = 1  # requests decoded at once (the engine's KV cache holds one)

    def __init__(self, build, metrics_factory, max_queue: int = 64, timeout: float = 600.0) -> None:
        self._build, self._metrics_factory = build, metrics_factory
        self.max_queue, self.timeout = max_queue, timeout
        self.backend: Backend | None = None
        self.metrics = None
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self._cv = threading.Condition()
        self._stop = False
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._service = collections.deque(maxlen=32)  # recent service times, for Retry-After
        self.served = 0
        self.thread = threading.Thread(target=self._main, name="yggtree-engine", daemon=True)

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
        """Seconds until a queue slot is likely free: the recent mean service time, at least 1."""
        mean = sum(self._service) / len(self._service) if self._service else 1.0
        return max(1, min(60, math.ceil(mean)))

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
        """Stop taking jobs, fail the waiting ones (503), let the running one end, join."""
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
        self._serve_loop()

    def _serve_loop(self) -> None:
        m = self.metrics
        while True:
            with self._cv:
                while not self.waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self.waiting.popleft()
                m.waiting.labels(m.model).set(len(self.waiting))
                self.running.append(job)
                m.running.labels(m.model).set(len(self.running))
            try:
                self._serve(job)
            finally:
                with self._cv:
                    self.running.remove(job)
                    m.running.labels(m.model).set(len(self.running))

    def _serve(self, job: Job) -> None:
        """Run one job to its end; whatever happens, the job gets exactly one final event."""
        m, model = self.metrics, self.metrics.model
        job.started = time.monotonic()
        m.queue_time.labels(model).observe(job.started - job.arrival)
        if job.cancelled is not None:  # gave up while queued (its queue slot was freed then)
            return
        if job.started >= job.deadline:
            m.failed.labels(model, "timeout").inc()
            job.put("error", timeout_error(job.timeout))
            return
        session = Session(job, self.backend, m)
        try:
            res = self.backend.generate(job, session.on_tokens, session.on_step)
        except EndRequest as e:
            if e.why == "stop":
                self._finished(job, session, "stop")
            elif e.why == "timeout":
                m.failed.labels(model, "timeout").inc()
                job.put("error", timeout_error(job.timeout))
            else:
                m.failed.labels(model, job.cancelled or "cancelled").inc()
                job.put("error", ServeError(499, "the request was cancelled", "cancelled"))
        except YggError as e:  # a request the engine refuses (the HTTP side checks them first)
            m.failed.labels(model, "invalid").inc()
            job.put("error", ServeError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            traceback.print_exc(file=sys.stderr)
            m.failed.labels(model, "error").inc()
            job.put("error", ServeError(500, f"internal error while decoding: {type(e).__name__}: {e}",
                                        "server_error"))
        else:
            finish, _ = session.close(res.finish_reason)
            self._finished(job, session, finish)
        finally:
            self._service.append(time.monotonic() - job.started)
            self.served += 1

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
