import sys, statistics, torch, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from ab import chat_prompts
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
import yggtree.runtime.steps as steps_mod
import yggtree.runtime.aoti as aoti
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
prompts = chat_prompts(tok)
acc = {"tree_step": 0.0, "run": 0.0, "finish": 0.0, "n": 0}
g = eng.graphs; orig = g.tree_step
def ts(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); acc["tree_step"] += time.perf_counter() - t; acc["n"] += 1; return r
g.tree_step = ts
of = steps_mod.finish_step
def fin(*a):
    t = time.perf_counter(); r = of(*a); acc["finish"] += time.perf_counter() - t; return r
steps_mod.finish_step = fin
whole = aoti.StepPackages
sp = None
for obj in [eng.graphs] + list(vars(eng.graphs).values()):
    pass
eng.generate(prompts[0], SamplingParams(max_new_tokens=16))
import gc
sps = [o for o in gc.get_objects() if isinstance(o, aoti.StepPackages)]
for s in sps:
    for key, r in list(s.runners.items()):
        class Wrap:
            def __init__(self, r): self.r = r
            def run(self, ins):
                t = time.perf_counter(); out = self.r.run(ins); acc["run"] += time.perf_counter() - t; return out
        s.runners[key] = Wrap(r)
for p in prompts[:6]:
    for k in acc: acc[k] = 0 if k == "n" else 0.0
    r = eng.generate(p, SamplingParams(max_new_tokens=64))
    n = len(r.token_ids) - 1; per = (r.stats["total_ms"] - r.stats["ttft_ms"]) / n
    c = acc["n"]
    print(f"{per:.3f} ms/token | tree_step {acc['tree_step']*1e3/c:.3f} = run {acc['run']*1e3/c:.3f} + finish {acc['finish']*1e3/c:.3f} + other {(acc['tree_step']-acc['run']-acc['finish'])*1e3/c:.3f} | outside {per - acc['tree_step']*1e3/c:.3f}")
