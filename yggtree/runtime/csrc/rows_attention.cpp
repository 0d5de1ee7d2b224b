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
// LANES-wide chunks then a fixed lane reduction; the others slot by slot, LANES at a time for the
// probabilities' sums), so a row's result depends neither on the call's other rows nor on the
// bucket C nor on the thread count; a tree node and the plain step at its position see the same
// part 1 and the same window values, hence the same bits. Work is proportional to the visible
// slots, not to the context bucket. float32 or bfloat16 (q, K and V read as float32, every sum in
// float32, the output rounded to bfloat16 at the end: _rows_attention's .float() and .to(dtype)),
// or float32 q over a 16-bit cache (float16 or bfloat16 K and V, read as float32, exactly: a float32
// model's 16-bit KV cache); D a multiple of 16, at most 256.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "loops.h"
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include "simd.h"
#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

namespace {

using namespace yggtree::simd;

// e^x for LANES floats <= 0 (the scores minus their maximum): 2^n e^r with n = round(x log2 e) and
// r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf polynomial; below -104 the result is 0.
inline F exp_neg(F x) {
  x = max(x, set1(-104.f));
  const F n = round_even(mul(x, set1(1.44269504088896341f)));
  F r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  F p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));
  return scalef(p, n);
}

// sum of n floats: LANES lanes slot by slot (a tail adds zeros), then the lanes in a fixed order
inline float sum_of(const float* x, int64_t n) {
  F acc = zero();
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) acc = add(acc, load(x + j));
  if (j < n) acc = add(acc, load_n(x + j, int(n - j)));
  return reduce_add(acc);
}

// LANES values of q, K or V as float32, and LANES results stored in the model's dtype: bfloat16 is the
// high half of a float32; the store rounds to nearest even, as a tensor's .to(torch.bfloat16)
inline F load16(const float* p) { return load(p); }
inline F load16(const at::BFloat16* p) { return load(reinterpret_cast<const uint16_t*>(p)); }
inline F load16(const at::Half* p) { return load_half(p); }
inline void store16(float* p, F v) { store(p, v); }
inline void store16(at::BFloat16* p, F v) { store_bf16(reinterpret_cast<uint16_t*>(p), v); }

constexpr int MAX_CHUNKS = 16;  // D <= 256

// Scratch of one thread: the visible slots' scores and their slot numbers (reused across calls)
struct Scratch {
  std::vector<float> sc;
  std::vector<int64_t> slot;
};

// NG heads of one query row that share a KV head (see the header), with ND = D / 16 known at
// compile time so the queries and the weighted sums' accumulators stay in registers. Each head's
// arithmetic is what it would be alone, in the same order (the heads only share the loads of K
// and V rows and fill each other's latency), so the grouping changes no bit.
template <typename E, typename K, int ND, int NG>
void head_group(const E* qh, int64_t qs, const K* kb, const K* vb, int64_t ks1, int64_t vs1, const bool* hm,
                int64_t C, const int64_t* win, int64_t T, float scale, E* o, int64_t os, Scratch& buf) {
  constexpr int NC = ND * 16 / LANES;  // vectors a head's D = 16 ND values
  const int64_t cap = C + T;
  float* sc = buf.sc.data();  // [NG, C + T] scores, then probabilities
  int64_t* slot = buf.slot.data();
  F qv[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = load16(qh + g * qs + LANES * c);
  auto score = [&](int64_t s, int64_t j) {
    const K* kr = kb + s * ks1;
    F acc[NG];
    const F k0 = load16(kr);
    for (int g = 0; g < NG; ++g) acc[g] = mul(qv[g][0], k0);
    for (int c = 1; c < NC; ++c) {
      const F kc = load16(kr + LANES * c);
      for (int g = 0; g < NG; ++g) acc[g] = fmadd(qv[g][c], kc, acc[g]);
    }
    for (int g = 0; g < NG; ++g) sc[g * cap + j] = reduce_add(acc[g]) * scale;
  };
  // K and V rows are read in slot order, each KV head's slots one contiguous run (the cache is
  // head-major): the hardware prefetchers stream them (a software prefetch was slower on this
  // layout)
  int64_t n = 0;
  for (int64_t s = 0; s < C; ++s)
    if (hm[s]) slot[n] = s, score(s, n++);
  const int64_t n1 = n;
  for (int64_t t = 0; t < T; ++t)
    if (win[t] >= 0) slot[n] = win[t], score(win[t], n++);
  if (n == 0) {  // a row that sees nothing (never in a decode step): zeros
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < NC; ++c) store16(o + g * os + LANES * c, zero());
    return;
  }
  float total[NG];
  for (int g = 0; g < NG; ++g) {
    float* sg = sc + g * cap;
    F mx = set1(sg[0]);  // the maximum (exact in any order)
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) mx = max(mx, load(sg + j));
    if (j < n) mx = max(mx, load_n(sg + j, int(n - j), sg[0]));
    const F mv = set1(reduce_max(mx));
    for (j = 0; j + LANES <= n; j += LANES) store(sg + j, exp_neg(sub(load(sg + j), mv)));
    if (j < n) store_n(sg + j, exp_neg(sub(load_n(sg + j, int(n - j)), mv)), int(n - j));
    total[g] = sum_of(sg, n1) + sum_of(sg + n1, n - n1);
  }
  F a1[NG][NC], a2[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) a1[g][c] = zero(), a2[g][c] = zero();
  auto weigh = [&](F (&a)[NG][NC], int64_t jj) {
    const K* vr = vb + slot[jj] * vs1;
    for (int c = 0; c < NC; ++c) {
      const F vc = load16(vr + LANES * c);
      for (int g = 0; g < NG; ++g) a[g][c] = fmadd(set1(sc[g * cap + jj]), vc, a[g][c]);
    }
  };
  for (int64_t jj = 0; jj < n1; ++jj) weigh(a1, jj);
  for (int64_t jj = n1; jj < n; ++jj) weigh(a2, jj);
  for (int g = 0; g < NG; ++g) {
    const F tv = set1(total[g]);
    for (int c = 0; c < NC; ++c) store16(o + g * os + LANES * c, div(add(a1[g][c], a2[g][c]), tv));
  }
}

