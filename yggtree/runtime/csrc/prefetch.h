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

// The library's attentions fetch the K and V rows of the slots this many ahead of the one they read into the
// first-level cache (0: none, the hardware prefetchers alone). A step's layers each read their own cache once,
// cold after the products' weight stream, where one core's stream of 64- or 128-byte rows stalls on its misses;
// where fetching ahead pays is measured per machine (runtime/attention_choice.py) and set while an engine decodes.
int64_t attention_ahead();                 // read once per call
void set_attention_ahead(int64_t slots);   // from now on
}  // namespace yggtree
