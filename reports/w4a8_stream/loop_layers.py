"""The 121 w4a8 products in a loop for perf (the end-of-region wait): OMP_NUM_THREADS=2 python loop_layers.py, then perf record -p PID."""
import sys, time, os, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import arena_model
from yggtree.runtime.w4a8 import load_kernel
torch.set_num_threads(2); load_kernel()
L, nb = arena_model(torch.Generator().manual_seed(0), pack=lambda b: (__import__("yggtree.runtime.w4a8", fromlist=["x"]).pack_blocks(b),))
op = torch.ops.yggtree.w4a8_mm
xs = {K: torch.randn(1, K) for K in (576, 1536)}
for _ in range(20): [op(xs[e[0]], *e[1:]) for e in L]
print("ready", os.getpid(), flush=True)
t = time.perf_counter(); n = 0
while time.perf_counter() - t < 10:
    [op(xs[e[0]], *e[1:]) for e in L]; n += 1
print(f"{(time.perf_counter()-t)/n*1e3:.3f} ms/pass")