constexpr int MAX_GROUP = 4;  // heads computed together (a KV head's query heads, up to this many)

template <typename E, typename K>
using GroupFn = void (*)(const E*, int64_t, const K*, const K*, int64_t, int64_t, const bool*, int64_t, const int64_t*,
                         int64_t, float, E*, int64_t, Scratch&);

template <typename E, typename K, int ND, int... G>
constexpr std::array<GroupFn<E, K>, sizeof...(G)> group_fns(std::integer_sequence<int, G...>) {
  return {&head_group<E, K, ND, G + 1>...};
}

template <typename E, typename K, int... I>
constexpr std::array<std::array<GroupFn<E, K>, MAX_GROUP>, sizeof...(I)> all_fns(std::integer_sequence<int, I...>) {
  return {group_fns<E, K, I + 1>(std::make_integer_sequence<int, MAX_GROUP>{})...};
}

template <typename E, typename K>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& head, const at::Tensor& window,
         at::Tensor& out) {
  const int64_t B = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t C = k.size(1), Hkv = k.size(2), T = window.size(2), G = H / Hkv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const E* qp = q.data_ptr<E>();
  const K* kp = k.data_ptr<K>();
  const K* vp = v.data_ptr<K>();
  const bool* hp = head.data_ptr<bool>();
  const int64_t* wp = window.data_ptr<int64_t>();
  E* op = out.data_ptr<E>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  static constexpr auto fns = all_fns<E, K>(std::make_integer_sequence<int, MAX_CHUNKS>{});
  const auto& by_group = fns[D / 16 - 1];
  // Work items in (batch, KV head, row, query head of the group) order: a thread's share holds
  // whole KV heads where it can, so each reads its KV heads' K and V rows once from memory and
  // then from its cache for the other rows (in (row, head) order a W-row call had every thread
  // stream every KV head). Which thread computes a (row, head) changes no bit of it.
  yggtree::parallel_for(0, B * W * H, 1, [&](int64_t i0, int64_t i1) {
    static thread_local Scratch buf;
    if (static_cast<int64_t>(buf.slot.size()) < C + T) buf.sc.resize(MAX_GROUP * (C + T)), buf.slot.resize(C + T);
    for (int64_t i = i0; i < i1;) {  // this thread's heads, in runs that share a KV head
      const int64_t b = i / (W * H), g = (i / (W * G)) % Hkv, r = (i / G) % W, h = g * G + i % G;
      const int64_t ng = std::min<int64_t>({i1 - i, (g + 1) * G - h, MAX_GROUP});
      by_group[ng - 1](qp + ((b * W + r) * H + h) * D, D, kp + b * ks0 + g * ks2, vp + b * vs0 + g * vs2, ks1, vs1,
                       hp + (b * W + r) * C, C, wp + (b * W + r) * T, T, scale, op + (b * W + r) * H * D + h * D, D, buf);
      i += ng;
    }
  });
}

at::Tensor rows_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& head_in, const at::Tensor& window_in) {
  const auto dt = q_in.scalar_type();
  TORCH_CHECK(q_in.dim() == 4 && (dt == at::kFloat || dt == at::kBFloat16),
              "rows_attention: q must be [B, W, H, D] float32 or bfloat16");
  const auto kt = k.scalar_type();
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && v.scalar_type() == kt && k.stride(3) == 1 && v.stride(3) == 1 &&
              (kt == dt || (dt == at::kFloat && (kt == at::kHalf || kt == at::kBFloat16))),
              "rows_attention: k and v must be [B, C, Hkv, D], D contiguous, in q's dtype (or 16-bit under float32 q)");
  const int64_t B = q_in.size(0), W = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t C = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0, "rows_attention: q and k/v shapes differ");
  TORCH_CHECK(D % 16 == 0 && D <= 16 * MAX_CHUNKS, "rows_attention: head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(head_in.scalar_type() == at::kBool && head_in.dim() == 3 && head_in.size(0) == B && head_in.size(1) == W &&
              head_in.size(2) == C, "rows_attention: head must be [B, W, C] bool");
  TORCH_CHECK(window_in.scalar_type() == at::kLong && window_in.dim() == 3 && window_in.size(0) == B &&
              window_in.size(1) == W, "rows_attention: window must be [B, W, T] int64");
  const at::Tensor q = q_in.contiguous(), head = head_in.contiguous(), window = window_in.contiguous();
  auto out = at::empty({B, W, H * D}, q.options());
  if (dt == at::kBFloat16)
    run<at::BFloat16, at::BFloat16>(q, k, v, head, window, out);
  else if (kt == at::kHalf)
    run<float, at::Half>(q, k, v, head, window, out);
  else if (kt == at::kBFloat16)
    run<float, at::BFloat16>(q, k, v, head, window, out);
  else
    run<float, float>(q, k, v, head, window, out);
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
