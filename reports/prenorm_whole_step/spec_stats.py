"""One prompt (64 tokens) on a speculative plan: the engine's counters, stage times and each step's (D, W_v):
``OMP_NUM_THREADS=2 python reports/prenorm_whole_step/spec_stats.py PLAN``."""
import sys, json, time, torch
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make(True)
ids = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a robot who learns to paint."}], add_generation_prompt=True, return_dict=False)
for rep in range(2):
    steps = []
    t = time.perf_counter()
    r = eng.generate(ids, SamplingParams(max_new_tokens=64), policy=pol, on_step=lambda rec: steps.append(rec))
    dt = time.perf_counter() - t
print(len(ids), "prompt tokens", round(dt * 1e3, 1), "ms total")
print({k: v for k, v in r.stats.items() if not isinstance(v, (list, dict))})
for k, v in r.stats.items():
    if isinstance(v, dict): print(k, {a: (round(b, 3) if isinstance(b, float) else b) for a, b in v.items()})
print([ (s.choice.draft_depth, s.verify_width) for s in steps][:70])
