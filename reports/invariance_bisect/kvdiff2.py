import torch
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams, TreeParams
from yggtree.runtime.model import set_invariant_rows
from yggtree.data import load_prompts
torch.set_num_threads(2)
tree = TreeParams(draft_width=8, draft_depth=6, verify_width=32, top_k=8)
plain, tok = build_engine(EngineSpec(model="default", dtype="bfloat16", mode="reference", min_rows=4))
spec, _ = build_engine(EngineSpec(model="default", drafter="default", dtype="bfloat16", mode="reference", min_rows=4, tree=tree))
for e in (plain, spec): set_invariant_rows(e.target, 63)
pid, ids = load_prompts(1, 0, tok)[0]
L = len(ids); n = 18
a = plain.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0)).token_ids
ka = [c.k[0].clone() for c in plain.target.caches()]
b = spec.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0)).token_ids
kb = [c.k[0].clone() for c in spec.target.caches()]
print("tokens equal", a == b, a[:n], b[:n])
for s in range(L, L + n - 1):
    bad = [i for i in range(len(ka)) if not torch.equal(ka[i][s], kb[i][s])]
    if bad:
        print("slot", s, "(new token", s - L, ") first layer differing", bad[0], "of", len(bad), "max|d|", float((ka[bad[0]][s].float() - kb[bad[0]][s].float()).abs().max())); break
else:
    print("all decode slots equal")
print("spec stats", spec.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0)).stats.get("verify_calls"))
