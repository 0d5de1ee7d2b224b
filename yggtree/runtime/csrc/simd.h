// The kernel library's vectors, one implementation per instruction set it is built for (runtime/kernels.py
// picks the set from the CPU's features and compiles every source with its flags):
//
//   AVX-512 (F, BW, VL): LANES = 16 (one zmm register); with AVX512-VNNI the integer dot products are single
//                        instructions (vpdpbusd, vpdpwssd), without it two (vpmaddubsw / vpmaddwd + an add);
//   AVX2 + FMA + F16C:   LANES = 8 (one ymm register); with AVX-VNNI the dot products are the VEX-encoded
//                        vpdpbusd / vpdpwssd, without it vpmaddubsw / vpmaddwd + an add.
//
// The kernels keep their layouts (tiles of 16 output columns, 64-byte code lines) and walk a tile's columns
// LANES at a time, so packed weights are the same on every instruction set. Every operation is lane-wise
// except the reductions, which run in a fixed order; a kernel written on these functions computes each row
// in an order that does not depend on the call's other rows. Integer sums are exact on every set; float
// sums over a vector's lanes (reduce_add, LANES-wide partial sums) round per set, the same on every call.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace yggtree::simd {

#if defined(__AVX512F__)
constexpr int LANES = 16;  // float32 / int32 lanes of a vector
constexpr int REGISTERS = 32;  // vector registers: how many rows a kernel keeps in flight
struct F { __m512 v; };   // 16 float32
struct I { __m512i v; };  // 16 int32 lanes (64 bytes)

inline F zero() { return {_mm512_setzero_ps()}; }
inline F set1(float x) { return {_mm512_set1_ps(x)}; }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F load(const uint16_t* bf16) {  // bfloat16 -> float32: the 16 bits on top, exact
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
}
inline F load_half(const void* f16) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f16)))}; }
// the first n (0..LANES) floats at p, the other lanes `fill`
inline F load_n(const float* p, int n, float fill = 0.f) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), m, p)};
}
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline void store_n(float* p, F a, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a.v); }
inline F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F abs(F a) { return {_mm512_abs_ps(a.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a b + c, one rounding
inline F fnmadd(F a, F b, F c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b, one rounding
inline F round_even(F a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline F scalef(F p, F n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p 2^n, n integral
// the lanes' sum: halves of what is left, in a fixed order (the one of GCC's _mm512_reduce_add_ps, spelled
// out so that reduce_add_each below reproduces it whatever the compiler's header does)
inline float reduce_add(F a) {
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)),
                                 _mm512_castps512_ps256(a.v));
  __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
// lane i: reduce_add(a[i]), bit for bit (every add is one of reduce_add's, on the same two values), for
// LANES vectors at once: 15 adds and 30 shuffles instead of 16 reductions' 64 adds and shuffles
inline F reduce_add_each(const F* a) {
  __m512 x[8], y[4], z[2];
  // the inputs' order makes lane i come out of a[i] (the steps below transpose 4 x 4)
  auto in = [&](int m) { return a[(m % 4) * 4 + m / 4].v; };
  for (int i = 0; i < 8; ++i)  // 16 -> 8 lanes each: [a lanes 0-7 + 8-15, b's]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in(2 * i), in(2 * i + 1), 0x44),
                         _mm512_shuffle_f32x4(in(2 * i), in(2 * i + 1), 0xEE));
  for (int i = 0; i < 4; ++i)  // 8 -> 4: one 128-bit block a vector
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // 4 -> 2: lanes 0 + 2, 1 + 3 of each block
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD))};  // 2 -> 1
}
inline float reduce_max(F a) { return _mm512_reduce_max_ps(a.v); }
// bit i: byte i of the 64 at p is not zero (a bool mask's 64 entries)
inline uint64_t nonzero_bytes(const void* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return _mm512_test_epi8_mask(v, v);
}
// float32 -> bfloat16, nearest even (NaN stays a quiet NaN): LANES values at p
inline void store_bf16(uint16_t* p, F a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

inline I zero_i() { return {_mm512_setzero_si512()}; }
inline I load_i(const void* p) { return {_mm512_loadu_si512(p)}; }
inline I bytes4(const void* p) {  // the 4 bytes at p in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
inline I widen_i8(const void* p) { return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline I add(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
template <int S> inline I shl32(I a) { return {_mm512_slli_epi32(a.v, S)}; }
inline I low_nibbles(I a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline I high_nibbles(I a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }
inline F to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I to_int(F a) { return {_mm512_cvtps_epi32(a.v)}; }  // nearest even (the default rounding mode)
inline int32_t reduce_add(I a) { return _mm512_reduce_add_epi32(a.v); }
// LANES int32 -> LANES int16 / int8, saturated
inline void store_i16(int16_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(a.v)); }
inline void store_i8(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a.v)); }
#if defined(__AVX512VNNI__)
inline I dpwssd(I acc, I a, I b) { return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)}; }
inline I dpbusd(I acc, I u, I s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
#else
inline I dpwssd(I acc, I a, I b) { return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(a.v, b.v))}; }
inline I dpbusd(I acc, I u, I s) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(u.v, s.v), _mm512_set1_epi16(1)))};
}
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int LANES = 8;
constexpr int REGISTERS = 16;
struct F { __m256 v; };   // 8 float32
struct I { __m256i v; };  // 8 int32 lanes (32 bytes)

