"""The OpenAI-compatible HTTP API over a :class:`~yggtree.serve.scheduler.Scheduler`.

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text). Every error is OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with a one-line message.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.engine import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams
from .metrics import CONTENT_TYPE
from .scheduler import Job, Scheduler, ServeError, timeout_error

MAX_STOPS = 4  # OpenAI's limit on stop sequences
ROLES = ("system", "user", "assistant", "tool")
# OpenAI fields this server does not implement: accepted at their neutral value, else a 400
NEUTRAL = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
}


def error_response(e: ServeError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ----------------------------------------------------------------------------- request fields


def _field(body: dict, name: str, kinds, default, what: str):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise ServeError(400, f"'{name}' must be {what}, got {json.dumps(v)[:60]}", param=name)
    return v


def _int(body, name, lo, hi, default):
    v = _field(body, name, (int,), default, "an integer")
    if v is not None and not lo <= v <= hi:
        raise ServeError(400, f"'{name}' must be in {lo}..{hi}, got {v}", param=name)
    return v


def _number(body, name, default):
    return float(_field(body, name, (int, float), default, "a number"))


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ServeError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(v) > MAX_STOPS:
        raise ServeError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(v)}", param="stop")
    return [s for s in v if s]


def _content(message: dict, i: int) -> str:
    c = message.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ServeError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(p["text"])
        return "".join(parts)
    raise ServeError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


class Api:
    """The endpoints' logic over one scheduler (its backend's tokenizer and context)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.backend = scheduler.backend
        self.tok = self.backend.tokenizer
        self.created = int(time.time())

    # ---------------------------------------------------------------- parsing

    async def body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            raise ServeError(400, "the request body is not UTF-8 JSON") from None
        except ValueError as e:
            raise ServeError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        return body

    def chat_ids(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ServeError(400, "'messages' must be a non-empty list of messages", param="messages")
        conv = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ServeError(400, f"messages[{i}] must be an object", param="messages")
            if m.get("role") not in ROLES:
                raise ServeError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                                 f"{json.dumps(m.get('role'))[:40]}", param="messages")
            conv.append({"role": m["role"], "content": _content(m, i)})
        if not getattr(self.tok, "chat_template", None):
            raise ServeError(400, "this model has no chat template: use /v1/completions")
        with self.backend.tokenizer_lock:
            try:  # exactly as yggtree run applies it (runtime/loading.encode_prompt)
                text = self.tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - the template rejects the conversation (jinja's raise_exception)
                raise ServeError(400, f"the chat template rejects these messages: {e}", param="messages") from None
            return self.tok(text, add_special_tokens=False)["input_ids"]

    def completion_ids(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one prompt
        if isinstance(p, str):
            with self.backend.tokenizer_lock:
                return self.tok(p)["input_ids"]  # as yggtree run --raw
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.backend.vocab_size]
            if bad:
                raise ServeError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.backend.vocab_size - 1})", param="prompt")
            return list(p)
        if isinstance(p, list) and len(p) > 1:
            raise ServeError(400, "'prompt' takes one prompt per request (n = 1, no batches)", param="prompt")
        raise ServeError(400, "'prompt' must be a string or a list of token ids", param="prompt")

    def job(self, body: dict, ids: list[int], chat: bool) -> tuple[Job, dict]:
        """The job of a validated request, and its response options."""
        model = body.get("model")
        if model is not None and model != self.backend.model_name:
            raise ServeError(404, f"the model {str(model)[:80]!r} does not exist (this server serves "
                             f"{self.backend.model_name!r})", "not_found_error", param="model")
        if _int(body, "n", 1, 1 << 30, 1) != 1:
            raise ServeError(400, "'n' must be 1 (this server generates one choice per request)", param="n")
        for name, ok in NEUTRAL.items():
            if body.get(name) not in ok:
                raise ServeError(400, f"'{name}' is not supported by this server", param=name)
        stream = _field(body, "stream", (bool,), False, "true or false")
        opts = _field(body, "stream_options", (dict,), {}, "an object")
        include_usage = _field(opts, "include_usage", (bool,), False, "true or false")
        speculative = _field(body, "speculative", (bool,), True, "true or false")
        temperature = _number(body, "temperature", 1.0)
        if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
            raise ServeError(400, f"'temperature' must be 0 (greedy) or in {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, "
                             f"got {temperature:g}", param="temperature")
        top_p = _number(body, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise ServeError(400, f"'top_p' must be in (0, 1], got {top_p:g}", param="top_p")
        seed = _int(body, "seed", 0, MAX_SEED, None)
        if seed is None:
            seed = secrets.randbelow(1 << 62)
        stops = _stops(body)
        n, ctx = len(ids), self.backend.max_context
        if n == 0:
            raise ServeError(400, "the prompt is empty", param="messages" if chat else "prompt")
        if n >= ctx:
            raise ServeError(400, f"the prompt has {n} tokens, more than this server's context of {ctx} "
                             f"tokens (prompt + completion) allows", param="messages" if chat else "prompt")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, name, 1, 1 << 30, None)
        if max_tokens is None:
            max_tokens = ctx - n if chat else min(16, ctx - n)  # OpenAI's defaults, inside the context
        elif n + max_tokens > ctx:
            raise ServeError(400, f"the prompt ({n} tokens) + {name} ({max_tokens}) exceeds this server's "
                             f"context of {ctx} tokens", param=name)
        params = SamplingParams(max_tokens, temperature, top_p, seed)
        job = Job(f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", ids, params,
                  asyncio.get_running_loop(), speculative=speculative, stops=stops,
                  timeout=self.scheduler.timeout)
        return job, {"stream": stream, "include_usage": include_usage}

    # ---------------------------------------------------------------- serving

    async def events(self, job: Job):
        """The job's events until its end: ``("text", s)`` items, then ``("done", finish, usage)``;
        a ServeError for a failed or timed-out job. The timeout is enforced here too, so the
        answer comes on time even while another request holds the engine."""
        while True:
            left = job.deadline - time.monotonic()
            try:
                ev = await asyncio.wait_for(job.events.get(), max(left, 0.0))
            except asyncio.TimeoutError:
                self.scheduler.discard(job, "timeout")
                raise timeout_error(job.timeout) from None
            if ev[0] == "error":
                raise ev[1]
            yield ev
            if ev[0] == "done":
                return

    async def watch_disconnect(self, request: Request, job: Job) -> None:
        """Cancel ``job`` when the client goes away (the body is read: only a disconnect is left)."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                self.scheduler.discard(job, "disconnect")
                # wake the handler now (a job that left the queue gets no event from the worker)
                job.events.put_nowait(("error", ServeError(499, "the client disconnected", "cancelled")))
                return

    async def complete(self, request: Request, chat: bool):
        body = await self.body(request)
        ids = self.chat_ids(body) if chat else self.completion_ids(body)
        job, opts = self.job(body, ids, chat)
        self.scheduler.submit(job)
        watcher = asyncio.create_task(self.watch_disconnect(request, job))
        try:
            if opts["stream"]:
                it = self.events(job)
                first = await it.__anext__()  # an error before the first token is an HTTP status
                watcher.cancel()  # from here starlette watches the client and cancels sse() when it goes
                return StreamingResponse(self.sse(job, chat, first, it, opts["include_usage"]),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            text, finish, usage = [], None, None
            async for ev in self.events(job):
                if ev[0] == "text":
                    text.append(ev[1])
                else:
                    finish, usage = ev[1], ev[2]
            watcher.cancel()
            return JSONResponse(self.whole(job, chat, "".join(text), finish, usage))
        except BaseException:
            watcher.cancel()
            self.scheduler.discard(job, "disconnect")  # a no-op for a job that ended
            raise

    def whole(self, job: Job, chat: bool, text: str, finish: str, usage: dict) -> dict:
        head = {"id": job.id, "created": int(time.time()), "model": self.backend.model_name}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return head | {"object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return head | {"object": "text_completion", "choices": [choice], "usage": usage}

    def chunk(self, job: Job, chat: bool, text: str | None, finish: str | None, role: bool = False) -> str:
        head = {"id": job.id, "created": int(time.time()), "model": self.backend.model_name}
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {} if text is None
                     else {"content": text})
            obj = head | {"object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        else:
            obj = head | {"object": "text_completion",
                          "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                       "finish_reason": finish}]}
        return f"data: {json.dumps(obj)}\n\n"

    async def sse(self, job: Job, chat: bool, first, it, include_usage: bool):
        """Server-sent events: a role chunk (chat), one chunk per text delta, the finish chunk, the
        usage chunk when asked, ``data: [DONE]``. An error mid-stream is one ``{"error": ...}``
        event before ``[DONE]``; a disconnect cancels the job (its slot frees at the next step)."""
        try:
            if chat:
                yield self.chunk(job, chat, None, None, role=True)
            ev = first
            while True:
                if ev[0] == "text":
                    yield self.chunk(job, chat, ev[1], None)
                else:
                    finish, usage = ev[1], ev[2]
                    yield self.chunk(job, chat, None, finish)
                    if include_usage:
                        head = {"id": job.id, "created": int(time.time()), "model": self.backend.model_name}
                        obj = head | {"object": "chat.completion.chunk" if chat else "text_completion",
                                      "choices": [], "usage": usage}
                        yield f"data: {json.dumps(obj)}\n\n"
                    break
                try:
                    ev = await it.__anext__()
                except ServeError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away (starlette cancels this generator)
            self.scheduler.discard(job, "disconnect")


def create_app(scheduler: Scheduler) -> FastAPI:
    """The FastAPI application over a started scheduler."""
    app = FastAPI(title="yggtree", docs_url=None, redoc_url=None, openapi_url=None)
    api = Api(scheduler)
    app.state.api = api

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, e: ServeError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        detail = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        msg = f"{request.method} {request.url.path}: {detail}"
        return error_response(ServeError(e.status_code, msg, kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(ServeError(400, str(e).splitlines()[0] if str(e) else "invalid request"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error_response(ServeError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.complete(request, chat=True)

    @app.get("/v1/models")
    async def models():
        b = scheduler.backend
        return {"object": "list", "data": [{"id": b.model_name, "object": "model", "created": api.created,
                                            "owned_by": "yggtree", "max_model_len": b.max_context}]}

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok", "waiting": len(scheduler.waiting), "running": len(scheduler.running),
                "served": scheduler.served}

    @app.get("/metrics")
    async def metrics():
        return Response(scheduler.metrics.render(), media_type=CONTENT_TYPE)

    return app
