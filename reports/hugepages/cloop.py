"""The 121 w4a8 products of the plan's target at 1 row, called from a C++ loop through the
dispatcher (no Python per call), vs a 256 MiB sum's bandwidth; paired, 2 threads."""
import sys, time, statistics, torch
from torch.utils.cpp_extension import load_inline
from yggtree.runtime import w4a8
w4a8.load_kernel()
src = r'''
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <chrono>
double loop(std::vector<at::Tensor> xs, std::vector<at::Tensor> cs, std::vector<at::Tensor> ds, std::vector<at::Tensor> ms, int64_t reps) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("yggtree::w4a8_mm", "").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (size_t i = 0; i < xs.size(); ++i) op.call(xs[i], cs[i], ds[i], ms[i]);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}
'''
mod = load_inline("cloop", cpp_sources=src, functions=["loop"], build_directory=str(__import__("pathlib").Path(__file__).parent / "build"), extra_cflags=["-O2"])
torch.set_num_threads(2)
from yggtree.runtime.loading import load_model, resolve_model
sys.path.insert(0, "/work/main")
from yggtree.bench import plan_runner
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
lins = [m for m in eng.target.modules() if isinstance(m, w4a8.W4A8Linear)]
nb = sum(l.codes.numel() + 2 * l.d.numel() + 2 * l.m.numel() for l in lins)
xs = [torch.randn(1, l.in_features) for l in lins]
args = (xs, [l.codes for l in lins], [l.d for l in lins], [l.m for l in lins])
groups = {}
for l, x in zip(lins, xs):
    groups.setdefault((l.out_features, l.in_features), []).append(l)
big = torch.ones(256 * 2**20 // 4)
mod.loop(*args, 5)
tp, tb, tg = [], [], {k: [] for k in groups}
for rep in range(7):
    tp.append(mod.loop(*args, 20))
    t = time.perf_counter(); big.sum(); big.sum(); tb.append(2 * big.numel() * 4 / (time.perf_counter() - t) / 1e9)
    for k, ls in groups.items():
        a = ([torch.randn(1, k[1]) for _ in ls], [l.codes for l in ls], [l.d for l in ls], [l.m for l in ls])
        tg[k].append(mod.loop(*a, 20))
p, b = statistics.median(tp), statistics.median(tb)
print(f"{len(lins)} products {nb/1e6:.1f} MB: {p*1e3:.3f} ms = {nb/p/1e9:.1f} GB/s; sum {b:.1f} GB/s ({nb/p/1e9/b*100:.0f}%)")
for k, ls in groups.items():
    t = statistics.median(tg[k]) / len(ls)
    nbk = ls[0].codes.numel() + 4 * ls[0].d.numel()
    print(f"  N {k[0]} K {k[1]} x{len(ls)}: {t*1e6:.1f} us each, {nbk/1e3:.0f} KB, {nbk/t/1e9:.1f} GB/s")
