"""w4a8_mm (prefetch hint T0) against the same source with _MM_HINT_NTA, one process, alternating per pass:
the 121 products in step order (weights cold: a 96 MB sum between passes), and then a 'glue probe' right
after the products: numpy argmax of a fixed 196 KB buffer, torch.zeros(1) and a small op (what a step's
serial code touches), showing how much of the cache the products left. Outputs asserted equal."""
import os, time, statistics, torch, numpy as np
from torch.utils import cpp_extension
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.build import quantize_models
from yggtree.runtime.w4a8 import W4A8Linear
torch.set_num_threads(2)
load_library()
src = resolve_model("default")
m = load_model(src, "float32"); quantize_models(m, None, "w4a8", src)
cpp_extension.load(name="w4nta", sources=["/tmp/nta/nta.cpp"], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory="/tmp/nta", is_python_module=False)
ops = {"t0": torch.ops.yggtree.w4a8_mm, "nta": torch.ops.yggtree.w4a8_mm_nta}
lins = [mod for mod in m.modules() if isinstance(mod, W4A8Linear)]
flush = torch.randn((96 << 20) // 4)
xs = {l.in_features: torch.randn(1, l.in_features) for l in lins}
for l in lins[:3] + [m.lm_head]:
    assert torch.equal(ops["t0"](xs[l.in_features], l.codes, l.d, l.m), ops["nta"](xs[l.in_features], l.codes, l.d, l.m))
probe_buf = torch.randn(49152).numpy()
small = torch.randn(64, 64)
res = {k: [] for k in ops}; glue = {k: [] for k in ops}
for i in range(60):
    for k in (list(ops) if i % 2 else list(ops)[::-1]):
        flush.sum(); probe_buf.argmax(); small @ small
        t = time.perf_counter()
        for l in lins: ops[k](xs[l.in_features], l.codes, l.d, l.m)
        t1 = time.perf_counter()
        probe_buf.argmax(); torch.zeros(1); small @ small
        t2 = time.perf_counter()
        res[k].append((t1 - t) * 1e3); glue[k].append((t2 - t1) * 1e6)
r = statistics.median([a / b for a, b in zip(res["t0"], res["nta"])])
print(f"121 products: T0 {statistics.median(res['t0']):.3f} ms, NTA {statistics.median(res['nta']):.3f} ms; T0/NTA paired {r:.3f}")
print(f"glue probe after them: T0 {statistics.median(glue['t0']):.1f} us, NTA {statistics.median(glue['nta']):.1f} us")
