// Prototype: the tiled 4-bit product with codes, scales and offsets in one stream per tile:
// blocks [T, B, G * 8 + 32 * sizeof(S)] uint8: per group g of tile t its G / 8 x 64 code bytes (q4_tiles
// layout), then 16 s, then 16 m (S = float16 here)
#include <ATen/ATen.h>
#include "../../../yggtree/runtime/csrc/loops.h"
#include "../../../yggtree/runtime/csrc/prefetch.h"
#include <torch/library.h>
#include <immintrin.h>
#include <cstring>
#include <vector>
#include <thread>
#include <x86intrin.h>
namespace {
template <int BYTES>
inline void fetch_ahead(const char* at, yggtree::Prefetch ahead) {
  for (int b = 0; b < BYTES; b += 64) {
    if (ahead.near) _mm_prefetch(at + ahead.near + b, _MM_HINT_T0);
    if (ahead.far) _mm_prefetch(at + ahead.far + b, _MM_HINT_T1);
  }
}
void quantize16(const float* x, int64_t M, int64_t K, int64_t K2, int16_t* qa, float* da) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 in = k + 16 <= K ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(in, xr + k)));
    }
    const float d = _mm512_reduce_max_ps(mx) / 32767.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    for (int64_t k = 0; k < K2; k += 16) {
      const __mmask16 in = k + 16 <= K ? __mmask16(0xFFFF) : k < K ? __mmask16((1u << (K - k)) - 1) : __mmask16(0);
      const __mmask16 out = k + 16 <= K2 ? __mmask16(0xFFFF) : __mmask16((1u << (K2 - k)) - 1);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, xr + k), inv));
      _mm256_mask_storeu_epi16(qa + r * K2 + k, out, _mm512_cvtsepi32_epi16(q));
    }
    da[r] = d;
  }
}
inline __m512i pair(const int16_t* a) { int32_t v; std::memcpy(&v, a, 4); return _mm512_set1_epi32(v); }
inline __m512 scales(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

template <int R, int J>
inline void q4b_tile(const uint8_t* blocks, int64_t S, const int16_t* qa, const float* da, const float* xs, int64_t K,
                     int64_t G, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  const int64_t B = K / G, CB = G * 8;
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 ys[R], ym[R];
  for (int r = 0; r < R; ++r) ys[r] = _mm512_setzero_ps(), ym[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < B; ++g) {
    const uint8_t* blk = blocks + g * S;
    for (int64_t b = 0; b < S; b += 64) fetch_ahead<64>(reinterpret_cast<const char*>(blk + b), ahead);
    __m512i is[R][J];
    for (int r = 0; r < R; ++r) for (int j = 0; j < J; ++j) is[r][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < G; k += 8) {
      const __m512i v = _mm512_loadu_si512(blk + k * 8);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i z[4] = {_mm512_unpacklo_epi8(lo, zero), _mm512_unpackhi_epi8(lo, zero),
                            _mm512_unpacklo_epi8(hi, zero), _mm512_unpackhi_epi8(hi, zero)};
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
          is[r][j % J] = _mm512_dpwssd_epi32(is[r][j % J], z[j], pair(qa + r * K + g * G + k + 2 * j));
    }
    const at::Half* sm = reinterpret_cast<const at::Half*>(blk + CB);
    const __m512 sg = scales(sm), mg = scales(sm + 16);
    for (int r = 0; r < R; ++r) {
      __m512i t = is[r][0];
      for (int j = 1; j < J; ++j) t = _mm512_add_epi32(t, is[r][j]);
      ys[r] = _mm512_fmadd_ps(sg, _mm512_cvtepi32_ps(t), ys[r]);
      ym[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[r * B + g]), ym[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_fmadd_ps(ys[r], _mm512_set1_ps(da[r]), ym[r]));
}

at::Tensor q4b_mm(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t T = blocks.size(0), B = blocks.size(1), S = blocks.size(2), G = (S - 64) / 8;
  const int64_t M = x.size(0), K = x.size(1), N = 16 * T;
  TORCH_CHECK(K == B * G);
  auto out = at::empty({M, N}, x.options());
  static thread_local std::vector<int16_t> qa; static thread_local std::vector<float> da, xs;
  qa.resize(M * K); da.resize(M); xs.resize(M * B);
  const float* xp = x.data_ptr<float>();
  quantize16(xp, M, K, K, qa.data(), da.data());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < B; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xp + r * K + k));
      xs[r * B + g] = _mm512_reduce_add_ps(acc);
    }
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int16_t* q = qa.data(); const float *d = da.data(), *s = xs.data();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = bp + t * B * S;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) q4b_tile<4, 1>(c, S, q + r * K, d + r, s + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r + 2 <= M; r += 2) q4b_tile<2, 2>(c, S, q + r * K, d + r, s + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r < M; ++r) q4b_tile<1, 4>(c, S, q + r * K, d + r, s + r * B, K, G, op + r * N + 16 * t, N, pf);
    }
  });
  return out;
}
}  // namespace

