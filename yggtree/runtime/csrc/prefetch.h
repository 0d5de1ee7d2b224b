// The kernel library's software prefetch distance (csrc/prefetch.cpp): how many bytes of a product's weight
// stream its kernels fetch ahead of the bytes they read. Which distance streams fastest depends on the machine
// (none of 512-16384 beat another on one AMD EPYC; 16384 ran the int8 model's products 1.22x as fast as 1024
// on an Intel Xeon: docs/results.md), so the runtime measures it per machine
// (yggtree.offline.profile.time_padding) and sets it while an engine decodes (runtime/kernels.py prefetch).
#pragma once
#include <cstdint>

namespace yggtree {
int64_t prefetch_distance();  // bytes; read once per product
}  // namespace yggtree
