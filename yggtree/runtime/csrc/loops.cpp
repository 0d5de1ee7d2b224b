// yggtree::parallel_for (csrc/loops.h) and the library's thread pool.
//
// Why a pool of our own: starting and joining an OpenMP region is slow where the two CPUs sit far apart
// (libgomp's team start touches several cache lines the other CPU wrote last), and a w4a8 decode step runs one
// region per product. Here a task is posted on one cache line (generation, body, range) and each worker reports on a line of
// its own, so a region costs about one line transfer each way; the caller runs the first chunk at once. Whether
// it pays is measured per machine and plan (`yggtree compile`'s loops choice).
//
// A spinning worker must never share a core with a spinning OpenMP worker (both lose their time slices), so the runtime switches the pool on only where the step has no OpenMP region
// (packages compiled with inductor's loops serial, the decoding thread at one OpenMP thread): runtime/kernels.py.
// Workers spin SPIN_US after their last task, then sleep on a futex until the next. A loop called while the
// pool is busy (another thread's loop, or a loop inside a task) runs serially on its caller: nothing waits on
// another caller, and the split never changes a result (every kernel's rows and columns are independent).
// The pool is the process's: of two threads switching it on at once (kernels.loop_pool), the first to switch it
// off leaves the other's loops serial: correct, slower.
//
// The split follows the threads' speeds (balance on, the default): a loop's range is cut into one contiguous
// range a thread, in proportion to each thread's items a tick over the loops before (an average, LEARN a loop),
// from time stamps around each thread's range. A thread on a CPU that runs slower for a while -- another tenant
// on its core, a frequency step, an efficiency core -- gets less, so the caller does not wait at every loop's
// end for the slowest range; on CPUs alike the cut stays near equal. Balance off: equal ranges. Which thread
// runs which items never changes a result.
#include "loops.h"

#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <x86intrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace yggtree {
namespace {

using Body = std::function<void(int64_t, int64_t)>;
constexpr double SPIN_US = 2000;  // a worker's spin before it sleeps: longer than a decode step's serial stretches
constexpr double LEARN = 0.25;    // a loop's weight in the threads' speeds
constexpr double SPREAD = 2;      // a thread's speed stays within this factor of the threads' mean

struct alignas(64) Task {  // written by the caller, read by every worker: one line
  std::atomic<uint32_t> gen{0};
  std::atomic<uint32_t> sleepers{0};
  const Body* body = nullptr;
  const int64_t* bounds = nullptr;  // worker i runs [bounds[i], bounds[i + 1])
  bool stop = false;
};
struct alignas(64) Done {  // written by one worker
  std::atomic<uint32_t> gen{0};
  uint64_t ticks = 0;  // its range's time in its last loop (time stamp counter ticks)
};

long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, nullptr, nullptr, 0);
}

