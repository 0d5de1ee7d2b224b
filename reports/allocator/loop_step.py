import sys, time, os, torch
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool); tokv = torch.tensor([42])
L = torch.tensor(int(sys.argv[2]) if len(sys.argv) > 2 else 200); C = eng.graphs.bucket(int(L) + 1)
with torch.no_grad():
    for _ in range(50): eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C)
    print("ready", os.getpid(), flush=True)
    t = time.perf_counter(); n = 0
    while time.perf_counter() - t < float(os.environ.get("SECS", "12")):
        eng.graphs.tree_step(tokv, zero, zero, anc, L, (), C); n += 1
    print(f"{(time.perf_counter() - t) / n * 1e3:.3f} ms/step over {n}")
