// The kernel library's kernels as plain C++ (csrc/rows_attention.cpp, w4a8.cpp, tiled_mm.cpp): pointers, sizes and
// strides in, results written to a buffer the caller allocated. Nothing here includes torch: the kernels' sources
// compile without its headers (a few seconds of every source's compile), and csrc/ops.cpp alone turns tensors into
// these calls, checks them, and registers the ops and their AOTInductor shims.
#pragma once
#include <cstdint>
#include <vector>

namespace yggtree {

// 16-bit floats as they lie in memory (torch's bfloat16 and float16 tensors)
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
enum class Dtype { F32, BF16, F16 };

// rows_attention / tree_attention (csrc/rows_attention.cpp): q [B, W, H, D] and out [B, W, H D] contiguous, in
// `q_dtype` (F32 or BF16); k and v [B, C, Hkv, D] with the strides below (D contiguous), in `kv_dtype` (q's, or
// 16-bit under float32 q); head [B, W, C] bool and window [B, W, T] int64 contiguous
struct AttentionCall {
  const void* q;
  const void* k;
  const void* v;
  const bool* head;
  const int64_t* window;
  void* out;
  int64_t B, W, H, D, C, Hkv, T;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  Dtype q_dtype, kv_dtype;
};
bool attention_head_dim(int64_t D);                 // whether the library has kernels for head dim D
void attention(const AttentionCall& call, bool tree);  // tree: tree_attention's shared pass (same bits)

// w4a8_mm (csrc/w4a8.cpp): x [M, K] float32 contiguous, blocks [T, K / 32, stride] uint8 (W4A8_STRIDE4: 4-bit
// codes, W4A8_STRIDE8: 8-bit), out [M, 16 T] float32
constexpr int64_t W4A8_STRIDE4 = 320, W4A8_STRIDE8 = 576;  // bytes of a block of 16 columns: codes, 16 d, 16 m
void w4a8_mm(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t T, int64_t stride, float* out);

// tiled_mm (csrc/tiled_mm.cpp): x [M, K] float32 contiguous, out [M, 16 T] float32; w [T, K, 16] float32 or
// bfloat16 (scale null, or [T, 16] float32 per column), or [T, K2 / 2, 32] int8 (K2 = K or K + 1) with scale
// [T, 16] or [T, B, 16] float32 (B blocks of K2 / B inputs)
void tiled_mm_f32(const float* w, const float* scale, const float* x, int64_t M, int64_t K, int64_t T, float* out);
void tiled_mm_bf16(const BF16* w, const float* scale, const float* x, int64_t M, int64_t K, int64_t T, float* out);
void tiled_mm_i8(const int8_t* w, const float* scale, int64_t B, const float* x, int64_t M, int64_t K, int64_t K2,
                 int64_t T, float* out);
// tiled_q4_mm: blocks [T, B, S] uint8 (S bytes a block of G = K / B inputs; f16_scales: the block's 16 scales
// as float16, else float32)
void tiled_q4_mm(const uint8_t* blocks, int64_t S, bool f16_scales, const float* x, int64_t M, int64_t K, int64_t G,
                 int64_t T, float* out);

// rms_norm (csrc/rms_norm.cpp): x [M, K] float32 contiguous, weight [K] float32, out [M, K] float32
void rms_norm(const float* x, int64_t M, int64_t K, const float* weight, float eps, float* out);

// loop_pool (csrc/loops.cpp): the loops on a pool of n threads (n <= 1: on OpenMP), each loop split by the threads'
// speeds (balance) or equally; returns the previous setting {n, balance}
std::vector<int64_t> loop_pool(int64_t n, bool balance);

}  // namespace yggtree
