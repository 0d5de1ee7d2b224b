"""The kernel choice's measurement (offline/profile.py model_padding) per format, with the prefetch sweep;
then the w4a8 kernel's 121 products (random weights in one huge-page arena) at each distance."""
import statistics, sys, torch
sys.path.insert(0, "/work/main/reports/w4a8_stream")
from yggtree.offline.profile import model_padding
from yggtree.runtime.loading import resolve_model
from yggtree.runtime.kernels import PREFETCH_CHOICES, prefetch
from yggtree.offline.timing import time_rounds
torch.set_num_threads(2)
src = resolve_model("default")
for dtype, weights in (("float32", "int8"), ("float32", "gguf-native"), ("bfloat16", None), ("float32", None)):
    p = model_padding(src, dtype, weights, (1,), warmup=1, repeats=7)
    print(dtype, weights, p["kernel"], p.get("prefetch"), p["median_ms"], p.get("prefetch_ms"), flush=True)
from common import arena_model
from yggtree.runtime.w4a8 import load_kernel, pack_blocks
load_kernel()
L, nbytes = arena_model(torch.Generator().manual_seed(1), pack=lambda b: (pack_blocks(b),))
g = torch.Generator().manual_seed(0)
xs = {K: torch.randn(1, K, generator=g) for K in (576, 1536)}
def run(d):
    with prefetch(d):
        for K, p in L:
            torch.ops.yggtree.w4a8_mm(xs[K], p)
s = time_rounds({d: (lambda d=d: run(d)) for d in (0,) + PREFETCH_CHOICES}, 2, 15)
print("w4a8", {d: round(statistics.median(v), 3) for d, v in s.items()}, f"{nbytes/1e6:.0f} MB")
