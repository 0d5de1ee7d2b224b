"""``yggtree serve`` (yggtree/serve/): the OpenAI API over HTTP.

Fast tests run a real uvicorn server on a loopback port in a thread, over a tiny random-weight
target (the embedded model's tokenizer and chat template, a 2-layer model of hidden size 32) with a
perturbed copy as its drafter, and drive it with httpx: every endpoint, the SSE format, stop
strings across chunk boundaries, errors, the bounded queue, timeouts, disconnects, a failing
request, and a bounded load and fault test. One slow test starts ``yggtree serve`` with the
embedded model and talks to it with the ``openai`` package and ``curl -N``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
import uvicorn  # noqa: E402

from helpers import perturbed, tiny_model  # noqa: E402
from yggtree.runtime.drafters import LMDrafter  # noqa: E402
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams  # noqa: E402
from yggtree.runtime.kernels import library_missing  # noqa: E402
from yggtree.runtime.packed import pack_linears  # noqa: E402
from yggtree.runtime.loading import encode_prompt  # noqa: E402
from yggtree.serve.app import create_app  # noqa: E402
from yggtree.serve.metrics import Metrics  # noqa: E402
from yggtree.serve.scheduler import Backend, Scheduler  # noqa: E402
from yggtree.serve.text import StopMatcher  # noqa: E402
from yggtree.streaming import IncrementalDecoder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 256
TREE = TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2)
PROMPTS = ["Hello there", "Write a haiku about trees.", "def fib(n):", "1, 2, 3, 4,",
           "The quick brown fox", "Why is the sky blue?", "Translate 'cat' to French.", "Once upon a time"]


@pytest.fixture(scope="module")
def tok(real_tokenizer):
    return real_tokenizer


def tiled(model):
    """``model``'s products on the tiled kernel (rows bitwise independent of the other rows of a
    call, as batched decoding needs; ``F.linear``'s BLAS picks kernels by the row count)."""
    if not library_missing():
        pack_linears(model, kernel="tiled")
    return model


def tiny_engine(tok, speculative: bool = True) -> Engine:
    """The tiny target (its EOS the tokenizer's) with a perturbed copy drafting: partial acceptances."""
    eos = (tok.eos_token_id,)
    target = tiled(tiny_model(len(tok), 32, 2, max_pos=512, eos=eos, seed=0, std=0.3))
    drafter = LMDrafter(tiled(perturbed(tiny_model(len(tok), 32, 2, max_pos=512, eos=eos, seed=0, std=0.3), 0.05)),
                        "reference") if speculative else None
    cfg = EngineConfig(mode="reference", max_context=CONTEXT, prefill_chunk=16, tree=TREE if speculative else None)
    return Engine(target, cfg, drafter, eos_ids=eos)


