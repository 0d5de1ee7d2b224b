"""One verify step of the w4a8 plan's speculative engine at W = 1, 2, 4, 8, 16 (a chain: node i's
parent is i - 1) at CTX tokens of context (default 150), split into the 30 block packages, the norm + head and
the rest, in ms (issue #20). OMP_NUM_THREADS=2 python reports/plain_loop/widths.py PLAN [CTX]"""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime import aoti
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(True)
m = eng.target
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 150
L = torch.tensor(CTX)
run_s = [0.0]
orig = aoti.PackagedForward.__call__
def timed(self, *a):
    t = time.perf_counter(); r = orig(self, *a); run_s[0] += time.perf_counter() - t; return r
layers = eng.drafter.target_layers
for w in (1, 2, 4, 8, 16):
    tokv = torch.arange(40, 40 + w)
    depth = torch.arange(w)
    node = torch.arange(w)
    anc = torch.tril(torch.ones(w, w, dtype=torch.bool))
    C = eng.graphs.bucket(CTX + w)
    step = lambda: eng.graphs.tree_step(tokv, depth, node, anc, L, layers, C)
    h = torch.randn(w, m.cfg.hidden_size)
    with torch.no_grad():
        for _ in range(10): step()
        tot, runs, head = [], [], []
        for _ in range(5):
            aoti.PackagedForward.__call__ = orig
            t = time.perf_counter()
            for _ in range(20): step()
            tot.append((time.perf_counter() - t) / 20 * 1e3)
            aoti.PackagedForward.__call__ = timed
            run_s[0] = 0.0
            for _ in range(20): step()
            runs.append(run_s[0] / 20 * 1e3)
            t = time.perf_counter()
            for _ in range(20): m.logits(m.norm(h))
            head.append((time.perf_counter() - t) / 20 * 1e3)
        aoti.PackagedForward.__call__ = orig
    T, R, H = (statistics.median(x) for x in (tot, runs, head))
    print(f"W {w:2d}: step {T:6.2f} ms; 30 block calls {R:6.2f}; norm + head {H:5.2f}; rest {T - R - H:5.2f}", flush=True)
