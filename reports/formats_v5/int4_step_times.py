import time, statistics, torch, sys
from yggtree.plan import load_plan, artifact_dir
from yggtree.runtime.build import build_plan_engine, build_engine, EngineSpec
from yggtree.runtime.engine import SamplingParams
from yggtree.runtime.policy import FixedPolicy, StepChoice
torch.set_num_threads(2)
plan = load_plan(sys.argv[1])
eng, tok = build_plan_engine(plan, artifact_dir(plan))
def t_call(f, n=30):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
layers = eng.drafter.target_layers
vocab = eng.target.cfg.vocab_size
with torch.no_grad(), eng.graphs.frozen(), eng.drafter.frozen():
    for ctx in (128, 400):
        for w in (1, 4, 8):
            ar = torch.arange(w); anc = ar[None, :] <= ar[:, None]; L = torch.tensor(ctx)
            b = eng.graphs.bucket(ctx + w)
            print("tree_step", w, ctx, round(t_call(lambda: eng.graphs.tree_step(ar % vocab, ar, ar, anc, L, layers, b)), 2))
            print("tree_step nocap", w, ctx, round(t_call(lambda: eng.graphs.tree_step(ar % vocab, ar, ar, anc, L, (), b)), 2))
ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a hash table works."}], add_generation_prompt=True, return_dict=False)
pol = FixedPolicy(StepChoice(0, min(plan.draft_widths)), 1)
sp = SamplingParams(max_new_tokens=64)
eng.generate(ids, sp, policy=pol)
for _ in range(2):
    st = eng.generate(ids, sp, policy=pol).stats
    print("plain steps in plan engine ms/token", round((st["total_ms"] - st["ttft_ms"]) / (st["new_tokens"] - 1), 2), len(ids))