class Pool {
 public:
  Pool(int threads, bool balance)
      : n_(threads), balance_(balance), done_(threads), bounds_(threads + 1), speed_(threads, 1.0), rate_(threads) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    task_.stop = true;
    post();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return n_; }
  bool balance() const { return balance_; }

  // false: busy (the caller runs the loop itself)
  bool run(int64_t b, int64_t e, int64_t grain, const Body& body) {
    // taken by one loop at a time; any other caller -- another thread, or a loop nested in this one's
    // chunk on this thread -- is told to run its loop itself
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    struct Release {
      std::atomic<bool>& flag;
      ~Release() { flag.store(false, std::memory_order_release); }
    } release{busy_};
    const int64_t n = e - b, parts = std::min<int64_t>(n_, (n + grain - 1) / grain);
    if (parts <= 1) {
      body(b, e);
      return true;
    }
    split(b, e, parts);
    task_.body = &body, task_.bounds = bounds_.data();
    const uint32_t g = post();
    const uint64_t t0 = __rdtsc();
    body(bounds_[0], bounds_[1]);
    const uint64_t mine = __rdtsc() - t0;
    for (int i = 1; i < n_; ++i)
      while (done_[i].gen.load(std::memory_order_acquire) != g) _mm_pause();
    if (balance_) learn(parts, mine);
    return true;
  }

 private:
  // [b, e) into `parts` contiguous ranges, bounds_[i] .. bounds_[i + 1] thread i's, each at least one item and
  // in proportion to the threads' speeds (balance off: equal); the threads past `parts` get none
  void split(int64_t b, int64_t e, int64_t parts) {
    double total = 0, upto = 0;
    for (int64_t i = 0; i < parts; ++i) total += speed_[i];
    bounds_[0] = b;
    for (int64_t i = 0; i < parts; ++i) {
      upto += speed_[i];
      const int64_t at = i + 1 == parts ? e : b + static_cast<int64_t>(static_cast<double>(e - b) * upto / total + 0.5);
      bounds_[i + 1] = std::min(std::max(at, bounds_[i] + 1), e - (parts - 1 - i));
    }
    for (int64_t i = parts; i < n_; ++i) bounds_[i + 1] = e;
  }
  // Each running thread's items a tick in this loop, over their mean, into its speed (speeds stay within
  // [1 / SPREAD, SPREAD] of each other's mean: one stalled range must not starve a thread of work)
  void learn(int64_t parts, uint64_t mine) {
    double mean = 0;
    for (int64_t i = 0; i < parts; ++i) {
      const uint64_t t = std::max<uint64_t>(i == 0 ? mine : done_[i].ticks, 1);
      rate_[i] = static_cast<double>(bounds_[i + 1] - bounds_[i]) / static_cast<double>(t);
      mean += rate_[i] / static_cast<double>(parts);
    }
    for (int64_t i = 0; i < parts; ++i)
      speed_[i] = std::min(SPREAD, std::max(1 / SPREAD, (1 - LEARN) * speed_[i] + LEARN * rate_[i] / mean));
  }

  uint32_t post() {
    const uint32_t g = task_.gen.load(std::memory_order_relaxed) + 1;
    task_.gen.store(g, std::memory_order_seq_cst);
    if (task_.sleepers.load(std::memory_order_seq_cst) > 0) futex(&task_.gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    return g;
  }
  void work(int i) {
    uint32_t seen = 0;
    for (;;) {
      uint32_t g;
      auto since = std::chrono::steady_clock::now();
      for (int k = 1; (g = task_.gen.load(std::memory_order_acquire)) == seen; ++k) {
        _mm_pause();
        if (k % 256 == 0 &&
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - since).count() > SPIN_US) {
          task_.sleepers.fetch_add(1, std::memory_order_seq_cst);
          if (task_.gen.load(std::memory_order_seq_cst) == seen) futex(&task_.gen, FUTEX_WAIT_PRIVATE, seen);
          task_.sleepers.fetch_sub(1, std::memory_order_seq_cst);
          since = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      if (task_.stop) return;
      const int64_t b = task_.bounds[i], e = task_.bounds[i + 1];
      const uint64_t t0 = __rdtsc();
      if (b < e) (*task_.body)(b, e);
      done_[i].ticks = __rdtsc() - t0;
      done_[i].gen.store(g, std::memory_order_release);
    }
  }

  const int n_;
  const bool balance_;  // ranges by the threads' speeds (else equal)
  Task task_;
  std::vector<Done> done_;
  std::vector<std::thread> workers_;
  std::atomic<bool> busy_{false};
  std::vector<int64_t> bounds_;  // [n_ + 1] the loop under way's ranges (the caller's)
  std::vector<double> speed_;    // [n_] each thread's items a tick, relative to the others' (1: all alike)
  std::vector<double> rate_;     // [n_] learn's scratch
};

// The pool in use (null: OpenMP). A loop holds its own reference, so switching never pulls a pool from under
// a running loop; a pool is joined when its last loop ends.
std::shared_ptr<Pool> current;
std::mutex switching;

std::shared_ptr<Pool> in_use() { return std::atomic_load_explicit(&current, std::memory_order_acquire); }

}  // namespace

// loop_pool(n, balance): the loops on a pool of n threads (the caller and n - 1 workers) splitting each loop by
// the threads' speeds or equally; n <= 1: on OpenMP. Returns the previous setting {n (0: OpenMP), balance}, so a
// caller can restore it.
std::vector<int64_t> loop_pool(int64_t n, bool balance) {
  // a forked child has none of the pool's workers: it forgets the pool without joining them (leaked, not
  // destroyed) and its loops run on OpenMP
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { new std::shared_ptr<Pool>(std::move(current)); }); });
  std::lock_guard<std::mutex> held(switching);
  auto before = in_use();
  const std::vector<int64_t> was{before ? before->threads() : 0, before ? before->balance() : true};
  if ((n <= 1 && !before) || (before && before->threads() == n && before->balance() == balance)) return was;
  std::atomic_store_explicit(&current,
                             n <= 1 ? std::shared_ptr<Pool>() : std::make_shared<Pool>(static_cast<int>(n), balance),
                             std::memory_order_release);
  return was;
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  if (begin >= end) return;
  auto pool = in_use();
  if (!pool) {
    at::parallel_for(begin, end, grain, body);
    return;
  }
  if (!pool->run(begin, end, grain, body)) body(begin, end);
}

int64_t pool_threads() {
  auto pool = in_use();
  return pool ? pool->threads() : 0;
}

}  // namespace yggtree

