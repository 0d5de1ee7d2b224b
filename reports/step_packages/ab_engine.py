"""Paired A/B of the plan's plain engine: whole-step packages vs block packages only; decode ms/token
(prefill excluded) on 8 chat prompts of our own, 64 new tokens, alternating, 3 rounds."""
import sys, time, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
sp = eng.target.step_packages
qs = ["Explain how a hash table works.", "Write a haiku about autumn rain.", "What causes the seasons on Earth?",
      "Give three tips for writing clean Python code.", "Summarise the plot of Romeo and Juliet.",
      "How do I reverse a linked list in C?", "Compare TCP and UDP briefly.", "Why is the sky blue?"]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False) for q in qs]
p = SamplingParams(max_new_tokens=64)
def dec(path, ids):
    eng.target.step_packages = path
    r = eng.generate(ids, p)
    return (r.stats["total_ms"] - r.stats["ttft_ms"]), len(r.token_ids) - 1, r.token_ids
dec(sp, prompts[0]); dec(None, prompts[0])
A, B, same = [], [], 0
for rnd in range(3):
    for i, ids in enumerate(prompts):
        order = (sp, None) if (i + rnd) % 2 == 0 else (None, sp)
        res = {id(o): dec(o, ids) for o in order}
        a, b = res[id(sp)], res[id(None)]
        A.append(a[0] / a[1]); B.append(b[0] / b[1]); same += a[2] == b[2]
eng.target.step_packages = sp
ratios = [b / a for a, b in zip(A, B)]
print(f"whole-step {statistics.median(A):.3f} ms/token, blocks {statistics.median(B):.3f} ms/token, speed-up median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); identical {same}/{len(A)}")
