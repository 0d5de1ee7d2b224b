#!/usr/bin/env python
"""Batch invariance of a target's forward on this machine (issue #20): is row i of a W-row
forward bitwise its one-row forward? Exact speculation needs it (a verified node's logits must be
the ones a plain step computes); tests check it on tiny models, this on the real one.

For a weight format (``--weights``, runtime/quant.py) and the padding of short packed products
(``--min-rows``, runtime/packed.py), eager code:

- products: each distinct product of the target (packed float, int8, int4; by type and shape),
  row i of an M-row product against its one-row product, M = 2..``--rows``: the M that differ;
- forward: ``--rows`` tokens of a fixed text after a prefix, fed as one chain forward of that
  many rows and as one-row forwards on the same cache: rows whose logits are bitwise equal, the
  largest logit difference, and the rows whose top two logits tie exactly.

One JSON line.

    OMP_NUM_THREADS=1 python scripts/batch_invariance.py --weights int4 --rows 8

``--cost``: what the row-invariant attention costs instead (model.Attention.invariant_rows). The
target's verify step (a compiled tree step, graphs.Graphs in performance mode: what users run)
with the grouped attention matmuls (``invariant_rows`` 1, before issue #20's fix) and with every
width computed row by row, at each ``--widths`` x ``--contexts`` x ``--dtypes``, one call of each
per round in interleaved rounds (offline/timing.time_rounds), medians in ms; each also says
whether its root row's logits are bitwise those of the W = 1 step that decodes the root's token
at the root's slot and position (cache filled with random keys and values; before 2026-11-26
the comparison took the W = 1 step at the bucket's last slot, another position, so it reported
every root as differing). One JSON line per dtype. On quiet cores:

    OMP_NUM_THREADS=2 python scripts/batch_invariance.py --cost --min-rows 2 --dtypes float32,bfloat16 \
        --widths 1,8,16,32 --contexts 256,1024 --warmup 5 --repeats 30
"""

from __future__ import annotations

import argparse
import json

import torch

from yggtree.errors import run_reporting

TEXT = ("Speculative decoding drafts several tokens with a small model and verifies them with the "
        "large one in a single forward pass, keeping exactly the tokens the large model would have "
        "chosen. The verification costs about one step on a memory-bound device.")


def product_rows(layer, rows: int, dtype: torch.dtype) -> list[int]:
    """The row counts M at which some row of an M-row product differs from its one-row product."""
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    one = [layer(x[i : i + 1]) for i in range(rows)]
    return [m for m in range(2, rows + 1) if not all(torch.equal(layer(x[:m])[i : i + 1], one[i]) for i in range(m))]


def chain_vs_rows(model, ids: list[int], rows: int) -> dict:
    """The last ``rows`` tokens of ``ids`` as one forward and as one-row forwards after the rest."""
    n, slots = len(ids), len(ids) + 1

    def logits(lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)[None]
        mask = (torch.arange(slots)[None, :] <= torch.arange(lo, hi)[:, None])[None]
        return model.logits(model(torch.tensor([ids[lo:hi]]), pos, pos, mask).hidden)[0]

    model.setup_cache(1, slots)
    logits(0, n - rows)
    one = torch.cat([logits(i, i + 1) for i in range(n - rows, n)])
    chain = logits(n - rows, n)
    top2 = one.topk(2, -1).values
    return {"rows_equal": sum(torch.equal(a, b) for a, b in zip(one, chain)),
            "max_abs_diff": (one - chain).abs().max().item(),
            "top2_ties": int((top2[:, 0] == top2[:, 1]).sum())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default=None, help="float32 | bfloat16 | int8 | int4@G | gguf-native | w4a8")
    p.add_argument("--min-rows", type=int, default=1, help="padding of short packed products")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--cost", action="store_true", help="time the row-invariant attention instead")
    p.add_argument("--dtypes", default="float32,bfloat16", help="--cost: comma-separated")
    p.add_argument("--widths", default="1,8,16,32", help="--cost: verify widths, comma-separated")
    p.add_argument("--contexts", default="256,1024", help="--cost: context buckets (slots read)")
    p.add_argument("--warmup", type=int, default=5, help="--cost: untimed rounds")
    p.add_argument("--repeats", type=int, default=30, help="--cost: timed rounds")
    args = p.parse_args(argv)
    return run_reporting("batch_invariance", cost if args.cost else run, args)


