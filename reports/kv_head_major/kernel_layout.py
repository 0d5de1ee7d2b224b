"""One-row and few-row rows_attention over 30 layers of a float32 cache, K and V cold, in both layouts (the same
kernel: it takes strided views), alternating per step; paired ratios slot-major / head-major."""
import time, statistics, torch, os
from yggtree.runtime.kernels import load_library
from yggtree.runtime.model import row_window
load_library()
op = torch.ops.yggtree.rows_attention
torch.set_num_threads(2)
S, Hkv, D, H = 1074, 3, 64, 9
slot_major = [(torch.randn(1, S, Hkv, D), torch.randn(1, S, Hkv, D)) for _ in range(30)]
head_major = [(torch.randn(1, Hkv, S, D).permute(0, 2, 1, 3), torch.randn(1, Hkv, S, D).permute(0, 2, 1, 3)) for _ in range(30)]
flush = torch.randn((64 << 20) // 4)
for ctx in (224, 480, 900):
    for W in (1, 4, 16):
        C = 256 if ctx < 256 else (512 if ctx < 512 else S)
        q = torch.randn(1, W, H, D)
        mask = torch.zeros(1, W, C, dtype=torch.bool); mask[..., :ctx] = True
        win, head = row_window(mask)
        res = {"slot": [], "head": []}
        for i in range(30):
            for name, layers in ((("slot", slot_major), ("head", head_major)) if i % 2 else (("head", head_major), ("slot", slot_major))):
                flush.sum(); t0 = time.perf_counter()
                for k, v in layers: op(q, k[:, :C], v[:, :C], head, win)
                res[name].append((time.perf_counter() - t0) * 1e3)
        r = statistics.median([a / b for a, b in zip(res["slot"], res["head"])])
        print(f"ctx {ctx} W {W}: slot-major {statistics.median(res['slot']):.3f} head-major {statistics.median(res['head']):.3f} ms; slot/head {r:.3f}", flush=True)
