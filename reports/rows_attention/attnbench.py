"""rows_attention alone at decode shapes (default model: 9 heads, 3 KV heads, D 64, T 32)."""
import sys, time, statistics, torch
from yggtree.runtime.kernels import load_library
from yggtree.runtime.model import row_window
load_library()
op = torch.ops.yggtree.rows_attention
torch.manual_seed(0)
S = 1026
def case(L, C, W=1):
    cache_k = torch.randn(1, S, 3, 64); cache_v = torch.randn(1, S, 3, 64)
    q = torch.randn(1, W, 9, 64)
    mask = torch.zeros(1, W, C, dtype=torch.bool); mask[..., :L] = True
    for r in range(W): mask[0, r, L - W + r + 1:L] = False  # rows see their prefix (W=1: all L)
    window, head = row_window(mask)
    return q, cache_k[:, :C], cache_v[:, :C], head, window
def t(fn, n=2000):
    for _ in range(50): fn()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(ts), 2)
ref = {}
for th in (1, 2):
    torch.set_num_threads(th)
    for L, C, W in ((50, 256, 1), (200, 256, 1), (400, 512, 1), (900, 1026, 1), (400, 512, 8), (900, 1026, 8)):
        a = case(L, C, W)
        print(f"threads {th} L {L} C {C} W {W}: {t(lambda: op(*a), 2000 // W)} us", flush=True)
if len(sys.argv) > 1:
    torch.set_num_threads(2)
    torch.manual_seed(1)
    outs = [op(*case(L, C, W)) for L, C, W in ((50, 256, 1), (200, 256, 4), (900, 1026, 8), (33, 256, 1), (5, 256, 1))]
    torch.save(outs, sys.argv[1])
