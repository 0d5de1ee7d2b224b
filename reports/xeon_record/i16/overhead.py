import statistics, sys, time, torch
from yggtree.runtime.kernels import load_library, loop_pool
torch.set_num_threads(int(sys.argv[1])); load_library()
w = torch.randint(-127, 128, (2, 576, 16), dtype=torch.int8); s = torch.rand(2, 16); x = torch.randn(1, 576)
def run():
    t = time.perf_counter()
    for _ in range(121): torch.ops.yggtree.tiled_mm(x, w, s)
    return time.perf_counter() - t
for _ in range(50): run()
print("omp   121 tiny calls: %.1f us" % (statistics.median(run() for _ in range(200)) * 1e6))
with loop_pool(int(sys.argv[1])):
    for _ in range(50): run()
    print("pool  121 tiny calls: %.1f us" % (statistics.median(run() for _ in range(200)) * 1e6))
