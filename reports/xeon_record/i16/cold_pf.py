import statistics, sys, time, torch
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import build; build.load()
from yggtree.runtime.hugepages import huge_empty
from yggtree.runtime.kernels import load_library, prefetch
threads, rounds, copies = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads); load_library()
H, I, V, L = 576, 1536, 49152, 30
shapes = [(H + 2 * 192, H), (H, H), (2 * I, H), (H, I)] * L + [(V, H)]
g = torch.Generator().manual_seed(0)
def arena(tensors):
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)
    a = huge_empty(total); off = 0; out = []
    for t in tensors:
        nb = t.numel() * t.element_size()
        r = a[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); out.append(r); off += (nb + 63) // 64 * 64
    return out, total
def pairs(w):  # [T, K, 16] -> [T, K/2, 32] interleaved
    T, K, _ = w.shape
    return w.view(T, K // 2, 2, 16).transpose(2, 3).reshape(T, K // 2, 32).contiguous()
def model():
    ts = []
    for N, K in shapes:
        w = torch.randint(-127, 128, (N // 16, K, 16), generator=g, dtype=torch.int8)
        ts += [w, pairs(w), torch.rand(N // 16, 16, generator=g)]
    a, nb = arena(ts)
    return [tuple(a[3 * i: 3 * i + 3]) for i in range(len(shapes))], nb // 2
xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
# correctness sanity
m0, _ = model()
for w, p, s in m0[:4]:
    x = xs[w.size(1)]
    ref = torch.ops.yggtree.tiled_mm(x, w, s)
    for c in (1, 2, 4):
        y = torch.ops.proto.i16_mm(x, p, s, c)
        assert (y - ref).abs().max() / ref.abs().max() < 1e-4, ((y - ref).abs().max(), ref.abs().max())
    x4 = torch.randn(7, w.size(1))
    y4 = torch.ops.proto.i16_mm(x4, p, s, 4)
    for i in range(7): assert torch.equal(y4[i:i+1], torch.ops.proto.i16_mm(x4[i:i+1], p, s, 4))
    for c in (2, 4, 8):
        assert (torch.ops.proto.f_mm(x, w, s, c) - ref).abs().max() / ref.abs().max() < 1e-5
print("checks ok", flush=True)
models = [model() for _ in range(copies)]
nb = models[0][1]
calls = {}
for d in ((512, 16384), (1024, 8192), (2048, 32768), (512, 4096), (0, 16384), (0, 0)):
    calls[f"f4@{d}"] = (d, lambda q: torch.ops.proto.f_mm(xs[q[0].size(1)], q[0], q[2], 4))
    calls[f"i16c2@{d}"] = (d, lambda q: torch.ops.proto.i16_mm(xs[q[0].size(1)], q[1], q[2], 2))
sums = [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)]
res = {}
for rnd in range(rounds):
    for name, (d, call) in calls.items():
        torch.ops.proto.set_pf(*d)
        if True:
            for m, _ in models:
                t = time.perf_counter()
                for q in m: call(q)
                res.setdefault(name, []).append(time.perf_counter() - t)
    for s in sums:
        t = time.perf_counter(); s.sum(); res.setdefault("sum", []).append(time.perf_counter() - t)
sm = statistics.median(res["sum"])
for name, v in res.items():
    ms = statistics.median(v) * 1e3
    print(f"{name:22s} {nb/1e6:6.0f} MB {ms:7.3f} ms {nb/ms/1e6:5.1f} GB/s  {sm*1e3/ms*100:5.1f}% of sum", flush=True)