namespace {
inline __m512i bytes4(const void* a) { int32_t v; std::memcpy(&v, a, 4); return _mm512_set1_epi32(v); }
// one stream, w4a8's nibble layout, byte products: blocks [T, B, (G/32)*256 + 64]
template <int R, int J>
inline void q4c_tile(const uint8_t* blocks, int64_t S, const int8_t* hi, const uint8_t* lo, const float* da, const float* xs,
                     int64_t K, int64_t G, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  const int64_t B = K / G, CB = G * 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 ys[R], ym[R];
  for (int r = 0; r < R; ++r) ys[r] = _mm512_setzero_ps(), ym[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < B; ++g) {
    const uint8_t* blk = blocks + g * S;
    for (int64_t b = 0; b < S; b += 64) fetch_ahead<64>(reinterpret_cast<const char*>(blk + b), ahead);
    __m512i sh[R][J], sl[R][J];
    for (int r = 0; r < R; ++r) for (int j = 0; j < J; ++j) sh[r][j] = _mm512_setzero_si512(), sl[r][j] = _mm512_setzero_si512();
    for (int64_t k0 = 0; k0 < G; k0 += 32) {
      const uint8_t* c = blk + k0 * 8;
      for (int h = 0; h < 4; ++h) {
        const __m512i v = _mm512_loadu_si512(c + h * 64);
        const __m512i a = _mm512_and_si512(v, low), b = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const int64_t ka = g * G + k0 + 4 * h, kb = ka + 16;
        for (int r = 0; r < R; ++r) {
          sh[r][0] = _mm512_dpbusd_epi32(sh[r][0], a, bytes4(hi + r * K + ka));
          sl[r][0] = _mm512_dpbusd_epi32(sl[r][0], bytes4(lo + r * K + ka), a);
          sh[r][J - 1] = _mm512_dpbusd_epi32(sh[r][J - 1], b, bytes4(hi + r * K + kb));
          sl[r][J - 1] = _mm512_dpbusd_epi32(sl[r][J - 1], bytes4(lo + r * K + kb), b);
        }
      }
    }
    const at::Half* sm = reinterpret_cast<const at::Half*>(blk + CB);
    const __m512 sg = scales(sm), mg = scales(sm + 16);
    for (int r = 0; r < R; ++r) {
      __m512i th = sh[r][0], tl = sl[r][0];
      if constexpr (J == 2) th = _mm512_add_epi32(th, sh[r][1]), tl = _mm512_add_epi32(tl, sl[r][1]);
      const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(th, 8), tl);
      ys[r] = _mm512_fmadd_ps(sg, _mm512_cvtepi32_ps(t), ys[r]);
      ym[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[r * B + g]), ym[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_fmadd_ps(ys[r], _mm512_set1_ps(da[r]), ym[r]));
}
at::Tensor q4c_mm(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t T = blocks.size(0), B = blocks.size(1), S = blocks.size(2), G = (S - 64) / 8;
  const int64_t M = x.size(0), K = x.size(1), N = 16 * T;
  TORCH_CHECK(K == B * G);
  auto out = at::empty({M, N}, x.options());
  static thread_local std::vector<int16_t> qa; static thread_local std::vector<float> da, xs;
  static thread_local std::vector<int8_t> hi; static thread_local std::vector<uint8_t> lo;
  qa.resize(M * K); da.resize(M); xs.resize(M * B); hi.resize(M * K); lo.resize(M * K);
  const float* xp = x.data_ptr<float>();
  quantize16(xp, M, K, K, qa.data(), da.data());
  for (int64_t i = 0; i < M * K; ++i) hi[i] = int8_t(qa[i] >> 8), lo[i] = uint8_t(qa[i] & 255);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < B; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xp + r * K + k));
      xs[r * B + g] = _mm512_reduce_add_ps(acc);
    }
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int8_t* h = hi.data(); const uint8_t* l = lo.data(); const float *d = da.data(), *s = xs.data();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = bp + t * B * S;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) q4c_tile<4, 1>(c, S, h + r * K, l + r * K, d + r, s + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r + 2 <= M; r += 2) q4c_tile<2, 2>(c, S, h + r * K, l + r * K, d + r, s + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r < M; ++r) q4c_tile<1, 2>(c, S, h + r * K, l + r * K, d + r, s + r * B, K, G, op + r * N + 16 * t, N, pf);
    }
  });
  return out;
}
}  // namespace

