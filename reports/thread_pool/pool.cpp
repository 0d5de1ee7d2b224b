// Experiment: a minimal spinning thread pool for the kernel library's parallel loops (see README.txt).
// One cache line posts a task (generation, function, range), one line per worker reports it done; the
// caller runs the first share itself. Workers spin SPIN_US after their last task, then sleep on a futex.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ygg_pool {
using Body = std::function<void(int64_t, int64_t)>;
namespace {
struct alignas(64) Task {
  std::atomic<uint32_t> gen{0};
  std::atomic<uint32_t> sleepers{0};
  const Body* body = nullptr;
  int64_t begin = 0, chunk = 0, end = 0;
  bool stop = false;
};
struct alignas(64) Done { std::atomic<uint32_t> gen{0}; };

class Pool {
 public:
  Pool(int threads, double spin_us) : n_(threads), spin_us_(spin_us), done_(threads) {
    for (int i = 1; i < n_; ++i) th_.emplace_back([this, i] { work(i); });
  }
  ~Pool() { task_.stop = true; post(); for (auto& t : th_) t.join(); }
  int threads() const { return n_; }
  bool try_run(int64_t b, int64_t e, int64_t grain, const Body& f) {
    std::unique_lock<std::mutex> held(busy_, std::try_to_lock);
    if (!held.owns_lock()) return false;
    const int64_t n = e - b;
    const int64_t parts = std::min<int64_t>(n_, (n + grain - 1) / grain);
    if (parts <= 1) { f(b, e); return true; }
    const int64_t chunk = (n + parts - 1) / parts;
    task_.body = &f, task_.begin = b, task_.chunk = chunk, task_.end = e;
    const uint32_t g = post();
    f(b, std::min(e, b + chunk));
    for (int i = 1; i < n_; ++i)
      while (done_[i].gen.load(std::memory_order_acquire) != g) _mm_pause();
    return true;
  }
 private:
  uint32_t post() {
    const uint32_t g = task_.gen.load(std::memory_order_relaxed) + 1;
    task_.gen.store(g, std::memory_order_seq_cst);
    if (task_.sleepers.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&task_.gen), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    return g;
  }
  void work(int i) {
    uint32_t seen = 0;
    for (;;) {
      uint32_t g;
      auto t0 = std::chrono::steady_clock::now();
      int k = 0;
      while ((g = task_.gen.load(std::memory_order_acquire)) == seen) {
        _mm_pause();
        if (++k % 256 == 0 &&
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() > spin_us_) {
          task_.sleepers.fetch_add(1, std::memory_order_seq_cst);
          if (task_.gen.load(std::memory_order_seq_cst) == seen)
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&task_.gen), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
          task_.sleepers.fetch_sub(1, std::memory_order_seq_cst);
          t0 = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      if (task_.stop) return;
      const int64_t b = task_.begin + i * task_.chunk;
      if (b < task_.end) (*task_.body)(b, std::min(task_.end, b + task_.chunk));
      done_[i].gen.store(g, std::memory_order_release);
    }
  }
  int n_;
  double spin_us_;
  Task task_;
  std::vector<Done> done_;
  std::vector<std::thread> th_;
  std::mutex busy_;
};
Pool& pool() {
  static Pool p(std::atoi(std::getenv("YGG_POOL_THREADS") ? std::getenv("YGG_POOL_THREADS") : "2"),
                std::atof(std::getenv("YGG_POOL_SPIN_US") ? std::getenv("YGG_POOL_SPIN_US") : "2000"));
  return p;
}
}  // namespace

std::atomic<bool> enabled{false};
void parallel_for(int64_t b, int64_t e, int64_t grain, const Body& f) {
  if (b >= e) return;
  if (!enabled.load(std::memory_order_relaxed)) { at::parallel_for(b, e, grain, f); return; }
  if (!pool().try_run(b, e, grain, f)) f(b, e);  // pool busy (another caller): this call runs serially
}
}  // namespace ygg_pool

extern "C" void ygg_pool_enable(int on) { ygg_pool::enabled.store(on != 0); }
