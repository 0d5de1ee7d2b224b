"""How often the w4a8 plan's objective speculates on three chat prompts of our own (64 new tokens,
2 threads, the plan's policy shared across the prompts as in one process): tokens, verify calls,
plain steps, drafter resyncs, draft calls and AAL per prompt (issue #20; counts, not timings).

    OMP_NUM_THREADS=2 python reports/plain_loop/probes.py
"""
import torch
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
torch.set_num_threads(2)
plan, info, make = plan_runner("profiles/epyc-2core-w4a8.yaml")
eng, tok, pol = make()
sp = SamplingParams(max_new_tokens=64)
for q in ["Explain how a hash table works.", "Write a short poem about the sea.", "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]:
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
    st = eng.generate(ids, sp, policy=pol).stats
    print({k: st.get(k) for k in ("new_tokens", "verify_calls", "plain_steps", "resyncs", "draft_calls", "aal")})