def run(args) -> int:
    from yggtree.runtime.prepare import pack_models
    from yggtree.runtime.loading import load_model, load_tokenizer, resolve_model
    from yggtree.runtime.packed import packed_layers
    from yggtree.runtime.quant import quant_layers

    src = resolve_model(args.model)
    model = load_model(src, args.dtype)
    pack_models(model, None, args.min_rows, args.weights, src)
    dtype = getattr(torch, args.dtype)
    products, seen = [], set()
    with torch.no_grad():
        for layer in [*packed_layers(model), *quant_layers(model)]:
            key = (type(layer).__name__, layer.in_features, layer.out_features)
            if key not in seen:
                seen.add(key)
                products.append({"kind": key[0], "in": key[1], "out": key[2],
                                 "differs_at_rows": product_rows(layer, args.rows, dtype)})
        ids = load_tokenizer(src)(TEXT)["input_ids"]
        forward = chain_vs_rows(model, ids, args.rows)
    print(json.dumps({"model": args.model, "dtype": args.dtype, "weights": args.weights or args.dtype,
                      "min_rows": args.min_rows, "rows": args.rows, "threads": torch.get_num_threads(),
                      "products": products, "forward": forward}))
    return 0


def verify_call(graphs, width: int, context: int, committed: int | None = None):
    """A call of the target's verify step: a chain of ``width`` nodes in a ``context``-slot bucket
    after ``committed`` slots (default: the chain's last node in the bucket's last slot, so
    attention reads all ``context`` slots); returns the root's logits [V]."""
    ar = torch.arange(width)
    anc = ar[None, :] <= ar[:, None]  # [W, W] a chain
    committed = torch.tensor(context - width if committed is None else committed)

    def call() -> torch.Tensor:
        return graphs.tree_step(ar + 100, ar, ar, anc, committed, (), context)[0][0]

    return call


def cost(args) -> int:
    from statistics import median

    from yggtree.offline.timing import time_rounds
    from yggtree.runtime.prepare import pack_models
    from yggtree.runtime.graphs import Graphs
    from yggtree.runtime.loading import load_model, resolve_model
    from yggtree.runtime.model import set_invariant_rows

    src = resolve_model(args.model)
    widths, contexts = ([int(x) for x in a.split(",")] for a in (args.widths, args.contexts))
    widths = sorted({1, *widths})  # the plain step each root row is compared with
    forms = {"grouped": 1, "rows": max(widths)}  # attention: invariant_rows
    for dtype in args.dtypes.split(","):
        calls, plain = {}, {}
        for form, rows in forms.items():
            model = load_model(src, dtype)
            pack_models(model, None, args.min_rows, args.weights, src)
            set_invariant_rows(model, rows)
            model.setup_cache(1, max(contexts) + 1)
            gen = torch.Generator().manual_seed(0)
            for cache in model.caches():  # keys and values that make attention non-trivial
                cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
                cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
            graphs = Graphs(model, "performance")
            calls.update({(form, c, w): verify_call(graphs, w, c) for c in contexts for w in widths if w <= c})
            # the plain step each root is compared with: the root's token at the root's slot and
            # position (committed c - w), one row
            plain.update({(form, c, w): verify_call(graphs, 1, c, c - w) for c in contexts for w in widths if w <= c})
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=256):
            root = {key: fn() for key, fn in calls.items()}  # builds every graph (untimed)
            one = {key: fn() for key, fn in plain.items()}
            ms = time_rounds(calls, args.warmup, args.repeats)
        rows = [{"attention": form, "context": c, "width": w, "median_ms": round(median(ms[form, c, w]), 3),
                 "root_equals_plain": torch.equal(root[form, c, w], one[form, c, w])}
                for (form, c, w) in calls]
        print(json.dumps({"model": args.model, "dtype": dtype, "weights": args.weights or dtype,
                          "min_rows": args.min_rows, "threads": torch.get_num_threads(),
                          "warmup": args.warmup, "repeats": args.repeats, "steps": rows}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
