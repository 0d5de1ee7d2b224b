"""w4a8_mm of the library (new: software prefetch for 4-bit codes only) against the previous source (old:
for 8-bit codes too), one process, alternating per call, weights cold (a 96 MB sum between), 2 threads; outputs
asserted equal. OLD_SRC: `git show 7a069e7:yggtree/runtime/csrc/w4a8.cpp | sed -e 's/w4a8_mm/w4a8_mm_old/g;
s/w4a8_threads/w4a8_threads_old/g' > OLD.cpp`."""
import os, time, statistics, torch
from torch.utils import cpp_extension
from yggtree.runtime.kernels import CFLAGS, LDFLAGS
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.build import quantize_models
from yggtree.runtime.w4a8 import W4A8Linear
torch.set_num_threads(2)
src = resolve_model("default")
m = load_model(src, "float32"); quantize_models(m, None, "w4a8", src)
OLD = os.environ["OLD_SRC"]  # w4a8.cpp of the previous commit with its ops renamed *_old (see the docstring)
os.makedirs("/tmp/w4old", exist_ok=True)
cpp_extension.load(name="w4old", sources=[OLD], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory="/tmp/w4old", is_python_module=False)
ops = {"new": torch.ops.yggtree.w4a8_mm, "old": torch.ops.yggtree.w4a8_mm_old}
lins = [mod for mod in m.modules() if isinstance(mod, W4A8Linear)]
head = m.lm_head; layers = [l for l in lins if l is not head]
flush = torch.randn((96 << 20) // 4)
xs = {l.in_features: torch.randn(1, l.in_features) for l in lins}
for l in lins[:3] + [head]:
    assert torch.equal(ops["new"](xs[l.in_features], l.codes, l.d, l.m), ops["old"](xs[l.in_features], l.codes, l.d, l.m))
for name, which in (("head", [head]), ("30 blocks' products", layers), ("all 121 in step order", lins)):
    res = {k: [] for k in ops}
    for i in range(40):
        for k in (list(ops) if i % 2 else list(ops)[::-1]):
            flush.sum(); t = time.perf_counter()
            for l in which: ops[k](xs[l.in_features], l.codes, l.d, l.m)
            res[k].append((time.perf_counter() - t) * 1e3)
    r = statistics.median([a / b for a, b in zip(res["old"], res["new"])])
    print(f"{name}: old {statistics.median(res['old']):.3f} ms, new {statistics.median(res['new']):.3f} ms; old/new paired {r:.3f}", flush=True)
