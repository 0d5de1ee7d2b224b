"""The drafter's prompt prefill (eagle.prefill, what the objective's "resync" stage runs) timed warm on
the prompt the engine gave it, 2 threads.

    OMP_NUM_THREADS=2 python reports/attention_spec/drafter_prefill.py profiles/epyc-2core-w4a8.yaml
"""
import sys, time, torch
from yggtree.bench import plan_runner
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, pol = make()
prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(36, seed=7)[30:]]
d = eng.drafter
orig = d.prefill
cap = {}
def grab(seq, feats, start=0):
    cap["a"] = (seq.clone(), tuple(f.clone() for f in feats), start); return orig(seq, feats, start)
d.prefill = grab
eng.generate(prompts[0], SamplingParams(max_new_tokens=8), policy=pol)
seq, feats, start = cap["a"]
for _ in range(3): orig(seq, feats, start)

for i in range(5):
    t0 = time.perf_counter(); orig(seq, feats, start); print("warm call ms", round((time.perf_counter() - t0) * 1e3, 1))
ids = prompts[1]
cap.clear()
t0 = time.perf_counter(); eng.generate(ids, SamplingParams(max_new_tokens=8), policy=pol); print("generate ms", round((time.perf_counter() - t0) * 1e3, 1))
seq, feats, start = cap["a"]
print("threads", torch.get_num_threads())
for i in range(3):
    t0 = time.perf_counter(); orig(seq, feats, start); print("warm call ms (prompt 1)", len(seq), round((time.perf_counter() - t0) * 1e3, 1))

