"""Stage breakdown of the w4a8 speculative plan under fixed trees and plain steps."""
import sys, time, json, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.build import fixed_policy
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt

plan_path = sys.argv[1]
trees = [tuple(int(x) for x in t.split(",")) for t in sys.argv[2:]]  # d,wd,wv
torch.set_num_threads(2)
plan, info, make = plan_runner(plan_path)
eng, tok, pol = make()
prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(40, seed=7)[30:36]]
params = SamplingParams(max_new_tokens=64)
def run(policy, label):
    rows = []
    for rep in range(2):
        for ids in prompts:
            r = eng.generate(ids, params, policy=policy)
            rows.append(r.stats)
    st = rows[len(prompts):]
    tpot = statistics.median(s["tpot_ms"] for s in st)
    aal = statistics.mean(s.get("aal", 1) for s in st)
    stage = {}
    for s in st:
        for k, v in s.get("stage_ms", {}).items():
            stage[k] = stage.get(k, 0) + v
    steps = sum(s["verify_calls"] for s in st)
    toks = sum(s["new_tokens"] for s in st)
    per = {k: round(v / steps, 3) for k, v in stage.items()}
    print(label, f"tpot {tpot:.2f} ms  aal {aal:.2f}  ms/step {sum(stage.values())/steps:.2f}", per, flush=True)
run(pol, "objective")
for d, wd, wv in trees:
    run(fixed_policy(eng, plan, draft_width=wd, verify_width=wv, draft_depth=d), f"fixed d{d} wd{wd} wv{wv}")
e2, _, _ = make(False)
eng = e2
run(None, "plain")
