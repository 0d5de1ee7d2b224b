"""Stress the overlap plan's two threads of compiled calls: a tiny random target with a random
EAGLE head, the drafter on a worker thread, garbage collection after every allocation, requests
until the time is up. Reports the requests run or the first error.

``--stance engine`` runs the engine as shipped (full guard evaluation while the worker runs,
Graphs.frozen); ``--stance unsafe`` forces dynamo's skip_guard_eval_unsafe stance on both threads,
which misses graphs it has (torch 2.13: docs/results-archive.md, "Install, first run and test suite").

    python scripts/stress_overlap.py --stance unsafe --seconds 150
    python scripts/stress_overlap.py --stance engine --seconds 150
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch


def tiny_target(seed: int = 0):
    from yggtree.runtime.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_ids=())
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stance", choices=["engine", "unsafe"], default="engine")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--gc-threshold", type=int, default=1, help="gc.set_threshold's first value")
    args = ap.parse_args(argv)

    from yggtree.runtime import graphs
    from yggtree.runtime.eagle import EagleDrafter
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    if args.stance == "unsafe":
        graphs.Graphs.frozen = lambda self, threaded=False: torch.compiler.set_stance(
            "fail_on_recompile", skip_guard_eval_unsafe=True)
    torch.set_num_threads(1)
    model = tiny_target()
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    drafter = EagleDrafter.random(model, "performance", max_depth=3, seed=1)
    cfg = EngineConfig(mode="performance", max_context=200, prefill_chunk=16, tree=tree, stages="overlap@1+1")
    eng = Engine(model, cfg, drafter)
    prompts = [list(range(5, 12)), [(7 * i) % 90 + 3 for i in range(23)], [1] * 40]
    gc.set_threshold(args.gc_threshold)
    n, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < args.seconds:
            eng.generate(prompts[n % len(prompts)], SamplingParams(max_new_tokens=40))
            n += 1
    except RuntimeError as e:
        print(f"stance {args.stance}: failed after {n} requests: {str(e).splitlines()[0]}")
        return 1
    print(f"stance {args.stance}: {n} requests in {args.seconds:.0f} s, no error")
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("stress_overlap", lambda _: main(), None))
