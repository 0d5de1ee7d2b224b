#!/usr/bin/env python
"""Responses under load equal the same requests decoded alone: greedy chat completions of
``--prompts`` prompts (half MT-Bench first turns, half HumanEval) sent ``--concurrency`` at a time
to ``yggtree serve --max-batch N`` and one at a time to ``yggtree serve --max-batch 1`` (a server of
one slot decodes as ``yggtree run`` does), with and without speculation; every text and token
count must match. Both servers are started here with ``--serve-args`` (loopback, free ports).
The last line is JSON.

    python scripts/check_serve.py --prompts 40 --max-tokens 128 --concurrency 8 --max-batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

from yggtree.errors import YggError, run_reporting

_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).with_name("bench_serve.py"))
bench_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serve)


async def answers(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                  speculative: bool) -> list[tuple[str, int, str]]:
    """(text, completion tokens, finish reason) of every prompt, ``concurrency`` in flight."""
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def one(c, p):
        async with sem:
            r = await c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                "temperature": 0, "speculative": speculative})
            if r.status_code != 200:
                raise YggError(f"the server at {url} answered {r.status_code}: {r.text[:200]}")
            body = r.json()
            ch = body["choices"][0]
            return ch["message"]["content"], body["usage"]["completion_tokens"], ch["finish_reason"]

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        return await asyncio.gather(*(one(c, p) for p in prompts))


def run(args: argparse.Namespace) -> int:
    import httpx

    from yggtree.data import humaneval_prompts, mtbench_first_turns

    half = args.prompts // 2
    prompts = [p.text for p in mtbench_first_turns(args.prompts - half) + humaneval_prompts(half)]
    results = {}
    for batch, concurrency in ((args.max_batch, args.concurrency), (1, 1)):
        proc, url, startup = bench_serve.start_server(f"{args.serve_args} --max-batch {batch}")
        try:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            for spec in (True, False):
                results[(batch, spec)] = asyncio.run(answers(url, model, prompts, concurrency, args.max_tokens, spec))
        finally:
            proc.terminate()
            proc.wait(30)
    out = {"prompts": len(prompts), "max_tokens": args.max_tokens, "concurrency": args.concurrency,
           "max_batch": args.max_batch}
    ok = True
    for spec in (True, False):
        same = sum(a == b for a, b in zip(results[(args.max_batch, spec)], results[(1, spec)]))
        out[f"identical_{'speculative' if spec else 'plain'}"] = same
        ok &= same == len(prompts)
        print(f"speculative={spec!s:5}: {same}/{len(prompts)} responses at concurrency {args.concurrency} "
              f"(batch {args.max_batch}) identical to one request at a time")
    print(json.dumps(out))
    return 0 if ok else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--serve-args", default="", help="flags of both servers (engine flags: --plan, --weights, ...)")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(run_reporting("check_serve", run, parse_args()))
