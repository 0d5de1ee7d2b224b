#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <vector>
template <bool PERM>
inline void q4_tile1(const uint8_t* codes, const float* s, const float* m, const float* x, const float* xs,
                     int64_t K, int64_t G, float* out, int64_t ahead_bytes) {
  const int64_t B = K / G;
  const __m512i low = _mm512_set1_epi32(0x0F);
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 y = _mm512_setzero_ps();
  for (int64_t g = 0; g < B; ++g) {
    if (ahead_bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(s + g * 16) + ahead_bytes / 4, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + g * 16) + ahead_bytes / 4, _MM_HINT_T0);
    }
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
      const uint8_t* c = codes + (k / 2) * 16;
      if (ahead_bytes && (k & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(c) + ahead_bytes, _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      __m512 w0, w1;
      if constexpr (PERM) {
        w0 = _mm512_permutexvar_ps(v, table);
        w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
      } else {
        w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
        w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      }
      even = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), w0, even);
      odd = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 1]), w1, odd);
    }
    const __m512 sg = _mm512_loadu_ps(s + g * 16), mg = _mm512_loadu_ps(m + g * 16);
    y = _mm512_fmadd_ps(sg, _mm512_add_ps(even, odd), y);
    y = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[g]), y);
  }
  _mm512_storeu_ps(out, y);
}
template <bool PERM>
double run(std::vector<at::Tensor> cs, std::vector<at::Tensor> ss, std::vector<at::Tensor> ms, std::vector<at::Tensor> xs,
           std::vector<at::Tensor> xss, std::vector<at::Tensor> outs, int64_t pf, int reps) {
  auto t0 = std::chrono::steady_clock::now();
  for (int rep = 0; rep < reps; ++rep)
    for (size_t i = 0; i < cs.size(); ++i) {
      const int64_t T = cs[i].size(0), K = 2 * cs[i].size(1), G = K / ss[i].size(1), B = K / G;
      const uint8_t* cp = cs[i].data_ptr<uint8_t>();
      const float *sp = ss[i].data_ptr<float>(), *mp = ms[i].data_ptr<float>(), *x = xs[i].data_ptr<float>(),
                  *xsum = xss[i].data_ptr<float>();
      float* o = outs[i].data_ptr<float>();
      at::parallel_for(0, T, 4, [&](int64_t a, int64_t b) {
        for (int64_t t = a; t < b; ++t)
          q4_tile1<PERM>(cp + t * (K / 2) * 16, sp + t * B * 16, mp + t * B * 16, x, xsum, K, G, o + 16 * t, pf);
      });
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}
double bench(std::vector<at::Tensor> cs, std::vector<at::Tensor> ss, std::vector<at::Tensor> ms, std::vector<at::Tensor> xs,
             std::vector<at::Tensor> xss, std::vector<at::Tensor> outs, bool perm, int64_t pf, int64_t reps) {
  return perm ? run<true>(cs, ss, ms, xs, xss, outs, pf, reps) : run<false>(cs, ss, ms, xs, xss, outs, pf, reps);
}
