"""A chain of DEPTH drafted and verified whole by a plan's reference engine on the held-out
selection prompts of scripts/compare_drafters.py (chunk 4000+): P(accepted >= d) per step and
the accepted tokens per step, to set against compare_drafters' offline figures.

    OMP_NUM_THREADS=2 python reports/drafter_w4a8/chain_engine.py profiles/epyc-2core.yaml 48 4 2
"""
import sys, time
from dataclasses import replace
import numpy as np, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from compare_drafters import selection_prompts
from yggtree.plan import load_plan
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import TreeParams, SamplingParams
from yggtree.runtime.policy import FixedPolicy, StepChoice
from yggtree.runtime.loading import encode_auto

plan = load_plan(sys.argv[1]); n = int(sys.argv[2]); D = int(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
spec = EngineSpec.from_plan(plan, mode="reference")
spec = replace(spec, tree=TreeParams(1, D, D + 1, plan.top_k), draft_widths=(1,), verify_widths=(D + 1,))
engine, tok = build_engine(spec)
texts = selection_prompts(4000, n, 0)
acc = []
t0 = time.time()
for i, t in enumerate(texts):
    ids = encode_auto(tok, t)[-(640):]
    recs = []
    engine.generate(ids, SamplingParams(max_new_tokens=128), policy=FixedPolicy(StepChoice(D, 1), D + 1), on_step=recs.append)
    acc += [r.n_accepted for r in recs]
    a = np.array(acc)
    print(i, len(recs), "P>=d", " ".join(f"{(a >= d).mean():.3f}" for d in range(1, D + 1)), f"AAL {1 + a.mean():.3f}", f"{time.time()-t0:.0f}s", flush=True)
