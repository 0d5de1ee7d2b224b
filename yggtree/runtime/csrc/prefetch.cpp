// yggtree::prefetch_distances (csrc/prefetch.h): the distances the kernels prefetch at, a setting of the process
// (csrc/ops.cpp's yggtree::prefetch op checks and sets them).
#include "prefetch.h"

#include <atomic>

namespace yggtree {
namespace {
constexpr int64_t DEFAULT_NEAR = 1024, DEFAULT_FAR = 0;  // before any is set (the profile measures them per machine)
std::atomic<int64_t> near_bytes{DEFAULT_NEAR}, far_bytes{DEFAULT_FAR};
}  // namespace

Prefetch prefetch_distances() {
  return {near_bytes.load(std::memory_order_relaxed), far_bytes.load(std::memory_order_relaxed)};
}

void set_prefetch_distances(Prefetch to) {
  near_bytes.store(to.near, std::memory_order_relaxed);
  far_bytes.store(to.far, std::memory_order_relaxed);
}
}  // namespace yggtree
