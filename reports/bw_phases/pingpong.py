"""The host's phases: a cache-line ping-pong between the two CPUs (round trip, ns) beside a 256 MiB huge-page sum (GB/s),
sampled every ~2 s. usage: pingpong.py SECONDS"""
import sys, time, statistics, torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <atomic>
#include <thread>
#include <pthread.h>
#include <chrono>
static void pin(int cpu) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_setaffinity_np(pthread_self(), sizeof(s), &s); }
double pingpong(int64_t iters) {
  alignas(64) static std::atomic<int64_t> flag{0};
  flag = 0;
  std::thread t([&] { pin(1); for (int64_t i = 0; i < iters; ++i) { while (flag.load(std::memory_order_acquire) != 2 * i + 1) {} flag.store(2 * i + 2, std::memory_order_release); } });
  pin(0);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) { flag.store(2 * i + 1, std::memory_order_release); while (flag.load(std::memory_order_acquire) != 2 * i + 2) {} }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t.join();
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(0, &s); CPU_SET(1, &s); pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
  return dt / iters * 1e9;
}
'''
m = load_inline("pingpong", cpp_sources=src, functions=["pingpong"], extra_cflags=["-O2"], extra_ldflags=["-lpthread"])
torch.set_num_threads(2)
from probe import sum_gbps
t_end = time.time() + float(sys.argv[1])
while time.time() < t_end:
    bw = sum_gbps()
    pp = m.pingpong(20000)
    print(f"{time.strftime('%H:%M:%S')} sum {bw:5.1f} GB/s  ping-pong {pp:6.0f} ns", flush=True)
    time.sleep(2)
