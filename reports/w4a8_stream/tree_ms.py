"""Median ms of the spec plan's target tree step at widths W (chain trees) at context Lc, interleaved rounds in one process:
PLAN.yaml Lc W... (five calls timed together); EACH=1: each call timed on its own, FLUSH=1 with it: a 128 MB sum before
each (the drafter's and the loop's work between verify calls in a decode)."""
import sys, time, os, statistics, torch
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(True)
Lc = int(sys.argv[2]); Ws = [int(x) for x in sys.argv[3:]]
args = {}
for W in Ws:
    args[W] = (torch.arange(42, 42 + W), torch.arange(W), torch.arange(W), torch.tril(torch.ones(W, W, dtype=torch.bool)), torch.tensor(Lc), (), eng.graphs.bucket(Lc + W))
ts = {W: [] for W in Ws}
EACH, FLUSH = os.environ.get("EACH") == "1", os.environ.get("FLUSH") == "1"
flush = torch.ones(32 * 2**20) if FLUSH else None
with torch.no_grad():
    for r in range(40):
        for W in Ws:
            for _ in range(3): eng.graphs.tree_step(*args[W])
            if EACH:
                tot = 0.0
                for _ in range(5):
                    if FLUSH: flush.sum()
                    t = time.perf_counter(); eng.graphs.tree_step(*args[W]); tot += time.perf_counter() - t
                if r >= 5: ts[W].append(tot / 5 * 1e3)
                continue
            t = time.perf_counter()
            for _ in range(5): eng.graphs.tree_step(*args[W])
            if r >= 5: ts[W].append((time.perf_counter() - t) / 5 * 1e3)
print(" ".join(f"W{W}={statistics.median(ts[W]):.3f}" for W in Ws))