class Gate:
    """A backend wrapper for scheduling tests: holds every step until ``gate`` is open, sleeps
    ``delay`` seconds per step; a job whose prompt is ``fail_on`` (a token id list) fails when it
    joins the batch."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self.delay, self.fail_on = backend, 0.0, None
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def admit(self, job):
        if self.fail_on is not None and job.prompt_ids == self.fail_on:
            raise RuntimeError("injected failure")
        self.backend.admit(job)

    def step(self):
        self.gate.wait()
        self.steps += 1
        if self.delay:
            time.sleep(self.delay)
        return self.backend.step()


class Server:
    """A uvicorn server on a free loopback port, in a thread, over a scheduler of the tiny engine."""

    def __init__(self, tok, max_queue: int = 64, timeout: float = 60.0, speculative: bool = True,
                 max_batch: int = 1) -> None:
        self.gated: Gate | None = None

        def build():
            self.gated = Gate(Backend(tiny_engine(tok, speculative), tok, None, "tiny", max_batch))
            return self.gated

        self.scheduler = Scheduler(build, lambda b: Metrics("tiny", TREE.draft_depth), max_queue, timeout).start()
        self.app = create_app(self.scheduler)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.stop()


# every endpoint test on a server of one slot (the default of a compiled engine) in the unit run, and
# on one of four slots in the slow run; the unit run keeps the batched server's own tests (batch_server)
BATCHES = [1, pytest.param(4, marks=[pytest.mark.slow,
                                     pytest.mark.skipif(bool(library_missing()),
                                                        reason="exact batching needs the tiled kernel")])]


@pytest.fixture(scope="module", params=BATCHES, ids=lambda b: f"batch{b}")
def server(tok, request):
    """The tiny server, decoding one request at a time, then up to four at once."""
    s = Server(tok, max_batch=request.param)
    yield s
    s.close()


@pytest.fixture(scope="module")
def batch_server(tok):
    if library_missing():
        pytest.skip("exact batching needs the tiled kernel")
    s = Server(tok, max_batch=4)
    yield s
    s.close()


@pytest.fixture()
def client(server):
    server.gated.delay, server.gated.fail_on = 0.0, None
    server.gated.gate.set()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tok):
    """Greedy decoding of a token list alone on a fresh engine (plain, the target only)."""
    eng = tiny_engine(tok, speculative=False)
    cache = {}

    def run(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = eng.generate(ids, SamplingParams(max_new_tokens=n)).token_ids
        return cache[key]

    return run


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing: every event one ``data:`` line
    and a blank line."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    out = []
    for ev in events:
        assert ev.startswith("data: ") and "\n" not in ev, ev
        out.append(ev[len("data: "):])
    return out


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


def error_of(r, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and "\n" not in e["message"]
    return e["message"]


# ----------------------------------------------------------------------------- text


def test_a_step_waits_for_the_http_side_to_run_what_it_handed_over():
    """Scheduler._drain returns once each loop has run the callbacks a step scheduled on it (and
    what they scheduled in turn), at once for a closed loop, and within DRAIN_WAIT for a stuck one."""
    import time

    from yggtree.serve.scheduler import DRAIN_WAIT, Scheduler

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ran = []
    try:
        loop.call_soon_threadsafe(lambda: loop.call_soon(ran.append, "sent"))  # a token event and its write
        Scheduler._drain({loop})
        assert ran == ["sent"]
        stuck = threading.Event()
        loop.call_soon_threadsafe(stuck.wait, 1.0)  # the loop busy for a second
        t0 = time.perf_counter()
        Scheduler._drain({loop})
        assert time.perf_counter() - t0 < DRAIN_WAIT + 0.5
        stuck.set()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    Scheduler._drain({loop})  # closed: nothing to wait for


def test_stop_matcher_never_emits_a_stop_string_wherever_the_chunks_split():
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        m, out, stopped = StopMatcher(stops), [], False
        for p in parts:
            o, stopped = m.feed(p)
            out.append(o)
            if stopped:
                break
        if not stopped:
            out.append(m.flush())
        # the stop string that appears first as the text grows: the one ending first
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
        want = text[: min(hits)[1]] if hits else text
        assert "".join(out) == want and stopped == bool(hits), (text, stops, parts)


def test_incremental_decoder_equals_decoding_the_whole(tok):
    rng = random.Random(1)
    for n in range(20):
        ids = encode_prompt(tok, "naïve café — 日本語 🌲🌳 " * 3 + str(n), raw=True)
        ids += [rng.randrange(len(tok)) for _ in range(20)]
        d = IncrementalDecoder(tok)
        text = "".join(d.push(t) for t in ids) + d.flush()
        assert text == decode(tok, ids)


# ----------------------------------------------------------------------------- endpoints


def test_models_health_and_metrics(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    m = r.json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == CONTEXT
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = client.get("/metrics").text
    for name in ("yggtree:num_requests_waiting", "yggtree:num_requests_running",
                 "yggtree:time_to_first_token_seconds_bucket", "yggtree:time_per_output_token_seconds_bucket",
                 "yggtree:spec_decode_num_drafts_total", "yggtree:spec_decode_num_draft_tokens_total",
                 "yggtree:spec_decode_num_accepted_tokens_total"):
        assert name in text, name


def test_greedy_completion_and_chat_equal_the_target_decoding_alone(client, tok, reference):
    for i, p in enumerate(PROMPTS[:2]):
        n = 12 + 5 * i
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = encode_prompt(tok, p, raw=True)
        want = reference(ids, n)
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["text"] == decode(tok, want)
        assert body["choices"][0]["finish_reason"] == ("stop" if want[-1] == tok.eos_token_id else "length")
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want),
                                 "total_tokens": len(ids) + len(want)}
        r = client.post("/v1/chat/completions", json=chat(p, max_tokens=n, temperature=0))
        assert r.status_code == 200, r.text
        body = r.json()
        ids = encode_prompt(tok, p)  # the chat template as yggtree run applies it
        want = reference(ids, n)
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": decode(tok, want)}
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(want)


def test_token_id_prompt_and_a_batch_of_one(client, tok, reference):
    ids = encode_prompt(tok, PROMPTS[4], raw=True)
    want = decode(tok, reference(ids, 10))
    for prompt in (ids, [ids], [PROMPTS[4]]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_speculative_false_gives_the_same_text_without_drafts(client, server):
    body = chat(PROMPTS[1], max_tokens=30, temperature=0)
    before = client.get("/metrics").text
    spec = client.post("/v1/chat/completions", json=body).json()
    mid = client.get("/metrics").text
    plain = client.post("/v1/chat/completions", json=body | {"speculative": False}).json()
    after = client.get("/metrics").text
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    name = "yggtree:spec_decode_num_drafts_total"
    assert metric(mid, name) > metric(before, name)  # the speculative request drafted
    assert metric(after, name) == metric(mid, name)  # the plain one did not
    acc = "yggtree:spec_decode_num_accepted_tokens_total"
    pos = sum(metric(after, "yggtree:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
              for i in range(TREE.draft_depth))
    assert pos == metric(after, acc) > 0  # a tree accepts one path: per position sums to the total


def test_sampling_is_seeded(client):
    body = chat(PROMPTS[2], max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    a = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    b = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    c = client.post("/v1/chat/completions", json=body | {"seed": 8}).json()["choices"][0]["message"]["content"]
    assert a == b and a != c


@pytest.mark.parametrize("chat_api", [True, False])
def test_stream_is_openai_sse(client, tok, reference, chat_api):
    p, n = PROMPTS[5], 25
    path = "/v1/chat/completions" if chat_api else "/v1/completions"
    body = (chat(p) if chat_api else {"prompt": p}) | {"max_tokens": n, "temperature": 0, "stream": True,
                                                       "stream_options": {"include_usage": True}}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    kind = "chat.completion.chunk" if chat_api else "text_completion"
    assert all(c["object"] == kind and c["id"] == chunks[0]["id"] for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "length"
    deltas = chunks[:-2]
    if chat_api:
        assert deltas[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in deltas)
    else:
        text = "".join(c["choices"][0]["text"] for c in deltas)
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas)
    ids = encode_prompt(tok, p, raw=not chat_api)
    assert text == decode(tok, reference(ids, n))
    assert len(deltas) > 3  # streamed step by step, not in one piece


def test_stop_strings_across_chunk_boundaries(client, tok, reference):
    """Stop strings made of the end of one token's text and the start of the next one's (so they
    span a chunk boundary whatever the step sizes) end the text before them, in both forms."""
    p, n = PROMPTS[6], 40
    ids = encode_prompt(tok, p)
    out = reference(ids, n)
    pieces = [decode(tok, out[:k]) for k in range(len(out) + 1)]
    full = pieces[-1]
    tried = 0
    for k in range(3, len(out) - 1, 4):
        a, b = pieces[k], pieces[k + 1]
        if len(b) - len(a) < 2 or len(a) < 2:
            continue
        stop = full[len(a) - 2 : len(a) + 2]  # 2 chars either side of the token boundary
        want = full[: full.find(stop)]
        for stream in (False, True):
            body = chat(p, max_tokens=n, temperature=0, stop=["\u2603never", stop], stream=stream)
            if not stream:
                r = client.post("/v1/chat/completions", json=body).json()
                assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "stop"
                assert r["usage"]["completion_tokens"] <= k + 2
                continue
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
            deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
            assert "".join(deltas) == want and chunks[-1]["choices"][0]["finish_reason"] == "stop"
        tried += 1
        if tried == 3:  # three boundaries, both forms each
            break
    assert tried >= 2


def test_stop_string_alone_and_finish_by_length(client):
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                             "stop": "\u2603"}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 8


# ----------------------------------------------------------------------------- errors


def test_malformed_and_invalid_requests_get_400_in_openai_shape(client):
    cases = [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"\xff\xfe", "JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), "'messages'"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
        ("/v1/chat/completions", json.dumps(chat("x", n=2)).encode(), "'n' must be 1"),
        ("/v1/chat/completions", json.dumps(chat("x", temperature=-1)).encode(), "'temperature'"),
        ("/v1/chat/completions", json.dumps(chat("x", temperature="hot")).encode(), "'temperature' must be a number"),
        ("/v1/chat/completions", json.dumps(chat("x", top_p=0)).encode(), "'top_p'"),
        ("/v1/chat/completions", json.dumps(chat("x", max_tokens=0)).encode(), "'max_tokens'"),
        ("/v1/chat/completions", json.dumps(chat("x", max_tokens=True)).encode(), "'max_tokens' must be an integer"),
        ("/v1/chat/completions", json.dumps(chat("x", stop=[1])).encode(), "'stop'"),
        ("/v1/chat/completions", json.dumps(chat("x", stream="yes")).encode(), "'stream'"),
        ("/v1/chat/completions", json.dumps(chat("x", seed=-1)).encode(), "'seed'"),
        ("/v1/chat/completions", json.dumps(chat("x", logprobs=True)).encode(), "'logprobs' is not supported"),
        ("/v1/chat/completions", json.dumps(chat("x", speculative="no")).encode(), "'speculative'"),
        ("/v1/completions", json.dumps({"prompt": 5}).encode(), "'prompt'"),
        ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), "one prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, 10**9]}).encode(), "outside the vocabulary"),
    ]
    for path, raw, needle in cases:
        msg = error_of(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert needle in msg, (raw, msg)
    assert "does not exist" in error_of(client.post("/v1/chat/completions", json=chat("x") | {"model": "gpt-9"}), 404)
    error_of(client.get("/v1/nothing"), 404)
    error_of(client.get("/v1/chat/completions"), 405)
    assert client.get("/health").json()["status"] == "ok"


def test_prompt_longer_than_the_context_names_the_limit(client, tok):
    long = "tree " * (CONTEXT + 10)
    msg = error_of(client.post("/v1/completions", json={"prompt": long}), 400)
    assert f"context of {CONTEXT} tokens" in msg and "the prompt has" in msg
    msg = error_of(client.post("/v1/chat/completions", json=chat("hi", max_tokens=CONTEXT)), 400)
    assert f"context of {CONTEXT} tokens" in msg and "max_tokens" in msg
    # without max_tokens a chat completion may use the rest of the context
    r = client.post("/v1/completions", json={"prompt": "tree " * (CONTEXT - 10), "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= CONTEXT


def test_a_failing_request_does_not_take_down_the_others(client, server, tok):
    server.gated.fail_on = encode_prompt(tok, "boom", raw=True)
    msg = error_of(client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 4}), 500)
    assert "injected failure" in msg
    with client.stream("POST", "/v1/completions", json={"prompt": "boom", "stream": True}) as r:
        assert r.status_code == 500
    r = client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4})
    assert r.status_code == 200 and client.get("/health").json()["status"] == "ok"


# ----------------------------------------------------------------------------- concurrency


def test_concurrent_requests_each_equal_their_decoding_alone(batch_server, tok, reference):
    """Twenty requests, eight at a time, into four slots: chat and completions, streamed or not,
    speculative or not, of different lengths, joining and leaving the running batch at step
    boundaries; each response is its prompt decoded alone (greedy), and the batch ran full."""
    rng = random.Random(7)
    plans = [{"prompt": rng.choice(PROMPTS), "n": rng.randint(1, 40), "chat": rng.random() < 0.5,
              "stream": rng.random() < 0.5, "speculative": rng.random() < 0.7} for _ in range(20)]
    busiest = []

    async def one(c, p, sem):
        async with sem:
            path = "/v1/chat/completions" if p["chat"] else "/v1/completions"
            body = (chat(p["prompt"]) if p["chat"] else {"prompt": p["prompt"]}) | {
                "max_tokens": p["n"], "temperature": 0, "stream": p["stream"], "speculative": p["speculative"]}
            if not p["stream"]:
                r = await c.post(path, json=body)
                assert r.status_code == 200, r.text
                ch = r.json()["choices"][0]
                return ch["message"]["content"] if p["chat"] else ch["text"]
            async with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                chunks = [json.loads(e) for e in sse_events((await r.aread()).decode())[:-1]]
            return "".join(c["choices"][0]["delta"].get("content", "") if p["chat"] else c["choices"][0]["text"]
                           for c in chunks)

    async def watch(c, done):
        while not done.is_set():
            busiest.append((await c.get("/health")).json()["running"])
            await asyncio.sleep(0.005)

    async def go():
        sem, done = asyncio.Semaphore(8), asyncio.Event()
        async with httpx.AsyncClient(base_url=batch_server.url, timeout=120) as c:
            w = asyncio.create_task(watch(c, done))
            texts = await asyncio.gather(*(one(c, p, sem) for p in plans))
            done.set()
            await w
            return texts

    texts = asyncio.run(asyncio.wait_for(go(), 120))
    for p, text in zip(plans, texts):
        assert text == decode(tok, reference(encode_prompt(tok, p["prompt"], raw=not p["chat"]), p["n"])), p
    assert max(busiest) == 4


def test_a_request_failing_mid_batch_leaves_the_others_decoding(tok, reference):
    """One request of a running batch fails in its own stages: it alone gets a 500, the requests
    decoding beside it finish as alone, the server stays healthy."""
    if library_missing():
        pytest.skip("exact batching needs the tiled kernel")
    s = Server(tok, max_batch=4)
    try:
        dec = s.gated.backend.decoder
        bad = encode_prompt(tok, "boom", raw=True)
        real = dec._plan

        def plan(slot, st):
            if slot.prompt == bad and slot.req.committed > len(bad) + 2:  # a few steps in
                raise RuntimeError("injected mid-batch failure")
            return real(slot, st)

        dec._plan = plan

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                bodies = [{"prompt": "boom", "max_tokens": 30, "temperature": 0, "speculative": False}] + [
                    {"prompt": p, "max_tokens": 25, "temperature": 0} for p in PROMPTS[:3]]
                return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

        rs = asyncio.run(go())
        assert "injected mid-batch failure" in error_of(rs[0], 500)
        for p, r in zip(PROMPTS[:3], rs[1:]):
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == decode(tok, reference(encode_prompt(tok, p, raw=True), 25))
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert metric(c.get("/metrics").text, "yggtree:request_failure_total", reason="error") == 1
    finally:
        s.close()


def test_the_openai_client_at_concurrency(batch_server, tok, reference):
    """The ``openai`` package against the batching server from six threads at once: streamed and
    whole chat completions, completions with stop strings, and errors, each as alone."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=batch_server.url + "/v1", api_key="unused", max_retries=0)

    def chat_case(i):
        p, n = PROMPTS[i % len(PROMPTS)], 10 + 3 * i
        want = decode(tok, reference(encode_prompt(tok, p), n))
        if i % 2:
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                    max_tokens=n, temperature=0, stream=True)
            got = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        else:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                               max_tokens=n, temperature=0)
            got = r.choices[0].message.content
        return got == want

    def stop_case(i):
        p, n = PROMPTS[i], 30
        full = decode(tok, reference(encode_prompt(tok, p, raw=True), n))
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        if not stop.strip():
            return True  # nothing to stop at in this text
        r = client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0, stop=[stop])
        return r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"

    def error_case(i):
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=10 * CONTEXT)
        except openai.BadRequestError as e:
            return "context" in str(e)
        return False

    cases = [(chat_case, i) for i in range(6)] + [(stop_case, i) for i in range(4)] + [(error_case, 0)] * 2
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda c: c[0](c[1]), cases))
    assert all(results), results
    assert client.models.list().data[0].id == "tiny"


