"""Where the w4a8 plan's speculative engine spends a request's decode time against its plain engine,
on chat prompts of our own (not MT-Bench/HumanEval): drafter prefills (prompt + resyncs), plain
steps, drafted steps, and the feedback's state after each request.
    OMP_NUM_THREADS=2 python diag.py PLAN [N_PROMPTS]"""
import sys, time, statistics, torch

from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
torch.set_num_threads(2)
plan_path = sys.argv[1]
plan, info, make = plan_runner(plan_path)
eng, tok, pol = make()
dp = eng.drafter.prefill
tpre = []
def timed_prefill(*a, **k):
    t = time.perf_counter(); r = dp(*a, **k); tpre.append((time.perf_counter() - t) * 1e3, ); return r
eng.drafter.prefill = timed_prefill
sp = SamplingParams(max_new_tokens=64)
qs = ["Explain how a hash table works.", "Write a short poem about the sea.",
      "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
      "What are three tips for staying focused while studying?", "Summarise the plot of a heist movie in five sentences.",
      "Compare Python lists and tuples.", "Write a function that checks whether a string is a palindrome.",
      "Give me a recipe for pancakes."]
qs = qs[: int(sys.argv[2]) if len(sys.argv) > 2 else len(qs)]
for rep in range(2):
    for q in qs:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        recs = []; tpre.clear()
        r = eng.generate(ids, sp, policy=pol, on_step=recs.append)
        st = r.stats
        if rep == 0:
            continue
        dec = st["total_ms"] - st["ttft_ms"]
        plain = [sum(x.stage_ms.values()) for x in recs if x.choice.draft_depth == 0]
        drafted = [x for x in recs if x.choice.draft_depth]
        fb = pol.feedback
        print(f"prompt {len(ids):4d} tok  decode {dec:6.1f} ms  ({dec/(st['new_tokens']-1):.2f}/tok) steps {len(recs)} plain {len(plain)} "
              f"sum {sum(plain):6.1f} (median {statistics.median(plain):.2f})  drafter prefills {[round(x,1) for x in tpre]}")
        for x in drafted:
            print(f"    drafted D{x.choice.draft_depth} Wd{x.choice.draft_width} Wv{x.verify_width} acc {x.n_accepted} "
                  f"total {sum(x.stage_ms.values()):.1f} ms", {k: round(v, 2) for k, v in x.stage_ms.items() if v > 0.1})
        print(f"    feedback machine {fb.machine:.3f} spec_extra {fb.spec_extra:.3f} widths { {k: round(v,3) for k,v in fb._width.items()} } "
              f"scale D1..4 {[round(fb.accept_scale_at(d),3) for d in range(1,5)]}")
print("plain step stage means:", {k: round(statistics.mean(x.stage_ms.get(k, 0) for x in recs if x.choice.draft_depth == 0), 3) for k in recs[0].stage_ms})
