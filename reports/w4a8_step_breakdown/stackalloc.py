"""Scratch: the w4a8 plain plan's whole step (W 1, C 256) compiled with extra inductor settings."""
import sys, time, torch, json
from pathlib import Path
from yggtree.plan import load_plan
from yggtree.offline.compile import plan_kernel, plan_min_rows
from yggtree.runtime import aoti
from yggtree.runtime.build import pack_models, plan_slots
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.model import attention_rows, set_invariant_rows
torch.set_num_threads(2)
plan = load_plan(sys.argv[1])
extra = json.loads(sys.argv[3])
src = resolve_model(plan.target)
target = load_model(src, plan.dtype)
target.setup_cache(1, plan_slots(plan))
pack_models(target, None, plan_min_rows(plan), plan.weights, src, plan.drafter, plan_kernel(plan))
set_invariant_rows(target, attention_rows(plan.prefill_chunk))
orig = aoti.package_config
aoti.package_config = lambda block: {**orig(block), **extra}
t = time.time()
aoti.compile_step_package(target, 1, 256, (), Path(sys.argv[2]))
print("compiled", sys.argv[2], round(time.time() - t), "s")
