// w4a8: 4-bit weights (per 32-wide K block: scale d, offset m, w = d * q + m, q in 0..15) times
// activations quantized per row and 32-wide block to int8 (a ~= da * qa, |qa| <= 127), summed in
// int32 by AVX512-VNNI (vpdpbusd: u8 x s8), the blocks' partial sums scaled and added in float32 in
// block order. A row's result does not depend on the other rows of the call (integer sums are
// exact; the float steps are per row, in a fixed order): batch-invariant by construction.
//
// Packed weights, per tile of 16 output columns t and K block b (T = N / 16, B = K / 32):
//   nib [T, B, 4, 16, 4] uint8: byte (g, lane, i) = q[16t + lane][32b + 4g + i]
//                                 | q[16t + lane][32b + 16 + 4g + i] << 4
//   d, m [T, B, 16] float16 (GGUF stores them so: exact)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

namespace {

// per row r and block b: qa [M, K] int8, da / sa [M, B] float (sa = da * sum(qa) over the block)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qa, float* da, float* sa) {
  const int64_t B = K / 32;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + r * K + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int>(std::nearbyint(xb[i] * inv));
        qa[r * K + b * 32 + i] = static_cast<int8_t>(q);
        sum += q;
      }
      da[r * B + b] = d;
      sa[r * B + b] = d * static_cast<float>(sum);
    }
  }
}

template <int R>
inline void tile_rows(const uint8_t* nib, const at::Half* dw, const at::Half* mw, const int8_t* qa, const float* da,
                      const float* sa, int64_t K, int64_t B, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    const uint8_t* nb = nib + b * 256;
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(nb + g * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = qa + r * K + b * 32 + 4 * g;
        int32_t alo, ahi;
        std::memcpy(&alo, a, 4);
        std::memcpy(&ahi, a + 16, 4);
        isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(alo));
        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(ahi));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw + b * 16)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mw + b * 16)));
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(da[r * B + b]));
      acc[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sa[r * B + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

}  // namespace

// x [M, K] float32 contiguous; nib [T, B, 256] uint8; d, m [T, B, 16] float16 -> [M, 16 T] float32
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor nib, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), T = nib.size(0), B = nib.size(1);
  TORCH_CHECK(K == 32 * B && nib.size(2) == 256, "K must be 32 x the weight's blocks");
  auto out = torch::empty({M, 16 * T}, x.options());
  auto qa = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto da = torch::empty({M, B}, x.options());
  auto sa = torch::empty({M, B}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, qa.data_ptr<int8_t>(), da.data_ptr<float>(), sa.data_ptr<float>());
  const uint8_t* nbp = nib.data_ptr<uint8_t>();
  const at::Half *dp = d.data_ptr<at::Half>(), *mp = m.data_ptr<at::Half>();
  const int8_t* q = qa.data_ptr<int8_t>();
  const float *dap = da.data_ptr<float>(), *sap = sa.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t N = 16 * T;
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* nb = nbp + t * B * 256;
      const at::Half* dw = dp + t * B * 16;
      const at::Half* mw = mp + t * B * 16;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4)
        tile_rows<4>(nb, dw, mw, q + r * K, dap + r * B, sap + r * B, K, B, op + r * N + 16 * t, N);
      for (; r < M; ++r)
        tile_rows<1>(nb, dw, mw, q + r * K, dap + r * B, sap + r * B, K, B, op + r * N + 16 * t, N);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { mod.def("w4a8_mm", &w4a8_mm); }
