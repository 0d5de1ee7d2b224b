// yggtree::tiled_mm -- float32, bfloat16 or int8 weights in tiles of 16 output columns (csrc/simd.h: AVX-512
// or AVX2)
// (runtime/kernels.py builds this file with the kernel library; runtime/packed.py and runtime/quant.py
// document the formats).
//
// Float weights w [T, K, 16] times float32 activations: tile t holds output columns 16t..16t+15, one
// 16-wide row per input column k, so a tile is one contiguous stream; float32 or bfloat16 (widened
// exactly to float32), times an optional scale per column [T, 16] applied once at the end. For row r
// and column n = 16t + l:
//   y[r, n] = (sum over even k of x[r, k] w[t, k, l]) + (sum over odd k ...)
// each partial sum accumulated in k order with fused multiply-adds in float32.
//
// Quantized weights (int8 here, 4-bit codes in yggtree::tiled_q4_mm) take their activations as 16-bit
// integers, summed exactly in int32 (vpdpwssd, or vpmaddwd where there is no VNNI: two products a lane): per row r,
//   da[r] = amax_k |x[r, k]| / 32767,  qa[r, k] = nearest-even(x[r, k] * (1 / da[r]))  (float32 steps)
// an error of at most da / 2 (1 / 65534 of the row's largest activation) where bfloat16 activations
// (torch's quantized kernels) err by up to 1 / 512 of each. Int8 codes q [T, K2 / 2, 32] (K2 = K rounded
// up to even, the odd column's weights 0): pair j of tile t holds bytes 2l, 2l + 1 = q[16t+l][2j],
// q[16t+l][2j+1]. A scale per column, [T, 16], or per group of G = K2 / B input columns and column,
// [T, B, 16] (a GGUF Q8_0 weight: w = d q per block of 32). For row r, column n, group g:
//   i[g, c] = sum over chunk c of group g (256 inputs, or the group if smaller) of qa q   (int32, exact)
//   a[g]    = sum over c in order of float(i[g, c])
//   y[r, n] = da[r] * (a[0] * s[0]) for one group, else da[r] * (sum over g in order of fma(s[g], a[g], .))
//
// yggtree::tiled_q4_mm: 4-bit codes q in 0..15 per group of G input columns (G a multiple of 32, at most
// 4096) with a scale s and offset m per group and output column, w = s q + m, float32 or float16 (a GGUF's
// Q4_0 / Q4_1 blocks hold theirs in float16: two bytes each instead of four), widened exactly. One stream per
// tile (runtime/quant.py q4_blocks packs it): blocks [T, B, S] uint8, per tile t and group g the group's codes
// in G / 32 blocks of 256 bytes, byte (h, l, i) (h < 4, lane l < 16, i < 4) of block b =
// q[16t+l][32b+4h+i] | q[16t+l][32b+16+4h+i] << 4 (the w4a8 kernel's codes), then the group's 16 s, then its
// 16 m: S = 8 G + 32 e, e the bytes of a scale (2: float16, 4: float32; S mod 256 is 64 or 128). The integer
// sums split each 16-bit activation exactly, qa = 256 hi + lo (hi = qa >> 8 in -128..127, lo = qa & 255),
// into byte products summed four at a time (vpdpbusd, or vpmaddubsw + vpmaddwd: the codes as unsigned bytes times hi, lo
// times the codes as signed bytes). Per row r:
//   xs[g] = sum of x[r, k] over group g (LANES-wide partial sums, lanes added in a fixed order: csrc/simd.h)
//   i[g]  = 256 (sum over group g of q hi) + (sum of lo q) = sum over group g of qa q   (int32, exact)
//   y     = fma(sum over g in order of fma(s[g], float(i[g]), .), da[r], sum over g in order of fma(m[g], xs[g], .))
//
// Every step is per row and per output column in a fixed order, so a row's result does not depend on the
// call's other rows nor on the thread count (tiles are split across threads whole): speculation verifying
// W rows computes each row bitwise as a plain step does.
#include "kernels.h"
#include "loops.h"
#include "prefetch.h"
#include "simd.h"
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace yggtree::simd;
using yggtree::BF16;
using yggtree::F16;

