import torch
from yggtree.runtime.w4a8 import pack_blocks, Blocks
from yggtree.runtime.hugepages import huge_empty
def blocks(g, N, K, bits):
    return Blocks(torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8), (torch.rand(N, K//32, generator=g)/64).half(), (torch.rand(N, K//32, generator=g)/64).half(), bits)
SHAPES = [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4)] * 30 + [(49152, 576, 8)]
def arena_model(g, shapes=SHAPES, pack=pack_blocks):
    """packed weights, all in one huge-page arena in order (like the runtime's)."""
    packed = [(K, pack(blocks(g, N, K, bits))) for N, K, bits in shapes]
    total = sum(sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in p) for K, p in packed)
    arena = huge_empty(total); off = 0; out = []
    for K, p in packed:
        ts = []
        for t in p:
            nb = t.numel() * t.element_size()
            r = arena[off: off + nb].view(t.dtype).view(t.shape); r.copy_(t); ts.append(r); off += (nb + 63) // 64 * 64
        out.append((K, *ts))
    return out, total
