// The kernel library's ops (yggtree::w4a8_mm, rows_attention, tree_attention, tiled_mm, tiled_q4_mm, rms_norm, loop_pool,
// prefetch, attention_prefetch, w4a8_threads): each checks its tensors, allocates its result and calls its kernel (csrc/kernels.h),
// registered with torch, and the AOTInductor C shims of the products and attentions. The one source of the
// library that includes torch's headers (parsing them is most of a source's compile).
#include "kernels.h"
#include "loops.h"
#include "prefetch.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace {

using yggtree::Dtype;

// x [M, K] float32; blocks [T, K / 32, 320 | 576] uint8 (csrc/w4a8.cpp) -> [M, 16 T] float32
at::Tensor w4a8_mm(const at::Tensor& x_in, const at::Tensor& blocks) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "w4a8_mm: x must be [M, K] float32");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
              (blocks.size(2) == yggtree::W4A8_STRIDE4 || blocks.size(2) == yggtree::W4A8_STRIDE8),
              "w4a8_mm: blocks must be [T, B, 320 | 576] uint8");
  const int64_t T = blocks.size(0), B = blocks.size(1);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == 32 * B, "w4a8_mm: x has ", K, " columns, the weight ", 32 * B);
  auto out = at::empty({M, 16 * T}, x.options());
  yggtree::w4a8_mm(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), T, blocks.size(2), out.data_ptr<float>());
  return out;
}

// The threads the kernels' parallel loops run on: the calling thread's intra-op count on OpenMP (1 if the build
// lacked OpenMP: at::parallel_for then runs serially), the pool's while it is on (csrc/loops.cpp); the
// argument only selects the CPU kernel
int64_t w4a8_threads(const at::Tensor&) {
  std::mutex held;
  std::set<std::thread::id> seen;
  yggtree::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(held);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

Dtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? Dtype::BF16 : t.scalar_type() == at::kHalf ? Dtype::F16 : Dtype::F32;
}

// Both attentions' checks, then the kernel (csrc/rows_attention.cpp)
at::Tensor attention(const char* op, bool tree, const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& head_in, const at::Tensor& window_in) {
  const auto dt = q_in.scalar_type();
  TORCH_CHECK(q_in.dim() == 4 && (dt == at::kFloat || dt == at::kBFloat16), op,
              ": q must be [B, W, H, D] float32 or bfloat16");
  const auto kt = k.scalar_type();
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && v.scalar_type() == kt && k.stride(3) == 1 && v.stride(3) == 1 &&
              (kt == dt || (dt == at::kFloat && (kt == at::kHalf || kt == at::kBFloat16))),
              op, ": k and v must be [B, C, Hkv, D], D contiguous, in q's dtype (or 16-bit under float32 q)");
  const int64_t B = q_in.size(0), W = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t C = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0, op, ": q and k/v shapes differ");
  TORCH_CHECK(yggtree::attention_head_dim(D), op, ": the library has no kernel for head dim ", D);
  TORCH_CHECK(head_in.scalar_type() == at::kBool && head_in.dim() == 3 && head_in.size(0) == B && head_in.size(1) == W &&
              head_in.size(2) == C, op, ": head must be [B, W, C] bool");
  TORCH_CHECK(window_in.scalar_type() == at::kLong && window_in.dim() == 3 && window_in.size(0) == B &&
              window_in.size(1) == W, op, ": window must be [B, W, T] int64");
  const at::Tensor q = q_in.contiguous(), head = head_in.contiguous(), window = window_in.contiguous();
  auto out = at::empty({B, W, H * D}, q.options());
  const yggtree::AttentionCall call{q.data_ptr(), k.data_ptr(), v.data_ptr(), head.data_ptr<bool>(),
                                    window.data_ptr<int64_t>(), out.data_ptr(), B, W, H, D, C, Hkv, window.size(2),
                                    k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                                    dtype_of(q), dtype_of(k)};
  yggtree::attention(call, tree);
  return out;
}

at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& head,
                          const at::Tensor& window) {
  return attention("rows_attention", false, q, k, v, head, window);
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& head,
                          const at::Tensor& window) {
  return attention("tree_attention", true, q, k, v, head, window);
}

