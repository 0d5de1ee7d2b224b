#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>
#include <vector>
#include <cstring>
namespace {
int64_t NEAR = 512, FAR = 16384;
inline void fetch(const char* at) {
  if (NEAR) _mm_prefetch(at + NEAR, _MM_HINT_T0);
  if (FAR) _mm_prefetch(at + FAR, _MM_HINT_T1);
}
// w [T, K/2, 32] int8: pair j, lane l: bytes 2l, 2l+1 = w[2j][l], w[2j+1][l]
// qa [M, K] int16, da [M]
template <int R, int C>
inline void tile16(const int8_t* w, const int16_t* qa, const float* da, int64_t K, const float* s, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t CH = 256;
  for (int64_t c0 = 0; c0 < K; c0 += CH) {
    const int64_t c1 = std::min(K, c0 + CH);
    __m512i is[R][C];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) is[r][c] = _mm512_setzero_si512();
    int64_t k = c0;
    for (; k + 2 * C <= c1; k += 2 * C) {
      const int8_t* at = w + (k / 2) * 32;
      for (int c = 0; c < C; c += 2) fetch(reinterpret_cast<const char*>(at + c * 32));
      for (int c = 0; c < C; ++c) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + c * 32)));
        for (int r = 0; r < R; ++r) {
          int32_t p; std::memcpy(&p, qa + r * K + k + 2 * c, 4);
          is[r][c] = _mm512_dpwssd_epi32(is[r][c], wv, _mm512_set1_epi32(p));
        }
      }
    }
    for (; k < c1; k += 2) {
      const int8_t* at = w + (k / 2) * 32;
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      for (int r = 0; r < R; ++r) {
        int32_t p; std::memcpy(&p, qa + r * K + k, 4);
        is[r][0] = _mm512_dpwssd_epi32(is[r][0], wv, _mm512_set1_epi32(p));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i t = is[r][0];
      for (int c = 1; c < C; ++c) t = _mm512_add_epi32(t, is[r][c]);
      acc[r] = _mm512_add_ps(acc[r], _mm512_cvtepi32_ps(t));
    }
  }
  const __m512 sv = _mm512_loadu_ps(s);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_mul_ps(_mm512_mul_ps(acc[r], _mm512_set1_ps(da[r])), sv));
}

at::Tensor i16_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t chains) {
  const int64_t T = w.size(0), K = 2 * w.size(1), M = x.size(0);
  auto out = at::empty({M, 16 * T}, x.options());
  static thread_local std::vector<int16_t> qa; static thread_local std::vector<float> da;
  qa.resize(M * K); da.resize(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xp + r * K + k)));
    const float amax = _mm512_reduce_max_ps(mx);
    const float d = amax / 32767.f;
    const __m512 inv = _mm512_set1_ps(d > 0 ? 1.f / d : 0.f);
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa.data() + r * K + k),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xp + r * K + k), inv))));
    da[r] = d;
  }
  const int8_t* wp = w.data_ptr<int8_t>(); const float* sp = s.data_ptr<float>(); float* op = out.data_ptr<float>();
  const int16_t* q = qa.data(); const float* dd = da.data();
  const int64_t N = 16 * T;
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* wt = wp + t * K * 16;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) tile16<4, 1>(wt, q + r * K, dd + r, K, sp + 16 * t, op + r * N + 16 * t, N);
      for (; r + 2 <= M; r += 2) tile16<2, 2>(wt, q + r * K, dd + r, K, sp + 16 * t, op + r * N + 16 * t, N);
      for (; r < M; ++r) {
        if (chains == 4) tile16<1, 4>(wt, q + r * K, dd + r, K, sp + 16 * t, op + r * N + 16 * t, N);
        else if (chains == 2) tile16<1, 2>(wt, q + r * K, dd + r, K, sp + 16 * t, op + r * N + 16 * t, N);
        else tile16<1, 1>(wt, q + r * K, dd + r, K, sp + 16 * t, op + r * N + 16 * t, N);
      }
    }
  });
  return out;
}

// current-style float path with C chains (1 row only): w [T, K, 16] int8
template <int C>
inline void tilef(const int8_t* w, const float* x, int64_t K, const float* s, float* out) {
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + C <= K; k += C) {
    if ((k * 16) % 64 == 0) fetch(reinterpret_cast<const char*>(w + k * 16));
    if (C >= 8) fetch(reinterpret_cast<const char*>(w + k * 16 + 64));
    for (int c = 0; c < C; ++c) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + c) * 16))));
      acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(x[k + c]), wv, acc[c]);
    }
  }
  for (; k < K; ++k) acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16)))), acc[0]);
  __m512 t = acc[0];
  for (int c = 1; c < C; ++c) t = _mm512_add_ps(t, acc[c]);
  _mm512_storeu_ps(out, _mm512_mul_ps(t, _mm512_loadu_ps(s)));
}
at::Tensor f_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t chains) {
  const int64_t T = w.size(0), K = w.size(1);
  auto out = at::empty({1, 16 * T}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>(); const float* sp = s.data_ptr<float>(); float* op = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (chains == 8) tilef<8>(wp + t * K * 16, xp, K, sp + 16 * t, op + 16 * t);
      else if (chains == 4) tilef<4>(wp + t * K * 16, xp, K, sp + 16 * t, op + 16 * t);
      else tilef<2>(wp + t * K * 16, xp, K, sp + 16 * t, op + 16 * t);
    }
  });
  return out;
}

