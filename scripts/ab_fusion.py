#!/usr/bin/env python
"""In-process A/B of fused vs separate packed products (runtime/packed.py, ``pack_linears(fuse=)``).

Two copies of the default model, one with q/k/v and gate/up fused (121 products per step), one
without (211), each compiled as the runtime compiles a step (performance mode, whole-step graph);
then ``--steps`` decode steps of width ``--width`` at a 256-slot context bucket, alternating
between the two so machine drift hits both alike. Prints the median and p10 ms per step of each,
and whether their logits are equal. A measurement, not a test.

    OMP_NUM_THREADS=1 python scripts/ab_fusion.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--width", type=int, default=1)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    from yggtree.runtime.graphs import Graphs
    from yggtree.runtime.loading import load_model, resolve_model
    from yggtree.runtime.packed import pack_linears

    torch.set_num_threads(args.threads)

    def build(fuse: bool) -> Graphs:
        m = load_model(resolve_model("default"), args.dtype).eval().requires_grad_(False)
        pack_linears(m, fuse=fuse)
        m.setup_cache(1, 512)
        g = Graphs(m, "performance")
        g.warm_up([args.width])
        return g

    graphs = {"fused": build(True), "separate": build(False)}
    ar = torch.arange(args.width)
    anc = ar[None] <= ar[:, None]
    committed = torch.tensor(100)
    times: dict[str, list[float]] = {k: [] for k in graphs}
    logits = {}
    with torch.no_grad():
        for _ in range(args.steps):
            for name, g in graphs.items():
                with g.frozen():
                    t = time.perf_counter()
                    logits[name] = g.tree_step(ar, ar, ar, anc, committed, (), 256)[0]
                    times[name].append(time.perf_counter() - t)
    warm = min(20, args.steps // 5)
    for name, ts in times.items():
        ms = np.array(ts[warm:]) * 1e3
        print(f"{args.dtype} width {args.width} {name}: median {np.median(ms):.2f} ms, p10 {np.percentile(ms, 10):.2f} ms")
    print("logits equal:", bool(torch.equal(logits["fused"], logits["separate"])))
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("ab_fusion", lambda _: main(), None))
