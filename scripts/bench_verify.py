#!/usr/bin/env python
"""What a verify step of W rows costs against one row, per weight format and product kernel (one run).

For every ``--formats`` entry and ``--kernels`` entry the target is prepared as an engine prepares it
(``yggtree.runtime.prepare.pack_models``: the format's quantized or packed layers on that product kernel),
then, at each width W of ``--widths``:

- ``products``: every weight product of one decoder step (each block's fused q/k/v, o, gate/up, down
  and the LM head), called in order on W rows;
- ``attention @C``: the library's row attention (``yggtree::rows_attention``: each row on its own) of
  every layer, each over its own ``--kv-cache`` cache (the machine plans' float16 by default), W tree
  rows over C committed tokens plus the W-token tree suffix (a chain), for each ``--contexts`` C;
  ``tree attention @C`` the same rows by ``yggtree::tree_attention`` (the same bits from one pass over
  each layer's cache for all the rows).

Timing: one warm-up round, then ``--repeats`` rounds; in each round every (format, kernel, W) is timed
once, in rotating order, so a slow stretch of a shared host hits all of them. Medians are printed with
the ratio to W = 1 of the same format and kernel; ``attn@C`` and ``tree@C`` are the two attentions,
``step @C`` is products + the attention the model runs (runtime/model.py: the row attention), and
``attn share`` that attention's part of it. The last line is JSON with every median.

    python scripts/bench_verify.py --formats float32,int8,gguf-native,w4a8 --kernels tiled,torch \\
        --widths 1,2,4,8,16 --contexts 256,1024 --threads 2 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from yggtree.errors import YggError, run_reporting


# the library's two attentions, timed alike; a step's is the one this machine's choice runs
# (runtime/kernels.py attention_kernel; one row: rows_attention)
ATTENTIONS = ("rows_attention", "tree_attention")


def product_layers(model) -> list:
    """The model's weight products in forward order (leaf modules with ``in_features``)."""
    return [m for m in model.modules() if hasattr(m, "in_features") and not list(m.children())]


def prepare(fmt: str, kernel: str):
    """The default target in ``fmt`` on the product ``kernel``, as an engine builds it."""
    from yggtree.runtime.prepare import pack_models
    from yggtree.runtime.loading import load_model, resolve_model

    src = resolve_model("default")
    dtype = "bfloat16" if fmt == "bfloat16" else "float32"
    model = load_model(src, dtype)
    pack_models(model, None, min_rows=1, weights=None if fmt in ("float32", "bfloat16") else fmt, src=src,
                kernel=kernel)
    return model


def run(args) -> int:
    from yggtree.runtime.attention_choice import attention_call, attention_kernel
    from yggtree.runtime.kernels import isa, library_dir, load_library

    torch.set_num_threads(args.threads)
    load_library()
    systems = {}  # (fmt, kernel) -> (layers, cfg)
    for fmt in args.formats:
        for kernel in args.kernels:
            try:
                model = prepare(fmt, kernel)
            except YggError as e:
                sys.stderr.write(f"{fmt} on {kernel}: skipped ({e})\n")
                continue
            systems[fmt, kernel] = (product_layers(model), model.cfg)
    if not systems:
        raise YggError("no format runs here on the kernels asked for")
    cfg = next(iter(systems.values()))[1]
    heads, kv_dtype = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), getattr(torch, args.kv_cache)
    calls = {}
    for (fmt, kernel), (layers, _) in systems.items():
        for w in args.widths:
            xs = {m.in_features: torch.randn(w, m.in_features) for m in layers}

            def products(layers=layers, xs=xs, bf16=fmt == "bfloat16"):
                for m in layers:
                    x = xs[m.in_features]
                    m(x.bfloat16() if bf16 else x)

            calls[("products", fmt, kernel, w)] = products
    for c in args.contexts:
        for w in args.widths:
            for kind in ATTENTIONS:
                calls[(kind, c, w)] = attention_call(kind.removesuffix("_attention"), heads, w, c, kv_dtype,
                                                     cfg.num_layers)
    keys = list(calls)
    times = {k: [] for k in keys}
    with torch.no_grad():
        for r in range(args.repeats + 1):
            shift = r % len(keys)
            for k in keys[shift:] + keys[:shift]:
                t0 = time.perf_counter()
                calls[k]()
                if r:
                    times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"verify cost by rows: kernel library {isa()}, {args.threads} thread(s), median ms of {args.repeats}, "
          f"{cfg.num_layers} layers, torch {torch.__version__}")
    head = f"{'format':<12} {'kernel':<6} {'W':>3} {'products':>9} {'x W=1':>6}"
    for c in args.contexts:
        head += f" {'attn@' + str(c):>9} {'tree@' + str(c):>9} {'step@' + str(c):>10} {'x W=1':>6} {'attn share':>10}"
    print(head)
    chosen = attention_kernel(heads, args.threads, library_dir(), kv_dtype)["kernel"]
    rows = []
    for fmt, kernel in systems:
        p1 = med[("products", fmt, kernel, args.widths[0])]
        for w in args.widths:
            p = med[("products", fmt, kernel, w)]
            line = f"{fmt:<12} {kernel:<6} {w:>3} {p:>9.2f} {p / p1:>6.2f}"
            row = {"format": fmt, "kernel": kernel, "width": w, "products_ms": round(p, 3)}
            for c in args.contexts:
                rows_ms, tree_ms = med[("rows_attention", c, w)], med[("tree_attention", c, w)]
                runs = lambda w: f"{chosen}_attention" if w > 1 else "rows_attention"  # noqa: E731
                a, a1 = med[(runs(w), c, w)], med[(runs(args.widths[0]), c, args.widths[0])]
                line += (f" {rows_ms:>9.2f} {tree_ms:>9.2f} {p + a:>10.2f} {(p + a) / (p1 + a1):>6.2f}"
                         f" {a / (p + a):>10.2f}")
                row[f"attention_ms@{c}"] = round(rows_ms, 3)
                row[f"tree_attention_ms@{c}"] = round(tree_ms, 3)
            print(line)
            rows.append(row)
    print(json.dumps({"command": "bench_verify", "isa": isa(), "attention": chosen, "kv_cache": args.kv_cache,
                      "threads": args.threads, "repeats": args.repeats, "rows": rows, "torch": torch.__version__}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda t: [x for x in t.split(",") if x]  # noqa: E731
    p.add_argument("--formats", type=csv, default=["float32", "int8", "int4", "gguf-native", "w4a8"])
    p.add_argument("--kernels", type=csv, default=["tiled", "torch"])
    p.add_argument("--widths", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=[256, 1024])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--kv-cache", choices=("float16", "bfloat16", "float32"), default="float16",
                   help="the attention's cache dtype (default: the quantized machine plans')")
    args = p.parse_args(argv)
    return run_reporting("bench_verify", run, args)


if __name__ == "__main__":
    sys.exit(main())