// rows a tile computes together (each keeps its own accumulators in registers)
constexpr int WIDE = 8 * REGISTERS / 32;  // float and int8 tiles
constexpr int WIDE_Q4 = 4 * REGISTERS / 32;  // 4-bit tiles (two sums a row)

inline F widen(const float* p) { return load(p); }
inline F widen(const BF16* p) { return load(reinterpret_cast<const uint16_t*>(p)); }

// One prefetch per 64-byte line of the weight stream at `at`: into the first-level cache `ahead.near` bytes
// ahead, into the second `ahead.far` bytes ahead (0: none; csrc/prefetch.h)
template <int BYTES>
inline void fetch_ahead(const char* at, yggtree::Prefetch ahead) {
  for (int b = 0; b < BYTES; b += 64) {
    if (ahead.near) _mm_prefetch(at + ahead.near + b, _MM_HINT_T0);
    if (ahead.far) _mm_prefetch(at + ahead.far + b, _MM_HINT_T1);
  }
}

// R rows of one float tile: x rows at stride K, results at stride ldo; scale [16] per column, or null
template <int R, typename W>
inline void tile(const W* w, const float* scale, const float* x, int64_t K, float* out, int64_t ldo,
                 yggtree::Prefetch ahead) {
  constexpr int BYTES = 32 * sizeof(W);  // weight bytes of one step of two k
  for (int h = 0; h < 16; h += LANES) {  // the tile's columns, LANES at a time
    F even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = zero(), odd[r] = zero();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      if (h == 0) fetch_ahead<BYTES>(reinterpret_cast<const char*>(w + k * 16), ahead);
      const F w0 = widen(w + k * 16 + h), w1 = widen(w + (k + 1) * 16 + h);
      for (int r = 0; r < R; ++r) {
        even[r] = fmadd(set1(x[r * K + k]), w0, even[r]);
        odd[r] = fmadd(set1(x[r * K + k + 1]), w1, odd[r]);
      }
    }
    if (k < K) {
      const F w0 = widen(w + k * 16 + h);
      for (int r = 0; r < R; ++r) even[r] = fmadd(set1(x[r * K + k]), w0, even[r]);
    }
    for (int r = 0; r < R; ++r) {
      const F y = add(even[r], odd[r]);
      store(out + r * ldo + h, scale ? mul(y, load(scale + h)) : y);
    }
  }
}

// Rows in groups of 8 (where the registers hold them), 4, 2, 1: a group reads each weight of the tile once
// (the tile stays in cache for the next group). `rows(r, n)` computes rows r..r+n-1 with a tile of n rows.
template <int MAX, typename Rows>
inline void in_groups(int64_t M, Rows&& rows) {
  int64_t r = 0;
  if constexpr (MAX >= 8)
    for (; r + 8 <= M; r += 8) rows(r, std::integral_constant<int, 8>{});
  if constexpr (MAX >= 4)
    for (; r + 4 <= M; r += 4) rows(r, std::integral_constant<int, 4>{});
  for (; r + 2 <= M; r += 2) rows(r, std::integral_constant<int, 2>{});
  for (; r < M; ++r) rows(r, std::integral_constant<int, 1>{});
}

template <typename W>
void run(const W* wp, const float* sp, const float* x, int64_t M, int64_t K, int64_t T, float* op) {
  const int64_t N = 16 * T;
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const W* w = wp + t * K * 16;
      const float* s = sp ? sp + t * 16 : nullptr;
      in_groups<WIDE>(M, [&](int64_t r, auto n) {
        tile<decltype(n)::value>(w, s, x + r * K, K, op + r * N + 16 * t, N, pf);
      });
    }
  });
}

