"""Paired A/B of plain decoding on the two product kernels of a weight format: torch's (padded as
the profile measures it) vs the tiled kernel, per dtype. Performance engines (dynamo graphs),
weights on huge pages as build_engine leaves them, 8 chat prompts of our own x 64 new tokens,
alternating, 3 rounds, 2 threads; decode ms/token medians and the median of the paired ratios.
Formats float32, bfloat16 (float weights: torch's kernel is oneDNN), int8, int4 and gguf-native
(float32 runs: torch's kernels are aten._weight_int8pack_mm and _weight_int4pack_mm_for_cpu on
bfloat16 activations).
Usage: python reports/tiled/ab_kernel.py float32,bfloat16,int8,int4,gguf-native"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder, paired  # noqa: E402

import torch

from yggtree.offline.profile import model_padding
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.loading import resolve_model

torch.set_num_threads(2)
for fmt in sys.argv[1].split(","):
    dtype, weights = (fmt, None) if fmt in ("float32", "bfloat16") else ("float32", fmt)
    pad = model_padding(resolve_model("default"), dtype, weights, (1,))
    print(f"{fmt}: padding measurement {pad['median_ms']} -> {pad['kernel']}, min_rows {pad['min_rows']}", flush=True)
    torch_rows = min((r for r in pad["median_ms"] if r != "tiled" and pad["invariant"][r]),
                     key=lambda r: pad["median_ms"][r])
    B, tok = build_engine(EngineSpec(model="default", dtype=dtype, weights=weights, min_rows=int(torch_rows),
                                     kernel="torch"))
    A, _ = build_engine(EngineSpec(model="default", dtype=dtype, weights=weights, kernel="tiled"))
    r = paired(decoder(A), decoder(B), chat_prompts(tok))
    print(f"{fmt}: torch (min_rows {torch_rows}) {r['b_ms']:.3f} ms/token, tiled {r['a_ms']:.3f}; speed-up median "
          f"{r['speedup']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}); same tokens {r['same']}/{r['pairs']}", flush=True)
    del A, B
