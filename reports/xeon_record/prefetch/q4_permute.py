"""The 4-bit tiled kernel (one row): codes to float32 by conversion (shipped) against a 16-entry table permute (vpermps),
the default model's 121 product shapes, G 32, random codes; outputs compared bitwise; rounds interleaved."""
import statistics, sys, torch
from pathlib import Path
from torch.utils.cpp_extension import load_inline
torch.set_num_threads(int(sys.argv[1])); pf = int(sys.argv[2])
m = load_inline("q4perm", cpp_sources=Path(__file__).with_name("q4_permute_src.cpp").read_text(), functions=["bench"],
                extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
H, I, V, L, G = 576, 1536, 49152, 30, 32
shapes = [(H, H + 2 * 192), (H, H), (H, 2 * I), (I, H)] * L + [(H, V)]
g = torch.Generator().manual_seed(0)
cs, ss, ms, xs, xss, outs = [], [], [], [], [], []
for K, N in shapes:
    cs.append(torch.randint(0, 256, (N // 16, K // 2, 16), generator=g, dtype=torch.uint8))
    ss.append(torch.rand(N // 16, K // G, 16, generator=g)); ms.append(torch.rand(N // 16, K // G, 16, generator=g))
    x = torch.randn(K, generator=g); xs.append(x); xss.append(x.view(-1, G).sum(1)); outs.append(torch.empty(N))
nb = sum(t.numel() * t.element_size() for t in cs + ss + ms)
m.bench(cs, ss, ms, xs, xss, outs, False, pf, 1); ref = [o.clone() for o in outs]
m.bench(cs, ss, ms, xs, xss, outs, True, pf, 1)
print("bitwise equal:", all(torch.equal(a, b) for a, b in zip(ref, outs)))
res = {False: [], True: []}
for rnd in range(15):
    for p in (False, True):
        res[p].append(m.bench(cs, ss, ms, xs, xss, outs, p, pf, 2))
a, b = statistics.median(res[False]), statistics.median(res[True])
print(f"{nb/1e6:.0f} MB, threads {sys.argv[1]}, prefetch {pf}: convert {a*1e3:.3f} ms ({nb/a/1e9:.1f} GB/s), permute {b*1e3:.3f} ms ({nb/b/1e9:.1f} GB/s), speed-up {a/b:.3f}")
