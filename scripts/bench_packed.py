#!/usr/bin/env python
"""Weight matmuls of one decoder step, F.linear vs oneDNN-packed, at 1..W rows (one run).

Times every 2-D weight product of a model's forward (its decoder blocks' seven projections and
the LM head, yggtree.measure.floor.matmul_weights) for M rows, both ways, interleaved per repeat, and
prints the medians and the ratio to M = 1. This is what decides whether verifying a tree of M
nodes can cost about one plain step (see yggtree/runtime/packed.py).

    OMP_NUM_THREADS=1 python scripts/bench_packed.py --model default --widths 1,2,4,8,16 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from yggtree.errors import YggError, run_reporting


def run(args) -> int:
    from yggtree.measure.floor import matmul_weights
    from yggtree.runtime.loading import load_model, resolve_model
    from yggtree.runtime.packed import can_pack

    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model), args.dtype)
    if not can_pack(model):
        raise YggError(f"oneDNN packing is not available for {args.dtype} on this machine")
    ws = matmul_weights([m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)])
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    rows = []
    with torch.no_grad():
        for m in args.widths:
            xs = {w.shape[1]: torch.randn(m, w.shape[1]).to(w.dtype) for w in ws}
            ways = {
                "F.linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws],
                "packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                   for w, p in zip(ws, packed)],
            }
            times = {k: [] for k in ways}
            for r in range(args.repeats + 1):
                for k, fn in ways.items():
                    t0 = time.perf_counter()
                    fn()
                    if r:  # the first round warms up
                        times[k].append((time.perf_counter() - t0) * 1e3)
            rows.append({"rows": m} | {k: statistics.median(v) for k, v in times.items()})
    base = {k: rows[0][k] for k in ("F.linear", "packed")}
    print(f"{len(ws)} weight matmuls of {args.model} ({args.dtype}, {args.threads} thread(s)), median ms of {args.repeats}")
    print(f"{'rows':>5} {'F.linear':>10} {'x M=1':>7} {'packed':>10} {'x M=1':>7}")
    for r in rows:
        print(f"{r['rows']:>5} {r['F.linear']:>10.1f} {r['F.linear'] / base['F.linear']:>7.2f} "
              f"{r['packed']:>10.1f} {r['packed'] / base['packed']:>7.2f}")
    print(json.dumps({"command": "bench_packed", "model": args.model, "dtype": args.dtype,
                      "threads": args.threads, "matmuls": len(ws), "rows": rows, "torch": torch.__version__}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--widths", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if not args.widths or min(args.widths) < 1 or args.repeats < 1:
        p.error("--widths must be positive integers and --repeats >= 1")
    return run_reporting("bench_packed", run, args)


if __name__ == "__main__":
    sys.exit(main())
