"""Row-invariant attention (issue #20): a query row's attention, and the target's logits for it,
are bitwise the same whether the row is a plain one-row step or one of W rows of a verify step
(model._rows_attention, Attention.invariant_rows, model.attention_rows)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from yggtree.runtime import steps
from yggtree.runtime.kv_cache import KVCache
from yggtree.runtime.model import (Attention, ModelConfig, _rows_attention, attention_rows, row_window,
                                   set_invariant_rows)
from yggtree.runtime.packed import pack_linears

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTHS = (2, 5, 8, 16)
DTYPES = (torch.float32, torch.bfloat16)


def _qkv(dtype, w=16, c=96, heads=6, kv_heads=2, d=32, seed=0):
    """Random queries [1, W, H, D], a cache prefix [1, C, Hkv, D] (k, v) and a mask [1, W, C]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, w, heads, d, generator=g).to(dtype)
    k = torch.randn(1, c, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(1, c, kv_heads, d, generator=g).to(dtype)
    mask = torch.rand(1, w, c, generator=g) < 0.7
    mask[..., 0] = True  # every row sees something
    return q, k, v, mask


def _rows(q, k, v, mask):
    """Row-by-row attention of the rows of ``mask`` (their window split as the model does it)."""
    window, head = row_window(mask)
    return _rows_attention(q, k, v, head, window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_attention_row_is_its_one_row_call(dtype):
    """Row i of a W-row call is bitwise the one-row call of row i, whatever the other rows are
    (two different sets of other rows)."""
    q, k, v, mask = _qkv(dtype)
    q2, _, _, mask2 = _qkv(dtype, seed=1)
    one = [_rows(q[:, i:i + 1], k, v, mask[:, i:i + 1]) for i in range(q.shape[1])]
    for w in WIDTHS:
        wide = _rows(q[:, :w], k, v, mask[:, :w])  # [1, W, H*D]
        for i in range(w):
            assert torch.equal(wide[:, i:i + 1], one[i]), (w, i)
        # row 0 among other rows (those of another draw)
        mixed_q, mixed_m = torch.cat([q[:, :1], q2[:, 1:w]], 1), torch.cat([mask[:, :1], mask2[:, 1:w]], 1)
        assert torch.equal(_rows(mixed_q, k, v, mixed_m)[:, :1], one[0]), w


def test_rows_attention_is_attention():
    """It computes attention (against the grouped matmul path of a wider call, float32)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
                      num_heads=6, num_kv_heads=2, head_dim=16)
    attn = Attention(cfg).requires_grad_(False)
    attn.cache = KVCache.zeros(1, 2, 40, 16, torch.float32, "cpu")
    attn.cache.k.normal_()
    attn.cache.v.normal_()
    x = torch.randn(1, 5, 48)
    cos, sin = torch.rand(1, 5, 1, 8), torch.rand(1, 5, 1, 8)
    slots = torch.tensor([[20, 21, 22, 23, 24]])
    mask = torch.rand(1, 5, 32) < 0.7
    mask[..., 20:25] = False
    mask[0, :, 20] = True
    grouped = attn(x, cos, sin, slots, mask)  # invariant_rows 1: the matmul path
    attn.invariant_rows = 5
    rows = attn(x, cos, sin, slots, mask)
    torch.testing.assert_close(rows, grouped, rtol=1e-5, atol=1e-5)


def _root_logits(model, w, n_ctx=64, run=None, seed=0):
    """Logits [V] of the root of a W-node tree step over a 20-token committed prefix (W = 1: a
    plain step); the other W - 1 nodes are random tokens under the root."""
    g = torch.Generator().manual_seed(seed)
    model.setup_cache(1, n_ctx + 1)
    tokens = torch.randint(0, model.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(7))
    steps.prefill_chunk(model, tokens[None, :24], torch.tensor(0), torch.tensor(20), (), n_ctx)
    tree = torch.cat([tokens[20:21], torch.randint(0, model.cfg.vocab_size, (w - 1,), generator=g)])
    depth = torch.ones(w, dtype=torch.long)
    depth[0] = 0
    anc = torch.eye(w, dtype=torch.bool)
    anc[:, 0] = True
    logits, _, _ = steps.tree_step(model, tree, depth, torch.arange(w), anc, torch.tensor(20),
                                   n_ctx=n_ctx, run=run)
    return logits[0]


def _packed_tiny(dtype, rows):
    """A tiny target on packed products (as engines run them; row-invariant at its shapes, as
    the grouped path's failure below shows) computing calls of up to ``rows`` rows row by row."""
    model = tiny_model(hidden=64, seed=3, dtype=dtype)
    pack_linears(model)
    set_invariant_rows(model, rows)
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_of_a_row_do_not_depend_on_the_width(dtype):
    """A tiny target's logits for the root: the plain step's bits in every W-node verify step,
    with different other nodes (eager). The grouped matmuls (invariant_rows 1, the attention
    before issue #20's fix) round otherwise at every width here."""
    for rows, want in ((attention_rows(64), True), (1, False)):
        model = _packed_tiny(dtype, rows)
        plain = _root_logits(model, 1)
        for w in WIDTHS:
            for seed in (0, 1):
                assert torch.equal(_root_logits(model, w, seed=seed), plain) is want, (rows, w, seed)


@pytest.mark.slow
def test_compiled_rows_are_the_one_row_graph():
    """Under torch.compile (inductor, static shapes, as performance mode builds them): the
    W = 5 graph's root row is bitwise the W = 1 graph's, float32 and bfloat16 attention."""
    from yggtree.runtime.graphs import compile_options

    for dtype in DTYPES:
        q, k, v, mask = _qkv(dtype, w=5)
        fn = torch.compile(_rows, **compile_options("inductor-cpu", half=dtype != torch.float32))
        wide = fn(q, k, v, mask)
        for i in range(5):
            assert torch.equal(wide[:, i:i + 1], fn(q[:, i:i + 1], k, v, mask[:, i:i + 1])), (dtype, i)


@pytest.mark.slow
def test_compiled_step_logits_do_not_depend_on_the_width():
    """The compiled masked_step (one graph per width, the performance path) of a bfloat16 tiny
    target: the root's logits at W = 5 bitwise the W = 1 graph's."""
    from yggtree.runtime.graphs import compile_options

    model = _packed_tiny(torch.bfloat16, attention_rows(64))
    torch._dynamo.reset()  # masked_step's code object may hold other tests' graphs up to dynamo's recompile limit
    run = torch.compile(steps.masked_step, **compile_options("inductor-cpu", half=True))
    assert torch.equal(_root_logits(model, 5, run=run), _root_logits(model, 1, run=run))


def test_engines_share_one_formulation():
    """An engine sets its target's row-invariant widths from its prefill chunk alone, so a
    plain and a speculative engine of one plan run the same prefill and the same steps (and
    yggtree compile's packages, which apply the same rule, hold them)."""
    from yggtree.runtime.engine import Engine, EngineConfig, TreeParams

    assert attention_rows(64) == 63 and attention_rows(1) == 1
    model = tiny_model()
    Engine(model, EngineConfig(mode="reference", max_context=40, prefill_chunk=8))
    assert {m.invariant_rows for m in model.modules() if isinstance(m, Attention)} == {7}
    tree = TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2)
    Engine(model, EngineConfig(mode="reference", max_context=40, prefill_chunk=8, tree=tree),
           _self_drafter(model))
    assert {m.invariant_rows for m in model.modules() if isinstance(m, Attention)} == {7}


def _self_drafter(model):
    from yggtree.runtime.drafters import LMDrafter

    return LMDrafter(model.shared_copy(), "reference")


def test_bfloat16_speculation_is_plain_decoding():
    """End to end on a bfloat16 target with packed products (every activation rounded to
    bfloat16): greedy speculation emits plain decoding's tokens (the engines set row-by-row
    attention themselves; the real model, compiled, in every format: docs/results.md)."""
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams

    model = tiny_model(hidden=64, max_pos=256, seed=3, dtype=torch.bfloat16)
    pack_linears(model)
    cfg = dict(mode="reference", max_context=80, prefill_chunk=8)
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    plain = Engine(model, EngineConfig(**cfg))
    spec = Engine(model, EngineConfig(**cfg, tree=tree), _self_drafter(model))
    for prompt in ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)]):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert spec.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want, prompt


