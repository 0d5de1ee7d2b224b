"""verify-stage ms per step of plain, d3w1v4 and d4w2v8 on 6 held-out prompts x 64 (one pass after a warm-up)."""
import sys, json, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.build import fixed_policy
from yggtree.runtime.policy import FixedPolicy, StepChoice
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make()
prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(36, seed=7)[30:]]
params = SamplingParams(max_new_tokens=64)
systems = {"plain": FixedPolicy(StepChoice(0, 1), 1), "d3w1v4": fixed_policy(eng, plan, draft_width=1, verify_width=4, draft_depth=3),
           "d4w2v8": fixed_policy(eng, plan, draft_width=2, verify_width=8, draft_depth=4)}
acc = {k: {} for k in systems}
for rep in range(2):
    for ids in prompts:
        for name, p in systems.items():
            r = eng.generate(ids, params, policy=p)
            if rep == 1:
                for st, v in r.stats.get("stage_ms", {}).items():
                    acc[name].setdefault(st, []).append(v)
                acc[name].setdefault("_steps", []).append(r.stats["verify_calls"])
print(json.dumps({k: {st: sum(v) for st, v in d.items()} for k, d in acc.items()}))
