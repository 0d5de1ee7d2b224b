"""Which compiled component breaks row invariance? Each piece compiled (dynamic=False) at W=1 and
W=k; row 0 of the W=k call vs the W=1 call on the same row-0 input, bitwise."""
import sys, math, torch, torch.nn.functional as F
from yggtree.runtime.model import RMSNorm, _rows_attention, apply_rope
torch.manual_seed(0); torch._dynamo.config.recompile_limit = 256; torch._dynamo.config.cache_size_limit = 256
threads = int(sys.argv[1]); torch.set_num_threads(threads)
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
H, HKV, D, HID = 9, 3, 64, 576
def same(a, b): return bool(torch.equal(a, b)), float((a.float() - b.float()).abs().max())
def check(name, fn, make, widths=(2, 8, 32)):
    comp = torch.compile(fn, fullgraph=True, dynamic=False)
    for w in widths:
        args = make(w)
        one = comp(*[a[:, :1] if getattr(a, "_row", False) else a for a in args])
        full = comp(*[a for a in args])
        eq, diff = same(full[:, :1], one)
        print(f"{name:28s} W={w:3d}: row0 {'EQUAL' if eq else 'DIFFERS'} max|d|={diff:.3g}", flush=True)
def rowed(t): t._row = True; return t
norm = RMSNorm(HID, 1e-5); norm.weight.data = torch.rand(HID) + 0.5; norm = norm.to(dtype)
check("rmsnorm", lambda x: norm(x), lambda w: [rowed(torch.randn(1, w, HID).to(dtype))])
for C in (256, 1024):
    k = torch.randn(1, C, HKV, D).to(dtype); v = torch.randn(1, C, HKV, D).to(dtype)
    def rows_attn(q, mask): return _rows_attention(q, k, v, mask)
    def grouped(q, mask):
        bsz, w = q.shape[:2]; g = H // HKV
        qg = q.view(bsz, w, HKV, g, D).permute(0, 2, 3, 1, 4).reshape(bsz, HKV, g * w, D)
        s = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() / math.sqrt(D)
        s = s.view(bsz, HKV, g, w, -1).masked_fill(~mask[:, None, None], float("-inf"))
        p = torch.softmax(s, -1).to(v.dtype).view(bsz, HKV, g * w, -1)
        o = torch.matmul(p, v.permute(0, 2, 1, 3))
        return o.view(bsz, HKV, g, w, D).permute(0, 3, 1, 2, 4).reshape(bsz, w, H * D)
    mk = lambda w: [rowed(torch.randn(1, w, H, D).to(dtype)), rowed(torch.ones(1, w, C, dtype=torch.bool))]
    check(f"rows-attention C={C}", rows_attn, mk)
    check(f"grouped-attention C={C}", grouped, mk)
cos = torch.rand(1, 32, 1, D // 2); sin = torch.rand(1, 32, 1, D // 2)
check("rope", lambda x, c, s: apply_rope(x, c, s), lambda w: [rowed(torch.randn(1, w, H, D).to(dtype)), rowed(cos[:, :w]), rowed(sin[:, :w])])
check("silu*up", lambda a, b: F.silu(a) * b, lambda w: [rowed(torch.randn(1, w, 1536).to(dtype)), rowed(torch.randn(1, w, 1536).to(dtype))])
