#!/usr/bin/env python
"""A concurrency sweep of an OpenAI-compatible server (one run): total tokens/s and per-request
p50/p95 time to first token and time per output token, at each concurrency.

Each cell streams chat completions of ``--max-tokens`` tokens over ``--prompts`` prompts
(half MT-Bench first turns, half HumanEval), ``C`` requests in flight at a time, after one
uncounted warm-up request per setting. For yggtree the
sweep runs with speculation (``"speculative": true``) and without (``false``) on one server;
``--url`` points it at a server already running instead (yggtree's, or llama.cpp's
``llama-server``: ``--speculative none`` then sends no such field). Without ``--url`` it starts
``yggtree serve`` with ``--serve-args`` and reports its start-up time. The last line is JSON.

    python scripts/bench_serve.py --concurrency 1,2,4,8 --prompts 40 --max-tokens 128 \\
        --serve-args "--mode reference --max-batch 8"
    python scripts/bench_serve.py --url http://127.0.0.1:8080 --speculative none   # llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import time

from yggtree.errors import YggError, run_reporting


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics); NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one(client, model: str, text: str, max_tokens: int, speculative: bool | None,
              temperature: float = 0.0) -> dict:
    """One streamed chat completion: its time to first token, end, and completion tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if speculative is not None:
        body["speculative"] = speculative
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise YggError(f"the server answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if first is None and ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - t0, "tpot": (end - first) / (tokens - 1) if tokens > 1 else float("nan"),
            "tokens": tokens, "start": t0, "end": end}


async def cell(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
               speculative: bool | None, temperature: float = 0.0) -> dict:
    """Every prompt once, ``concurrency`` in flight: the cell's totals and percentiles."""
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def run(c, p):
        async with sem:
            return await one(c, model, p, max_tokens, speculative, temperature)

    # a connection per request: a server may close a kept-alive connection as the next request
    # goes out on it (llama-server after a few requests), which no client can tell from a failure
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        t0 = time.perf_counter()
        try:
            rs = await asyncio.gather(*(run(c, p) for p in prompts))
        except httpx.HTTPError as e:
            raise YggError(f"the server at {url} failed a request at concurrency {concurrency}: "
                           f"{type(e).__name__}: {e}") from None
        wall = time.perf_counter() - t0
    tpots = [r["tpot"] for r in rs if r["tpot"] == r["tpot"]]
    tokens = sum(r["tokens"] for r in rs)
    return {"concurrency": concurrency, "speculative": speculative, "requests": len(rs), "tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_ms": round(1e3 * percentile([r["ttft"] for r in rs], 0.5), 1),
            "ttft_p95_ms": round(1e3 * percentile([r["ttft"] for r in rs], 0.95), 1),
            "tpot_p50_ms": round(1e3 * percentile(tpots, 0.5), 1),
            "tpot_p95_ms": round(1e3 * percentile(tpots, 0.95), 1)}


SPEC_COUNTERS = {"drafts": "yggtree:spec_decode_num_drafts_total",
                 "accepted": "yggtree:spec_decode_num_accepted_tokens_total",
                 "tokens": "yggtree:generation_tokens_total"}


def spec_counters(text: str) -> dict[str, float] | None:
    """yggtree's speculation counters in a Prometheus text page (None: another server's)."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition("{") if "{" in line else line.partition(" ")
        for key, metric in SPEC_COUNTERS.items():
            if name.strip() == metric:
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out if len(out) == len(SPEC_COUNTERS) else None


def drafted_share(before: dict | None, after: dict | None) -> dict:
    """What a cell's steps did, from the counters around it: the share of decode steps that
    verified a drafted tree, and accepted tokens per such step ({} for another server)."""
    if before is None or after is None:
        return {}
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    steps = d["tokens"] - d["accepted"]  # every step emits one token beside the accepted ones
    return {"drafted_share": round(d["drafts"] / steps, 3) if steps else 0.0,
            "accepted_per_draft": round(d["accepted"] / d["drafts"], 2) if d["drafts"] else 0.0}


def metrics_of(url: str) -> dict | None:
    import httpx

    try:
        return spec_counters(httpx.get(url + "/metrics", timeout=30).text)
    except httpx.HTTPError:
        return None


def start_server(serve_args: str) -> tuple[subprocess.Popen, str, float]:
    """``yggtree serve`` on a free loopback port: the process, its URL and its start-up time."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "yggtree.launch", "serve", "--port", str(port),
                             *shlex.split(serve_args)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise YggError(f"yggtree serve exited with status {proc.returncode} before it listened")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            time.sleep(0.2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (default: start yggtree serve)")
    ap.add_argument("--serve-args", default="", help="flags of the yggtree serve this script starts")
    ap.add_argument("--concurrency", default="1,2,4,8", help="requests in flight, comma-separated")
    ap.add_argument("--prompts", type=int, default=40, help="prompts per cell: half MT-Bench, half HumanEval")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's (0: greedy; 1.0 is the OpenAI API's default)")
    ap.add_argument("--speculative", choices=["both", "on", "off", "none"], default="both",
                    help="the request field: both settings, one, or none sent (another server)")
    return ap.parse_args()


def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise YggError(f"--concurrency takes integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1 or args.prompts < 1 or args.max_tokens < 1:
        raise YggError("--concurrency, --prompts and --max-tokens must be >= 1")
    from yggtree.data import humaneval_prompts, mtbench_first_turns

    half = args.prompts // 2
    prompts = [p.text for p in mtbench_first_turns(args.prompts - half) + humaneval_prompts(half)]
    settings = {"both": [True, False], "on": [True], "off": [False], "none": [None]}[args.speculative]
    proc, startup = None, None
    url = args.url
    if url is None:
        proc, url, startup = start_server(args.serve_args)
        print(f"yggtree serve ready in {startup:.1f} s", flush=True)
    try:
        import httpx

        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rows = []
        for spec in settings:
            asyncio.run(cell(url, model, prompts[:1], 1, args.max_tokens, spec, args.temperature))  # warm-up, not counted
        # the settings alternate at each concurrency: a host whose speed drifts over the run
        # shifts both alike
        for c in levels:
            for spec in settings:
                before = metrics_of(url)
                r = asyncio.run(cell(url, model, prompts, c, args.max_tokens, spec, args.temperature))
                r |= drafted_share(before, metrics_of(url))
                rows.append(r)
                drafted = (f"  drafted {100 * r['drafted_share']:.0f}% of steps, {r['accepted_per_draft']:.2f} "
                           "accepted each" if "drafted_share" in r else "")
                print(f"speculative={spec!s:5} C={c:2}  {r['tokens_per_s']:8.1f} tok/s  "
                      f"TTFT p50 {r['ttft_p50_ms']:8.1f} p95 {r['ttft_p95_ms']:8.1f} ms  "
                      f"TPOT p50 {r['tpot_p50_ms']:7.1f} p95 {r['tpot_p95_ms']:7.1f} ms{drafted}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps({"startup_s": startup, "max_tokens": args.max_tokens, "temperature": args.temperature,
                      "prompts": len(prompts), "cells": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(run_reporting("bench_serve", run, parse_args()))
