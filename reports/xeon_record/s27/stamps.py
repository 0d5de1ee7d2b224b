"""Where a pooled one-row 4-bit product's time goes: the caller's and the worker's chunk start and end
(rdtsc) for the default model's 120 block products, cold-ish (2 copies rotated). usage: stamps.py [pool]"""
import os, statistics, sys, time, torch
from torch.utils import cpp_extension
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, load_library, prefetch, loop_pool
from yggtree.runtime.quant import q4_blocks
import contextlib
torch.set_num_threads(2); load_library()
os.makedirs("/tmp/proto27t", exist_ok=True)
cpp_extension.load(name="proto27t", sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "proto_q4_stamps.cpp")], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                   build_directory="/tmp/proto27t", is_python_module=False, verbose=False)
H, I, L = 576, 1536, 30
shapes = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L
g = torch.Generator().manual_seed(0)
def model():
    out = []
    for N, K in shapes:
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        s, m = (torch.rand(N, K // 32, generator=g) / 64).half(), (torch.randn(N, K // 32, generator=g) / 64).half()
        b = q4_blocks(q, s, m); a = huge_empty(b.numel()).view(b.shape); a.copy_(b); out.append(a)
    return out
ms = [model(), model()]
xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
# tsc rate
t, c = time.perf_counter(), __import__("ctypes")
import subprocess
t0 = time.perf_counter(); torch.ops.proto27t.q4t_stamps()
ctx = loop_pool(2) if len(sys.argv) > 1 else contextlib.nullcontext()
with prefetch((2048, 32768)), ctx:
    for rnd in range(12):
        for m in ms:
            for i, b in enumerate(m): torch.ops.proto27t.q4t_mm(xs[shapes[i][1]], b)
st = torch.ops.proto27t.q4t_stamps()[len(shapes) * 4:]  # after 2 warm rounds
ghz = 2.6  # the guest's TSC (lscpu: 5199.99 BogoMIPS -> 2.6 GHz)
us = st[:, :5].double() / (ghz * 1e3)
names = ["qkv 960x576", "o 576x576", "gate_up 3072x576", "down 576x1536"]
print("median us: total, caller [begin, end], worker [begin, end]; worker start latency, |caller end - worker end|")
for k in range(4):
    rows = us[k::4]
    med = rows.median(0).values
    lat = (rows[:, 3]).median().item()
    imb = (rows[:, 2] - rows[:, 4]).abs().median().item()
    wait_c = (rows[:, 0] - rows[:, 2]).median().item()
    prep = (st[k::4, 6].double() / (ghz * 1e3)).median().item(); act = (st[k::4, 5].double() / (ghz * 1e3)).median().item()
    print(f"{names[k]:18s} out+scratch {prep:5.2f} +quantize/split {act:5.2f}", end="  ")
    print(f"{names[k]:18s} total {med[0]:6.2f}  caller [{med[1]:5.2f}, {med[2]:6.2f}]  worker [{med[3]:5.2f}, {med[4]:6.2f}]  "
          f"worker start {lat:5.2f}  |end gap| {imb:5.2f}  after caller's chunk {wait_c:5.2f}")
