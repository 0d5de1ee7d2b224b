// yggtree::w4a8_mm -- block-quantized weights times int8-quantized activations (csrc/simd.h: AVX-512
// or AVX2, with or without VNNI)
// (runtime/w4a8.py builds this file once per machine and documents the format).
//
// Weights: per 32-wide input block b of output column n, w = d * u + m with codes u in 0..15
// (4-bit: GGUF Q4_0 / Q4_1) or 0..255 (8-bit: GGUF Q8_0, whose int8 q is u - 128), d and m
// float16. Activations: per row r and block b, a ~= da * qa with da = amax / 127 and
// qa = round-to-nearest-even(a * (1 / da)) in -127..127 (float32 arithmetic). Then
//   y[r, n] = sum_b ( (d * da) * isum + m * sa ),  isum = sum_k u * qa (int32, exact),
//                                                  sa   = da * sum_k qa
// accumulated in float32 in block order with fused multiply-adds. Every float step is per row
// and per output column in a fixed order, so a row's result does not depend on the call's
// other rows nor on the thread count (tiles of 16 columns are split across threads whole).
//
// Layout: one uint8 tensor [T, B, S], per tile t of 16 output columns and block b (T = N / 16,
// B = K / 32) the block's codes, then its 16 d, then its 16 m (float16), so each thread reads one
// contiguous stream (three tensors -- codes, d, m -- are three streams a thread, slower):
//   4-bit, S = 320: byte (g, lane, i) = u[16t+lane][32b+4g+i] | u[16t+lane][32b+16+4g+i] << 4, then d, m
//   8-bit, S = 576: byte (g, lane, i) = u[16t+lane][32b+4g+i] (g < 8), then d, m
#include "kernels.h"
#include "loops.h"
#include "prefetch.h"
#include "simd.h"
#include <atomic>
#include <cstring>
#include <vector>

namespace {


using namespace yggtree::simd;

// Block-major, so that a tile's rows of one block sit at fixed offsets (one address register for all of them):
// qa [B, M, 32] int8, da and sa [B, M] float32 (see the header), qsum [B, M] int32: each block's sum of qa
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qa, float* da, float* sa, int32_t* qsum) {
  const int64_t B = K / 32;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + r * K + b * 32;
      constexpr int V = 32 / LANES;  // vectors a block
      F a[V];
      F mx = zero();
      for (int i = 0; i < V; ++i) a[i] = load(xb + i * LANES), mx = max(mx, abs(a[i]));
      const float d = reduce_max(mx) / 127.f;
      const F inv = set1(d > 0.f ? 1.f / d : 0.f);
      I qs = zero_i();
      for (int i = 0; i < V; ++i) {
        const I q = to_int(mul(a[i], inv));  // nearest even (default rounding mode)
        store_i8(qa + (b * M + r) * 32 + i * LANES, q);
        qs = add(qs, q);
      }
      qsum[b * M + r] = reduce_add(qs);
      da[b * M + r] = d;
      sa[b * M + r] = d * static_cast<float>(qsum[b * M + r]);
    }
  }
}

template <int BITS>
constexpr int CODES = BITS == 4 ? 256 : 512;  // bytes of a block's codes in a tile
template <int BITS>
constexpr int STRIDE = CODES<BITS> + 64;  // bytes of a block in a tile: codes, 16 d, 16 m
static_assert(STRIDE<4> == yggtree::W4A8_STRIDE4 && STRIDE<8> == yggtree::W4A8_STRIDE8, "csrc/kernels.h's strides");
constexpr int WIDE = 8 * REGISTERS / 32;  // rows a tile computes together (each keeps its own accumulators in registers)

