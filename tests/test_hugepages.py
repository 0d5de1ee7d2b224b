"""Weights and caches on huge pages (``yggtree.runtime.hugepages``): moving a model's tensors into
one arena keeps every value, tie and shared storage (a self-drafter's copy of the target), leaves
the KV caches and oneDNN-packed weights where they are, and an engine built on the moved weights
decodes the same tokens."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from yggtree.runtime.hugepages import PAGE, huge_empty, huge_page_bytes, huge_zeros, move_to_huge_pages
from yggtree.runtime.kv_cache import KVCache, KVStore

pytestmark = pytest.mark.usefixtures("one_thread")


def test_arena_is_aligned_and_untouched_memory_is_zeroed_on_request():
    buf = huge_empty(3 * PAGE + 5)
    assert buf.numel() == 3 * PAGE + 5 and buf.data_ptr() % PAGE == 0
    z = huge_zeros((2, 3, 5), torch.float32)
    assert z.shape == (2, 3, 5) and z.dtype == torch.float32 and not z.any() and z.is_contiguous()


def test_moving_keeps_values_ties_and_shared_storage():
    target = tiny_model(layers=2)
    target.setup_cache(1, 40)
    twin = target.shared_copy()  # a second model over the same weight storages
    before = {n: t.clone() for n, t in target.state_dict().items()}
    cache_ptr = target.kv.kv.data_ptr()
    old_ptr = target.layers[0].mlp.up_proj.weight.data_ptr()
    n = move_to_huge_pages([target, twin], skip=(KVCache,))
    assert n > 0 and target.layers[0].mlp.up_proj.weight.data_ptr() != old_ptr  # moved
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert target.lm_head.weight is target.embed_tokens.weight  # the tie is one Parameter still
    assert isinstance(target.lm_head.weight, torch.nn.Parameter)
    for (_, a), (_, b) in zip(target.named_parameters(), twin.named_parameters()):
        assert a.data_ptr() == b.data_ptr()  # the twin reads the moved weights too
    up, down = target.layers[0].mlp.up_proj.weight, target.layers[0].mlp.down_proj.weight
    # storages of their own (compiled regions refuse inputs sharing one), in one arena
    assert up.untyped_storage().data_ptr() != down.untyped_storage().data_ptr()
    assert abs(up.data_ptr() - down.data_ptr()) < n
    assert target.kv.kv.data_ptr() == cache_ptr  # caches are not weights
    assert target.layers[1].self_attn.cache.kv.data_ptr() == target.kv.kv[1].data_ptr()


def test_a_storage_held_only_by_a_skipped_module_stays_and_a_shared_one_moves_with_its_tie():
    """An untied embedding table (read one row a token) stays where it is; a table tied to the LM
    head moves, and the embedding follows it: one Parameter still."""
    tied = tiny_model(layers=1)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    old = tied.embed_tokens.weight.data_ptr()
    move_to_huge_pages([tied], skip=(KVCache, torch.nn.Embedding))
    assert tied.embed_tokens.weight.data_ptr() != old and tied.lm_head.weight is tied.embed_tokens.weight
    def untied():
        m = tiny_model(layers=1)
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
        return m

    m = untied()
    old, head = m.embed_tokens.weight.data_ptr(), m.lm_head.weight.data_ptr()
    before = m.embed_tokens.weight.clone()
    n = move_to_huge_pages([m], skip=(KVCache, torch.nn.Embedding))
    assert m.embed_tokens.weight.data_ptr() == old and torch.equal(m.embed_tokens.weight, before)
    assert m.lm_head.weight.data_ptr() != head
    assert move_to_huge_pages([untied()], skip=(KVCache,)) - n == before.numel() * before.element_size()


@pytest.mark.parametrize("mode", ["reference", pytest.param("performance", marks=pytest.mark.slow)])
def test_engine_on_moved_weights_decodes_the_same_tokens(mode):
    """Eager, and compiled step graphs (whose nested layer regions refuse aliased inputs)."""
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams

    cfg = EngineConfig(mode=mode, max_context=60, prefill_chunk=8)
    want = Engine(tiny_model(layers=2), cfg).generate(list(range(5, 20)), SamplingParams(max_new_tokens=12))
    model = tiny_model(layers=2)
    move_to_huge_pages([model], skip=(KVCache,))
    got = Engine(model, cfg).generate(list(range(5, 20)), SamplingParams(max_new_tokens=12))
    assert got.token_ids == want.token_ids


def test_kv_store_on_huge_pages_starts_zero():
    store = KVStore.zeros(3, 1, 2, 50, 8, torch.float32, "cpu")
    assert store.kv.shape == (3, 2, 1, 2, 50, 8) and not store.kv.any()
    assert store.kv.data_ptr() % PAGE == 0 and store.caches[2].kv.data_ptr() == store.kv[2].data_ptr()


def test_huge_page_bytes_reads_anon_huge_pages_or_says_unknown(monkeypatch, tmp_path):
    """``AnonHugePages`` of smaps_rollup in bytes; None without the line or the file."""
    import io

    import yggtree.runtime.hugepages as hp

    rollup = "Rss:   51200 kB\nAnonHugePages:    4096 kB\nShmemPmdMapped:  0 kB\n"
    monkeypatch.setattr(hp, "open", lambda *a, **k: io.StringIO(rollup), raising=False)
    assert huge_page_bytes() == 4096 * 1024
    monkeypatch.setattr(hp, "open", lambda *a, **k: io.StringIO("Rss: 51200 kB\n"), raising=False)
    assert huge_page_bytes() is None

    def missing(*a, **k):
        raise FileNotFoundError(a[0])

    monkeypatch.setattr(hp, "open", missing, raising=False)
    assert huge_page_bytes() is None


def test_only_a_performance_engine_moves_its_weights(tmp_path, monkeypatch):
    """A reference engine (eager, checks on: a run's stopgap while its machine's plan builds)
    decodes its weights as loaded; a performance engine moves them into the arena, taking the
    run's reserve (runtime/reserve.py) along."""
    pytest.importorskip("transformers")
    from test_compile import save_tiny_checkpoint
    from yggtree.runtime import build

    save_tiny_checkpoint(tmp_path / "model", intermediate=64)
    moved = []
    monkeypatch.setattr(build, "move_to_huge_pages", lambda models, skip=(), reserve=None: moved.append(reserve) or 0)
    monkeypatch.setattr(build, "Engine", lambda *args: None)  # the move comes first; no graphs are built here
    for mode, calls in (("reference", []), ("performance", ["the reserve"])):
        moved.clear()
        spec = build.EngineSpec(model=str(tmp_path / "model"), mode=mode, max_context=64, prefill_chunk=8)
        build.build_engine(spec, reserve="the reserve")
        assert moved == calls, mode
