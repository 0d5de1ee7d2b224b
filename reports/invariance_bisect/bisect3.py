"""Engine-like differences: W=1 step without capture vs W=k with capture (2,15,29); and buckets."""
import sys, torch
from yggtree.runtime.loading import load_model, resolve_model
from yggtree.runtime.build import pack_models
from yggtree.runtime.model import set_invariant_rows
torch._dynamo.config.recompile_limit = 256; torch._dynamo.config.cache_size_limit = 256
threads = int(sys.argv[1]); dtype = sys.argv[2]; torch.set_num_threads(threads)
src = resolve_model("default"); m = load_model(src, dtype); pack_models(m, None, min_rows=int(sys.argv[3]), src=src)
set_invariant_rows(m, 63)
S, L = 1100, 200
m.setup_cache(1, S)
g = torch.Generator().manual_seed(0)
for c in m.caches():
    c.k.copy_(torch.randn(c.k.shape, generator=g).to(c.k.dtype)); c.v.copy_(torch.randn(c.v.shape, generator=g).to(c.v.dtype))
def make(capture):
    def fwd(tokens, pos, slots, mask):
        out = m(tokens, pos, slots, mask, capture)
        return m.logits(out.hidden)
    return torch.compile(fwd, fullgraph=True, dynamic=False)
nocap, cap = make(()), make((2, 15, 29))
def inputs(w, C):
    tokens = torch.randint(0, 49152, (1, w), generator=torch.Generator().manual_seed(1))
    pos = (L + torch.arange(w))[None]; slots = pos.clone()
    s = torch.arange(C); mask = (s[None, :] <= (L + torch.arange(w))[:, None])[None]
    return tokens, pos, slots, mask
with torch.no_grad():
    base = nocap(*inputs(1, 256)).clone()
    for name, fn, w, C in [("nocap W1 C512", nocap, 1, 512), ("cap W1 C256", cap, 1, 256), ("cap W8 C256", cap, 8, 256),
                           ("nocap W8 C256", nocap, 8, 256), ("cap W32 C256", cap, 32, 256), ("cap W32 C512", cap, 32, 512)]:
        r = fn(*inputs(w, C))[:, :1]
        print(f"{dtype} t={threads} {name}: row0 logits equal {torch.equal(r, base)} max|d| {float((r-base).abs().max()):.3g}", flush=True)
