"""The 121 products of one decode step of the default model (q/k/v and gate/up fused, the tied
head), one call each, in rounds: torch's oneDNN-packed kernel unpadded and padded to 4 rows
against the tiled kernel (yggtree::tiled_mm) with the same weights as float32, bfloat16 and int8
tiles on huge pages, at 1, 4 and 32 rows; median ms of 15 rounds, at $T threads (default 2).
Usage: python reports/tiled/products.py float32,bfloat16"""
import os
import statistics
import sys

import torch

from yggtree.offline.timing import time_rounds
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import load_library
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.packed import pack_weight, pack_linears, packed_layers, packed_linear
from yggtree.runtime.quant import quantize_int8

torch.set_num_threads(int(os.environ.get("T", "2")))
load_library()
op = torch.ops.yggtree.tiled_mm


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    buf = huge_empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    return buf.copy_(t)


def tiles(w: torch.Tensor, kind: str):
    if kind == "int8":
        q, s = quantize_int8(w)
        return on_huge_pages(pack_weight(q, "tiled")), pack_weight(s[:, None], "tiled").reshape(-1, 16)
    return on_huge_pages(pack_weight(w.to(getattr(torch, kind)), "tiled")), torch.empty(0)


for dname in sys.argv[1].split(","):
    dt = getattr(torch, dname)
    model = load_model(resolve_model("default"), dname)
    pack_linears(model)
    layers = packed_layers(model)
    mats = [w.detach() for w in model.matmul_weights()]
    print(f"{dname}: {len(mats)} products, {sum(w.numel() * w.element_size() for w in mats) / 1e6:.1f} MB")
    kinds = ["float32", "bfloat16", "int8"] if dt == torch.float32 else ["bfloat16"]
    tw = {k: [tiles(w, k) for w in mats] for k in kinds}
    for rows in (1, 4, 32):
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(rows, m.in_features, generator=g).to(dt) for m in layers]
        xt = [torch.randn(rows, w.shape[1], generator=g) for w in mats]
        fns = {f"torch@{p}": (lambda p=p: [packed_linear(x, m.packed, m.out_features, m.bias, p)
                                          for x, m in zip(xs, layers)]) for p in (1, 4)}
        for k in kinds:
            fns[f"tiled-{k}"] = lambda k=k: [op(x, w, s) for x, (w, s) in zip(xt, tw[k])]
        with torch.no_grad():
            samples = time_rounds(fns, 3, 15)
        print(f"{dname} {rows} row(s): " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in samples.items()),
              flush=True)
