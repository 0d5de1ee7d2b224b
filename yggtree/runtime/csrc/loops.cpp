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
#include "loops.h"

#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
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

struct alignas(64) Task {  // written by the caller, read by every worker: one line
  std::atomic<uint32_t> gen{0};
  std::atomic<uint32_t> sleepers{0};
  const Body* body = nullptr;
  int64_t begin = 0, chunk = 0, end = 0;
  bool stop = false;
};
struct alignas(64) Done {  // written by one worker
  std::atomic<uint32_t> gen{0};
};

long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, nullptr, nullptr, 0);
}

class Pool {
 public:
  explicit Pool(int threads) : n_(threads), done_(threads) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    task_.stop = true;
    post();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return n_; }

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
    const int64_t chunk = (n + parts - 1) / parts;
    task_.body = &body, task_.begin = b, task_.chunk = chunk, task_.end = e;
    const uint32_t g = post();
    body(b, std::min(e, b + chunk));
    for (int i = 1; i < n_; ++i)
      while (done_[i].gen.load(std::memory_order_acquire) != g) _mm_pause();
    return true;
  }

 private:
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
      const int64_t b = task_.begin + i * task_.chunk;
      if (b < task_.end) (*task_.body)(b, std::min(task_.end, b + task_.chunk));
      done_[i].gen.store(g, std::memory_order_release);
    }
  }

  const int n_;
  Task task_;
  std::vector<Done> done_;
  std::vector<std::thread> workers_;
  std::atomic<bool> busy_{false};
};

// The pool in use (null: OpenMP). A loop holds its own reference, so switching never pulls a pool from under
// a running loop; a pool is joined when its last loop ends.
std::shared_ptr<Pool> current;
std::mutex switching;

std::shared_ptr<Pool> in_use() { return std::atomic_load_explicit(&current, std::memory_order_acquire); }

}  // namespace

// loop_pool(n): the loops on a pool of n threads (the caller and n - 1 workers); n <= 1: on OpenMP. Returns the
// previous setting (0: OpenMP), so a caller can restore it.
int64_t loop_pool(int64_t n) {
  // a forked child has none of the pool's workers: it forgets the pool without joining them (leaked, not
  // destroyed) and its loops run on OpenMP
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { new std::shared_ptr<Pool>(std::move(current)); }); });
  std::lock_guard<std::mutex> held(switching);
  auto before = in_use();
  const int64_t was = before ? before->threads() : 0;
  if ((n <= 1 && !before) || (before && before->threads() == n)) return was;
  std::atomic_store_explicit(&current, n <= 1 ? std::shared_ptr<Pool>() : std::make_shared<Pool>(static_cast<int>(n)),
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

