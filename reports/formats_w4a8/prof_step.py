"""Where a plain decode step's time goes (torch profiler over compiled plain decoding)."""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams
fmt, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
import os
if os.environ.get("NO_INLINE"): torch._dynamo.config.inline_inbuilt_nn_modules = False
weights = None if fmt in ("float32", "bfloat16") else fmt
dtype = "bfloat16" if fmt == "bfloat16" else "float32"
engine, tok = build_engine(EngineSpec(model="default", dtype=dtype, weights=weights, threads=threads))
ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a hash table works."}], add_generation_prompt=True, return_dict=False)
sp = SamplingParams(max_new_tokens=64, temperature=0.0)
engine.generate(ids, sp)
st = engine.generate(ids, sp).stats
print("ms/token", (st["total_ms"] - st["ttft_ms"]) / (st["new_tokens"] - 1))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    st = engine.generate(ids, sp).stats
n = st["new_tokens"] - 1
print("ms/token (profiled)", (st["total_ms"] - st["ttft_ms"]) / n)
rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
tot = sum(e.self_cpu_time_total for e in rows)
for e in rows[:25]:
    print(f"{e.key[:70]:70s} {e.count/ (n+1):8.1f}/tok {e.self_cpu_time_total/1e3/(n+1):8.3f} ms/tok")
print("total self ms/tok", tot / 1e3 / (n + 1))
