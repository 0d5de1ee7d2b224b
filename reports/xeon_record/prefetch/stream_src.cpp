#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <vector>
inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen(const at::BFloat16* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <int C, typename W>
inline void tile1(const W* w, const float* s, const float* x, int64_t K, float* out, int64_t PF) {
  constexpr int BYTES = 16 * sizeof(W) * C;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += C) {
    const char* ahead = reinterpret_cast<const char*>(w + k * 16) + PF;
    for (int b = 0; b < BYTES; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(x[k + c]), widen(w + (k + c) * 16), acc[c]);
  }
  for (int h = C / 2; h >= 1; h /= 2)
    for (int c = 0; c < h; ++c) acc[c] = _mm512_add_ps(acc[c], acc[c + h]);
  __m512 y = acc[0];
  if (s) y = _mm512_mul_ps(y, _mm512_loadu_ps(s));
  _mm512_storeu_ps(out, y);
}
template <int C, typename W>
double run(std::vector<at::Tensor> ws, std::vector<at::Tensor> ss, std::vector<at::Tensor> xs, int reps, int64_t pf) {
  std::vector<at::Tensor> outs;
  for (auto& w : ws) outs.push_back(at::empty({16 * w.size(0)}, at::kFloat));
  auto t0 = std::chrono::steady_clock::now();
  for (int rep = 0; rep < reps; ++rep)
    for (size_t i = 0; i < ws.size(); ++i) {
      const W* wp = reinterpret_cast<const W*>(ws[i].data_ptr());
      const int64_t T = ws[i].size(0), K = ws[i].size(1);
      const float* sp = ss[i].numel() ? ss[i].data_ptr<float>() : nullptr;
      const float* x = xs[i].data_ptr<float>();
      float* o = outs[i].data_ptr<float>();
      at::parallel_for(0, T, 4, [&](int64_t a, int64_t b) {
        for (int64_t t = a; t < b; ++t) tile1<C, W>(wp + t * K * 16, sp ? sp + t * 16 : nullptr, x, K, o + 16 * t, pf);
      });
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}
double bench(std::vector<at::Tensor> ws, std::vector<at::Tensor> ss, std::vector<at::Tensor> xs, int64_t chains, int64_t reps, int64_t pf) {
  auto dt = ws[0].scalar_type();
#define GO(C) \
  if (chains == C) { \
    if (dt == at::kFloat) return run<C, float>(ws, ss, xs, reps, pf); \
    if (dt == at::kBFloat16) return run<C, at::BFloat16>(ws, ss, xs, reps, pf); \
    return run<C, int8_t>(ws, ss, xs, reps, pf); }
  GO(2) GO(4) GO(8)
  return -1;
}
