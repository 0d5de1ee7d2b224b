// yggtree::prefetch_distances and yggtree::attention_ahead (csrc/prefetch.h): how far ahead the kernels prefetch, settings of the process
// (csrc/ops.cpp's yggtree::prefetch and yggtree::attention_prefetch ops check and set them).
#include "prefetch.h"

#include <atomic>

namespace yggtree {
namespace {
constexpr int64_t DEFAULT_NEAR = 1024, DEFAULT_FAR = 0;  // before any is set (the profile measures them per machine)
std::atomic<int64_t> near_bytes{DEFAULT_NEAR}, far_bytes{DEFAULT_FAR};
std::atomic<int64_t> attention_slots{0};  // before any is set: none
}  // namespace

Prefetch prefetch_distances() {
  return {near_bytes.load(std::memory_order_relaxed), far_bytes.load(std::memory_order_relaxed)};
}

void set_prefetch_distances(Prefetch to) {
  near_bytes.store(to.near, std::memory_order_relaxed);
  far_bytes.store(to.far, std::memory_order_relaxed);
}

int64_t attention_ahead() { return attention_slots.load(std::memory_order_relaxed); }

void set_attention_ahead(int64_t slots) { attention_slots.store(slots, std::memory_order_relaxed); }
}  // namespace yggtree
