"""The EAGLE-style drafter on tiny random-weight targets: exact greedy output under the engine loop,
reduced draft vocabularies, feature alignment after commits, and the head's file format."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from helpers import sweep, tiny_model
from yggtree.errors import YggError
from yggtree.runtime import steps
from yggtree.runtime.eagle import EagleDrafter, load_eagle, save_eagle
from yggtree.runtime.eagle_config import is_eagle_dir
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.kv_cache import KVCache
from yggtree.runtime.model import ModelConfig, Transformer, rope_table, set_invariant_rows
from yggtree.runtime.tree import ancestor_mask

CHUNK = 8
MAX_DEPTH = 5
NEW = 24
PROMPTS = [[11], list(range(3, 11)), list(range(3, 12)), [(7 * i) % 90 + 3 for i in range(21)]]
TREES = {
    "chain": TreeParams(draft_width=1, draft_depth=4, verify_width=5, top_k=1),
    "egt": TreeParams(draft_width=4, draft_depth=3, verify_width=8, top_k=3),
    "full-binary": TreeParams(draft_width=2, draft_depth=3, verify_width=7, top_k=2),
    "deep-chain": TreeParams(draft_width=1, draft_depth=MAX_DEPTH, verify_width=6, top_k=2),
}


def tiny(hidden: int = 64, seed: int = 0) -> Transformer:
    return tiny_model(hidden=hidden, max_pos=256, tied=False, seed=seed, std=None)


def true_features(target: Transformer, prompt: torch.Tensor, n_slots: int) -> torch.Tensor:
    """[L, H] the target's last-layer features f_0 .. f_{L-1} of ``prompt``: one causal pass of a
    fresh copy of the target with ``n_slots`` cache slots."""
    twin = target.shared_copy()
    twin.setup_cache(1, n_slots)
    _, _, (feat,) = steps.prefill_chunk(
        twin, prompt[None], torch.tensor(0), torch.tensor(prompt.shape[0]), (target.cfg.num_layers - 1,)
    )
    return feat[0]


def bigram_head(
    target: Transformer, draft_vocab=None, mode="reference", max_depth=MAX_DEPTH, target_layers=None,
    num_layers=1,
) -> EagleDrafter:
    """A random head bent towards the target's bigram prediction, so drafts are often accepted.

    fc's token half is the identity (its feature half stays random, so features do change every
    K/V entry), the blocks' residual branches are damped and norm/LM head are the target's: the
    head then proposes roughly ``argmax target(embed(t))`` after token t, which the target (whose
    own prediction is dominated by the current token) accepts some of the time, not always.
    """
    d = EagleDrafter.random(
        target, mode, max_depth, draft_vocab=draft_vocab, seed=1, target_layers=target_layers,
        num_layers=num_layers,
    )
    net, h = d.net, target.cfg.hidden_size
    net.fc.weight[:, :h] = torch.eye(h)
    net.fc.bias.zero_()
    for block in net.layers:
        block.self_attn.o_proj.weight.mul_(0.1)
        block.mlp.down_proj.weight.mul_(0.1)
    net.norm.weight.copy_(target.norm.weight)
    net.lm_head.weight.copy_(target.lm_head.weight[net.draft_vocab])
    return d


def engine(target, tree=None, drafter=None) -> Engine:
    cfg = EngineConfig(mode="reference", max_context=128, prefill_chunk=CHUNK, tree=tree)
    return Engine(target, cfg, drafter)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny()


@pytest.fixture(scope="module")
def plain(target) -> dict[int, list[int]]:
    eng = engine(target)
    params = SamplingParams(max_new_tokens=NEW)
    return {i: eng.generate(p, params).token_ids for i, p in enumerate(PROMPTS)}


# ---------------------------------------------------------------- exactness under the engine loop


@pytest.mark.parametrize("tree,kind", sweep(
    list(TREES), ["random", "bigram", "bigram-2-layers", "bigram-2-blocks"],
    unit=[("chain", "random"), ("egt", "bigram"), ("full-binary", "bigram-2-layers"), ("deep-chain", "bigram-2-blocks")]))
def test_greedy_speculation_equals_plain(target, plain, tree, kind):
    if kind == "random":
        drafter = EagleDrafter.random(target, "reference", max_depth=MAX_DEPTH)
    elif kind == "bigram":
        drafter = bigram_head(target)
    elif kind == "bigram-2-layers":  # features of both target layers, concatenated and reduced
        drafter = bigram_head(target, target_layers=(0, 1))
    else:  # a head of two decoder layers
        drafter = bigram_head(target, num_layers=2)
    eng = engine(target, TREES[tree], drafter)
    accepted = 0
    for i, p in enumerate(PROMPTS):
        res = eng.generate(p, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == plain[i], f"prompt {i} (length {len(p)})"
        accepted += res.stats["accepted_tokens"]
    if kind != "random":  # the alignment bookkeeping is exercised with n_accepted > 0
        assert accepted > 0


@pytest.mark.parametrize("tree", sweep(["egt", "deep-chain"], unit=[("deep-chain",)]))
def test_last_level_is_not_fed(target, plain, tree):
    """An EAGLE head's D-deep tree costs the head and D - 1 steps: feeding the last level as
    well (what a KV-cache drafter needs) drafts the very same trees and emits the same tokens."""
    tp = TREES[tree]
    runs = {}
    for feeds in (False, True):
        drafter = bigram_head(target)
        drafter.feeds_leaves = feeds
        calls = []
        step = drafter.step
        drafter.step = lambda *a, **kw: (calls.append(1), step(*a, **kw))[1]
        trees, out = [], []
        for p in PROMPTS:
            res = engine(target, tp, drafter).generate(
                p, SamplingParams(max_new_tokens=NEW), trace=lambda r: trees.append(r.get("tree")))
            out.append(res.token_ids)
        runs[feeds] = (trees, out, len(calls), sum(t is not None for t in trees))
    (t0, o0, c0, n0), (t1, o1, c1, n1) = runs[False], runs[True]
    assert t0 == t1 and o0 == o1 == [plain[i] for i in range(len(PROMPTS))]
    assert c0 == n0 * (tp.draft_depth - 1) and c1 == n1 * tp.draft_depth


def test_reduced_draft_vocabulary(target, plain):
    gen = torch.Generator().manual_seed(3)
    vmap = torch.randperm(97, generator=gen)[:40]
    drafter = bigram_head(target, draft_vocab=vmap)
    eng = engine(target, TREES["egt"], drafter)
    proposed: set[int] = set()
    orig_head, orig_step = drafter.head, drafter.step

    def head(*a, **kw):
        out = orig_head(*a, **kw)
        proposed.update(out.token.flatten().tolist())
        return out

    def step(*a, **kw):
        out = orig_step(*a, **kw)
        proposed.update(out.token.flatten().tolist())
        return out

    drafter.head, drafter.step = head, step
    for i, p in enumerate(PROMPTS):
        assert eng.generate(p, SamplingParams(max_new_tokens=NEW)).token_ids == plain[i]
    assert proposed and proposed <= set(vmap.tolist())  # target ids from the map, never raw ids
    assert drafter.vocab_size == 97


def test_refuses_top_k_beyond_draft_vocabulary(target):
    drafter = EagleDrafter.random(target, "reference", MAX_DEPTH, draft_vocab=torch.arange(3))
    with pytest.raises(YggError, match="top-k 4"):
        eng = engine(target, TreeParams(2, 2, 4, 4), drafter)
        eng.generate([5, 6], SamplingParams(max_new_tokens=4))


# ---------------------------------------------------------------- feature alignment


def test_the_head_call_fuses_the_targets_pending_features_as_the_eager_fusion_does(target):
    """Pending rows holding the target's features side by side (a commit's, a deferred catch-up's)
    are fused inside the head call: the same call as with the features fused eagerly before it."""
    drafter = EagleDrafter.random(target, "reference", 3, seed=2, target_layers=(0, 1), input_norm=True)
    drafter.setup(64, [1], 8)
    g = torch.Generator().manual_seed(4)
    h = target.cfg.hidden_size
    drafter.prefill(torch.arange(3, 14), tuple(torch.randn(11, h, generator=g) for _ in range(2)))
    feats = tuple(torch.randn(3, h, generator=g) for _ in range(2))  # the root's and two accepted tokens'
    drafter.pend_tok[:2] = torch.tensor([7, 9])
    drafter.pend_n.fill_(2)
    root, L = torch.tensor(5), torch.tensor(13)

    drafter.pend_feat[:3] = drafter.net.fuse_target(feats)  # fused eagerly, as commits did
    want, want_f = drafter.head(root, L, 4), drafter.node_feat[0].clone()
    drafter.pend_feat.zero_()
    drafter._pend_true_features(feats)  # fused in the call
    got = drafter.head(root, L, 4)
    assert torch.equal(got.token, want.token)
    torch.testing.assert_close(got.logp, want.logp)
    torch.testing.assert_close(drafter.node_feat[0], want_f)


@pytest.mark.parametrize("layers,blocks", [(None, 1), ((0, 1), 1), (None, 2)])
def test_committed_cache_equals_causal_recompute(target, layers, blocks):
    """After several speculation steps, every committed drafter cache entry (slots 1..L, L = root
    of the last head call; every decoder layer's cache) equals a causal run of the head over the
    committed sequence with the target's true features: accepted drafts were recomputed with f_p,
    not the predicted f̂_p."""
    drafter = bigram_head(target, target_layers=layers, num_layers=blocks)
    heads: list[tuple[int, torch.Tensor]] = []
    orig_head = drafter.head

    def head(root, committed, k):
        out = orig_head(root, committed, k)
        heads.append((int(committed), out.token.clone()))
        return out

    drafter.head = head
    tree = TREES["full-binary"]
    eng = engine(target, tree, drafter)
    prompt = PROMPTS[3]
    res = eng.generate(prompt, SamplingParams(max_new_tokens=30))
    assert res.stats["accepted_tokens"] > 0, "no draft was ever accepted"
    L, last_top = heads[-1]
    seq = torch.tensor(prompt + res.token_ids)
    assert L < seq.shape[0]

    # true target features f_0 .. f_{L-1}: one causal pass of a fresh copy of the target
    twin = target.shared_copy()
    twin.setup_cache(1, eng.n_slots)
    _, _, caps = steps.prefill_chunk(
        twin, seq[None, :L], torch.tensor(0), torch.tensor(L), drafter.target_layers
    )
    feat = drafter.net.fuse_target(tuple(x[0] for x in caps))  # [L, H]

    # a fresh head with the same weights, run causally over pairs (t_s, f_{s-1}) at slots 1..L
    fresh = bigram_head(target, target_layers=layers, num_layers=blocks)
    fresh.setup(eng.n_slots, [CHUNK, 1, tree.draft_width], CHUNK)
    s = eng.n_slots
    slot = torch.arange(1, L + 1)
    cols = torch.arange(s)
    mask = (cols[None, :] >= 1) & (cols[None, :] <= slot[:, None])
    out = fresh.net(seq[1 : L + 1], feat, slot - 1, slot, mask)
    top = torch.topk(fresh.net.logits(out[-1:]), tree.top_k, dim=-1).indices

    live = slice(1, L + 1)
    assert len(drafter.net.caches()) == blocks
    for got, want in zip(drafter.net.caches(), fresh.net.caches(), strict=True):
        torch.testing.assert_close(got.k[:, live], want.k[:, live], atol=1e-5, rtol=1e-4)  # [B, S, H, D]
        torch.testing.assert_close(got.v[:, live], want.v[:, live], atol=1e-5, rtol=1e-4)
    assert torch.equal(last_top, fresh.net.draft_vocab[top])

    # the check is sensitive to the alignment: pairing t_s with f_s instead of f_{s-1} differs
    shifted = torch.cat([feat[1:], feat[-1:]])
    fresh.net(seq[1 : L + 1], shifted, slot - 1, slot, mask)
    for got, want in zip(drafter.net.caches(), fresh.net.caches(), strict=True):
        assert not torch.allclose(got.k[:, live], want.k[:, live], atol=1e-3)


def _full_logp(top, vocab=97) -> torch.Tensor:
    """TopK over the whole vocabulary -> [W, V] log-probs indexed by target id."""
    return torch.full((top.token.shape[0], vocab), float("-inf")).scatter(1, top.token, top.logp)


def test_tree_steps_equal_per_path_causal_chains(target):
    """head + two tree steps (one node attaching below the last level) equal, node by node, a
    causal run of the head along that node's path, each token paired with the feature the head
    predicted for its parent: tree attention, positions and the f̂ bookkeeping are right."""
    n_slots, prompt, root = 48, torch.tensor(PROMPTS[3][:10]), torch.tensor(42)
    L = prompt.shape[0]
    feat = true_features(target, prompt, n_slots)

    d = EagleDrafter.random(target, "reference", max_depth=MAX_DEPTH, seed=4)
    d.setup(n_slots, [CHUNK, 1, 2], CHUNK)
    d.prefill(prompt, (feat,))
    head = d.head(root, torch.tensor(L), 97)
    #   tree: 0 (root) -> 1 [5] -> 3 [7];  0 -> 2 [6];  0 -> 4 [8]   (node 4 is fed in step 2)
    parent = torch.tensor([0, 0, 0, 1, 0])
    token = torch.tensor([42, 5, 6, 7, 8])
    depth = torch.tensor([0, 1, 1, 2, 1])
    anc = ancestor_mask(parent, depth, torch.ones(5, dtype=torch.bool), 2)
    got = {0: _full_logp(head)[0]}
    for fed in (torch.tensor([1, 2]), torch.tensor([3, 4])):
        top = d.step(token[fed], depth[fed], fed, parent[fed], anc[fed], torch.tensor(L), 97)
        got.update(zip(fed.tolist(), _full_logp(top)))

    ref = EagleDrafter.random(target, "reference", max_depth=MAX_DEPTH, seed=4)
    ref.setup(n_slots, [CHUNK, 1, 2], CHUNK)
    net, cols = ref.net, torch.arange(n_slots)

    def run(tok, f, slot):  # causal over slots 1..slot
        mask = (cols[None, :] >= 1) & (cols[None, :] <= slot[:, None])
        return net(tok, f, slot - 1, slot, mask)

    slot = torch.arange(1, L + 1)
    root_h = run(torch.cat([prompt[1:], root[None]]), feat, slot)[-1:]  # f̂_L
    want = {0: torch.log_softmax(net.logits(root_h), -1)[0]}
    for leaf, path in ((2, [2]), (3, [1, 3]), (4, [4])):
        h = root_h
        for j in path:
            h = run(token[j][None], h, torch.tensor([L + int(depth[j])]))
            want[j] = torch.log_softmax(net.logits(h), -1)[0]
    for j in range(5):
        torch.testing.assert_close(got[j], want[j], atol=1e-5, rtol=1e-5, msg=f"node {j}")


def reference_stack(net, tokens: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
    """The head over pairs (tokens[i], feat[i]) at positions i = 0..n-1, causally, written apart
    from EagleNet.forward (no slot layout, no drafter cache): fc, then each decoder layer over
    the whole sequence with a cache of its own. The last layer's outputs [n, H]."""
    n = tokens.shape[0]
    lc = net.cfg.layer_config()
    cs = rope_table(lc, n)
    cos, sin = cs[None, :, None, :, 0], cs[None, :, None, :, 1]  # [1, n, 1, D/2]
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    x = net.fuse_input(F.embedding(tokens, net.embed_weight), feat)[None]
    for block in net.layers:
        block = copy.deepcopy(block)
        block.self_attn.cache = KVCache.zeros(1, lc.num_kv_heads, n, lc.head_dim, x.dtype, "cpu")
        x = block(x, cos, sin, pos[None], causal[None])
    return x[0]


# a tree (node 4 joins in the second step) and a chain, each fed as the engine would
DRAFTS = {
    "tree": ([0, 0, 0, 1, 0], [0, 1, 1, 2, 1], [[1, 2], [3, 4]]),  # parent, depth, fed per step
    "chain": ([0, 0, 1, 2, 3], [0, 1, 2, 3, 4], [[1], [2], [3], [4]]),
}


@pytest.mark.parametrize("num_layers,rows", [(1, 1), (2, 1), (2, CHUNK - 1)])
@pytest.mark.parametrize("shape", list(DRAFTS))
def test_draft_equals_reference_stack(target, shape, num_layers, rows):
    """Head and steps of a 1- and a 2-layer head equal, node by node, :func:`reference_stack`
    along the node's path (prompt pairs with true features, then each drafted token with its
    parent's predicted feature): every layer's cache, tree mask and position is right. With
    ``rows`` > 1 the head's calls of several rows (the head's D_max + 1, a tree's 2) take the row
    attention, each row's context split once for every layer (``row_window``)."""
    n_slots, prompt, root = 48, torch.tensor(PROMPTS[3][:10]), torch.tensor(42)
    L = prompt.shape[0]
    feat = true_features(target, prompt, n_slots)
    parents, depths, fed = DRAFTS[shape]
    parent, depth = torch.tensor(parents), torch.tensor(depths)
    token = torch.tensor([42, 5, 6, 7, 8])

    d = EagleDrafter.random(target, "reference", max_depth=MAX_DEPTH, seed=4, num_layers=num_layers)
    assert len(d.net.layers) == num_layers
    set_invariant_rows(d.net, rows)
    d.setup(n_slots, [CHUNK, 1, 2], CHUNK)
    d.prefill(prompt, (feat,))
    got = {0: _full_logp(d.head(root, torch.tensor(L), 97))[0]}
    anc = ancestor_mask(parent, depth, torch.ones(5, dtype=torch.bool), int(depth.max()))
    for nodes in map(torch.tensor, fed):
        top = d.step(token[nodes], depth[nodes], nodes, parent[nodes], anc[nodes], torch.tensor(L), 97)
        got.update(zip(nodes.tolist(), _full_logp(top)))

    # node j's path: the prompt pairs and the root with true features, then its ancestors' tokens
    # each with the reference's own output at its parent
    paths = {0: (torch.cat([prompt[1:], root[None]]), feat)}
    out = {}
    for j in range(5):
        if j:
            tok, f = paths[int(parent[j])]
            paths[j] = (torch.cat([tok, token[j : j + 1]]), torch.cat([f, out[int(parent[j])][None]]))
        out[j] = reference_stack(d.net, *paths[j])[-1]
        want = torch.log_softmax(d.net.logits(out[j]), -1)
        torch.testing.assert_close(got[j], want, atol=1e-5, rtol=1e-5, msg=f"node {j}")


def test_refuses_draft_depth_beyond_max_depth(target):
    drafter = EagleDrafter.random(target, "reference", max_depth=2)
    eng = engine(target, TreeParams(1, 3, 4, 1), drafter)
    with pytest.raises(YggError, match="draft depth 3 exceeds .* max_depth 2"):
        eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=NEW))


