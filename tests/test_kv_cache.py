"""The KV store: one tensor behind every layer's cache, moved in one gather and one write."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yggtree.runtime.kv_cache import KVStore


def per_layer_move(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The reference: each layer's keys and values moved on their own, gathered before written."""
    out = kv.clone()
    for layer in range(kv.shape[0]):
        for j in range(2):
            for b in range(kv.shape[2]):
                rows = out[layer, j, b, :, src[b]].clone()  # [H, K, D]
                out[layer, j, b, :, dst[b]] = rows
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 2), st.integers(1, 6), st.data())
def test_move_equals_per_layer_moves(layers, batch, k, data):
    slots = 10
    store = KVStore.zeros(layers, batch, 2, slots, 3, torch.float32, "cpu")
    store.kv.copy_(torch.randn(store.kv.shape))
    # overlapping sources and destinations, as a commit's path and prefix are
    src = torch.tensor([data.draw(st.lists(st.integers(0, slots - 1), min_size=k, max_size=k)) for _ in range(batch)])
    dst = torch.tensor([data.draw(st.lists(st.integers(0, slots - 1), min_size=k, max_size=k, unique=True))
                        for _ in range(batch)])
    want = per_layer_move(store.kv, src, dst)
    store.move(src, dst)
    assert torch.equal(store.kv, want)


def test_layers_read_and_write_the_store():
    store = KVStore.zeros(3, 1, 2, 8, 4, torch.float32, "cpu")
    k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    store.caches[1].write(torch.tensor([[5, 2]]), k, v)
    assert torch.equal(store.kv[1, 0, :, :, [5, 2]], k.transpose(1, 2)) and torch.equal(store.kv[1, 1, :, :, [5, 2]], v.transpose(1, 2))
    assert torch.equal(store.caches[1].k[:, [5, 2]], k) and torch.equal(store.caches[1].v[:, [5, 2]], v)
    assert store.kv[0].abs().sum() == 0 and store.kv[2].abs().sum() == 0
    store.move(torch.tensor([[5, 2]]), torch.tensor([[0, 1]]))
    assert torch.equal(store.caches[1].k[:, :2], k) and torch.equal(store.caches[1].v[:, :2], v)


def test_keep_rows_keeps_the_views_in_step():
    store = KVStore.zeros(2, 3, 1, 4, 2, torch.float32, "cpu")
    store.kv.copy_(torch.randn(store.kv.shape))
    kept = store.keep_rows(torch.tensor([2, 0]))
    assert torch.equal(kept.kv, store.kv[:, :, [2, 0]])
    kept.caches[0].k.zero_()
    assert kept.kv[0, 0].abs().sum() == 0 and store.kv[0, 0].abs().sum() > 0
