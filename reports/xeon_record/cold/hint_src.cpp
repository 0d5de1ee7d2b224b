// A copy of the tiled int8 kernel's one-row loop (csrc/tiled_mm.cpp) with the prefetch distance, the hint and the
// prefetches per line as run-time arguments, over a list of products in one call (C++ loop, OpenMP)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <vector>
template <int HINT>
inline void tile1(const int8_t* w, const float* s, const float* x, int64_t K, float* out, int64_t PF) {
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    if (PF && (k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + PF, static_cast<_mm_hint>(HINT));
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16 + 16))));
    even = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), w0, even);
    odd = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 1]), w1, odd);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_add_ps(even, odd), _mm512_loadu_ps(s)));
}
template <int HINT>
double run(const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& ss, const std::vector<at::Tensor>& xs, int64_t pf) {
  std::vector<at::Tensor> outs;
  for (auto& w : ws) outs.push_back(at::empty({16 * w.size(0)}, at::kFloat));
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < ws.size(); ++i) {
    const int8_t* wp = ws[i].data_ptr<int8_t>();
    const int64_t T = ws[i].size(0), K = ws[i].size(1);
    const float* sp = ss[i].data_ptr<float>();
    const float* x = xs[i].data_ptr<float>();
    float* o = outs[i].data_ptr<float>();
    at::parallel_for(0, T, 4, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) tile1<HINT>(wp + t * K * 16, sp + t * 16, x, K, o + 16 * t, pf);
    });
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
double bench(std::vector<at::Tensor> ws, std::vector<at::Tensor> ss, std::vector<at::Tensor> xs, int64_t hint, int64_t pf) {
  if (hint == 3) return run<_MM_HINT_T0>(ws, ss, xs, pf);
  if (hint == 2) return run<_MM_HINT_T1>(ws, ss, xs, pf);
  if (hint == 1) return run<_MM_HINT_T2>(ws, ss, xs, pf);
  return run<_MM_HINT_NTA>(ws, ss, xs, pf);
}
// one parallel region over all products (tiles of all products split across threads): the fork/join cost once
double bench_one_region(std::vector<at::Tensor> ws, std::vector<at::Tensor> ss, std::vector<at::Tensor> xs, int64_t pf) {
  std::vector<at::Tensor> outs;
  std::vector<int64_t> start{0};
  for (auto& w : ws) outs.push_back(at::empty({16 * w.size(0)}, at::kFloat)), start.push_back(start.back() + w.size(0));
  auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, start.back(), 4, [&](int64_t a, int64_t b) {
    size_t i = 0;
    for (int64_t g = a; g < b; ++g) {
      while (start[i + 1] <= g) ++i;
      const int64_t t = g - start[i], K = ws[i].size(1);
      tile1<_MM_HINT_T0>(ws[i].data_ptr<int8_t>() + t * K * 16, ss[i].data_ptr<float>() + t * 16, xs[i].data_ptr<float>(), K,
                         outs[i].data_ptr<float>() + 16 * t, pf);
    }
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// variants of the loop's prefetch: 0 the shipped (T0 once per line), 1 two levels (T2 far, T0 near), 2 a plain byte sum
// (the pattern with no arithmetic, T0), 3 T0 two lines per two lines
template <int V>
inline void tile_v(const int8_t* w, const float* s, const float* x, int64_t K, float* out, int64_t PF) {
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  if constexpr (V == 2) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + PF, _MM_HINT_T0);
      acc = _mm512_add_epi32(acc, _mm512_loadu_si512(w + k * 16));
    }
    _mm512_storeu_ps(out, _mm512_castsi512_ps(acc));
    return;
  }
  for (int64_t k = 0; k < K; k += 2) {
    if ((k & 3) == 0) {
      if constexpr (V == 1) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + (PF >> 16), _MM_HINT_T2);
        if (PF & 0xFFFF) _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + (PF & 0xFFFF), _MM_HINT_T0);
      } else if constexpr (V == 4) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + (PF >> 16), _MM_HINT_T1);
        if (PF & 0xFFFF) _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + (PF & 0xFFFF), _MM_HINT_T0);
      } else if constexpr (V == 3) {
        if ((k & 7) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + PF, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + PF + 64, _MM_HINT_T0);
        }
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + PF, _MM_HINT_T0);
      }
    }
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16 + 16))));
    even = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), w0, even);
    odd = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 1]), w1, odd);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_add_ps(even, odd), _mm512_loadu_ps(s)));
}
template <int V>
double run_v(const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& ss, const std::vector<at::Tensor>& xs, int64_t pf) {
  std::vector<at::Tensor> outs;
  for (auto& w : ws) outs.push_back(at::empty({16 * w.size(0)}, at::kFloat));
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < ws.size(); ++i) {
    const int8_t* wp = ws[i].data_ptr<int8_t>();
    const int64_t T = ws[i].size(0), K = ws[i].size(1);
    const float* sp = ss[i].data_ptr<float>();
    const float* x = xs[i].data_ptr<float>();
    float* o = outs[i].data_ptr<float>();
    at::parallel_for(0, T, 4, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) tile_v<V>(wp + t * K * 16, sp + t * 16, x, K, o + 16 * t, pf);
    });
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
double bench_v(std::vector<at::Tensor> ws, std::vector<at::Tensor> ss, std::vector<at::Tensor> xs, int64_t v, int64_t pf) {
  if (v == 1) return run_v<1>(ws, ss, xs, pf);
  if (v == 2) return run_v<2>(ws, ss, xs, pf);
  if (v == 3) return run_v<3>(ws, ss, xs, pf);
  if (v == 4) return run_v<4>(ws, ss, xs, pf);
  return run_v<0>(ws, ss, xs, pf);
}