# ----------------------------------------------------------------------------- overload


@pytest.mark.parametrize("max_batch", BATCHES)
def test_a_full_queue_answers_429_with_retry_after(tok, max_batch):
    s = Server(tok, max_queue=2, max_batch=max_batch)
    try:
        s.gated.gate.clear()  # the worker holds the first request: the next two wait, the fourth is refused

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                body = {"prompt": "x", "max_tokens": 3, "temperature": 0}
                tasks = [asyncio.create_task(c.post("/v1/completions", json=body))]
                while not s.scheduler.running:
                    await asyncio.sleep(0.01)
                tasks += [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
                while len(s.scheduler.waiting) < 2:
                    await asyncio.sleep(0.01)
                r = await c.post("/v1/completions", json=body)
                m = await c.get("/metrics")
                s.gated.gate.set()
                return r, m.text, await asyncio.gather(*tasks)

        r, metrics_text, done = asyncio.run(go())
        assert "queue is full" in error_of(r, 429) and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert metric(metrics_text, "yggtree:num_requests_waiting") == 2
        assert metric(metrics_text, "yggtree:num_requests_running") == 1
        assert [d.status_code for d in done] == [200, 200, 200]
    finally:
        s.gated.gate.set()
        s.close()


@pytest.mark.parametrize("max_batch", BATCHES)
def test_timeouts_while_queued_and_while_decoding(tok, max_batch):
    s = Server(tok, timeout=0.6, max_batch=max_batch)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            s.gated.gate.clear()
            t = time.monotonic()
            msg = error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}), 504)
            assert "timeout (0.6 s)" in msg and time.monotonic() - t < 3
            s.gated.gate.set()
            s.gated.delay = 0.05  # 100 steps would take 5 s
            t = time.monotonic()
            error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "speculative": False}), 504)
            with c.stream("POST", "/v1/completions",
                          json={"prompt": "x", "max_tokens": 100, "stream": True, "speculative": False}) as r:
                assert r.status_code == 200
                events = sse_events(r.read().decode())
            assert json.loads(events[-2])["error"]["type"] == "timeout_error" and events[-1] == "[DONE]"
            assert time.monotonic() - t < 5
            s.gated.delay = 0.0
            deadline = time.monotonic() + 10
            while s.scheduler.running and time.monotonic() < deadline:
                time.sleep(0.02)
            steps = s.gated.steps
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
            assert s.gated.steps - steps <= 3  # the timed-out requests stopped decoding
            m = c.get("/metrics").text
            assert metric(m, "yggtree:request_failure_total", reason="timeout") == 3
    finally:
        s.gated.gate.set()
        s.close()


