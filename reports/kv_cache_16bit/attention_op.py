"""rows_attention, 1 row, 30 layers one after another (a step's attention), K/V in float32 / float16 / bfloat16."""
import sys, time, statistics, torch
from yggtree.runtime.kernels import load_library
from yggtree.runtime.model import row_window, _rows_attention
load_library()
op = torch.ops.yggtree.rows_attention
torch.manual_seed(0)
S = 1026
kv32 = torch.randn(30, 2, 1, S, 3, 64)
kvs = {dt: kv32.to(dt) for dt in (torch.float32, torch.float16, torch.bfloat16)}
junk = torch.randn(24 * 1024 * 1024)
q = torch.randn(1, 1, 9, 64)
def timed(args_list):
    ts = []
    for rep in range(15):
        junk.mul_(1.0000001)
        t0 = time.perf_counter()
        for a in args_list: op(*a)
        ts.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(ts[3:]), 1)
torch.set_num_threads(2)
for L, C in ((60, 256), (400, 512), (900, 1026)):
    mask = torch.zeros(1, 1, C, dtype=torch.bool); mask[..., :L] = True
    window, head = row_window(mask)
    res = []
    for dt, kv in kvs.items():
        args = [(q, kv[i, 0][:, :C], kv[i, 1][:, :C], head, window) for i in range(30)]
        got = op(*args[0]); want = _rows_attention(*args[0])
        err = (got - want).abs().max().item()
        res.append(f"{str(dt)[6:]} {timed(args)} us (vs ref {err:.1e})")
    print(f"L {L}: " + " | ".join(res), flush=True)