# a tree whose deepest node (6) sees its ancestors 0, 3, 4 at tree slots with other nodes between
TREE_PARENT = (-1, 0, 0, 0, 3, 1, 4)


def _deep_node_logits(model, run=None, n_ctx=64, prefix=20, seed=0):
    """Logits [V] of tree node 6 of TREE_PARENT verified in one 7-row step after a ``prefix``-
    token prefill, and those of the plain one-row steps that decode its path 0, 3, 4, 6 one token
    at a time at the same positions (the path contiguous, as plain decoding holds it)."""
    g = torch.Generator().manual_seed(seed)
    v = model.cfg.vocab_size
    tokens = torch.randint(0, v, (prefix + 7,), generator=g)
    tree = tokens[prefix:]
    depth = torch.tensor([0, 1, 1, 1, 2, 2, 3])
    anc = torch.eye(7, dtype=torch.bool)
    for i, p in enumerate(TREE_PARENT):
        while p >= 0:
            anc[i, p] = True
            p = TREE_PARENT[p]
    committed = torch.tensor(prefix)

    def fill():
        model.setup_cache(1, n_ctx + 1)
        steps.prefill_chunk(model, tokens[None, :32], torch.tensor(0), committed, (), n_ctx)

    fill()
    node = steps.tree_step(model, tree, depth, torch.arange(7), anc, committed, n_ctx=n_ctx, run=run)[0][6]
    fill()
    one = torch.ones(1, 1, dtype=torch.bool)
    zero = torch.zeros(1, dtype=torch.long)
    for i, n in enumerate((0, 3, 4, 6)):
        plain = steps.tree_step(model, tree[n:n + 1], zero, zero, one, committed + i, n_ctx=n_ctx, run=run)[0][0]
    return node, plain


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verified_node_is_the_plain_step_of_its_path(dtype, compiled):
    """A verified node's logits are bitwise those plain decoding computes for the same token at
    the same position, although its ancestors sit at tree slots with other nodes' between them
    (row-by-row attention over the compacted context, eager and compiled)."""
    from yggtree.runtime.graphs import compile_options

    model = _packed_tiny(dtype, attention_rows(64))
    torch._dynamo.reset()  # as above: a fresh recompile budget for masked_step
    opts = compile_options("inductor-cpu", half=dtype != torch.float32)  # as Graphs builds it
    run = torch.compile(steps.masked_step, **opts) if compiled else None
    for seed in (0, 1, 2):
        node, plain = _deep_node_logits(model, run, seed=seed)
        assert torch.equal(node, plain), (dtype, compiled, seed)
