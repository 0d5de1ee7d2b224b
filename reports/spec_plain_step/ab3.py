"""Why a speculative plan's plain steps cost more than the plain plan's: one process, 8 chat prompts of our own x N,
order rotating by prompt; A = the plain plan (no drafter), C = the speculative plan without its drafter
(--no-speculate: its own target packages), B = the speculative plan decoding plain steps with its drafter loaded
(FixedPolicy D=0, as reports/spec_packages/stages.py's "plain"). usage: ab3.py PLAIN_PLAN SPEC_PLAN [ROUNDS] [N]"""
import statistics, sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from ab import chat_prompts
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
from yggtree.runtime.policy import FixedPolicy, StepChoice
torch.set_num_threads(2)
plain_path, spec_path = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2; n = int(sys.argv[4]) if len(sys.argv) > 4 else 64
ea, tok, _ = plan_runner(plain_path)[2](False)
mk = plan_runner(spec_path)[2]
ec, _, _ = mk(False)
eb, _, _ = mk(True)
params = SamplingParams(max_new_tokens=n)
def run(eng, ids, policy=None):
    r = eng.generate(ids, params, policy=policy) if policy is not None else eng.generate(ids, params)
    return (r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1), r.token_ids, r.stats.get("stage_ms", {})
systems = {"A plain plan": lambda ids: run(ea, ids), "C spec plan, no drafter": lambda ids: run(ec, ids),
           "B spec plan, plain steps": lambda ids: run(eb, ids, FixedPolicy(StepChoice(0, 1), 1))}
prompts = chat_prompts(tok)
for f in systems.values():
    f(prompts[0])
ms = {k: [] for k in systems}; toks = {k: [] for k in systems}; stages = {k: {} for k in systems}
names = list(systems)
for rnd in range(rounds):
    for i, ids in enumerate(prompts):
        order = names[(i + rnd) % 3:] + names[:(i + rnd) % 3]
        for k in order:
            t, out, st = systems[k](ids); ms[k].append(t); toks[k].append(out)
            for s, v in st.items():
                stages[k][s] = stages[k].get(s, 0) + v
for k in names:
    r = [b / a for a, b in zip(ms[names[0]], ms[k])]
    steps = len(prompts) * rounds * (n - 1)
    print(f"{k:26s} {statistics.median(ms[k]):.3f} ms/token  x A's time {statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}]  "
          f"same as A {sum(x == y for x, y in zip(toks[k], toks[names[0]]))}/{len(r)}  "
          f"stage ms/token {({s: round(v / steps, 3) for s, v in stages[k].items() if v})}", flush=True)