// codes [T, K/8, 64] (see layout), s, m [T, B, 16] f32, xs [M, B]
template <int R, int J>
inline void q4tile(const uint8_t* codes, const int16_t* qa, const float* da, const float* xs, int64_t K, int64_t G,
                   const float* s, const float* m, float* out, int64_t ldo) {
  const int64_t B = K / G;
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 ys[R], ym[R];
  for (int r = 0; r < R; ++r) ys[r] = _mm512_setzero_ps(), ym[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < B; ++g) {
    fetch(reinterpret_cast<const char*>(s + g * 16) - NEAR + NEAR / 4);
    fetch(reinterpret_cast<const char*>(m + g * 16) - NEAR + NEAR / 4);
    __m512i is[R][J];
    for (int r = 0; r < R; ++r) for (int j = 0; j < J; ++j) is[r][j] = _mm512_setzero_si512();
    for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
      const uint8_t* c = codes + (k / 8) * 64;
      fetch(reinterpret_cast<const char*>(c));
      const __m512i v = _mm512_loadu_si512(c);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i z[4] = {_mm512_unpacklo_epi8(lo, zero), _mm512_unpackhi_epi8(lo, zero),
                            _mm512_unpacklo_epi8(hi, zero), _mm512_unpackhi_epi8(hi, zero)};
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) {
          int32_t p; std::memcpy(&p, qa + r * K + k + 2 * j, 4);
          is[r][j % J] = _mm512_dpwssd_epi32(is[r][j % J], z[j], _mm512_set1_epi32(p));
        }
    }
    const __m512 sg = _mm512_loadu_ps(s + g * 16), mg = _mm512_loadu_ps(m + g * 16);
    for (int r = 0; r < R; ++r) {
      __m512i t = is[r][0];
      for (int j = 1; j < J; ++j) t = _mm512_add_epi32(t, is[r][j]);
      ys[r] = _mm512_fmadd_ps(sg, _mm512_cvtepi32_ps(t), ys[r]);
      ym[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[r * B + g]), ym[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_fmadd_ps(ys[r], _mm512_set1_ps(da[r]), ym[r]));
}
at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& s, const at::Tensor& m) {
  const int64_t T = codes.size(0), K = 8 * codes.size(1), M = x.size(0), B = s.size(1), G = K / B;
  auto out = at::empty({M, 16 * T}, x.options());
  static thread_local std::vector<int16_t> qa; static thread_local std::vector<float> da, xs;
  qa.resize(M * K); da.resize(M); xs.resize(M * B);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xp + r * K + k)));
    const float amax = _mm512_reduce_max_ps(mx);
    const float d = amax / 32767.f;
    const __m512 inv = _mm512_set1_ps(d > 0 ? 1.f / d : 0.f);
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa.data() + r * K + k),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xp + r * K + k), inv))));
    da[r] = d;
    for (int64_t g = 0; g < B; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xp + r * K + k));
      xs[r * B + g] = _mm512_reduce_add_ps(acc);
    }
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>(); const float *sp = s.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* op = out.data_ptr<float>(); const int16_t* q = qa.data(); const float *dd = da.data(), *xx = xs.data();
  const int64_t N = 16 * T;
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = cp + t * (K / 2) * 16;
      const float *st = sp + t * B * 16, *mt = mp + t * B * 16;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) q4tile<4, 1>(c, q + r * K, dd + r, xx + r * B, K, G, st, mt, op + r * N + 16 * t, N);
      for (; r + 2 <= M; r += 2) q4tile<2, 2>(c, q + r * K, dd + r, xx + r * B, K, G, st, mt, op + r * N + 16 * t, N);
      for (; r < M; ++r) q4tile<1, 4>(c, q + r * K, dd + r, xx + r * B, K, G, st, mt, op + r * N + 16 * t, N);
    }
  });
  return out;
}
int64_t set_pf(int64_t n, int64_t f) { NEAR = n; FAR = f; return 0; }
}
TORCH_LIBRARY(proto, m) {
  m.def("i16_mm(Tensor x, Tensor w, Tensor s, int chains) -> Tensor", &i16_mm);
  m.def("f_mm(Tensor x, Tensor w, Tensor s, int chains) -> Tensor", &f_mm);
  m.def("q4_mm(Tensor x, Tensor codes, Tensor s, Tensor m) -> Tensor", &q4_mm);
  m.def("set_pf(int n, int f) -> int", &set_pf);
}
