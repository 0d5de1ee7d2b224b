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
def old_layout(q):  # q [N, K] codes -> [T, K/2, 16]
    N, K = q.shape
    pairs = q.view(N // 16, 16, K // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1).contiguous()
def new_layout(q):  # -> [T, K/8, 64]
    N, K = q.shape
    T, C = N // 16, K // 8
    Z = q.view(T, 16, C, 4, 2).permute(0, 2, 3, 1, 4).reshape(T, C, 4, 32)  # Z[t,c,j,2l+e]
    i = torch.arange(64); L, ii = i // 16, i % 16
    jlo = (ii >= 8).long(); word = 8 * L + ii % 8
    return (Z[:, :, jlo, word] | (Z[:, :, jlo + 2, word] << 4)).contiguous()
def model():
    ts = []
    for N, K in shapes:
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        ts += [old_layout(q), new_layout(q), torch.rand(N // 16, K // 32, 16, generator=g) / 64, torch.rand(N // 16, K // 32, 16, generator=g) / 64]
    a, nb = arena(ts)
    # the bytes one kernel reads: its codes, s and m (the arena also holds the other layout's codes)
    return [tuple(a[4 * i: 4 * i + 4]) for i in range(len(shapes))], sum(t.numel() * t.element_size() for t in a[1::4] + a[2::4] + a[3::4])
xs = {K: torch.randn(1, K, generator=g) for K in (H, I)}
m0, _ = model()
for o, n, s, mm in m0[:4]:
    x = xs[2 * o.size(1)]
    ref = torch.ops.yggtree.tiled_q4_mm(x, o, s, mm)
    y = torch.ops.proto.q4_mm(x, n, s, mm)
    assert (y - ref).abs().max() / ref.abs().max() < 1e-4, ((y - ref).abs().max(), ref.abs().max())
    x4 = torch.randn(7, x.size(1))
    y4 = torch.ops.proto.q4_mm(x4, n, s, mm)
    assert (y4 - torch.ops.yggtree.tiled_q4_mm(x4, o, s, mm)).abs().max() < 1e-3
    for i in range(7): assert torch.equal(y4[i:i+1], torch.ops.proto.q4_mm(x4[i:i+1], n, s, mm))
print("checks ok", flush=True)
models = [model() for _ in range(copies)]
nb = models[0][1]
calls = {}
for d in ((512, 16384), (1024, 8192), (2048, 16384)):
    calls[f"tiled_q4@{d}"] = (d, lambda q: torch.ops.yggtree.tiled_q4_mm(xs[2 * q[0].size(1)], q[0], q[2], q[3]))
    calls[f"i16q4@{d}"] = (d, lambda q: torch.ops.proto.q4_mm(xs[2 * q[0].size(1)], q[1], q[2], q[3]))
sums = [huge_empty(nb // 4 * 4).view(torch.float32).fill_(1) for _ in range(copies)]
res = {}
for rnd in range(rounds):
    for name, (d, call) in calls.items():
        torch.ops.proto.set_pf(*d)
        with prefetch(d):
            for m, _ in models:
                t = time.perf_counter()
                for q in m: call(q)
                res.setdefault(name, []).append(time.perf_counter() - t)
    for s in sums:
        t = time.perf_counter(); s.sum(); res.setdefault("sum", []).append(time.perf_counter() - t)
sm = statistics.median(res["sum"])
for name, v in res.items():
    ms = statistics.median(v) * 1e3
    print(f"{name:24s} {nb/1e6:6.0f} MB {ms:7.3f} ms {nb/ms/1e6:5.1f} GB/s  {sm*1e3/ms*100:5.1f}% of sum", flush=True)
