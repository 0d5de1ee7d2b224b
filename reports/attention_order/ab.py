"""Old and new rows_attention in one process, alternating per step (30 layers, K/V cold); see README.md.

    OMP_NUM_THREADS=2 python reports/attention_order/ab.py OLD_NAMED.cpp
"""
import time, statistics, torch, sys
from torch.utils import cpp_extension
from yggtree.runtime.kernels import load_library, CFLAGS, LDFLAGS
load_library()
import os; os.makedirs("/tmp/ra_old_build", exist_ok=True)
cpp_extension.load(name="ra_old_ext", sources=[sys.argv[1] if len(sys.argv) > 1 else "/work/s16/ra_old_named.cpp"], extra_cflags=list(CFLAGS),
                   extra_ldflags=list(LDFLAGS), build_directory="/tmp/ra_old_build", is_python_module=False)
torch.set_num_threads(2)
S, Hkv, D, H, T = 1074, 3, 64, 9, 8
layers = [(torch.randn(1, S, Hkv, D), torch.randn(1, S, Hkv, D)) for _ in range(30)]
flush = torch.randn((64 << 20) // 4)
ops = {"old": torch.ops.yggtree.rows_attention_old, "new": torch.ops.yggtree.rows_attention}
for ctx in (224, 480, 900):
    for W in (1, 2, 4, 8):
        q = torch.randn(1, W, H, D)
        C = 256 if ctx < 256 else (512 if ctx < 512 else S)
        head = torch.zeros(1, W, C, dtype=torch.bool); head[..., :ctx] = True
        win = torch.full((1, W, T), -1, dtype=torch.int64)
        for r in range(W): win[0, r, :min(r + 1, T)] = ctx + torch.arange(min(r + 1, T))
        res = {k: [] for k in ops}
        a = ops["old"](q, layers[0][0][:, :C], layers[0][1][:, :C], head, win)
        b = ops["new"](q, layers[0][0][:, :C], layers[0][1][:, :C], head, win)
        assert torch.equal(a, b)
        for i in range(60):
            for name in (("old", "new") if i % 2 else ("new", "old")):
                flush.sum()
                t0 = time.perf_counter()
                for k, v in layers:
                    ops[name](q, k[:, :C], v[:, :C], head, win)
                res[name].append((time.perf_counter() - t0) * 1e3)
        ratios = [o / n for o, n in zip(res["old"], res["new"])]
        print(f"ctx {ctx} W {W}: old {statistics.median(res['old']):.3f} new {statistics.median(res['new']):.3f} ms, old/new paired median {statistics.median(ratios):.3f}", flush=True)
