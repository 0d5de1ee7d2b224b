"""One product each of three shapes of the default model (the head, gate/up, down) on random
weights: the 4-bit tiled kernel, torch's int4 kernel and the int8 tiled kernel, one row, 2 threads,
median of 30 calls; GB/s = the layer's buffer bytes over the time. Usage: python reports/tiled/single_products.py"""
import torch, time, statistics
from yggtree.runtime.kernels import load_library
from yggtree.runtime.quant import Int4Linear, Int8Linear, quantize_int4
load_library()
torch.set_num_threads(2)
for n, k in ((49152, 576), (3072, 576), (576, 1536)):
    w = torch.randn(n, k)
    a = Int4Linear([quantize_int4(w, 32)], None, torch.float32, "tiled")
    t = Int4Linear([quantize_int4(w, 32)], None, torch.float32, "torch")
    b = Int8Linear(w, None, torch.float32, "tiled")
    x = torch.randn(1, k)
    for name, f in (("q4 tiled", a), ("q4 torch", t), ("int8 tiled", b)):
        for _ in range(5): f(x)
        ts = []
        for _ in range(30):
            t0 = time.perf_counter(); f(x); ts.append(time.perf_counter() - t0)
        ms = statistics.median(ts) * 1e3
        nbytes = sum(v.numel() * v.element_size() for v in f.buffers() if v is not None)
        print(n, k, name, f"{ms:.3f} ms", f"{nbytes/ms/1e6:.1f} GB/s")