@pytest.mark.slow
@pytest.mark.parametrize("num_layers", [1, 2])
def test_compiled_matches_plain(plain, num_layers):
    """One small compiled run: every drafter shape is warmed up at setup (the loop runs under
    fail_on_recompile, every decoder layer of the head compiled) and the output is still exact."""
    target = tiny()  # its own copy: compiling patches the blocks of the model it is given
    tp = TreeParams(draft_width=2, draft_depth=3, verify_width=4, top_k=2)
    drafter = bigram_head(target, mode="performance", max_depth=3, num_layers=num_layers)
    cfg = EngineConfig(mode="performance", max_context=64, prefill_chunk=4, tree=tp)
    eng = Engine(target, cfg, drafter)
    assert drafter.graphs.widths == {1, 2, 4}
    res = eng.generate(PROMPTS[3], SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == plain[3]
    assert res.stats["accepted_tokens"] > 0


# ---------------------------------------------------------------- files


@pytest.fixture()
def saved(tmp_path, target):
    vmap = torch.randperm(97, generator=torch.Generator().manual_seed(5))[:50]
    drafter = EagleDrafter.random(target, "reference", MAX_DEPTH, draft_vocab=vmap, seed=7)
    path = tmp_path / "eagle"
    save_eagle(drafter, path)
    return drafter, path


def test_save_load_roundtrip(saved, target, plain):
    drafter, path = saved
    assert is_eagle_dir(path) and not is_eagle_dir(path.parent)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["kind"] == "eagle"
    assert cfg["target"] == {"vocab_size": 97, "hidden_size": 64, "num_layers": 2}
    assert "embed_tokens.weight" not in load_file(str(path / "model.safetensors"))  # shared
    loaded = load_eagle(path, target, "reference", max_depth=MAX_DEPTH)
    a, b = drafter.net.state_dict(), loaded.net.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.net.embed_weight is target.embed_tokens.weight  # no copy
    eng = engine(target, TREES["egt"], loaded)
    assert eng.generate(PROMPTS[2], SamplingParams(max_new_tokens=NEW)).token_ids == plain[2]


def test_two_layer_head_roundtrip(tmp_path, target, plain):
    drafter = bigram_head(target, num_layers=2)
    save_eagle(drafter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_layers"] == 2
    loaded = load_eagle(tmp_path, target, "reference", max_depth=MAX_DEPTH)
    assert loaded.cfg == drafter.cfg and len(loaded.net.layers) == 2
    a, b = drafter.net.state_dict(), loaded.net.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("layers.1.") for k in a)
    eng = engine(target, TREES["egt"], loaded)
    res = eng.generate(PROMPTS[3], SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == plain[3] and res.stats["accepted_tokens"] > 0


def test_config_without_num_layers_is_one_layer(saved, target):
    """A one-layer head's config has no num_layers field (byte-identical to heads written before
    the field existed, so profiles keyed on the config stay valid) and loads as one layer."""
    drafter, path = saved
    assert drafter.cfg.num_layers == 1
    assert "num_layers" not in json.loads((path / "config.json").read_text())
    loaded = load_eagle(path, target, "reference")
    assert loaded.cfg == drafter.cfg and loaded.cfg.num_layers == 1 and len(loaded.net.layers) == 1
    a, b = drafter.net.state_dict(), loaded.net.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_refuses_bad_num_layers(saved, target, bad):
    _, path = saved
    _edit_config(path, num_layers=bad)
    where = re.escape(str(path / "config.json"))
    with pytest.raises(YggError, match=where + ": bad value: num_layers must be an integer >= 1") as e:
        load_eagle(path, target, "reference")
    assert "\n" not in str(e.value)


def test_refuses_num_layers_without_their_weights(saved, target):
    _, path = saved
    _edit_config(path, num_layers=2)
    with pytest.raises(YggError, match=re.escape(str(path / "model.safetensors")) + ": missing tensors layers.1."):
        load_eagle(path, target, "reference")


def test_own_embedding_roundtrip(tmp_path, target):
    drafter = EagleDrafter.random(target, "reference", max_depth=MAX_DEPTH, shares_embedding=False)
    save_eagle(drafter, tmp_path)
    loaded = load_eagle(tmp_path, target, "reference")
    assert torch.equal(loaded.net.embed_weight, drafter.net.embed_weight)
    assert loaded.net.embed_weight is not target.embed_tokens.weight


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


def test_refuses_wrong_hidden_size(saved):
    _, path = saved
    other = tiny(hidden=32)
    with pytest.raises(YggError, match=re.escape(str(path / "config.json")) + ".*hidden size"):
        load_eagle(path, other, "reference")


def test_refuses_layer_index_out_of_range(saved, target):
    _, path = saved
    _edit_config(path, target_layers=[2])
    with pytest.raises(YggError, match=re.escape(str(path / "config.json")) + ".*layer index 2"):
        load_eagle(path, target, "reference")


def test_refuses_vocab_map_out_of_range(saved, target):
    _, path = saved

    def bad(state):
        state["draft_vocab"][0] = 97

    _edit_weights(path, bad)
    with pytest.raises(YggError, match=re.escape(str(path / "model.safetensors")) + ".*outside"):
        load_eagle(path, target, "reference")


def test_refuses_vocab_map_wrong_length(saved, target):
    _, path = saved

    def bad(state):
        state["draft_vocab"] = state["draft_vocab"][:-1].clone()

    _edit_weights(path, bad)
    where = re.escape(str(path / "model.safetensors"))
    with pytest.raises(YggError, match=where + ".*draft_vocab"):
        load_eagle(path, target, "reference")


def test_refuses_truncated_weights(saved, target):
    _, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(YggError, match=re.escape(str(f))):
        load_eagle(path, target, "reference")


def test_refuses_missing_tensor(saved, target):
    _, path = saved
    _edit_weights(path, lambda state: state.pop("fc.bias"))
    with pytest.raises(YggError, match=re.escape(str(path / "model.safetensors")) + ".*fc.bias"):
        load_eagle(path, target, "reference")


def test_refuses_other_target(saved):
    _, path = saved
    cfg = tiny().cfg
    three = Transformer(
        ModelConfig(**{**cfg.__dict__, "num_layers": 3})
    ).eval().requires_grad_(False)
    where = re.escape(str(path / "config.json"))
    with pytest.raises(YggError, match=where + ".*2 layers, the target has 3"):
        load_eagle(path, three, "reference")
