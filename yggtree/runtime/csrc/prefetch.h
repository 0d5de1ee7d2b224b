// The kernel library's software prefetch distances (csrc/prefetch.cpp): how many bytes of a product's weight
// stream its kernels fetch ahead of the bytes they read, into the first-level cache (near) and into the second
// (far; 0: none). One core keeps only so many first-level misses in flight, so fetching only into the first
// level caps a core's stream whatever the kernel's arithmetic; fetching far ahead into the second level as well
// can lift it. Which distances stream fastest depends on the machine, so the runtime measures them per machine (yggtree.offline.profile_padding.time_padding) and
// sets them while an engine decodes (runtime/kernels.py prefetch).
#pragma once
#include <cstdint>

namespace yggtree {
struct Prefetch {
  int64_t near, far;  // bytes ahead; far 0: no second-level prefetch
};
Prefetch prefetch_distances();            // read once per product
void set_prefetch_distances(Prefetch to);  // from now on
}  // namespace yggtree