// x [M, K] float32; w: float32 | bfloat16 [T, K, 16] with scale [T, 16] or empty, or int8 [T, K2 / 2, 32]
// with scale [T, 16] or [T, B, 16] float32 (B dividing K2 into even groups) -> [M, 16 T] float32 (csrc/tiled_mm.cpp)
at::Tensor tiled_mm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "tiled_mm: x must be [M, K] float32");
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(w.dim() == 3 && w.size(2) == (int8 ? 32 : 16) && w.is_contiguous(),
              "tiled_mm: w must be a contiguous [T, K, 16] (float32, bfloat16) or [T, K / 2, 32] (int8)");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = w.size(0), M = x.size(0), K = x.size(1), K2 = int8 ? 2 * w.size(1) : w.size(1);
  TORCH_CHECK(int8 ? (K2 == K || K2 == K + 1) : K2 == K, "tiled_mm: x has ", K, " columns, the weight ", K2);
  const bool scaled = scale.numel() > 0;
  const int64_t B = scaled && scale.dim() == 3 ? scale.size(1) : 1;
  TORCH_CHECK(!scaled || (scale.scalar_type() == at::kFloat && scale.is_contiguous() && B > 0 && K2 % B == 0 &&
                          (K2 / B) % 2 == 0 && (scale.sizes() == at::IntArrayRef({T, 16}) ||
                                                (int8 && scale.sizes() == at::IntArrayRef({T, B, 16})))),
              "tiled_mm: scale must be [T, 16], or [T, B, 16] float32 with B dividing int8 weights' inputs into "
              "even groups, or empty");
  TORCH_CHECK(scaled || !int8, "tiled_mm: int8 weights need a scale");
  auto out = at::empty({M, 16 * T}, x.options());
  const float* sp = scaled ? scale.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: yggtree::tiled_mm_f32(w.data_ptr<float>(), sp, xp, M, K, T, op); break;
    case at::kBFloat16:
      yggtree::tiled_mm_bf16(static_cast<const yggtree::BF16*>(w.data_ptr()), sp, xp, M, K, T, op);
      break;
    case at::kChar: yggtree::tiled_mm_i8(w.data_ptr<int8_t>(), sp, B, xp, M, K, K2, T, op); break;
    default: TORCH_CHECK(false, "tiled_mm: w must be float32, bfloat16 or int8, got ", w.scalar_type());
  }
  return out;
}

// x [M, K] float32; blocks [T, K / G, 8 G + 32 e] uint8 (csrc/tiled_mm.cpp) -> [M, 16 T] float32
at::Tensor tiled_q4_mm(const at::Tensor& x_in, const at::Tensor& blocks) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "tiled_q4_mm: x must be [M, K] float32");
  const int64_t S = blocks.dim() == 3 ? blocks.size(2) : 0, e = S % 256 / 32;
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.size(1) > 0 &&
              (e == 2 || e == 4) && S > 32 * e && S - 32 * e <= 8 * 4096,
              "tiled_q4_mm: blocks must be a contiguous [T, K / G, 8 G + 32 e] uint8 (G a multiple of 32 up to 4096, "
              "e 2 or 4: float16 or float32 scales)");
  const int64_t T = blocks.size(0), B = blocks.size(1), G = (S - 32 * e) / 8, K = B * G;
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.size(1) == K, "tiled_q4_mm: x has ", x.size(1), " columns, the weight ", K);
  const int64_t M = x.size(0);
  auto out = at::empty({M, 16 * T}, x.options());
  yggtree::tiled_q4_mm(blocks.data_ptr<uint8_t>(), S, e == 2, x.data_ptr<float>(), M, K, G, T, out.data_ptr<float>());
  return out;
}

// x [..., K] float32, weight [K] float32 -> [..., K] float32: every row RMS-normalised and scaled (csrc/rms_norm.cpp)
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat, "rms_norm: x must be [..., K] float32");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(weight_in.dim() == 1 && weight_in.size(0) == K && weight_in.scalar_type() == at::kFloat,
              "rms_norm: weight must be [K] float32 with K = ", K);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  yggtree::rms_norm(x.data_ptr<float>(), K ? x.numel() / K : 0, K, weight.data_ptr<float>(), static_cast<float>(eps),
                    out.data_ptr<float>());
  return out;
}

constexpr int64_t MAX_DISTANCE = 1 << 20;
constexpr int64_t MAX_AHEAD_SLOTS = 1024;

