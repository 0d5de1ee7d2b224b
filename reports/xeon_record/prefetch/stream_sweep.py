"""121 one-row products of the default model's shapes, tiled [T, K, 16], 2 chains (the shipped arithmetic),
the software prefetch distance swept at run time, rounds interleaved. usage: sweep.py THREADS ROUNDS"""
import sys, statistics, torch
from torch.utils.cpp_extension import load_inline
from pathlib import Path
torch.set_num_threads(int(sys.argv[1]))
m = load_inline("chains_rt", cpp_sources=Path(__file__).with_name("stream_src.cpp").read_text(), functions=["bench"],
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
H, I, V, L = 576, 1536, 49152, 30
shapes = [(H, H + 2 * 192), (H, H), (H, 2 * I), (I, H)] * L + [(H, V)]
PFS = (0, 512, 1024, 2048, 4096, 8192, 16384)
g = torch.Generator().manual_seed(0)
for dt in (torch.int8, torch.bfloat16, torch.float32):
    ws, ss, xs = [], [], []
    for K, N in shapes:
        w = (torch.randint(-127, 128, (N // 16, K, 16), generator=g, dtype=torch.int8) if dt == torch.int8
             else torch.randn(N // 16, K, 16, generator=g).to(dt))
        ws.append(w); ss.append(torch.rand(N // 16, 16, generator=g) if dt == torch.int8 else torch.empty(0))
        xs.append(torch.randn(K, generator=g))
    nb = sum(w.numel() * w.element_size() for w in ws)
    res = {p: [] for p in PFS}
    for rnd in range(int(sys.argv[2])):
        for p in PFS:
            res[p].append(m.bench(ws, ss, xs, 2, 2, p))
    base = statistics.median(res[1024])
    print(dt, f"{nb/1e6:.0f} MB", " | ".join(f"{p}: {nb/statistics.median(v)/1e9:.1f} GB/s {base/statistics.median(v):.3f}x" for p, v in res.items()), flush=True)
