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
    p.add_argument("--weights", default=None, help="float32 | bfloat16 | int8 | int4@G | gguf-native")
    p.add_argument("--min-rows", type=int, default=1, help="padding of short packed products")
    p.add_argument("--rows", type=int, default=8)
    return run_reporting("batch_invariance", run, p.parse_args(argv))


def run(args) -> int:
    from yggtree.runtime.build import pack_models
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


if __name__ == "__main__":
    raise SystemExit(main())