void check_distance(int64_t bytes, const char* which) {
  TORCH_CHECK(bytes >= 0 && bytes <= MAX_DISTANCE && bytes % 64 == 0, "prefetch: the ", which,
              " distance must be a multiple of 64 bytes up to ", MAX_DISTANCE, ", got ", bytes);
}

// prefetch(near, far): the kernels fetch `near` bytes ahead into the first-level cache (0: not at all) and
// `far` bytes ahead into the second (0: not at all) from now on; near < 0 changes nothing (a query). Returns
// the distances before the call. A setting of the process, as torch's thread count is (csrc/prefetch.h)
std::vector<int64_t> prefetch(int64_t near, int64_t far) {
  const yggtree::Prefetch was = yggtree::prefetch_distances();
  if (near >= 0) {
    check_distance(near, "near");
    check_distance(far, "far");
    yggtree::set_prefetch_distances({near, far});
  }
  return {was.near, was.far};
}

// attention_prefetch(slots): the attentions fetch K and V rows `slots` ahead from now on (0: not at all); slots < 0
// changes nothing (a query). Returns the setting before the call (csrc/prefetch.h)
int64_t attention_prefetch(int64_t slots) {
  const int64_t was = yggtree::attention_ahead();
  if (slots >= 0) {
    TORCH_CHECK(slots <= MAX_AHEAD_SLOTS, "attention_prefetch: at most ", MAX_AHEAD_SLOTS, " slots ahead, got ", slots);
    yggtree::set_attention_ahead(slots);
  }
  return was;
}

}  // namespace

// The ops' C shims: AOTInductor packages compiled with them (runtime/aoti.py) call the kernels here directly
// instead of through the proxy executor, which boxes every call's arguments into a dispatcher stack at every
// call, and a decode step makes one call per product. The names are AOTInductor's for the ops' schema names
// (aoti_torch_<device>_<op>); runtime/kernels.py loads this library with global symbols so a package's
// reference resolves to it.
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

extern "C" AOTITorchError aoti_torch_cpu_w4a8_mm(AtenTensorHandle x, AtenTensorHandle blocks, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(w4a8_mm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(blocks)));
  });
}

template <at::Tensor (*Op)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
AOTITorchError attention_shim(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle head,
                              AtenTensorHandle window, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(Op(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                 *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(head),
                                 *tensor_handle_to_tensor_pointer(window)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_rows_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                        AtenTensorHandle head, AtenTensorHandle window,
                                                        AtenTensorHandle* ret0) {
  return attention_shim<rows_attention>(q, k, v, head, window, ret0);
}

extern "C" AOTITorchError aoti_torch_cpu_tree_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                        AtenTensorHandle head, AtenTensorHandle window,
                                                        AtenTensorHandle* ret0) {
  return attention_shim<tree_attention>(q, k, v, head, window, ret0);
}

extern "C" AOTITorchError aoti_torch_cpu_tiled_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle scale,
                                                  AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(tiled_mm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w),
                                       *tensor_handle_to_tensor_pointer(scale)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_tiled_q4_mm(AtenTensorHandle x, AtenTensorHandle blocks,
                                                     AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(tiled_q4_mm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(blocks)));
  });
}

TORCH_LIBRARY_FRAGMENT(yggtree, lib) {
  lib.def("w4a8_mm(Tensor x, Tensor blocks) -> Tensor");
  lib.def("w4a8_threads(Tensor any) -> int");
  lib.def("rows_attention(Tensor q, Tensor k, Tensor v, Tensor head, Tensor window) -> Tensor");
  lib.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor head, Tensor window) -> Tensor");
  lib.def("tiled_mm(Tensor x, Tensor w, Tensor scale) -> Tensor");
  lib.def("tiled_q4_mm(Tensor x, Tensor blocks) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("loop_pool(int threads, bool balance=True) -> int[]", &yggtree::loop_pool);
  lib.def("prefetch(int near, int far) -> int[]", &prefetch);
  lib.def("attention_prefetch(int slots) -> int", &attention_prefetch);
}
TORCH_LIBRARY_IMPL(yggtree, CPU, lib) {
  lib.impl("w4a8_mm", &w4a8_mm);
  lib.impl("w4a8_threads", &w4a8_threads);
  lib.impl("rows_attention", &rows_attention);
  lib.impl("tree_attention", &tree_attention);
  lib.impl("tiled_mm", &tiled_mm);
  lib.impl("tiled_q4_mm", &tiled_q4_mm);
  lib.impl("rms_norm", &rms_norm);
}