inline F zero() { return {_mm256_setzero_ps()}; }
inline F set1(float x) { return {_mm256_set1_ps(x)}; }
inline F load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline F load(const uint16_t* bf16) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16))};
}
inline F load_half(const void* f16) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f16)))}; }
inline F load_n(const float* p, int n, float fill = 0.f) {
  alignas(32) float buf[LANES];
  for (int i = 0; i < LANES; ++i) buf[i] = i < n ? p[i] : fill;
  return load(buf);
}
inline void store(float* p, F a) { _mm256_storeu_ps(p, a.v); }
inline void store_n(float* p, F a, int n) {
  alignas(32) float buf[LANES];
  store(buf, a);
  std::memcpy(p, buf, sizeof(float) * n);
}
inline F add(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F abs(F a) { return {_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)))}; }
inline F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline F fnmadd(F a, F b, F c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline F round_even(F a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// p 2^n for integral n in -252..252, rounded once as vscalefps does: 2^n in two normal factors 2^h 2^(n-h)
// (h = floor(n / 2)); p 2^h is exact wherever it stays normal, which holds for the |p| ~ 1 the kernels scale
inline __m256 pow2(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }
inline F scalef(F p, F n) {
  const __m256i e = _mm256_cvtps_epi32(n.v), h = _mm256_srai_epi32(e, 1);
  return {_mm256_mul_ps(_mm256_mul_ps(p.v, pow2(h)), pow2(_mm256_sub_epi32(e, h)))};
}
inline float reduce_add(F a) {  // halves of what is left, in a fixed order
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
// lane i: reduce_add(a[i]), bit for bit (every add is one of reduce_add's, on the same two values)
inline F reduce_add_each(const F* a) {
  __m256 x[4], y[2];
  // the inputs' order makes lane i come out of a[i]
  auto in = [&](int m) { return a[(m % 2) * 4 + m / 2].v; };
  for (int i = 0; i < 4; ++i)  // 8 -> 4 lanes each: [a's halves added, b's]
    x[i] = _mm256_add_ps(_mm256_permute2f128_ps(in(2 * i), in(2 * i + 1), 0x20),
                         _mm256_permute2f128_ps(in(2 * i), in(2 * i + 1), 0x31));
  for (int i = 0; i < 2; ++i)  // 4 -> 2: lanes 0 + 2, 1 + 3
    y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  return {_mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88), _mm256_shuffle_ps(y[0], y[1], 0xDD))};  // 2 -> 1
}
inline float reduce_max(F a) {
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline uint64_t nonzero_bytes(const void* p) {
  const __m256i z = _mm256_setzero_si256();
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + 1);
  const uint64_t zl = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, z)));
  const uint64_t zh = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, z)));
  return ~(zl | zh << 32);
}
inline void store_bf16(uint16_t* p, F a) {  // nearest even; NaN -> 0x7FC0
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)));
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}

