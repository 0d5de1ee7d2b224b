"""Scratch: run time of whole-step packages on the same inputs, interleaved; outputs compared bitwise."""
import sys, time, statistics, glob, torch
from torch._C._aoti import AOTIModelPackageLoader
from yggtree.bench import plan_runner
from yggtree.runtime.aoti import step_packages
torch.set_num_threads(int(sys.argv[2]))
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make(False)
g = eng.graphs; m = g.model
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool)
L = torch.tensor(50); tk = torch.tensor([100])
sp = step_packages(m)
paths = {"shipped": glob.glob(f"compile/{plan.name}/graphs/step-*-w1-c256.pt2")[0], **{p.split("/")[-1]: p for p in sys.argv[3:]}}
runners = {k: AOTIModelPackageLoader(p, "model", False, 1, -1) for k, p in paths.items()}
with torch.no_grad():
    g.tree_step(tk, zero, zero, anc, L, (), 256)
    ins = [t.contiguous() for t in (tk, zero, zero, anc, L)] + sp._inputs
    outs = {}
    for k, r in runners.items():
        kv = [c.clone() for c in ins[5:5 + len(m.layers)]]
        outs[k] = r.run(ins)
        for c, c0 in zip(ins[5:5 + len(m.layers)], kv): c.copy_(c0)
    print("bitwise equal to shipped:", {k: all(torch.equal(a, b) for a, b in zip(o, outs["shipped"])) for k, o in outs.items()})
    res = {k: [] for k in runners}
    for rnd in range(int(sys.argv[0] and 7)):
        for k, r in runners.items():
            for _ in range(20): r.run(ins)
            t0 = time.perf_counter()
            for _ in range(150): r.run(ins)
            res[k].append((time.perf_counter() - t0) / 150 * 1e3)
    base = res["shipped"]
    for k, v in res.items():
        print(k, "median ms", round(statistics.median(v), 4), "shipped/this paired median", round(statistics.median([b / x for b, x in zip(base, v)]), 3))
