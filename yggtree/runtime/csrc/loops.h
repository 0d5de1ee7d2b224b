// The kernel library's parallel loops (csrc/loops.cpp): at::parallel_for's contract -- [begin, end) split into
// at most `threads` contiguous chunks of at least `grain`, the first run by the caller -- on OpenMP, or on the
// library's own spinning thread pool once yggtree::loop_pool switched it on.
#pragma once
#include <cstdint>
#include <functional>

namespace yggtree {
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body);
int64_t pool_threads();  // the pool's threads, 0 while the loops run on OpenMP
}  // namespace yggtree