// The rows' 16-bit activations (see the header): qa [M, K2] (K2 >= K; columns K.. are 0), da [M]
void quantize16(const float* x, int64_t M, int64_t K, int64_t K2, int16_t* qa, float* da) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    F mx = zero();
    for (int64_t k = 0; k < K; k += LANES)
      mx = max(mx, abs(k + LANES <= K ? load(xr + k) : load_n(xr + k, int(K - k))));
    const float d = reduce_max(mx) / 32767.f;
    const F inv = set1(d > 0.f ? 1.f / d : 0.f);
    for (int64_t k = 0; k < K2; k += LANES) {
      const F a = k + LANES <= K ? load(xr + k) : load_n(xr + k, int(std::clamp<int64_t>(K - k, 0, LANES)));
      const I q = to_int(mul(a, inv));  // nearest even
      if (k + LANES <= K2) {
        store_i16(qa + r * K2 + k, q);
      } else {
        int16_t tail[LANES];
        store_i16(tail, q);
        std::memcpy(qa + r * K2 + k, tail, sizeof(int16_t) * (K2 - k));
      }
    }
    da[r] = d;
  }
}

constexpr int64_t CHUNK = 256;  // inputs summed in int32 at most: 128 pairs of |qa q| <= 32767 * 128: < 2^31

// R rows of one int8 tile (pairs layout, K2 inputs, groups of G), C independent integer sums a row (the
// products' latency hidden at one and two rows; their sum is exact whatever C)
template <int R, int C>
inline void i8_tile(const int8_t* w, const float* scale, int64_t G, const int16_t* qa, const float* da, int64_t K2,
                    float* out, int64_t ldo, yggtree::Prefetch ahead) {
  for (int h = 0; h < 16; h += LANES) {  // the tile's columns, LANES at a time (2 h bytes into each pair line)
  F y[R];
  for (int64_t k0 = 0; k0 < K2; k0 += G) {
    F a[R];
    for (int r = 0; r < R; ++r) a[r] = zero();
    for (int64_t c0 = k0; c0 < k0 + G; c0 += CHUNK) {
      const int64_t c1 = std::min(k0 + G, c0 + CHUNK);
      I is[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) is[r][c] = zero_i();
      int64_t k = c0;
      for (; k + 2 * C <= c1; k += 2 * C) {
        const int8_t* at = w + k * 16;  // (k / 2) pairs of 32 bytes
        for (int c = 0; c < C; ++c) {
          if (h == 0 && (k + 2 * c) % 4 == 0) fetch_ahead<64>(reinterpret_cast<const char*>(at + c * 32), ahead);
          const I v = widen_i8(at + c * 32 + 2 * h);
          for (int r = 0; r < R; ++r) is[r][c] = dpwssd(is[r][c], v, bytes4(qa + r * K2 + k + 2 * c));
        }
      }
      for (; k < c1; k += 2) {
        const I v = widen_i8(w + k * 16 + 2 * h);
        for (int r = 0; r < R; ++r) is[r][0] = dpwssd(is[r][0], v, bytes4(qa + r * K2 + k));
      }
      for (int r = 0; r < R; ++r) {
        I t = is[r][0];
        for (int c = 1; c < C; ++c) t = add(t, is[r][c]);
        a[r] = add(a[r], to_float(t));
      }
    }
    const F s = load(scale + (k0 / G) * 16 + h);
    for (int r = 0; r < R; ++r) y[r] = k0 == 0 ? mul(a[r], s) : fmadd(s, a[r], y[r]);
  }
  for (int r = 0; r < R; ++r) store(out + r * ldo + h, mul(y[r], set1(da[r])));
  }
}

// The calling thread's scratch for the rows' activations (no allocation per product; the parallel tiles
// only read them)
struct Rows16 {
  int16_t* qa;  // [M, K2]
  float* da;    // [M]
  float* xs;    // [M, B] group sums (tiled_q4_mm)
  int8_t* hi;   // [M, K2] qa >> 8 (tiled_q4_mm)
  uint8_t* lo;  // [M, K2] qa & 255 (tiled_q4_mm)
};
Rows16 scratch(int64_t M, int64_t K2, int64_t B) {
  static thread_local std::vector<int16_t> qa;
  static thread_local std::vector<float> da, xs;
  static thread_local std::vector<int8_t> hi;
  static thread_local std::vector<uint8_t> lo;
  if (static_cast<int64_t>(qa.size()) < M * K2) qa.resize(M * K2);
  if (static_cast<int64_t>(da.size()) < M) da.resize(M);
  if (static_cast<int64_t>(xs.size()) < M * B) xs.resize(M * B);
  if (B && static_cast<int64_t>(hi.size()) < M * K2) hi.resize(M * K2), lo.resize(M * K2);
  return {qa.data(), da.data(), xs.data(), hi.data(), lo.data()};
}

