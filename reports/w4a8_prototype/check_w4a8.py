import time, statistics, torch
from torch.utils.cpp_extension import load
ext = load("w4a8", [str(__import__("pathlib").Path(__file__).with_name("w4a8.cpp"))], extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma"], verbose=False)

def pack(q, d, m):  # q [N, K] uint8 0..15, d, m [N, K/32] float16 values (as GGUF stores them)
    N, K = q.shape; T, B = N // 16, K // 32
    t = q.view(T, 16, B, 32).permute(0, 2, 1, 3)  # [T, B, lane, 32]
    lo = t[..., :16].reshape(T, B, 16, 4, 4).permute(0, 1, 3, 2, 4)  # [T, B, g, lane, i]
    hi = t[..., 16:].reshape(T, B, 16, 4, 4).permute(0, 1, 3, 2, 4)
    nib = (lo | (hi << 4)).contiguous().view(T, B, 256)
    dd = d.view(T, 16, B).permute(0, 2, 1).contiguous().half()
    mm = m.view(T, 16, B).permute(0, 2, 1).contiguous().half()
    return nib, dd, mm

def ref(x, q, d, m):  # the same math in float64: quantized activations times exact weights
    M, K = x.shape
    xb = x.view(M, K // 32, 32).double()
    da = xb.abs().amax(-1, keepdim=True) / 127
    qa = torch.where(da > 0, torch.round(xb / da), torch.zeros_like(xb))
    xa = (qa * da).view(M, K)
    w = (d.double().repeat_interleave(32, 1) * q.double() + m.double().repeat_interleave(32, 1))
    return xa @ w.T

torch.manual_seed(0)
for N, K in ((576, 576), (3072, 576), (576, 1536), (49152, 576)):
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    d = (torch.rand(N, K // 32) * 0.02).half().float()  # float16 values, as a GGUF file holds
    m = -8 * d
    nib, dd, mm = pack(q, d, m)
    x = torch.randn(8, K)
    y = ext.w4a8_mm(x, nib, dd, mm)
    r = ref(x, q, d, m)
    err = ((y.double() - r).abs().max() / r.abs().max()).item()
    inv = all(torch.equal(ext.w4a8_mm(x[:k].contiguous(), nib, dd, mm), y[:k]) for k in range(1, 9))
    row1 = all(torch.equal(ext.w4a8_mm(x[i:i+1].contiguous(), nib, dd, mm)[0], y[i]) for i in range(8))
    print(N, K, "rel err", f"{err:.2e}", "batch-invariant", inv and row1)
