"""The commit's KV move: every layer's cache moved on its own (four indexing operations per layer,
as before the KV store) against one gather and one write over the store (issue #20).

    python reports/plain_loop/commit_ab.py [threads]

The embedded target's shapes: 30 layers, 3 KV heads of 64, the float32 plan's 1058 slots; a
6-node accepted path moved to the prefix. Median of 2000 calls each, alternating in blocks."""

import statistics
import sys
import time

import torch

from yggtree.runtime.kv_cache import KVStore

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
store = KVStore.zeros(30, 1, 3, 1058, 64, torch.float32, "cpu")
store.kv.normal_()
src = torch.tensor([[400, 403, 405, 409, 410, 412]])
dst = torch.tensor([[401, 402, 403, 404, 405, 406]])


def per_layer():
    bi = torch.arange(1)[:, None]
    for c in store.caches:
        k, v = c.k[bi, src], c.v[bi, src]
        c.k.index_put_((bi, dst), k)
        c.v.index_put_((bi, dst), v)


def once():
    store.move(src, dst)


# the same result first
a = store.kv.clone()
per_layer()
b = store.kv.clone()
store.kv.copy_(a)
once()
assert torch.equal(store.kv, b)

times = {"per layer": [], "store": []}
for _ in range(20):
    for name, f in (("per layer", per_layer), ("store", once)):
        for _ in range(100):
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1e3)
for name, ts in times.items():
    print(f"{name}: {statistics.median(ts):.4f} ms")
