"""The spec plan's drafter head call (one whole-call package) hot and after a 128 MB sum evicts it, medians of 50: PLAN.yaml"""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.build import fixed_policy
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make()
ids = encode_prompt(tok, calibration_chat_prompts(31, seed=7)[30].text)
r = eng.generate(ids, SamplingParams(max_new_tokens=16), policy=fixed_policy(eng, plan, draft_width=1, verify_width=4, draft_depth=3))
root = torch.tensor(42); L = torch.tensor(len(ids) + 10); k = eng.envelope.top_k
flush = torch.ones(32 * 2**20)
ts, tc = [], []
with torch.no_grad():
    for i in range(60):
        t = time.perf_counter(); eng.drafter.head(root, L, k); dt = time.perf_counter() - t
        if i >= 10: ts.append(dt * 1e3)
        flush.sum()  # evict (the target's step streams ~98 MB between drafter calls)
        t = time.perf_counter(); eng.drafter.head(root, L, k); dt = time.perf_counter() - t
        if i >= 10: tc.append(dt * 1e3)
print(f"head_hot={statistics.median(ts):.3f} head_after_flush={statistics.median(tc):.3f}")
