import torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static float sum(const uint8_t* p, int64_t n) { __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 64) acc = _mm512_add_epi32(acc, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + i))));
  return (float)_mm512_reduce_add_epi32(acc); }
std::vector<double> run(torch::Tensor w, torch::Tensor big, int64_t mode, int64_t hint) {
  const uint8_t* p = w.data_ptr<uint8_t>(); int64_t n = w.numel(); volatile float s = 0;
  std::vector<double> out;
  for (int rep = 0; rep < 200; ++rep) {
    big.add_(1);  // evict
    double t0 = now();
    if (mode == 1) { if (hint == 0) for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T0);
                     else if (hint == 1) for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T1);
                     else for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T2); }
    if (mode == 2) s = s + sum(p, n);
    double t1 = now();
    while (now() - t1 < 40e-6) {}
    double t2 = now(); s = s + sum(p, n); double t3 = now();
    out.push_back((t1 - t0) * 1e6); out.push_back((t3 - t2) * 1e6);
  }
  return out;
}
'''
m = load_inline("pf_raw", cpp_sources=src, functions=["run"], extra_cflags=["-O2", "-mavx512f", "-mavx512bw"])
import statistics
torch.set_num_threads(1)
w = torch.ones(346 * 1024, dtype=torch.uint8); big = torch.zeros(64 << 20, dtype=torch.uint8)
for mode, hint, name in ((0, 0, "cold"), (1, 0, "prefetch T0"), (1, 1, "prefetch T1"), (1, 2, "prefetch T2"), (2, 0, "read first")):
    o = m.run(w, big, mode, hint)
    print(f"{name:12s} first phase {statistics.median(o[0::2]):6.1f} us, then the read {statistics.median(o[1::2]):6.1f} us")
