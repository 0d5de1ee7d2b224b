"""The default model's 121 products per token (30 layers x q/k/v, o, gate/up, down + the Q8_0 head) with
random, uncached weights: w4a8 against torch's int4 kernel. python kernel_stream.py THREADS ROWS"""
import time, torch, statistics, sys
from yggtree.runtime.w4a8 import W4A8Linear, Blocks, load_kernel
from yggtree.runtime.quant import Int4Linear, Int4Codes
torch.set_num_threads(int(sys.argv[1])); M = int(sys.argv[2])
load_kernel()
g = torch.Generator().manual_seed(0)
def blocks(N, K, bits):
    return Blocks(torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8), (torch.rand(N,K//32)/64).half(), (torch.rand(N,K//32)/64).half(), bits)
shapes = [(960,576),(576,576),(3072,576),(576,1536)]
layers = [W4A8Linear(blocks(N, K, 4), None, torch.float32) for _ in range(30) for N, K in shapes]
layers.append(W4A8Linear(blocks(49152, 576, 8), None, torch.float32))
i4 = [Int4Linear([Int4Codes(torch.randint(0,16,(N,K),dtype=torch.uint8), torch.rand(N,K//32), torch.rand(N,K//32))], None, torch.float32) for _ in range(30) for N, K in shapes]
i4.append(Int4Linear([Int4Codes(torch.randint(0,16,(49152,576),dtype=torch.uint8), torch.rand(49152,18), torch.rand(49152,18))], None, torch.float32))
xs = {K: torch.randn(M, K) for K in (576, 1536)}
def step(ls):
    for l in ls: l(xs[l.in_features])
def t(f, n=15):
    f(); f(); ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return statistics.median(ts)*1e3
for name, ls in (("w4a8", layers), ("int4", i4)):
    full = t(lambda: step(ls)); head = t(lambda: ls[-1](xs[576])); body = t(lambda: step(ls[:-1]))
    print(f"{name} threads {sys.argv[1]} M {M}: all {full:.2f} ms, layers {body:.2f}, head {head:.2f}")
