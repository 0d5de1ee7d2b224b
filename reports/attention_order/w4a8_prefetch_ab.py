# Needs /work/s16/w4_pf{2048,4096}.cpp: yggtree/runtime/csrc/w4a8.cpp with PREFETCH set and the ops renamed
# (sed: w4a8_mm -> w4a8_mm_pfN, w4a8_threads -> w4a8_threads_pfN, aoti_torch_cpu_w4a8_mm -> ..._pfN). 2 threads.
"""w4a8_mm with PREFETCH 1024 (the library) against 2048 and 4096 (copies, ops renamed), one process,
alternating per call, weights cold; the Q8_0 head and the block products of the default model, 1 row."""
import os, time, statistics, torch
from torch.utils import cpp_extension
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.build import quantize_models
from yggtree.runtime.w4a8 import W4A8Linear
torch.set_num_threads(2)
src = resolve_model("default")
m = load_model(src, "float32"); quantize_models(m, None, "w4a8", src)
for pf in (2048, 4096):
    d = f"/tmp/w4pf{pf}"; os.makedirs(d, exist_ok=True)
    cpp_extension.load(name=f"w4pf{pf}", sources=[f"/work/s16/w4_pf{pf}.cpp"], extra_cflags=list(CFLAGS),
                       extra_ldflags=list(LDFLAGS), build_directory=d, is_python_module=False)
ops = {"1024": torch.ops.yggtree.w4a8_mm, "2048": torch.ops.yggtree.w4a8_mm_pf2048, "4096": torch.ops.yggtree.w4a8_mm_pf4096}
lins = [mod for mod in m.modules() if isinstance(mod, W4A8Linear)]
head = m.lm_head
layers = [l for l in lins if l is not head]
flush = torch.randn((96 << 20) // 4)
xs = {l.in_features: torch.randn(1, l.in_features) for l in lins}
def step(op, which):
    for l in which:
        op(xs[l.in_features], l.codes, l.d, l.m)
for name, which in (("head", [head]), ("30 blocks' products", layers)):
    res = {k: [] for k in ops}
    for i in range(40):
        for k in (list(ops) if i % 2 else list(ops)[::-1]):
            flush.sum()
            t0 = time.perf_counter(); step(ops[k], which); res[k].append(time.perf_counter() - t0)
    base = res["1024"]
    print(name, " ".join(f"PF{k} {statistics.median(v)*1e3:.3f} ms (x{statistics.median([b / x for b, x in zip(base, v)]):.3f})" for k, v in res.items()), flush=True)
