"""scripts/bench_serve.py: its percentiles, a cell against a server that closes every connection
after one response (as llama-server does after a few), and a failing server as one line."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from yggtree.errors import YggError

pytest.importorskip("httpx")

spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parents[1] / "scripts" / "bench_serve.py")
bench_serve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_serve)


class Stream(BaseHTTPRequestHandler):
    """A chat-completions stream of ``max_tokens`` one-token chunks, then usage; the connection
    is then closed though its response did not say so (HTTP/1.1 keeps it alive), as a server
    that closes kept-alive connections after some requests does."""

    protocol_version = "HTTP/1.1"
    status = 200

    def do_POST(self):  # noqa: N802 (the stdlib's handler name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.status != 200:
            self.send_response(self.status)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            return
        events = [{"choices": [{"delta": {"content": "x"}}]} for _ in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()  # kept alive as far as the client can tell
        self.wfile.write(data.encode())
        self.close_connection = True  # and closed

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    Stream.status = 200


def test_percentiles_interpolate_between_order_statistics():
    assert bench_serve.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert bench_serve.percentile([5.0], 0.95) == 5.0
    assert bench_serve.percentile([1.0, 2.0], 1.0) == 2.0
    assert bench_serve.percentile([], 0.5) != bench_serve.percentile([], 0.5)  # NaN


def test_a_cell_counts_every_request_on_a_server_closing_its_connections(server):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    r = asyncio.run(bench_serve.cell(url, "m", ["a"] * 12, 3, 5, None))
    assert (r["requests"], r["tokens"], r["concurrency"]) == (12, 60, 3)
    assert r["ttft_p50_ms"] <= r["ttft_p95_ms"] and r["tokens_per_s"] > 0


def test_a_failing_server_is_one_line(server):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    Stream.status = 503
    with pytest.raises(YggError, match=r"^the server answered 503"):
        asyncio.run(bench_serve.cell(url, "m", ["a"] * 2, 1, 3, None))
    with pytest.raises(YggError, match=r"^the server at http://127\.0\.0\.1:1 failed a request at concurrency 1: ConnectError"):
        asyncio.run(bench_serve.cell("http://127.0.0.1:1", "m", ["a"], 1, 3, None))


def test_drafted_share_from_yggtree_counters():
    page = """# HELP yggtree:spec_decode_num_drafts_total Verify steps that checked drafted tokens
yggtree:spec_decode_num_drafts_total{model_name="m"} 30.0
yggtree:spec_decode_num_accepted_tokens_total{model_name="m"} 45.0
yggtree:generation_tokens_total{model_name="m"} 245.0
yggtree:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 20.0
"""
    before = {"drafts": 10.0, "accepted": 15.0, "tokens": 115.0}
    after = bench_serve.spec_counters(page)
    assert after == {"drafts": 30.0, "accepted": 45.0, "tokens": 245.0}
    # 130 tokens, 30 of them accepted: 100 steps, 20 drafted, 1.5 accepted each
    assert bench_serve.drafted_share(before, after) == {"drafted_share": 0.2, "accepted_per_draft": 1.5}
    assert bench_serve.spec_counters("llamacpp:tokens_predicted_total 5\n") is None
    assert bench_serve.drafted_share(None, after) == {}