void run_i8(const int8_t* wp, const float* sp, int64_t B, const float* x, int64_t M, int64_t K, int64_t K2,
            int64_t T, float* op) {
  const int64_t N = 16 * T, G = K2 / B;
  const Rows16 rows = scratch(M, K2, 0);
  quantize16(x, M, K, K2, rows.qa, rows.da);
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* w = wp + t * K2 * 16;
      const float* s = sp + t * B * 16;
      in_groups<WIDE>(M, [&](int64_t r, auto n) {
        constexpr int R = decltype(n)::value;
        // two sums a row where the registers hold them (a group of 4 with one ran slower than 8 rows)
        i8_tile<R, (R <= 2 || (R <= 4 && REGISTERS >= 32)) ? 2 : 1>(w, s, G, rows.qa + r * K2, rows.da + r, K2,
                                                                    op + r * N + 16 * t, N, pf);
      });
    }
  });
}

inline F scales(const float* p) { return load(p); }
inline F scales(const F16* p) { return load_half(p); }

// hi, lo of n 16-bit activations (see the header)
void split_bytes(const int16_t* qa, int64_t n, int8_t* hi, uint8_t* lo) {
  for (int64_t i = 0; i < n; ++i) hi[i] = static_cast<int8_t>(qa[i] >> 8), lo[i] = static_cast<uint8_t>(qa[i] & 255);
}

// R rows of one tile of 4-bit blocks (S bytes a group), all groups; J = 2: the low and the high nibbles'
// sums apart (four independent integer sums a row: the products' latency hidden at one and two rows),
// J = 1: together. Scales and offsets SC (float32 or float16). The codes (0..15) times hi, and lo times
// the codes, fit vpmaddubsw's 16-bit pairs (simd.h dpbusd)
template <int R, int J, typename SC>
inline void q4_tile(const uint8_t* blocks, int64_t S, const int8_t* hi, const uint8_t* lo, const float* da,
                    const float* xs, int64_t K, int64_t G, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  const int64_t B = K / G;
  for (int h = 0; h < 16; h += LANES) {  // the tile's columns, LANES at a time (4 h bytes into each code line)
  F ys[R], ym[R];
  for (int r = 0; r < R; ++r) ys[r] = zero(), ym[r] = zero();
  for (int64_t g = 0; g < B; ++g) {
    const uint8_t* group = blocks + g * S;
    if (h == 0)
      for (int64_t b = 0; b < S; b += 64) fetch_ahead<64>(reinterpret_cast<const char*>(group + b), ahead);
    I sh[R][J], sl[R][J];  // sums of q hi, of lo q
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) sh[r][j] = zero_i(), sl[r][j] = zero_i();
    for (int64_t k0 = 0; k0 < G; k0 += 32) {
      const uint8_t* c = group + k0 * 8;
      if constexpr (NATIVE_DOT) {
        for (int q = 0; q < 4; ++q) {
          const I v = load_i(c + q * 64 + 4 * h);
          const I a = low_nibbles(v), b = high_nibbles(v);
          const int64_t ka = g * G + k0 + 4 * q, kb = ka + 16;  // the inputs of a's and b's 4 bytes a lane
          for (int r = 0; r < R; ++r) {
            sh[r][0] = dpbusd(sh[r][0], a, bytes4(hi + r * K + ka));
            sl[r][0] = dpbusd(sl[r][0], bytes4(lo + r * K + ka), a);
            sh[r][J - 1] = dpbusd(sh[r][J - 1], b, bytes4(hi + r * K + kb));
            sl[r][J - 1] = dpbusd(sl[r][J - 1], bytes4(lo + r * K + kb), b);
          }
        }
      } else {
        // 16-bit sums of 32 inputs: 8 pairs of codes (<= 15) times hi (|hi| <= 128), <= 8 * 3840; lo (<= 255)
        // times the codes in two halves of 4 pairs, <= 4 * 7650
        I ph[R], pl[R];
        for (int q = 0; q < 4; ++q) {
          const I v = load_i(c + q * 64 + 4 * h);
          const I a = low_nibbles(v), b = high_nibbles(v);
          const int64_t ka = g * G + k0 + 4 * q, kb = ka + 16;
          for (int r = 0; r < R; ++r) {
            const I th = add16(pairs16(a, bytes4(hi + r * K + ka)), pairs16(b, bytes4(hi + r * K + kb)));
            const I tl = add16(pairs16(bytes4(lo + r * K + ka), a), pairs16(bytes4(lo + r * K + kb), b));
            ph[r] = q == 0 ? th : add16(ph[r], th);
            pl[r] = q % 2 == 0 ? tl : add16(pl[r], tl);
            if (q % 2 == 1) sl[r][0] = widen16(sl[r][0], pl[r]);
          }
        }
        for (int r = 0; r < R; ++r) sh[r][0] = widen16(sh[r][0], ph[r]);
      }
    }
    const SC* sm = reinterpret_cast<const SC*>(group + G * 8);
    const F sg = scales(sm + h), mg = scales(sm + 16 + h);
    for (int r = 0; r < R; ++r) {
      I th = sh[r][0], tl = sl[r][0];
      if constexpr (J == 2) th = add(th, sh[r][1]), tl = add(tl, sl[r][1]);
      const I t = add(shl32<8>(th), tl);
      ys[r] = fmadd(sg, to_float(t), ys[r]);
      ym[r] = fmadd(mg, set1(xs[r * B + g]), ym[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * ldo + h, fmadd(ys[r], set1(da[r]), ym[r]));
  }
}

template <typename SC>
void run_q4(const uint8_t* bp, int64_t S, const Rows16& rows, int64_t M, int64_t K, int64_t G, int64_t T, float* op) {
  const int64_t B = K / G, N = 16 * T;
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = bp + t * B * S;
      in_groups<WIDE_Q4>(M, [&](int64_t r, auto n) {
        constexpr int R = decltype(n)::value;
        constexpr int J = R <= 2 * REGISTERS / 32 ? 2 : 1;  // two sums a row where the registers hold them
        q4_tile<R, J, SC>(c, S, rows.hi + r * K, rows.lo + r * K, rows.da + r, rows.xs + r * B, K, G,
                            op + r * N + 16 * t, N, pf);
      });
    }
  });
}

}  // namespace

