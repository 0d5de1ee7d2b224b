// yggtree::rows_attention -- attention of W query rows, each computed on its own, over the two
// parts runtime/model.py's _rows_attention defines (built with w4a8.cpp into one library by
// runtime/w4a8.py; models in the w4a8 format use it, runtime/quant.py):
//
//   part 1: the slots a row reads in place, head[b, r, s] true, s < C, in slot order;
//   part 2: its window, window[b, r, t] >= 0, t < T, in window order (its last T visible slots).
//
// For query head h (KV head h / G) of row r: scores s_j = (q . k_j) * (1 / sqrt(D)) over the
// visible slots only (part 1, then part 2), m = max_j s_j, p_j = exp(s_j - m),
// out = (sum_part1 p_j v_j + sum_part2 p_j v_j) / (sum_part1 p_j + sum_part2 p_j).
// Every sum runs in a fixed order over the row's own visible slots (the dot product over D in
// 16-wide chunks then a fixed lane reduction; the others slot by slot, 16 lanes at a time for the
// probabilities' sums), so a row's result depends neither on the call's other rows nor on the
// bucket C nor on the thread count; a tree node and the plain step at its position see the same
// part 1 and the same window values, hence the same bits. Work is proportional to the visible
// slots, not to the context bucket. float32 only; D a multiple of 16, at most 256.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

// e^x for 16 floats <= 0 (the scores minus their maximum): 2^n e^r with n = round(x log2 e) and
// r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf polynomial; below -104 the result is 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// sum of n floats: 16 lanes slot by slot (a masked tail adds zeros), then the lanes in a fixed order
inline float sum_of(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + j));
  if (j < n) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - j)) - 1), x + j));
  return _mm512_reduce_add_ps(acc);
}

constexpr int MAX_CHUNKS = 16;  // D <= 256

at::Tensor rows_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& head_in, const at::Tensor& window_in) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "rows_attention: q must be [B, W, H, D] float32");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              k.stride(3) == 1 && v.stride(3) == 1, "rows_attention: k and v must be [B, C, Hkv, D] float32, D contiguous");
  const int64_t B = q_in.size(0), W = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t C = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0, "rows_attention: q and k/v shapes differ");
  TORCH_CHECK(D % 16 == 0 && D <= 16 * MAX_CHUNKS, "rows_attention: head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(head_in.scalar_type() == at::kBool && head_in.dim() == 3 && head_in.size(0) == B && head_in.size(1) == W &&
              head_in.size(2) == C, "rows_attention: head must be [B, W, C] bool");
  TORCH_CHECK(window_in.scalar_type() == at::kLong && window_in.dim() == 3 && window_in.size(0) == B &&
              window_in.size(1) == W, "rows_attention: window must be [B, W, T] int64");
  const at::Tensor q = q_in.contiguous(), head = head_in.contiguous(), window = window_in.contiguous();
  const int64_t T = window.size(2), G = H / Hkv, nd = D / 16;
  auto out = at::empty({B, W, H * D}, q.options());
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* hp = head.data_ptr<bool>();
  const int64_t* wp = window.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, B * W * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(C + T);
    std::vector<int64_t> slot(C + T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (W * H), r = (i / H) % W, h = i % H, g = h / G;
      __m512 qv[MAX_CHUNKS];
      for (int64_t c = 0; c < nd; ++c) qv[c] = _mm512_loadu_ps(qp + ((b * W + r) * H + h) * D + 16 * c);
      const float* kb = kp + b * ks0 + g * ks2;
      const float* vb = vp + b * vs0 + g * vs2;
      auto score = [&](int64_t s) {
        const float* kr = kb + s * ks1;
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int64_t c = 1; c < nd; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
        return _mm512_reduce_add_ps(acc) * scale;
      };
      int64_t n = 0;
      const bool* hm = hp + (b * W + r) * C;
      for (int64_t s = 0; s < C; ++s)
        if (hm[s]) slot[n] = s, sc[n++] = score(s);
      const int64_t n1 = n;
      const int64_t* win = wp + (b * W + r) * T;
      for (int64_t t = 0; t < T; ++t)
        if (win[t] >= 0) slot[n] = win[t], sc[n++] = score(win[t]);
      float* o = op + (b * W + r) * H * D + h * D;
      if (n == 0) {  // a row that sees nothing (never in a decode step): zeros
        for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_setzero_ps());
        continue;
      }
      float m = sc[0];
      for (int64_t j = 1; j < n; ++j) m = sc[j] > m ? sc[j] : m;
      const __m512 mv = _mm512_set1_ps(m);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) _mm512_storeu_ps(sc.data() + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + j), mv)));
      if (j < n) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(sc.data() + j, tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc.data() + j), mv)));
      }
      const float total = sum_of(sc.data(), n1) + sum_of(sc.data() + n1, n - n1);
      __m512 a1[MAX_CHUNKS], a2[MAX_CHUNKS];
      for (int64_t c = 0; c < nd; ++c) a1[c] = _mm512_setzero_ps(), a2[c] = _mm512_setzero_ps();
      for (int64_t jj = 0; jj < n1; ++jj) {
        const __m512 p = _mm512_set1_ps(sc[jj]);
        const float* vr = vb + slot[jj] * vs1;
        for (int64_t c = 0; c < nd; ++c) a1[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), a1[c]);
      }
      for (int64_t jj = n1; jj < n; ++jj) {
        const __m512 p = _mm512_set1_ps(sc[jj]);
        const float* vr = vb + slot[jj] * vs1;
        for (int64_t c = 0; c < nd; ++c) a2[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), a2[c]);
      }
      const __m512 tv = _mm512_set1_ps(total);
      for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(_mm512_add_ps(a1[c], a2[c]), tv));
    }
  });
  return out;
}

}  // namespace

// The op's C shim, for AOTInductor packages (see aoti_torch_cpu_w4a8_mm in w4a8.cpp)
extern "C" AOTITorchError aoti_torch_cpu_rows_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                        AtenTensorHandle head, AtenTensorHandle window,
                                                        AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = rows_attention(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                    *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(head),
                                    *tensor_handle_to_tensor_pointer(window));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

TORCH_LIBRARY_FRAGMENT(yggtree, lib) {
  lib.def("rows_attention(Tensor q, Tensor k, Tensor v, Tensor head, Tensor window) -> Tensor");
}
TORCH_LIBRARY_IMPL(yggtree, CPU, lib) {
  lib.impl("rows_attention", &rows_attention);
}
