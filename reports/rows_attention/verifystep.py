"""A W-row verify step (a chain) of a plan's target at committed length L in bucket C."""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make(False)
g = eng.graphs
W = int(sys.argv[2])
depth = torch.arange(W); node = torch.arange(W); anc = torch.tril(torch.ones(W, W, dtype=torch.bool))
tk = torch.arange(100, 100 + W)
with torch.no_grad():
    for L, C in ((60, 256), (400, 512), (900, 1074)):
        Lt = torch.tensor(L)
        for _ in range(5): g.tree_step(tk, depth, node, anc, Lt, (), C)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20): g.tree_step(tk, depth, node, anc, Lt, (), C)
            ts.append((time.perf_counter() - t0) / 20 * 1e3)
        print(f"W {W} L {L} C {C}: {statistics.median(ts):.3f} ms", flush=True)
