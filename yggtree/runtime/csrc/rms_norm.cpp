// yggtree::rms_norm (csrc/kernels.h): a decode step's final RMS norm in one call (runtime/model.py's
// RMSNorm.native), where torch's eager ops take five, each paying its dispatch right after the step's weight
// stream has left the caches cold.
//
// Every row alone, in a fixed order: its squares summed in 16 partial sums over the columns (then the
// remainder, then the partial sums in order), scaled by 1 / sqrt(sum / K + eps), times the weight. A row's
// result so depends neither on the call's other rows nor on the thread count (it runs on the calling thread).
#include "kernels.h"

#include <cmath>

void yggtree::rms_norm(const float* x, int64_t M, int64_t K, const float* weight, float eps, float* out) {
  constexpr int P = 16;
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    float* o = out + r * K;
    float part[P] = {};
    int64_t k = 0;
    for (; k + P <= K; k += P)
      for (int j = 0; j < P; ++j) part[j] += xr[k + j] * xr[k + j];
    float sum = 0.0f;
    for (; k < K; ++k) sum += xr[k] * xr[k];
    for (int j = 0; j < P; ++j) sum += part[j];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
    for (k = 0; k < K; ++k) o[k] = weight[k] * (xr[k] * scale);
  }
}
