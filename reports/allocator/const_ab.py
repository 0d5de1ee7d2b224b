"""Weights as AOTInductor constants (user-managed, loaded from the model's own tensors) against weights
as inputs: the plain w4a8 plan's W=1, C=256 step, both compiled here from the engine's model, alternated."""
import sys, time, statistics, os, torch
from pathlib import Path
from yggtree.bench import plan_runner
from yggtree.runtime import aoti
from yggtree.runtime.steps import finish_step
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
model = eng.target
n_layers = len(model.layers)

class ConstStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.step = aoti._TreeStep(model, 256, ())
    def forward(self, tokens, depth, node, anc, committed, *kvs):
        state = {f"step.model.layers.{i}.self_attn.cache.kv": kv for i, kv in enumerate(kvs)}
        return torch.func.functional_call(self, state, (tokens, depth, node, anc, committed), strict=False, tie_weights=True) if False else self._run(state, tokens, depth, node, anc, committed)
    def _run(self, state, *a):
        return torch.func.functional_call(self.step, {k[5:]: v for k, v in state.items()}, a)

out = Path(os.environ.get("PK_DIR", "/tmp/pk_ab")); out.mkdir(exist_ok=True)
from torch._C._aoti import AOTIModelPackageLoader
pb, pc = out / "base.pt2", out / "const.pt2"
fwd = {b: b.__dict__.pop("forward") for b in model.layers}
try:
    cfg = aoti.package_config(model.layers[0])
    ar = torch.arange(1); anc = ar[None, :] <= ar[:, None]
    kvs = [b.self_attn.cache.kv.clone() for b in model.layers]
    if not pb.exists():
        args = (ar.clone(), ar.clone(), ar.clone(), anc, torch.zeros((), dtype=torch.int64), *kvs,
                *(t.detach() for _, t in aoti.model_tensors(model)))
        aoti._export_and_package(aoti._StepFn(model, 256, ()), args, cfg, pb)
    if not pc.exists():
        t = time.perf_counter()
        args = (ar.clone(), ar.clone(), ar.clone(), anc, torch.zeros((), dtype=torch.int64), *kvs)
        aoti._export_and_package(ConstStep(), args, cfg | {"aot_inductor.package_constants_in_so": False}, pc)
        print("const compiled", round(time.perf_counter() - t), "s", flush=True)
finally:
    for b, f in fwd.items(): b.forward = f
rb = AOTIModelPackageLoader(str(pb), "model", False, 1, -1)
rc = AOTIModelPackageLoader(str(pc), "model", False, 1, -1)
fqns = rc.get_constant_fqns()
print(len(fqns), fqns[:5])
named = dict(ConstStep().named_parameters(remove_duplicate=False)) | dict(ConstStep().named_buffers(remove_duplicate=False))
cmap = {f: named[f] for f in fqns}
rc.load_constants(cmap, False, True, True)
sp = model.step_packages
inputs = [*(b.self_attn.cache.kv for b in model.layers), *(t for _, t in aoti.model_tensors(model))]
kvl = inputs[:n_layers]
L = torch.tensor(60); tokv = torch.tensor([42]); zero = torch.zeros(1, dtype=torch.int64); anc = torch.ones(1, 1, dtype=torch.bool)
calls = {"base": lambda: rb.run([tokv, zero, zero, anc, L, *inputs])[0],
         "const": lambda: rc.run([tokv, zero, zero, anc, L, *kvl])[0]}
ref = None; res = {n: [] for n in calls}
with torch.no_grad():
    for rnd in range(int(os.environ.get("ROUNDS", "20"))):
        for n, f in (calls.items() if rnd % 2 == 0 else reversed(list(calls.items()))):
            f()
            t = time.perf_counter()
            for _ in range(30):
                logits, _h = finish_step(model, f())
            res[n].append((time.perf_counter() - t) / 30 * 1e3)
            if ref is None: ref = logits.clone()
            assert torch.equal(ref, logits), n
for n, v in res.items():
    print(f"{n}: median {statistics.median(v):.3f} ms  base/this per round {statistics.median([a / b for a, b in zip(res['base'], v)]):.3f}x")
