"""Paired: the plan's W=1 step through the whole-step package vs the block packages."""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
m = eng.target
sp = m.step_packages
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool); tokv = torch.tensor([42])
L = torch.tensor(int(sys.argv[2]) if len(sys.argv) > 2 else 60)
C = eng.graphs.bucket(int(L) + 1)
def run(path):
    m.step_packages = path
    with torch.no_grad():
        for _ in range(30): eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C)
ta, tb = [], []
run(sp); run(None)
for rep in range(9):
    t = time.perf_counter(); run(sp); ta.append((time.perf_counter() - t) / 30 * 1e3)
    t = time.perf_counter(); run(None); tb.append((time.perf_counter() - t) / 30 * 1e3)
m.step_packages = sp
print(f"C {C}: whole step {statistics.median(ta):.3f} ms, blocks {statistics.median(tb):.3f} ms, ratio {statistics.median(tb)/statistics.median(ta):.3f}")
print("all", [round(x, 2) for x in ta], [round(x, 2) for x in tb])
