"""Where one plain (W = 1) step of a compiled plan's plain engine spends its time: the whole
tree_step, the 30 package runs inside it, the head. OMP_NUM_THREADS=2 python steptime.py PLAN"""
import sys, time, statistics, torch

from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
from yggtree.runtime import aoti
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a hash table works."}], add_generation_prompt=True, return_dict=False)
eng.generate(ids, SamplingParams(max_new_tokens=8))
run_s = [0.0]
orig = aoti.PackagedForward.__call__
def timed(self, *a):
    t = time.perf_counter(); r = orig(self, *a); run_s[0] += time.perf_counter() - t; return r
m = eng.target
L = torch.tensor(len(ids) + 4)
zero = torch.zeros(1, dtype=torch.int64)
anc = torch.ones(1, 1, dtype=torch.bool)
tokv = torch.tensor([42])
def step():
    return eng.graphs.tree_step(tokv, zero, zero, anc, L, (), eng.graphs.bucket(int(L) + 1))
with torch.no_grad():
    for _ in range(20): step()
    tot, runs, head = [], [], []
    for rep in range(7):
        aoti.PackagedForward.__call__ = orig
        t = time.perf_counter()
        for _ in range(50): step()
        tot.append((time.perf_counter() - t) / 50 * 1e3)
        aoti.PackagedForward.__call__ = timed
        run_s[0] = 0.0
        for _ in range(50): step()
        runs.append(run_s[0] / 50 * 1e3)
        h = torch.randn(1, m.cfg.hidden_size)
        t = time.perf_counter()
        for _ in range(50): m.logits(m.norm(h))
        head.append((time.perf_counter() - t) / 50 * 1e3)
    aoti.PackagedForward.__call__ = orig
print(f"step {statistics.median(tot):.3f} ms; 30 block calls {statistics.median(runs):.3f} ms; norm + head {statistics.median(head):.3f} ms; "
      f"rest {statistics.median(tot) - statistics.median(runs) - statistics.median(head):.3f} ms")
