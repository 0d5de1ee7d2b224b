// Experiment: the w4a8 products on a minimal spinning thread pool (one cache line posts a task, one
// line per worker reports it done) against at::parallel_for (libgomp), 120 layer products back to back.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <climits>
#include <thread>
#include <functional>

namespace pool_exp {
using Fn = void (*)(void*, int64_t, int64_t);
struct alignas(64) Task {
  std::atomic<uint32_t> gen{0};
  std::atomic<uint32_t> sleepers{0};
  Fn fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0;
  bool stop = false;
};
struct alignas(64) Done { std::atomic<uint32_t> gen{0}; };

class Pool {
 public:
  Pool(int threads, double spin_us) : n_(threads), spin_us_(spin_us), done_(threads) {
    for (int i = 1; i < n_; ++i) th_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    task_.stop = true;
    post();
    for (auto& t : th_) t.join();
  }
  void run(Fn fn, void* ctx, int64_t n) {
    task_.fn = fn, task_.ctx = ctx, task_.n = n;
    const uint32_t g = post();
    fn(ctx, 0, n / n_);  // the caller's share
    for (int i = 1; i < n_; ++i)
      while (done_[i].gen.load(std::memory_order_acquire) != g) _mm_pause();
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
      const int64_t n = task_.n;
      task_.fn(task_.ctx, n * i / n_, n * (i + 1) / n_);
      done_[i].gen.store(g, std::memory_order_release);
    }
  }
  int n_;
  double spin_us_;
  Task task_;
  std::vector<Done> done_;
  std::vector<std::thread> th_;
};
std::unique_ptr<Pool> the_pool;
}  // namespace pool_exp

void pool_start(int64_t threads, double spin_us) { pool_exp::the_pool = std::make_unique<pool_exp::Pool>(threads, spin_us); }
void pool_stop() { pool_exp::the_pool.reset(); }

namespace {
struct Ctx { const uint8_t* bp; const int8_t* q; const float* da; const float* sa; int64_t M, K, T, B; float* op; int bits; };
template <int BITS>
void tiles(const Ctx& c, int64_t t0, int64_t t1) {
  const int64_t N = 16 * c.T;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* w = c.bp + t * c.B * STRIDE<BITS>;
    int64_t r = 0;
    for (; r + 2 <= c.M; r += 2) tile<2, BITS>(w, c.q + r * c.K, c.da + r * c.B, c.sa + r * c.B, c.K, c.B, c.op + r * N + 16 * t, N);
    for (; r < c.M; ++r) tile<1, BITS>(w, c.q + r * c.K, c.da + r * c.B, c.sa + r * c.B, c.K, c.B, c.op + r * N + 16 * t, N);
  }
}
void task(void* p, int64_t t0, int64_t t1) {
  const Ctx& c = *static_cast<Ctx*>(p);
  if (c.bits == 4) tiles<4>(c, t0, t1); else tiles<8>(c, t0, t1);
}
at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, bool pool) {
  const int64_t T = blocks.size(0), B = blocks.size(1), M = x.size(0), K = x.size(1);
  auto out = at::empty({M, 16 * T}, x.options());
  static thread_local std::vector<int8_t> qa; static thread_local std::vector<float> da, sa;
  if ((int64_t)qa.size() < M * K) qa.resize(M * K);
  if ((int64_t)da.size() < M * B) da.resize(M * B), sa.resize(M * B);
  quantize_rows(x.data_ptr<float>(), M, K, qa.data(), da.data(), sa.data());
  Ctx c{blocks.data_ptr<uint8_t>(), qa.data(), da.data(), sa.data(), M, K, T, B, out.data_ptr<float>(), blocks.size(2) == STRIDE<4> ? 4 : 8};
  if (pool) pool_exp::the_pool->run(task, &c, T);
  else at::parallel_for(0, T, 4, [&](int64_t a, int64_t b) { task(&c, a, b); });
  return out;
}
}  // namespace

at::Tensor one(at::Tensor x, at::Tensor w, bool pool) { return mm(x, w, pool); }

double loop(std::vector<at::Tensor> xs, std::vector<at::Tensor> ws, int64_t reps, bool pool) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (size_t i = 0; i < ws.size(); ++i) { at::Tensor o = mm(xs[i], ws[i], pool); }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}
