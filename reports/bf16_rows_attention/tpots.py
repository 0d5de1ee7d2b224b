"""tpot (ms) per prompt of a plan's engine, after a warm-up pass: one JSON line."""
import sys, json, torch
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make(False)
prompts = ["Write a short story about a robot who learns to paint.", "Explain how a hash map works.",
           "List five tips for better sleep.", "What causes the seasons on Earth?",
           "Describe the water cycle for a ten-year-old.", "Give me a recipe for pancakes."]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False) for p in prompts]
for i in ids: eng.generate(i, SamplingParams(max_new_tokens=8))
out = []
for i in ids:
    r = eng.generate(i, SamplingParams(max_new_tokens=64))
    out.append((r.stats["tpot_ms"], r.token_ids))
print(json.dumps({"tpot": [o[0] for o in out], "tokens": [o[1] for o in out]}))