// R rows of one 16-column tile, all blocks. With one or two rows the 4-bit codes' low and high
// nibbles feed two integer accumulators (two dependency chains instead of one; the int32 sums
// are exact, so the result is the same)
template <int R, int BITS>
inline void tile(const uint8_t* blocks, const int8_t* qa, const float* da, const float* sa, const int32_t* qsum,
                 int64_t M, int64_t B, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  constexpr bool SPLIT = R <= 2;
  for (int h = 0; h < 16; h += LANES) {  // the tile's columns, LANES at a time (4 h bytes into each code line)
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  for (int64_t b = 0; b < B; ++b) {
    I isum[R], isum2[R];
    for (int r = 0; r < R; ++r) isum[r] = zero_i(), isum2[r] = zero_i();
    const uint8_t* cb = blocks + b * STRIDE<BITS>;
    if (BITS == 4 && h == 0) {
      // the weights are one stream (tiles are contiguous): fetch the library's distances ahead
      // (csrc/prefetch.h), which run on into the next tile (a prefetch past the end is harmless)
      for (int i = 0; i < STRIDE<BITS>; i += 64) {
        if (ahead.near) _mm_prefetch(reinterpret_cast<const char*>(cb + ahead.near + i), _MM_HINT_T0);
        if (ahead.far) _mm_prefetch(reinterpret_cast<const char*>(cb + ahead.far + i), _MM_HINT_T1);
      }
    }
    if constexpr (BITS == 4) {
      if constexpr (NATIVE_DOT) {
        for (int g = 0; g < 4; ++g) {
          const I v = load_i(cb + g * 64 + 4 * h);
          const I lo = low_nibbles(v), hi = high_nibbles(v);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = qa + (b * M + r) * 32 + 4 * g;
            isum[r] = dpbusd(isum[r], lo, bytes4(a));
            if constexpr (SPLIT)
              isum2[r] = dpbusd(isum2[r], hi, bytes4(a + 16));
            else
              isum[r] = dpbusd(isum[r], hi, bytes4(a + 16));
          }
        }
      } else {  // a block's 8 pair sums of codes (<= 15) times qa (|qa| <= 127) in 16 bits: <= 8 * 3810
        I p[R];
        for (int g = 0; g < 4; ++g) {
          const I v = load_i(cb + g * 64 + 4 * h);
          const I lo = low_nibbles(v), hi = high_nibbles(v);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = qa + (b * M + r) * 32 + 4 * g;
            const I both = add16(pairs16(lo, bytes4(a)), pairs16(hi, bytes4(a + 16)));
            p[r] = g == 0 ? both : add16(p[r], both);
          }
        }
        for (int r = 0; r < R; ++r) isum[r] = widen16(isum[r], p[r]);
      }
    } else {
      // 8-bit codes: into the second level only (a first-level prefetch slowed them on one CPU)
      if (ahead.far && h == 0)
        for (int i = 0; i < STRIDE<BITS>; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(cb + ahead.far + i), _MM_HINT_T1);
      if constexpr (NATIVE_DOT) {
        for (int g = 0; g < 8; ++g) {
          const I v = load_i(cb + g * 64 + 4 * h);
          for (int r = 0; r < R; ++r) {
            if (SPLIT && (g & 1))
              isum2[r] = dpbusd(isum2[r], v, bytes4(qa + (b * M + r) * 32 + 4 * g));
            else
              isum[r] = dpbusd(isum[r], v, bytes4(qa + (b * M + r) * 32 + 4 * g));
          }
        }
      } else {  // sum (u - 128) qa by the sign trick (simd.h), then + 128 sum qa: the same int32
        for (int g = 0; g < 8; ++g) {
          const I c = centered(load_i(cb + g * 64 + 4 * h)), mag = magnitude(c);
          for (int r = 0; r < R; ++r) {
            const I a = bytes4(qa + (b * M + r) * 32 + 4 * g);
            if (SPLIT && (g & 1))
              isum2[r] = dot_centered(isum2[r], mag, c, a);
            else
              isum[r] = dot_centered(isum[r], mag, c, a);
          }
        }
        for (int r = 0; r < R; ++r) {
          const int32_t offset = 128 * qsum[b * M + r];
          isum[r] = add(isum[r], bytes4(&offset));
        }
      }
    }
    if constexpr (SPLIT)
      for (int r = 0; r < R; ++r) isum[r] = add(isum[r], isum2[r]);
    const F d = load_half(cb + CODES<BITS> + 2 * h), m = load_half(cb + CODES<BITS> + 32 + 2 * h);
    for (int r = 0; r < R; ++r) {
      const F s = mul(d, set1(da[b * M + r]));
      acc[r] = fmadd(s, to_float(isum[r]), acc[r]);
      acc[r] = fmadd(m, set1(sa[b * M + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * ldo + h, acc[r]);
  }
}

// R rows of one 16-column tile where the vectors hold 8 columns and there is no VNNI (AVX2): both halves of
// the tile in one pass over its blocks, so each row's activation broadcasts serve all 16 columns (`tile`
// walks the halves one after the other, broadcasting twice). Per column the same integer sums and the same
// float steps in the same order as `tile`: the same bits.
template <int R, int BITS>
inline void tile_halves(const uint8_t* blocks, const int8_t* qa, const float* da, const float* sa, const int32_t* qsum,
                        int64_t M, int64_t B, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  static_assert(R > 0 && LANES == 8 && !NATIVE_DOT, "the AVX2 path without VNNI");  // R: checked where instantiated
  F acc0[R], acc1[R];  // columns 0-7, 8-15
  for (int r = 0; r < R; ++r) acc0[r] = zero(), acc1[r] = zero();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* cb = blocks + b * STRIDE<BITS>;
    for (int i = 0; i < STRIDE<BITS>; i += 64) {  // as `tile` does: 8-bit codes into the second level only
      if (BITS == 4 && ahead.near) _mm_prefetch(reinterpret_cast<const char*>(cb + ahead.near + i), _MM_HINT_T0);
      if (ahead.far) _mm_prefetch(reinterpret_cast<const char*>(cb + ahead.far + i), _MM_HINT_T1);
    }
    I s0[R], s1[R];  // the block's integer sums (4-bit: pair sums in 16 bits, <= 8 * 3810, as in `tile`)
    if constexpr (BITS == 4) {
      for (int g = 0; g < 4; ++g) {
        const I v0 = load_i(cb + g * 64), v1 = load_i(cb + g * 64 + 32);
        const I lo0 = low_nibbles(v0), hi0 = high_nibbles(v0), lo1 = low_nibbles(v1), hi1 = high_nibbles(v1);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = qa + (b * M + r) * 32 + 4 * g;
          const I al = bytes4(a), ah = bytes4(a + 16);
          const I t0 = add16(pairs16(lo0, al), pairs16(hi0, ah)), t1 = add16(pairs16(lo1, al), pairs16(hi1, ah));
          s0[r] = g == 0 ? t0 : add16(s0[r], t0);
          s1[r] = g == 0 ? t1 : add16(s1[r], t1);
          keep(s0[r]), keep(s1[r]);
        }
      }
      for (int r = 0; r < R; ++r) s0[r] = widen16(zero_i(), s0[r]), s1[r] = widen16(zero_i(), s1[r]);
    } else {  // sum (u - 128) qa by the sign trick (simd.h), then + 128 sum qa, as `tile`
      for (int g = 0; g < 8; ++g) {
        const I c0 = centered(load_i(cb + g * 64)), c1 = centered(load_i(cb + g * 64 + 32));
        const I mag0 = magnitude(c0), mag1 = magnitude(c1);
        for (int r = 0; r < R; ++r) {
          const I a = bytes4(qa + (b * M + r) * 32 + 4 * g);
          s0[r] = dot_centered(g == 0 ? zero_i() : s0[r], mag0, c0, a);
          s1[r] = dot_centered(g == 0 ? zero_i() : s1[r], mag1, c1, a);
          keep(s0[r]), keep(s1[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t offset = 128 * qsum[b * M + r];
        s0[r] = add(s0[r], bytes4(&offset)), s1[r] = add(s1[r], bytes4(&offset));
      }
    }
    const F d0 = load_half(cb + CODES<BITS>), d1 = load_half(cb + CODES<BITS> + 16);
    const F m0 = load_half(cb + CODES<BITS> + 32), m1 = load_half(cb + CODES<BITS> + 48);
    for (int r = 0; r < R; ++r) {
      const F dr = set1(da[b * M + r]), sr = set1(sa[b * M + r]);
      acc0[r] = fmadd(m0, sr, fmadd(mul(d0, dr), to_float(s0[r]), acc0[r]));
      acc1[r] = fmadd(m1, sr, fmadd(mul(d1, dr), to_float(s1[r]), acc1[r]));
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * ldo, acc0[r]), store(out + r * ldo + 8, acc1[r]);
}

// R rows of one tile: `tile_halves` where it applies, else `tile` (M: the call's rows, the stride of quantize_rows'
// block-major activations and scales)
template <int R, int BITS>
inline void rows(const uint8_t* c, const int8_t* qa, const float* da, const float* sa, const int32_t* qsum, int64_t M,
                 int64_t B, float* out, int64_t ldo, yggtree::Prefetch ahead) {
  // a one-row call (every plain step) with its stride a constant: the block loop's addressing as simple as
  // a row-major layout's (a runtime stride slowed one-row products: docs/results.md section 14)
  if constexpr (LANES == 8 && !NATIVE_DOT) {
    if (M == 1)
      tile_halves<R, BITS>(c, qa, da, sa, qsum, 1, B, out, ldo, ahead);
    else
      tile_halves<R, BITS>(c, qa, da, sa, qsum, M, B, out, ldo, ahead);
  } else {
    if (M == 1)
      tile<R, BITS>(c, qa, da, sa, qsum, 1, B, out, ldo, ahead);
    else
      tile<R, BITS>(c, qa, da, sa, qsum, M, B, out, ldo, ahead);
  }
}

template <int BITS>
void run(const uint8_t* bp, const int8_t* q, const float* dap, const float* sap, const int32_t* qsp, int64_t M,
         int64_t K, int64_t T, int64_t B, float* op) {
  const int64_t N = 16 * T;
  const yggtree::Prefetch pf = yggtree::prefetch_distances();
  yggtree::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* c = bp + t * B * STRIDE<BITS>;
      // rows in groups of 8 (where the registers hold them), 4, 3, 2, 1: a group shares every code block it
      // unpacks (three rows as one group, not two and one: a verify step of a chain of two)
      int64_t r = 0;
      if constexpr (WIDE >= 8)
        for (; r + 8 <= M; r += 8)
          rows<8, BITS>(c, q + r * 32, dap + r, sap + r, qsp + r, M, B, op + r * N + 16 * t, N, pf);
      for (; r + 4 <= M; r += 4)
        rows<4, BITS>(c, q + r * 32, dap + r, sap + r, qsp + r, M, B, op + r * N + 16 * t, N, pf);
      if (r + 3 == M) {
        rows<3, BITS>(c, q + r * 32, dap + r, sap + r, qsp + r, M, B, op + r * N + 16 * t, N, pf);
        r = M;
      }
      for (; r + 2 <= M; r += 2)
        rows<2, BITS>(c, q + r * 32, dap + r, sap + r, qsp + r, M, B, op + r * N + 16 * t, N, pf);
      for (; r < M; ++r)
        rows<1, BITS>(c, q + r * 32, dap + r, sap + r, qsp + r, M, B, op + r * N + 16 * t, N, pf);
    }
  });
}

}  // namespace

// x [M, K] float32; blocks [T, K / 32, 320 | 576] uint8 (see the header) -> out [M, 16 T] float32 (ops.cpp checks)
void yggtree::w4a8_mm(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t T, int64_t stride,
                      float* out) {
  const int64_t B = K / 32;
  // the quantized activations live in the calling thread's scratch (no allocation per product;
  // the parallel tiles only read them)
  static thread_local std::vector<int8_t> qa_buf;
  static thread_local std::vector<float> da_buf, sa_buf;
  static thread_local std::vector<int32_t> qsum_buf;
  if (static_cast<int64_t>(qa_buf.size()) < M * K) qa_buf.resize(M * K);
  if (static_cast<int64_t>(da_buf.size()) < M * B) da_buf.resize(M * B), sa_buf.resize(M * B), qsum_buf.resize(M * B);
  int8_t* qa = qa_buf.data();
  float *da = da_buf.data(), *sa = sa_buf.data();
  int32_t* qsum = qsum_buf.data();
  quantize_rows(x, M, K, qa, da, sa, qsum);
  if (stride == STRIDE<4>)
    run<4>(blocks, qa, da, sa, qsum, M, K, T, B, out);
  else
    run<8>(blocks, qa, da, sa, qsum, M, K, T, B, out);
}
