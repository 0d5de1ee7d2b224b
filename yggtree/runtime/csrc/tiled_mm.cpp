// yggtree::tiled_mm -- float32, bfloat16 or int8 weights in tiles of 16 output columns times
// float32 activations on AVX-512 (runtime/tiled.py builds this file with the kernel library and
// documents the format).
//
// Weight w [T, K, 16]: tile t holds output columns 16t..16t+15, one 16-wide row per input
// column k, so a tile is one contiguous stream; float32, bfloat16 (widened exactly to float32)
// or int8 (converted exactly), times an optional per-column scale [T, 16] float32 applied once
// at the end. For row r and column n = 16t + l:
//   y[r, n] = ((sum over even k of x[r, k] w[t, k, l]) + (sum over odd k ...)) * scale[t, l]
// each partial sum accumulated in k order with fused multiply-adds in float32. Every float step
// is per row and per output column in a fixed order, so a row's result does not depend on the
// call's other rows nor on the thread count (tiles are split across threads whole): speculation
// verifying W rows computes each row bitwise as a plain step does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

#ifndef TILED_PREFETCH
#define TILED_PREFETCH 1024  // bytes of weights fetched ahead of the row being read
#endif

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen(const at::BFloat16* p) {  // bfloat16 -> float32: the 16 bits on top, exact
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// R rows of one tile: x rows at stride ldx, results at stride ldo
template <int R, typename W>
inline void tile(const W* w, const float* scale, const float* x, int64_t K, int64_t ldx, float* out, int64_t ldo) {
  constexpr int BYTES = 32 * sizeof(W);  // weight bytes of one step of two k
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = _mm512_setzero_ps(), odd[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const char* ahead = reinterpret_cast<const char*>(w + k * 16) + TILED_PREFETCH;
    for (int b = 0; b < BYTES; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    const __m512 w0 = widen(w + k * 16), w1 = widen(w + (k + 1) * 16);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 1]), w1, odd[r]);
    }
  }
  if (k < K) {
    const __m512 w0 = widen(w + k * 16);
    for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, even[r]);
  }
  const __m512 s = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.f);
  for (int r = 0; r < R; ++r) {
    __m512 y = _mm512_add_ps(even[r], odd[r]);
    if (scale) y = _mm512_mul_ps(y, s);
    _mm512_storeu_ps(out + r * ldo, y);
  }
}

template <typename W>
void run(const W* wp, const float* sp, const float* x, int64_t M, int64_t K, int64_t T, float* op) {
  const int64_t N = 16 * T;
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const W* w = wp + t * K * 16;
      const float* s = sp ? sp + t * 16 : nullptr;
      // rows in groups of 8, 4, 2, 1: a group reads each weight once (the tile stays in cache for
      // the next group)
      int64_t r = 0;
      for (; r + 8 <= M; r += 8) tile<8>(w, s, x + r * K, K, K, op + r * N + 16 * t, N);
      for (; r + 4 <= M; r += 4) tile<4>(w, s, x + r * K, K, K, op + r * N + 16 * t, N);
      for (; r + 2 <= M; r += 2) tile<2>(w, s, x + r * K, K, K, op + r * N + 16 * t, N);
      for (; r < M; ++r) tile<1>(w, s, x + r * K, K, K, op + r * N + 16 * t, N);
    }
  });
}

// x [M, K] float32; w [T, K, 16] float32 | bfloat16 | int8; scale [T, 16] float32, or empty for
// none (int8 needs one) -> [M, 16 T] float32
at::Tensor tiled_mm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "tiled_mm: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.is_contiguous(), "tiled_mm: w must be a contiguous [T, K, 16]");
  const int64_t T = w.size(0), K = w.size(1);
  const bool scaled = scale.numel() > 0;
  TORCH_CHECK(!scaled || (scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                          scale.sizes() == at::IntArrayRef({T, 16})), "tiled_mm: scale must be [T, 16] float32 or empty");
  TORCH_CHECK(scaled || w.scalar_type() != at::kChar, "tiled_mm: int8 weights need a scale");
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.size(1) == K, "tiled_mm: x has ", x.size(1), " columns, the weight ", K);
  const int64_t M = x.size(0);
  auto out = at::empty({M, 16 * T}, x.options());
  const float* sp = scaled ? scale.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: run(w.data_ptr<float>(), sp, xp, M, K, T, op); break;
    case at::kBFloat16: run(w.data_ptr<at::BFloat16>(), sp, xp, M, K, T, op); break;
    case at::kChar: run(w.data_ptr<int8_t>(), sp, xp, M, K, T, op); break;
    default: TORCH_CHECK(false, "tiled_mm: w must be float32, bfloat16 or int8, got ", w.scalar_type());
  }
  return out;
}

}  // namespace

// The op's C shim (see csrc/w4a8.cpp): AOTInductor packages call the kernel here directly
extern "C" AOTITorchError aoti_torch_cpu_tiled_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle scale,
                                                  AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = tiled_mm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w),
                              *tensor_handle_to_tensor_pointer(scale));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

TORCH_LIBRARY_FRAGMENT(yggtree, lib) { lib.def("tiled_mm(Tensor x, Tensor w, Tensor scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(yggtree, CPU, lib) { lib.impl("tiled_mm", &tiled_mm); }