namespace {
inline uint64_t tsc() { return __rdtsc(); }
struct Stamp { uint64_t t0, c_begin, c_end, w_begin, w_end; int64_t c_tiles, w_tiles; };
std::vector<Stamp> stamps;
at::Tensor q4t_mm(const at::Tensor& x, const at::Tensor& blocks) {
  Stamp st{}; st.t0 = tsc();
  const int64_t T = blocks.size(0), B = blocks.size(1), S = blocks.size(2), G = (S - 64) / 8;
  const int64_t M = x.size(0), K = x.size(1), N = 16 * T;
  auto out = at::empty({M, N}, x.options());
  static thread_local std::vector<int16_t> qa; static thread_local std::vector<float> da, xs;
  static thread_local std::vector<int8_t> hi; static thread_local std::vector<uint8_t> lo;
  qa.resize(M * K); da.resize(M); xs.resize(M * B); hi.resize(M * K); lo.resize(M * K);
  const float* xp = x.data_ptr<float>();
  st.w_tiles = tsc() - st.t0;  // stamp: output and scratch ready
  quantize16(xp, M, K, K, qa.data(), da.data());
  for (int64_t i = 0; i + 32 <= M * K; i += 32) {
    const __m512i v = _mm512_loadu_si512(qa.data() + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi.data() + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo.data() + i), _mm512_cvtepi16_epi8(v));
  }
  st.c_tiles = tsc() - st.t0;  // stamp: the activations ready
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < B; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xp + r * K + k));
      xs[r * B + g] = _mm512_reduce_add_ps(acc);
    }
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int8_t* h = hi.data(); const uint8_t* l = lo.data(); const float *d = da.data(), *s = xs.data();
  const auto caller = std::this_thread::get_id();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    const bool me = std::this_thread::get_id() == caller;
    const uint64_t b = tsc();
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = bp + t * B * S;
      q4c_tile<1, 2>(c, S, h, l, d, s, K, G, op + 16 * t, N, pf);
    }
    const uint64_t e = tsc();
    if (me) st.c_begin = b, st.c_end = e; else st.w_begin = b, st.w_end = e, st.w_tiles = t1 - t0;
  });
  const uint64_t end = tsc();
  stamps.push_back(st);
  stamps.back().t0 = end - st.t0;  // total
  stamps.back().c_begin -= st.t0; stamps.back().c_end -= st.t0; stamps.back().w_begin -= st.t0; stamps.back().w_end -= st.t0;
  return out;
}
at::Tensor q4t_stamps() {
  auto o = at::empty({int64_t(stamps.size()), 7}, at::kLong);
  auto* p = o.data_ptr<int64_t>();
  for (size_t i = 0; i < stamps.size(); ++i) {
    const auto& s = stamps[i];
    int64_t v[7] = {int64_t(s.t0), int64_t(s.c_begin), int64_t(s.c_end), int64_t(s.w_begin), int64_t(s.w_end), s.c_tiles, s.w_tiles};
    for (int j = 0; j < 7; ++j) p[i * 7 + j] = v[j];
  }
  stamps.clear();
  return o;
}
}  // namespace
TORCH_LIBRARY(proto27t, lib) { lib.def("q4t_mm(Tensor x, Tensor blocks) -> Tensor"); lib.def("q4t_stamps() -> Tensor"); }
TORCH_LIBRARY_IMPL(proto27t, CPU, lib) { lib.impl("q4t_mm", &q4t_mm); }
TORCH_LIBRARY_IMPL(proto27t, CompositeExplicitAutograd, lib) { lib.impl("q4t_stamps", &q4t_stamps); }

TORCH_LIBRARY(proto27, lib) { lib.def("q4b_mm(Tensor x, Tensor blocks) -> Tensor"); lib.def("q4c_mm(Tensor x, Tensor blocks) -> Tensor"); }
TORCH_LIBRARY_IMPL(proto27, CPU, lib) { lib.impl("q4b_mm", &q4b_mm); lib.impl("q4c_mm", &q4c_mm); }
