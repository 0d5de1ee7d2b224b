"""121 w4a8 products from a C++ loop: the model's own weight tensors vs copies in one arena
madvise(MADV_HUGEPAGE)'d (2 MiB pages) vs copies in one plain arena; interleaved rounds, 2 threads."""
import sys, time, statistics, ctypes, torch
from yggtree.runtime import w4a8
w4a8.load_kernel()
import importlib.util, glob  # the loop extension cloop.py builds (run cloop.py first)
spec = importlib.util.spec_from_file_location("cloop", glob.glob(str(__import__("pathlib").Path(__file__).parent / "build" / "cloop*.so"))[0]); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
torch.set_num_threads(2)
from yggtree.bench import plan_runner
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
lins = [m for m in eng.target.modules() if isinstance(m, w4a8.W4A8Linear)]
libc = ctypes.CDLL("libc.so.6")
def arena(huge):
    tensors = [t for l in lins for t in (l.codes, l.d, l.m)]
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    raw = torch.empty(total + (4 << 20), dtype=torch.uint8)
    base = raw.data_ptr(); start = (base + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    if huge:
        rc = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(total + (2 << 20)), 14)
        assert rc == 0
    off = start - base; out = []
    for t in tensors:
        n = t.numel() * t.element_size()
        v = raw[off:off + n].view(t.dtype).view(t.shape); v.copy_(t); out.append(v); off += (n + 63) // 64 * 64
    return raw, out
xs = [torch.randn(1, l.in_features) for l in lins]
own = (xs, [l.codes for l in lins], [l.d for l in lins], [l.m for l in lins])
raw_h, h = arena(True); raw_p, pl = arena(False)
hp = (xs, h[0::3], h[1::3], h[2::3]); pp = (xs, pl[0::3], pl[1::3], pl[2::3])
print(open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0].strip(), "anon huge")
for a in (own, hp, pp):
    assert torch.equal(torch.ops.yggtree.w4a8_mm(a[0][5], a[1][5], a[2][5], a[3][5]), torch.ops.yggtree.w4a8_mm(own[0][5], own[1][5], own[2][5], own[3][5]))
nb = sum(l.codes.numel() + 2 * l.d.numel() + 2 * l.m.numel() for l in lins)
T = {"own": [], "huge": [], "plain arena": []}
for rep in range(9):
    for k, a in (("own", own), ("huge", hp), ("plain arena", pp)):
        T[k].append(mod.loop(*a, 20))
for k, v in T.items():
    t = statistics.median(v); print(f"{k}: {t*1e3:.3f} ms, {nb/t/1e9:.1f} GB/s")