inline I zero_i() { return {_mm256_setzero_si256()}; }
inline I load_i(const void* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
inline I bytes4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm256_set1_epi32(v)};
}
inline I widen_i8(const void* p) { return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline I add(I a, I b) { return {_mm256_add_epi32(a.v, b.v)}; }
template <int S> inline I shl32(I a) { return {_mm256_slli_epi32(a.v, S)}; }
inline I low_nibbles(I a) { return {_mm256_and_si256(a.v, _mm256_set1_epi8(0x0F))}; }
inline I high_nibbles(I a) { return {_mm256_and_si256(_mm256_srli_epi16(a.v, 4), _mm256_set1_epi8(0x0F))}; }
inline F to_float(I a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline I to_int(F a) { return {_mm256_cvtps_epi32(a.v)}; }
inline int32_t reduce_add(I a) {
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(a.v), _mm256_extracti128_si256(a.v, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
  return _mm_cvtsi128_si32(q);
}
inline __m128i packs16(I a) { return _mm_packs_epi32(_mm256_castsi256_si128(a.v), _mm256_extracti128_si256(a.v, 1)); }
inline void store_i16(int16_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packs16(a)); }
inline void store_i8(int8_t* p, I a) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(packs16(a), packs16(a))); }
#if defined(__AVXVNNI__)
inline I dpwssd(I acc, I a, I b) { return {_mm256_dpwssd_avx_epi32(acc.v, a.v, b.v)}; }
inline I dpbusd(I acc, I u, I s) { return {_mm256_dpbusd_avx_epi32(acc.v, u.v, s.v)}; }
#else
inline I dpwssd(I acc, I a, I b) { return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(a.v, b.v))}; }
inline I dpbusd(I acc, I u, I s) {
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(_mm256_maddubs_epi16(u.v, s.v), _mm256_set1_epi16(1)))};
}
#endif

#else
#error "yggtree's kernel library needs AVX-512 (F, BW, VL) or AVX2 with FMA and F16C"
#endif

// Where there is no VNNI, byte products are summed in 16 bits first (vpmaddubsw's pairs, then adds: exact
// while the caller keeps every partial sum within int16), then widened once (vpmaddwd by 1): a third of the
// instructions of one dpbusd a product group. NATIVE_DOT: the CPU sums four byte products into int32 in one.
#if defined(__AVX512VNNI__) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
constexpr bool NATIVE_DOT = true;
#else
constexpr bool NATIVE_DOT = false;
#endif
// 8-bit codes u (0..255) times signed bytes s (|s| <= 127) without VNNI: c = u - 128 (as a signed byte) times s,
// |c| times s with c's sign (never overflowing: |c| <= 128, a pair <= 32512 fits vpmaddubsw); the caller adds
// 128 sum(s). centered(u) = c, magnitude(c) = |c| (unsigned), dot_centered(acc, |c|, c, s) = acc + sum c s.
#if defined(__AVX512F__)
inline I pairs16(I u, I s) { return {_mm512_maddubs_epi16(u.v, s.v)}; }  // u0 s0 + u1 s1 per 16-bit lane
inline I add16(I a, I b) { return {_mm512_add_epi16(a.v, b.v)}; }
inline I widen16(I acc, I p) { return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p.v, _mm512_set1_epi16(1)))}; }
inline I centered(I u) { return {_mm512_xor_si512(u.v, _mm512_set1_epi8(char(0x80)))}; }
inline I magnitude(I c) { return {_mm512_abs_epi8(c.v)}; }
inline I dot_centered(I acc, I mag, I c, I s) {
  const __m512i z = _mm512_setzero_si512();  // s negated where c < 0, 0 where c == 0
  const __m512i t = _mm512_mask_sub_epi8(s.v, _mm512_movepi8_mask(c.v), z, s.v);
  return widen16(acc, pairs16(mag, I{_mm512_maskz_mov_epi8(_mm512_test_epi8_mask(c.v, c.v), t)}));
}
#else
inline I pairs16(I u, I s) { return {_mm256_maddubs_epi16(u.v, s.v)}; }
inline I add16(I a, I b) { return {_mm256_add_epi16(a.v, b.v)}; }
inline I widen16(I acc, I p) { return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(p.v, _mm256_set1_epi16(1)))}; }
inline I centered(I u) { return {_mm256_xor_si256(u.v, _mm256_set1_epi8(char(0x80)))}; }
inline I magnitude(I c) { return {_mm256_abs_epi8(c.v)}; }
inline I dot_centered(I acc, I mag, I c, I s) { return widen16(acc, pairs16(mag, I{_mm256_sign_epi8(s.v, c.v)})); }
#endif

// An opaque copy of a register: a sum written as a chain of adds stays that chain (the compiler may not
// reassociate integer adds through it into a tree whose partial sums outnumber the registers and spill)
inline void keep(I& a) { asm("" : "+x"(a.v)); }

// Integer dot products, per 32-bit lane, exact in int32:
//   dpwssd(acc, a, b):      acc + a0 b0 + a1 b1                 (16-bit a, b; never both -32768)
//   dpbusd(acc, u, s):      acc + u0 s0 + u1 s1 + u2 s2 + u3 s3 (unsigned bytes u, signed bytes s); without VNNI
//                           only where every pair u0 s0 + u1 s1 fits in int16 (vpmaddubsw saturates there):
//                           4-bit codes, or bytes times 4-bit codes (8-bit codes: dot_centered)

}  // namespace yggtree::simd
