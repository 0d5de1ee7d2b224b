// The library's tiled kernels at e6b6765 (float32 activations), ops renamed yggold:: and their C shims
// dropped, for a same-process A/B against the library's (ab_kernels.py).
// yggtree::tiled_mm -- float32, bfloat16 or int8 weights in tiles of 16 output columns times
// float32 activations on AVX-512 (runtime/tiled.py builds this file with the kernel library and
// documents the format).
//
// Weight w [T, K, 16]: tile t holds output columns 16t..16t+15, one 16-wide row per input
// column k, so a tile is one contiguous stream; float32, bfloat16 (widened exactly to float32)
// or int8 (converted exactly), times an optional scale: per column, [T, 16] float32, applied
// once at the end, or per group of G = K / B input columns and column, [T, B, 16] (a GGUF Q8_0
// weight: w = d q per block of 32). For row r, column n = 16t + l and group g:
//   a[g]    = (sum over even k of g of x[r, k] w[t, k, l]) + (sum over odd k of g ...)
//   y[r, n] = a[0] * scale[t, 0, l], then y = fma(scale[t, g, l], a[g], y) for g = 1 .. B - 1
// (no scale: y = a[0], one group) each partial sum accumulated in k order with fused
// multiply-adds in float32. Every float step
// is per row and per output column in a fixed order, so a row's result does not depend on the
// call's other rows nor on the thread count (tiles are split across threads whole): speculation
// verifying W rows computes each row bitwise as a plain step does.
//
// yggtree::tiled_q4_mm: 4-bit codes q in 0..15 per group of G input columns with a float32 scale
// s and offset m per group and output column, w = s q + m. Codes [T, K / 2, 16] uint8: byte
// (t, j, l) = q[16t+l][2j] | q[16t+l][2j+1] << 4; s and m [T, K / G, 16] float32. Per row r:
//   xs[g] = sum of x[r, k] over group g (16-lane partial sums, lanes added in a fixed order)
//   a[g]  = (sum over even k of g of x[r, k] q[k, l]) + (sum over odd k ...), each in k order
//   y     = sum over g in order of fma(s[g], a[g], .) then fma(m[g], xs[g], .)
// so the same row independence holds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../../../yggtree/runtime/csrc/loops.h"
#include "../../../yggtree/runtime/csrc/prefetch.h"
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <immintrin.h>
#include <vector>

namespace {

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen(const at::BFloat16* p) {  // bfloat16 -> float32: the 16 bits on top, exact
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One prefetch per 64-byte line of the weight stream at `at`: into the first-level cache `ahead.near` bytes
// ahead, into the second `ahead.far` bytes ahead (0: none; csrc/prefetch.h)
template <int BYTES>
inline void fetch_ahead(const char* at, yggtree::Prefetch ahead) {
  for (int b = 0; b < BYTES; b += 64) {
    if (ahead.near) _mm_prefetch(at + ahead.near + b, _MM_HINT_T0);
    if (ahead.far) _mm_prefetch(at + ahead.far + b, _MM_HINT_T1);
  }
}

// R rows of one tile: x rows at stride ldx, results at stride ldo; scale [B, 16] (per group of G input
// columns) or null (one group)
template <int R, typename W>
inline void tile(const W* w, const float* scale, int64_t G, const float* x, int64_t K, int64_t ldx, float* out,
                 int64_t ldo, yggtree::Prefetch ahead) {
  constexpr int BYTES = 32 * sizeof(W);  // weight bytes of one step of two k
  __m512 y[R];
  for (int64_t k0 = 0; k0 < K; k0 += G) {
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = _mm512_setzero_ps(), odd[r] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 2 <= k0 + G; k += 2) {
      const char* at = reinterpret_cast<const char*>(w + k * 16);
      if constexpr (BYTES >= 64)
        fetch_ahead<BYTES>(at, ahead);
      else if ((k * 16 * sizeof(W)) % 64 == 0)  // int8: a line every other step
        fetch_ahead<64>(at, ahead);
      const __m512 w0 = widen(w + k * 16), w1 = widen(w + (k + 1) * 16);
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 1]), w1, odd[r]);
      }
    }
    if (k < k0 + G) {
      const __m512 w0 = widen(w + k * 16);
      for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, even[r]);
    }
    if (!scale) {
      for (int r = 0; r < R; ++r) y[r] = _mm512_add_ps(even[r], odd[r]);
      continue;
    }
    const __m512 s = _mm512_loadu_ps(scale + (k0 / G) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_add_ps(even[r], odd[r]);
      y[r] = k0 == 0 ? _mm512_mul_ps(a, s) : _mm512_fmadd_ps(s, a, y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, y[r]);
}

