"""Plain one-row step of two plans at committed lengths, interleaved rounds (paired)."""
import sys, time, statistics, torch, json
from yggtree.bench import plan_runner
torch.set_num_threads(2)
engines = []
for p in sys.argv[1:3]:
    plan, info, make = plan_runner(p)
    eng, tok, pol = make(False)
    engines.append((plan.name, eng.graphs))
zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool)
tk = torch.tensor([100])
Ls = [(60, 256), (200, 256), (400, 512), (700, 1026), (900, 1026)]
res = {}
with torch.no_grad():
    for rnd in range(5):
        for L, C in Ls:
            Lt = torch.tensor(L)
            for name, g in engines:
                for _ in range(5): g.tree_step(tk, zero, zero, anc, Lt, (), C)
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(40): g.tree_step(tk, zero, zero, anc, Lt, (), C)
                    ts.append((time.perf_counter() - t0) / 40 * 1e3)
                res.setdefault(f"{name} L{L}", []).append(statistics.median(ts))
for L, C in Ls:
    a = res[f"{engines[0][0]} L{L}"]; b = res[f"{engines[1][0]} L{L}"]
    ratios = sorted(x / y for x, y in zip(a, b))
    print(f"L {L}: {engines[0][0]} {statistics.median(a):.3f} ms, {engines[1][0]} {statistics.median(b):.3f} ms, "
          f"ratio {statistics.median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]", flush=True)
print(json.dumps(res))
