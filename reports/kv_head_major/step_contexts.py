"""The plan's one-row step (tree_step, whole-step package) at contexts 5-1000, 20 steps x 7 rounds, medians (ms); run
with the old and the new code alternately (PYTHONPATH to a worktree of each, each with its own compiled packages)."""
import sys, time, os, statistics, torch
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool); tokv = torch.tensor([42])
big = torch.ones(256 * 2**20 // 4)
res = {}
with torch.no_grad():
    for rep in range(7):
        for Lv in (5, 200, 250, 500, 1000):
            L = torch.tensor(Lv); C = eng.graphs.bucket(Lv + 1)
            eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C)
            t = time.perf_counter()
            for _ in range(20): eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C)
            res.setdefault((Lv, C), []).append((time.perf_counter() - t) / 20 * 1e3)
        t = time.perf_counter(); big.sum(); big.sum(); res.setdefault("bw", []).append(2 * big.numel() * 4 / (time.perf_counter() - t) / 1e9)
for k, v in res.items(): print(k, f"{statistics.median(v):.3f}")
