"""The host-phase probe the scripts here share: GB/s of a 256 MiB float32 sum on huge pages (the median of
3 timed sums), as scripts/bench_formats.py probes between prompts."""
import statistics
import time

import torch

from yggtree.runtime.hugepages import huge_zeros

NBYTES = 256 << 20
_buf = []


def sum_gbps(sums: int = 3) -> float:
    if not _buf:
        _buf.append(huge_zeros((NBYTES // 4,), torch.float32).fill_(1.0))
    r = []
    for _ in range(sums):
        t = time.perf_counter(); _buf[0].sum(); r.append(time.perf_counter() - t)
    return NBYTES / statistics.median(r) / 1e9