// The products for the weights' dtypes (kernels.h; ops.cpp checks the shapes)
void yggtree::tiled_mm_f32(const float* w, const float* scale, const float* x, int64_t M, int64_t K, int64_t T,
                           float* out) {
  run(w, scale, x, M, K, T, out);
}

void yggtree::tiled_mm_bf16(const BF16* w, const float* scale, const float* x, int64_t M, int64_t K, int64_t T,
                            float* out) {
  run(w, scale, x, M, K, T, out);
}

void yggtree::tiled_mm_i8(const int8_t* w, const float* scale, int64_t B, const float* x, int64_t M, int64_t K,
                          int64_t K2, int64_t T, float* out) {
  run_i8(w, scale, B, x, M, K, K2, T, out);
}

// x [M, K] float32; blocks [T, K / G, S = 8 G + 32 e] uint8 (see the header) -> out [M, 16 T] float32
void yggtree::tiled_q4_mm(const uint8_t* blocks, int64_t S, bool f16_scales, const float* x, int64_t M, int64_t K,
                          int64_t G, int64_t T, float* out) {
  const int64_t B = K / G;
  const Rows16 rows = scratch(M, K, B);
  quantize16(x, M, K, K, rows.qa, rows.da);
  split_bytes(rows.qa, M * K, rows.hi, rows.lo);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < B; ++g) {
      F acc = zero();
      for (int64_t k = g * G; k < (g + 1) * G; k += LANES) acc = add(acc, load(x + r * K + k));
      rows.xs[r * B + g] = reduce_add(acc);
    }
  if (f16_scales)
    run_q4<F16>(blocks, S, rows, M, K, G, T, out);
  else
    run_q4<float>(blocks, S, rows, M, K, G, T, out);
}