template <typename W>
void run(const W* wp, const float* sp, int64_t B, const float* x, int64_t M, int64_t K, int64_t T, float* op) {
  const int64_t N = 16 * T;
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const W* w = wp + t * K * 16;
      const float* s = sp ? sp + t * B * 16 : nullptr;
      const int64_t G = K / B;
      // rows in groups of 8, 4, 2, 1: a group reads each weight once (the tile stays in cache for
      // the next group)
      int64_t r = 0;
      for (; r + 8 <= M; r += 8) tile<8>(w, s, G, x + r * K, K, K, op + r * N + 16 * t, N, pf);
      for (; r + 4 <= M; r += 4) tile<4>(w, s, G, x + r * K, K, K, op + r * N + 16 * t, N, pf);
      for (; r + 2 <= M; r += 2) tile<2>(w, s, G, x + r * K, K, K, op + r * N + 16 * t, N, pf);
      for (; r < M; ++r) tile<1>(w, s, G, x + r * K, K, K, op + r * N + 16 * t, N, pf);
    }
  });
}

// x [M, K] float32; w [T, K, 16] float32 | bfloat16 | int8; scale [T, 16] or [T, B, 16] float32 (B
// dividing K), or empty for none (int8 needs one) -> [M, 16 T] float32
at::Tensor tiled_mm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "tiled_mm: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.is_contiguous(), "tiled_mm: w must be a contiguous [T, K, 16]");
  const int64_t T = w.size(0), K = w.size(1);
  const bool scaled = scale.numel() > 0;
  const int64_t B = scaled && scale.dim() == 3 ? scale.size(1) : 1;
  TORCH_CHECK(!scaled || (scale.scalar_type() == at::kFloat && scale.is_contiguous() && B > 0 && K % B == 0 &&
                          (scale.sizes() == at::IntArrayRef({T, 16}) || scale.sizes() == at::IntArrayRef({T, B, 16}))),
              "tiled_mm: scale must be [T, 16] or [T, B, 16] float32 with B dividing K, or empty");
  TORCH_CHECK(scaled || w.scalar_type() != at::kChar, "tiled_mm: int8 weights need a scale");
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.size(1) == K, "tiled_mm: x has ", x.size(1), " columns, the weight ", K);
  const int64_t M = x.size(0);
  auto out = at::empty({M, 16 * T}, x.options());
  const float* sp = scaled ? scale.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: run(w.data_ptr<float>(), sp, B, xp, M, K, T, op); break;
    case at::kBFloat16: run(w.data_ptr<at::BFloat16>(), sp, B, xp, M, K, T, op); break;
    case at::kChar: run(w.data_ptr<int8_t>(), sp, B, xp, M, K, T, op); break;
    default: TORCH_CHECK(false, "tiled_mm: w must be float32, bfloat16 or int8, got ", w.scalar_type());
  }
  return out;
}

