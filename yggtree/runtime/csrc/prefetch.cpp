// yggtree::prefetch_distance (csrc/prefetch.h) and the op that sets it.
#include "prefetch.h"

#include <torch/library.h>

#include <atomic>

namespace yggtree {
namespace {
constexpr int64_t DEFAULT_DISTANCE = 1024;  // before any is set (measured on the first CPU, docs/results.md)
constexpr int64_t MAX_DISTANCE = 1 << 20;
std::atomic<int64_t> distance{DEFAULT_DISTANCE};

// prefetch(bytes): the kernels fetch `bytes` ahead from now on (0: no software prefetch); bytes < 0 changes
// nothing. Returns the distance before the call. A setting of the process, as torch's thread count is
int64_t prefetch(int64_t bytes) {
  if (bytes < 0) return distance.load(std::memory_order_relaxed);
  TORCH_CHECK(bytes <= MAX_DISTANCE && bytes % 64 == 0, "prefetch: the distance must be a multiple of 64 bytes up to ",
              MAX_DISTANCE, ", got ", bytes);
  return distance.exchange(bytes, std::memory_order_relaxed);
}
}  // namespace

int64_t prefetch_distance() { return distance.load(std::memory_order_relaxed); }
}  // namespace yggtree

TORCH_LIBRARY_FRAGMENT(yggtree, lib) { lib.def("prefetch(int bytes) -> int", &yggtree::prefetch); }
