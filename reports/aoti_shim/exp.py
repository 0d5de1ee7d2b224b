"""Per-call overheads of an AOTInductor package: runner.run with many inputs, and a custom op
called through the proxy executor vs a C shim. python reports/aoti_shim/exp.py (one thread; shim.cpp calls the op through the typed dispatcher, a stand-in for the C shim now in csrc/w4a8.cpp)"""
import ctypes, os, sys, tempfile, time, statistics, torch
from pathlib import Path
HERE = Path(__file__).resolve().parent
BUILD = Path(tempfile.mkdtemp(prefix="ygg_shim_"))
from torch.utils import cpp_extension
from yggtree.runtime.w4a8 import load_kernel, pack_blocks, Blocks
torch.set_num_threads(1)
load_kernel()
so = cpp_extension.load(name="ygg_shim_exp", sources=[str(HERE / "shim.cpp")], build_directory=str(BUILD),
                        is_python_module=False, verbose=False)
lib = str(BUILD / "ygg_shim_exp.so")
ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
g = torch.Generator().manual_seed(0)
N = K = 64
b = Blocks(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8), (torch.rand(N, K//32, generator=g)/64).half(),
           (torch.rand(N, K//32, generator=g)/64).half(), 4)
W = [t for _ in range(6) for t in pack_blocks(b)]  # 6 products' weights: 18 inputs
class F(torch.nn.Module):
    def forward(self, x, *w):
        for i in range(0, len(w), 3):
            x = torch.ops.yggtree.w4a8_mm(x, w[i], w[i+1], w[i+2]) * 0.5 + x
        return x
x = torch.randn(1, K)
ep = torch.export.export(F(), (x, *W), strict=False)
from torch._C._aoti import AOTIModelPackageLoader
res = {}
for name, cfg in (("proxy", {}), ("shim", {"aot_inductor.custom_ops_to_c_shims": {torch.ops.yggtree.w4a8_mm.default: [
        "AOTITorchError aoti_torch_cpu_w4a8_mm(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle d, AtenTensorHandle m, AtenTensorHandle* ret0)"]}})):
    p = torch._inductor.aoti_compile_and_package(ep, package_path=str(BUILD / f"{name}.pt2"), inductor_configs={"size_asserts": False, **cfg})
    r = AOTIModelPackageLoader(p, "model", False, 1, -1)
    args = [x, *W]
    out = r.run(args)[0]
    assert torch.equal(out, F()(x, *W)), name
    for _ in range(200): r.run(args)
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(200): r.run(args)
        ts.append((time.perf_counter() - t) / 200 * 1e6)
    res[name] = statistics.median(ts)
    print(name, f"{res[name]:.1f} us per run (6 products + 6 fused kernels, 19 inputs)", flush=True)
e = []
for _ in range(15):
    t = time.perf_counter()
    for _ in range(200): torch.ops.yggtree.w4a8_mm(x, *W[:3])
    e.append((time.perf_counter() - t) / 200 * 1e6)
print(f"eager python call of one product: {statistics.median(e):.1f} us")
