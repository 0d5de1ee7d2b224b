// yggtree::prefetch_distances (csrc/prefetch.h) and the op that sets them.
#include "prefetch.h"

#include <torch/library.h>

#include <atomic>
#include <vector>

namespace yggtree {
namespace {
constexpr int64_t DEFAULT_NEAR = 1024, DEFAULT_FAR = 0;  // before any is set (the profile measures them per machine)
constexpr int64_t MAX_DISTANCE = 1 << 20;
std::atomic<int64_t> near_bytes{DEFAULT_NEAR}, far_bytes{DEFAULT_FAR};

void check(int64_t bytes, const char* which) {
  TORCH_CHECK(bytes >= 0 && bytes <= MAX_DISTANCE && bytes % 64 == 0, "prefetch: the ", which,
              " distance must be a multiple of 64 bytes up to ", MAX_DISTANCE, ", got ", bytes);
}

// prefetch(near, far): the kernels fetch `near` bytes ahead into the first-level cache (0: not at all) and
// `far` bytes ahead into the second (0: not at all) from now on; near < 0 changes nothing (a query). Returns
// the distances before the call. A setting of the process, as torch's thread count is
std::vector<int64_t> prefetch(int64_t near, int64_t far) {
  const std::vector<int64_t> was{near_bytes.load(std::memory_order_relaxed), far_bytes.load(std::memory_order_relaxed)};
  if (near < 0) return was;
  check(near, "near");
  check(far, "far");
  near_bytes.store(near, std::memory_order_relaxed);
  far_bytes.store(far, std::memory_order_relaxed);
  return was;
}
}  // namespace

Prefetch prefetch_distances() {
  return {near_bytes.load(std::memory_order_relaxed), far_bytes.load(std::memory_order_relaxed)};
}
}  // namespace yggtree

TORCH_LIBRARY_FRAGMENT(yggtree, lib) { lib.def("prefetch(int near, int far) -> int[]", &yggtree::prefetch); }