// R rows of one tile of 4-bit codes: all groups; xs [R, B] the rows' group sums (stride B)
template <int R>
inline void q4_tile(const uint8_t* codes, const float* s, const float* m, const float* x, const float* xs,
                    int64_t K, int64_t G, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  const int64_t B = K / G;
  // a code's float32 value by a permute over the 16 values (it reads an index's low 4 bits only):
  // the conversion's exact result in one instruction instead of two (1.145x on one CPU, docs/results.md)
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < B; ++g) {
    // the scales and offsets stream at a quarter of the codes' pace (G 32) or less
    const yggtree::Prefetch quarter{ahead.near / 4 / 64 * 64, ahead.far / 4 / 64 * 64};
    fetch_ahead<64>(reinterpret_cast<const char*>(s + g * 16), quarter);
    fetch_ahead<64>(reinterpret_cast<const char*>(m + g * 16), quarter);
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = _mm512_setzero_ps(), odd[r] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
      const uint8_t* c = codes + (k / 2) * 16;
      if ((k & 7) == 0) fetch_ahead<64>(reinterpret_cast<const char*>(c), ahead);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      const __m512 w0 = _mm512_permutexvar_ps(v, values), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + 1]), w1, odd[r]);
      }
    }
    const __m512 sg = _mm512_loadu_ps(s + g * 16), mg = _mm512_loadu_ps(m + g * 16);
    for (int r = 0; r < R; ++r) {
      y[r] = _mm512_fmadd_ps(sg, _mm512_add_ps(even[r], odd[r]), y[r]);
      y[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xs[r * B + g]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, y[r]);
}

// x [M, K] float32; codes [T, K / 2, 16] uint8; s, m [T, K / G, 16] float32 -> [M, 16 T] float32
at::Tensor tiled_q4_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& s, const at::Tensor& m) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "tiled_q4_mm: x must be [M, K] float32");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 16 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "tiled_q4_mm: codes must be a contiguous [T, K / 2, 16] uint8");
  const int64_t T = codes.size(0), K = 2 * codes.size(1);
  TORCH_CHECK(s.dim() == 3 && s.size(0) == T && s.size(2) == 16 && s.scalar_type() == at::kFloat && s.is_contiguous() &&
              m.sizes() == s.sizes() && m.scalar_type() == at::kFloat && m.is_contiguous(),
              "tiled_q4_mm: s and m must be [T, K / G, 16] float32");
  const int64_t B = s.size(1);
  TORCH_CHECK(B > 0 && K % B == 0 && (K / B) % 16 == 0, "tiled_q4_mm: the group size must divide K and be a multiple of 16");
  const int64_t G = K / B;
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.size(1) == K, "tiled_q4_mm: x has ", x.size(1), " columns, the weight ", K);
  const int64_t M = x.size(0), N = 16 * T;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  // the rows' group sums, in the calling thread's scratch (the parallel tiles only read them)
  static thread_local std::vector<float> xs_buf;
  if (static_cast<int64_t>(xs_buf.size()) < M * B) xs_buf.resize(M * B);
  float* xs = xs_buf.data();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < B; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xp + r * K + k));
      xs[r * B + g] = _mm512_reduce_add_ps(acc);
    }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = cp + t * (K / 2) * 16;
      const float *st = sp + t * B * 16, *mt = mp + t * B * 16;
      int64_t r = 0;
      for (; r + 8 <= M; r += 8) q4_tile<8>(c, st, mt, xp + r * K, xs + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r + 4 <= M; r += 4) q4_tile<4>(c, st, mt, xp + r * K, xs + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r + 2 <= M; r += 2) q4_tile<2>(c, st, mt, xp + r * K, xs + r * B, K, G, op + r * N + 16 * t, N, pf);
      for (; r < M; ++r) q4_tile<1>(c, st, mt, xp + r * K, xs + r * B, K, G, op + r * N + 16 * t, N, pf);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yggold, lib) {
  lib.def("tiled_mm(Tensor x, Tensor w, Tensor scale) -> Tensor");
  lib.def("tiled_q4_mm(Tensor x, Tensor codes, Tensor s, Tensor m) -> Tensor");
}
TORCH_LIBRARY_IMPL(yggold, CPU, lib) {
  lib.impl("tiled_mm", &tiled_mm);
  lib.impl("tiled_q4_mm", &tiled_q4_mm);
}
