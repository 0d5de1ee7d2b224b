"""Two builds of csrc/rows_attention.cpp in one process, alternated per step (30 layers, K/V cold, head-major
unless LAYOUT=slot); EXACT=1 asserts equal outputs. Each build is the source with its op renamed:

    sed -e 's/lib.def("rows_attention(/lib.def("rows_attention_NAME(/; s/lib.impl("rows_attention"/lib.impl("rows_attention_NAME"/; \
        s/aoti_torch_cpu_rows_attention/aoti_torch_cpu_rows_attention_NAME/' SOURCE.cpp > DIR/NAME.cpp
    AB_DIR=DIR CTX=224,480,900 WS=1,4,16 python reports/kv_head_major/prefetch_ab.py NAME_A NAME_B
"""
import time, statistics, torch, sys, os
from torch.utils import cpp_extension
from yggtree.runtime.kernels import load_library, CFLAGS, LDFLAGS
load_library()
names = sys.argv[1:3]
for n in names:
    os.makedirs(f"/tmp/ra_{n}", exist_ok=True)
    cpp_extension.load(name=f"ra_{n}_ext", sources=[os.path.join(os.environ["AB_DIR"], f"{n}.cpp")], extra_cflags=list(CFLAGS),
                       extra_ldflags=list(LDFLAGS), build_directory=f"/tmp/ra_{n}", is_python_module=False)
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
S, Hkv, D, H, T = 1074, 3, 64, 9, 32
kvd = getattr(torch, os.environ.get("KV", "float32"))
if os.environ.get("LAYOUT", "head") == "head":
    layers = [(torch.randn(1, Hkv, S, D).to(kvd).transpose(1, 2), torch.randn(1, Hkv, S, D).to(kvd).transpose(1, 2)) for _ in range(30)]
else:
    layers = [(torch.randn(1, S, Hkv, D).to(kvd), torch.randn(1, S, Hkv, D).to(kvd)) for _ in range(30)]
flush = torch.randn((64 << 20) // 4)
ops = {n: getattr(torch.ops.yggtree, f"rows_attention_{n}") for n in names}
exact = os.environ.get("EXACT", "1") == "1"
for ctx in [int(c) for c in os.environ.get("CTX", "224,480,900").split(",")]:
    for W in [int(w) for w in os.environ.get("WS", "1,4,16").split(",")]:
        q = torch.randn(1, W, H, D)
        C = 256 if ctx < 256 else (512 if ctx < 512 else S)
        mask = torch.zeros(1, W, C, dtype=torch.bool); mask[..., :ctx] = True
        for r in range(W): mask[0, r, ctx:ctx + min(r, 4)] = True  # tree-like rows
        from yggtree.runtime.model import row_window
        win, head = row_window(mask)
        a = ops[names[0]](q, layers[0][0][:, :C], layers[0][1][:, :C], head, win)
        b = ops[names[1]](q, layers[0][0][:, :C], layers[0][1][:, :C], head, win)
        if exact: assert torch.equal(a, b)
        else: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        res = {k: [] for k in names}
        for i in range(40):
            for name in (names if i % 2 else names[::-1]):
                flush.sum()
                t0 = time.perf_counter()
                for k, v in layers: ops[name](q, k[:, :C], v[:, :C], head, win)
                res[name].append((time.perf_counter() - t0) * 1e3)
        r = [x / y for x, y in zip(res[names[0]], res[names[1]])]
        print(f"ctx {ctx} W {W}: {names[0]} {statistics.median(res[names[0]]):.3f} {names[1]} {statistics.median(res[names[1]]):.3f} ms, {names[0]}/{names[1]} {statistics.median(r):.3f}", flush=True)
