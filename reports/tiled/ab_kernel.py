"""Paired A/B of plain decoding on the two product kernels of float weights: oneDNN (padded as
the profile measures it) vs the tiled kernel, per dtype. Performance engines (dynamo graphs),
weights on huge pages as build_engine leaves them, 8 chat prompts of our own x 64 new tokens,
alternating, 3 rounds, 2 threads; decode ms/token medians and the median of the paired ratios.
Formats float32, bfloat16 (float weights: torch's kernel is oneDNN) and int8 (float32 run: torch's
kernel is aten._weight_int8pack_mm on bfloat16 activations).
Usage: python reports/tiled/ab_kernel.py float32,bfloat16,int8"""
import statistics
import sys

import torch

from yggtree.offline.profile import model_padding
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams
from yggtree.runtime.loading import resolve_model

torch.set_num_threads(2)
QS = ["Explain how a hash table works.", "Write a haiku about autumn rain.", "What causes the seasons on Earth?",
      "Give three tips for writing clean Python code.", "Summarise the plot of Romeo and Juliet.",
      "How do I reverse a linked list in C?", "Compare TCP and UDP briefly.", "Why is the sky blue?"]
P = SamplingParams(max_new_tokens=64)


def dec(eng, ids):
    r = eng.generate(ids, P)
    return (r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1), r.token_ids


for fmt in sys.argv[1].split(","):
    dtype, weights = ("float32", fmt) if fmt == "int8" else (fmt, None)
    pad = model_padding(resolve_model("default"), dtype, weights, (1,))
    print(f"{fmt}: padding measurement {pad['median_ms']} -> {pad['kernel']}, min_rows {pad['min_rows']}", flush=True)
    torch_rows = min((r for r in pad["median_ms"] if r != "tiled" and pad["invariant"][r]),
                      key=lambda r: pad["median_ms"][r])
    A, tok = build_engine(EngineSpec(model="default", dtype=dtype, weights=weights, min_rows=int(torch_rows),
                                     kernel="torch"))
    B, _ = build_engine(EngineSpec(model="default", dtype=dtype, weights=weights, kernel="tiled"))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_dict=False) for q in QS]
    dec(A, prompts[0]), dec(B, prompts[0])
    ta, tb, same = [], [], 0
    for rnd in range(3):
        for i, ids in enumerate(prompts):
            if (i + rnd) % 2:
                a = dec(A, ids); b = dec(B, ids)
            else:
                b = dec(B, ids); a = dec(A, ids)
            ta.append(a[0]); tb.append(b[0]); same += a[1] == b[1]
    r = [a / b for a, b in zip(ta, tb)]
    print(f"{fmt}: torch (min_rows {torch_rows}) {statistics.median(ta):.3f} ms/token, tiled {statistics.median(tb):.3f}; "
          f"speed-up median {statistics.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f}); same tokens {same}/{len(r)}",
          flush=True)
    del A, B
