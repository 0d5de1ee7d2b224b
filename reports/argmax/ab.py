"""Paired in-process A/B: accept.argmax through numpy (new) vs ATen's argmax (old), the same engine,
prompts and tokens; tpot medians per arm, interleaved."""
import sys, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime import stages, engine as engmod, accept
from yggtree.runtime.engine import SamplingParams
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
spec = len(sys.argv) > 2
eng, tok, pol = make(spec)
prompts = ["Write a short story about a robot who learns to paint.", "Explain how a hash map works.",
           "List five tips for better sleep.", "What causes the seasons on Earth?"]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False) for p in prompts]
old = lambda l: l.argmax(dim=-1)
arms = {"new": accept.argmax, "old": old}
def use(fn):
    stages.argmax = fn; engmod.greedy = fn
res = {a: [] for a in arms}; toks = {}
for a in arms:
    use(arms[a]); [eng.generate(i, SamplingParams(max_new_tokens=16), policy=pol) for i in ids]
for rnd in range(3):
    for a, fn in (list(arms.items()) if rnd % 2 == 0 else list(arms.items())[::-1]):
        use(fn)
        for k, i in enumerate(ids):
            r = eng.generate(i, SamplingParams(max_new_tokens=64), policy=pol)
            res[a].append(r.stats["tpot_ms"])
            toks.setdefault((a, k), r.token_ids)
same = all(toks[("new", k)] == toks[("old", k)] for k in range(len(ids)))
ratios = [o / n for o, n in zip(res["old"], res["new"])]
print(sys.argv[1], "spec" if spec else "plain", "tpot new", round(statistics.median(res["new"]), 3), "old", round(statistics.median(res["old"]), 3),
      "old/new paired median", round(statistics.median(ratios), 3), "same tokens", same)
