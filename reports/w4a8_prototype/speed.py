import time, statistics, torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from check_w4a8 import ext, pack
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
def t(f, n=30):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
for N, K in ((49152, 576), (3072, 576), (576, 1536)):
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8); d = (torch.rand(N, K // 32) * 0.02).half().float(); m = -8 * d
    nib, dd, mm = pack(q, d, m)
    w = torch.randn(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
    sz = torch.rand(K // 32, N, 2).to(torch.bfloat16)
    for M in (1, 4, 8):
        x = torch.randn(M, K)
        xb = x.to(torch.bfloat16)
        a = t(lambda: ext.w4a8_mm(x, nib, dd, mm))
        b = t(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz))
        print(f"N {N} K {K} M {M}: w4a8 {a:.3f} ms, aten int4 {b:.3f} ms, ratio {b/a:.2f}")
