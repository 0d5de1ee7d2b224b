"""Whole-step package configs A/B: compile the plain w4a8 plan's W=1, C=256 step with inductor config
variants from the engine's own model, then time each package's run alternately in one process."""
import sys, time, statistics, os, torch
from pathlib import Path
from yggtree.bench import plan_runner
from yggtree.runtime import aoti
from yggtree.runtime.steps import finish_step
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
model = eng.target
VARIANTS = {"base": {}, "memplan": {"memory_planning": True}, "stack": {"aot_inductor.allow_stack_allocation": True}}
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
out = Path(os.environ.get("PK_DIR", "/tmp/pk_ab")); out.mkdir(exist_ok=True)
from torch._C._aoti import AOTIModelPackageLoader
runners = {}
for name in only:
    p = out / f"{name}.pt2"
    if not p.exists():
        fwd = {b: b.__dict__.pop("forward") for b in model.layers}
        try:
            cfg = aoti.package_config(model.layers[0]) | VARIANTS[name]
            ar = torch.arange(1); anc = ar[None, :] <= ar[:, None]
            kvs = [b.self_attn.cache.kv.clone() for b in model.layers]
            args = (ar.clone(), ar.clone(), ar.clone(), anc, torch.zeros((), dtype=torch.int64), *kvs,
                    *(t.detach() for _, t in aoti.model_tensors(model)))
            t = time.perf_counter()
            aoti._export_and_package(aoti._StepFn(model, 256, ()), args, cfg, p)
            print(name, "compiled", round(time.perf_counter() - t), "s", flush=True)
        finally:
            for b, f in fwd.items(): b.forward = f
    runners[name] = AOTIModelPackageLoader(str(p), "model", False, 1, -1)
sp = model.step_packages
sp(torch.tensor([1]), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.bool), torch.tensor(60), (), 256)
inputs = sp._inputs
L = torch.tensor(60); tokv = torch.tensor([42]); zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool)
ref = None
res = {n: [] for n in runners}
with torch.no_grad():
    for rnd in range(int(os.environ.get("ROUNDS", "15"))):
        for n, r in (runners.items() if rnd % 2 == 0 else reversed(list(runners.items()))):
            ins = [tokv, zero, zero, anc, L, *inputs]
            r.run(ins)
            t = time.perf_counter()
            for _ in range(30):
                x = r.run([tokv, zero, zero, anc, L, *inputs])[0]
                logits, _h = finish_step(model, x)
            res[n].append((time.perf_counter() - t) / 30 * 1e3)
            if ref is None: ref = logits.clone()
            assert torch.equal(ref, logits), n
for n, v in res.items():
    print(f"{n}: median {statistics.median(v):.3f} ms  ratio to base {statistics.median([a / b for a, b in zip(res['base'], v)]):.3f}x" if 'base' in res else f"{n}: {statistics.median(v):.3f}")
