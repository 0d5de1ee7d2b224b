import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.aoti import step_packages
from yggtree.runtime.steps import finish_step
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make(False)
g = eng.graphs; m = g.model
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool)
L = torch.tensor(50); tk = torch.tensor([100])
sp = step_packages(m)
with torch.no_grad():
    g.tree_step(tk, zero, zero, anc, L, (), 256)
    runner = sp.runners[(1, 256)]
    ins = [t.contiguous() for t in (tk, zero, zero, anc, L)] + sp._inputs
    print("inputs", len(ins))
    def t(fn, n=300):
        for _ in range(10): fn()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n): fn()
            ts.append((time.perf_counter() - t0) / n * 1e3)
        return round(statistics.median(ts), 4)
    x = runner.run(ins)[0]
    for rep in range(2):
        print("tree_step", t(lambda: g.tree_step(tk, zero, zero, anc, L, (), 256)),
              "run", t(lambda: runner.run(ins)),
              "finish_step", t(lambda: finish_step(m, x)),
              "list build", t(lambda: [t_.contiguous() for t_ in (tk, zero, zero, anc, L)] + sp._inputs, 3000))