@pytest.mark.parametrize("max_batch", BATCHES)
def test_a_disconnect_frees_the_slot_at_the_next_step(tok, max_batch):
    s = Server(tok, max_batch=max_batch)
    try:
        s.gated.delay = 0.03
        with httpx.Client(base_url=s.url, timeout=30) as c:
            body = {"prompt": "x", "max_tokens": 200, "stream": True, "temperature": 0, "speculative": False}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
            assert all(g.startswith("data: ") or g == "" for g in got)
            deadline = time.monotonic() + 5
            while s.scheduler.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not s.scheduler.running  # stopped long before its 200 tokens (6 s)
            assert s.gated.steps < 60
            # a non-streaming client that gives up
            s.gated.gate.clear()
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body | {"stream": False}, timeout=0.3)
            deadline = time.monotonic() + 5
            while s.scheduler.waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not s.scheduler.waiting  # left the queue at once
            s.gated.gate.set()
            s.gated.delay = 0.0
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
            m = c.get("/metrics").text
            assert metric(m, "yggtree:request_failure_total", reason="disconnect") >= 2
    finally:
        s.gated.gate.set()
        s.close()


# ----------------------------------------------------------------------------- load and faults


@pytest.mark.slow
def test_bounded_load_with_disconnects_and_malformed_bodies(server, tok, reference):
    """200 requests, 16 at a time: random lengths, streaming or not, random disconnects and
    malformed bodies mixed in. Every valid request that was not abandoned gets exactly one
    complete response equal to its prompt decoded alone (greedy); no 5xx; healthy afterwards."""
    server.gated.delay, server.gated.fail_on = 0.0, None
    rng = random.Random(61)
    plans = []
    for i in range(200):
        kind = rng.choices(["valid", "disconnect", "malformed"], [0.75, 0.12, 0.13])[0]
        plans.append({"i": i, "kind": kind, "prompt": rng.choice(PROMPTS), "n": rng.randint(1, 24),
                      "stream": rng.random() < 0.5, "chat": rng.random() < 0.5, "cut": rng.randint(1, 4)})
    bad_bodies = [b"{", b"null", b'{"messages": 3}', b'{"prompt": "x", "max_tokens": -5}',
                  b'{"prompt": "x", "n": 3}', b'{"messages": [{"role": "user"}], "stop": {}}', b"\x00\x01"]

    async def one(c: httpx.AsyncClient, p: dict, sem: asyncio.Semaphore) -> dict:
        async with sem:
            path = "/v1/chat/completions" if p["chat"] else "/v1/completions"
            if p["kind"] == "malformed":
                r = await c.post(path, content=rng.choice(bad_bodies), headers={"content-type": "application/json"})
                return {"status": r.status_code, "body": r.json()}
            body = (chat(p["prompt"]) if p["chat"] else {"prompt": p["prompt"]}) | {
                "max_tokens": p["n"], "temperature": 0, "stream": p["stream"], "user": str(p["i"])}
            if not p["stream"]:
                if p["kind"] == "disconnect":
                    try:
                        await c.post(path, json=body, timeout=0.05)
                    except httpx.TimeoutException:
                        return {"status": "abandoned"}
                    return {"status": "finished-before-abandon"}
                r = await c.post(path, json=body)
                return {"status": r.status_code, "body": r.json()}
            async with c.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return {"status": r.status_code, "body": json.loads(await r.aread())}
                events, buf = [], ""
                async for chunk in r.aiter_text():
                    buf += chunk
                    while "\n\n" in buf:
                        ev, buf = buf.split("\n\n", 1)
                        events.append(ev)
                    if p["kind"] == "disconnect" and len(events) >= p["cut"]:
                        return {"status": "abandoned"}
                return {"status": 200, "events": events}

    async def go():
        sem = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, p, sem) for p in plans))

    t = time.monotonic()
    results = asyncio.run(asyncio.wait_for(go(), 240))
    elapsed = time.monotonic() - t
    ids_seen, counts = set(), {"valid": 0, "malformed": 0, "abandoned": 0}
    for p, res in zip(plans, results):
        if p["kind"] == "malformed":
            assert res["status"] == 400 and "\n" not in res["body"]["error"]["message"]
            counts["malformed"] += 1
            continue
        if res["status"] in ("abandoned", "finished-before-abandon"):
            counts["abandoned"] += 1
            continue
        assert res["status"] == 200, (p, res)
        counts["valid"] += 1
        want_ids = reference(encode_prompt(tok, p["prompt"], raw=not p["chat"]), p["n"])
        want = decode(tok, want_ids)
        if p["stream"]:
            data = [e[len("data: "):] for e in res["events"]]
            assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
            chunks = [json.loads(d) for d in data[:-1]]
            assert len({c["id"] for c in chunks}) == 1
            cid = chunks[0]["id"]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
            assert len(finishes) == 1  # exactly one end, nothing duplicated
            key = "delta" if p["chat"] else None
            text = "".join((c["choices"][0]["delta"].get("content", "") if key else c["choices"][0]["text"])
                           for c in chunks)
        else:
            cid = res["body"]["id"]
            ch = res["body"]["choices"][0]
            text = ch["message"]["content"] if p["chat"] else ch["text"]
            assert res["body"]["usage"]["completion_tokens"] == len(want_ids)
        assert cid not in ids_seen
        ids_seen.add(cid)
        assert text == want, (p, text, want)
    assert counts["valid"] >= 120 and counts["malformed"] >= 15 and counts["abandoned"] >= 10
    deadline = time.monotonic() + 10
    while (server.scheduler.running or server.scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        m = c.get("/metrics").text
        assert metric(m, "yggtree:num_requests_waiting") == 0 and metric(m, "yggtree:num_requests_running") == 0
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    print(f"\nload: 200 requests ({counts}) in {elapsed:.1f} s")


# ----------------------------------------------------------------------------- the real server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a self-drafting tree on eager graphs (no compile in the test): the engine flags of both commands
SERVE_FLAGS = ["--drafter", "self", "--draft-width", "2", "--draft-depth", "2", "--verify-width", "4",
               "--max-context", "512", "--mode", "reference"]


@pytest.mark.slow
@pytest.mark.integration
def test_real_server_with_the_openai_client_and_curl(tmp_path):
    """``yggtree serve`` with the embedded model (a self-drafting tree) against the ``openai``
    package and ``curl -N``: greedy chat and completion responses equal ``yggtree run --json``
    with the same engine flags, token for token; streaming, a stop string, errors."""
    openai = pytest.importorskip("openai")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "yggtree.launch", "serve", "--port", str(port), *SERVE_FLAGS],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() - t0 < 900, "the server did not start in 15 minutes"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        startup = time.monotonic() - t0
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        prompts = ["Explain speculative decoding in two sentences.", "Write a haiku about trees."]
        outs = []
        for p in prompts:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                               max_tokens=48, temperature=0)
            outs.append(r)
            assert r.usage.completion_tokens == 48 or r.choices[0].finish_reason == "stop"
        # the same prompts decoded alone by yggtree run, with the same engine flags
        for p, r in zip(prompts, outs):
            run = subprocess.run([sys.executable, "-m", "yggtree.launch", "run", "--json", "--prompt", p,
                                  "--max-new-tokens", "48", *SERVE_FLAGS],
                                 env=env, capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, run.stderr[-2000:]
            alone = json.loads(run.stdout)
            assert r.choices[0].message.content == alone["text"]
            assert r.usage.completion_tokens == len(alone["token_ids"])
            assert r.choices[0].finish_reason == alone["finish_reason"]
        # streaming: the deltas add up to the same text
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[0]}],
                                                max_tokens=48, temperature=0, stream=True)
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(deltas) == outs[0].choices[0].message.content and len(deltas) > 3
        # a stop string: the text before it, finish_reason stop
        full = outs[0].choices[0].message.content
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[0]}],
                                           max_tokens=48, temperature=0, stop=[stop])
        assert r.choices[0].message.content == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
        # a completion without the template
        c = client.completions.create(model=model, prompt="def fib(n):", max_tokens=16, temperature=0)
        assert c.choices[0].text and c.usage.completion_tokens <= 16
        # errors come back as openai's exceptions
        with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2)
        with pytest.raises(openai.BadRequestError, match="context of 512 tokens"):
            client.completions.create(model=model, prompt="tree " * 600, max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
        # curl -N: the raw SSE stream
        if shutil.which("curl"):
            body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompts[1]}],
                               "max_tokens": 24, "temperature": 0, "stream": True})
            raw = subprocess.run(["curl", "-sN", base + "/v1/chat/completions", "-H",
                                  "Content-Type: application/json", "-d", body],
                                 capture_output=True, text=True, timeout=300).stdout
            events = sse_events(raw)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert outs[1].choices[0].message.content.startswith(text)
        # concurrent requests share the batch (the server batches eager engines): each as alone
        from concurrent.futures import ThreadPoolExecutor

        def ask(p):
            return client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                  max_tokens=48, temperature=0).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, prompts * 2))
        assert texts == [r.choices[0].message.content for r in outs] * 2
        assert "batch 4" in log.read_text()
        m = httpx.get(base + "/metrics").text
        assert metric(m, "yggtree:spec_decode_num_drafts_total") > 0
        assert metric(m, "yggtree:spec_decode_num_accepted_tokens_total") > 0
        assert httpx.get(base + "/health").json()["status"] == "ok"
        print(f"\nreal server: ready in {startup:.1f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        tail = log.read_text()[-1500:]
        if "Traceback" in tail:
            print(tail)


@pytest.mark.parametrize("flags,line", [
    (["--max-batch", "33"], "yggtree: error: --max-batch must be in 1..32, got 33"),
    (["--max-batch", "0"], "argument --max-batch: must be >= 1, got 0"),
    (["--max-batch", "four"], "argument --max-batch: expected an integer, got 'four'"),
])
def test_a_bad_max_batch_is_one_line_before_the_model_loads(monkeypatch, capsys, flags, line):
    import yggtree.runtime.loading as loading
    from yggtree.cli import main

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    try:
        code = main(["serve", *flags])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code != 0 and line in err and err.strip().count("\n") <= 1, err
