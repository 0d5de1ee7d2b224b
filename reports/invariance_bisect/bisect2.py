"""Real model, whole forward compiled (dynamic=False) at W=1 and W=k: which layer's row 0 first
differs? Row-by-row attention everywhere (set_invariant_rows), packed products padded to 2."""
import sys, torch
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.build import pack_models
from yggtree.runtime.model import set_invariant_rows
torch._dynamo.config.recompile_limit = 256; torch._dynamo.config.cache_size_limit = 256
threads = int(sys.argv[1]); dtype = sys.argv[2]; nested = sys.argv[3] == "nested"; rows_all = sys.argv[4] == "rows"
torch.set_num_threads(threads)
src = resolve_model("default"); m = load_model(src, dtype); pack_models(m, None, min_rows=2, src=src)
if rows_all: set_invariant_rows(m, 64)
S, C, L = 8192, int(sys.argv[5]), int(sys.argv[5]) - 60  # cache slots, context bucket, committed prefix
m.setup_cache(1, S)
g = torch.Generator().manual_seed(0)
for c in m.caches():  # a random committed prefix
    for t in (c.k, c.v) if hasattr(c, "k") else c.tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
capture = tuple(range(len(m.layers)))
if not nested:
    import yggtree.runtime.model as M
    M._block = M._run_block  # plain call: one flat graph
def fwd(tokens, pos, slots, mask):
    out = m(tokens, pos, slots, mask, capture)
    return out.hidden, out.layers, m.logits(out.hidden)
comp = torch.compile(fwd, fullgraph=True, dynamic=False)
def inputs(w):
    tokens = torch.randint(0, 49152, (1, w), generator=torch.Generator().manual_seed(1))
    pos = (L + torch.arange(w))[None]; slots = pos.clone()
    s = torch.arange(C); mask = (s[None, :] <= (L + torch.arange(w))[:, None])[None]
    return tokens, pos, slots, mask
with torch.no_grad():
    t1 = inputs(32)
    one = comp(t1[0][:, :1], t1[1][:, :1], t1[2][:, :1], t1[3][:, :1])
    one = (one[0].clone(), tuple(x.clone() for x in one[1]), one[2].clone())
    for w in (2, 8, 32):
        full = comp(t1[0][:, :w], t1[1][:, :w], t1[2][:, :w], t1[3][:, :w])
        first = next((i for i, (a, b) in enumerate(zip(full[1], one[1])) if not torch.equal(a[:, :1], b)), None)
        print(f"{dtype} threads={threads} nested={nested} rows={rows_all} W={w}: first differing layer {first}, "
              f"hidden equal {torch.equal(full[0][:, :1], one[0])}, logits equal {torch.equal(full[2][:, :1], one[2])}, "
              f"max|dlogit| {float((full[2][:, :1]-one[2]).abs().max()):.3g}", flush=True)
