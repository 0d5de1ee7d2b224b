"""decode ms/token of plain decoding in one weight format (median over prompts x repeats)"""
import sys, time, json, statistics, torch
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams
fmt, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
weights = None if fmt in ("float32", "bfloat16") else fmt
dtype = "bfloat16" if fmt == "bfloat16" else "float32"
engine, tok = build_engine(EngineSpec(model="default", dtype=dtype, weights=weights, threads=threads))
texts = ["Write a short story about a robot learning to paint.", "Explain how a hash table works.",
         "List five tips for staying productive when working from home.", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
sp = SamplingParams(max_new_tokens=64, temperature=0.0)
ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False) for t in texts]
engine.generate(ids[0], sp)
ms = []
for _ in range(3):
    for i in ids:
        st = engine.generate(i, sp).stats
        ms.append((st["total_ms"] - st["ttft_ms"]) / max(1, st["new_tokens"] - 1))
print(json.dumps({"fmt": fmt, "threads": threads, "median_ms_per_token": statistics.median(ms), "all": ms}))
