"""The package runtime (``yggtree.runtime.aoti``) without compiling anything: every block of a tiny
engine runs fake "packages" that call the exported function (:class:`_BlockFn`: weights and KV cache
as inputs, the cache written in place) eagerly. Greedy tokens equal the reference engine's for a
self-drafter and an EAGLE drafter (one or two decoder layers), dynamo never runs, and a shape with
no package is refused."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from yggtree.errors import YggError
from yggtree.runtime.aoti import (DRAFTER_CALLS, PackageSet, _BlockFn, _DrafterCallFn, block_key,
                                  compile_drafter_call_package, drafter_call_key, install_drafter_calls,
                                  install_packages, model_tensors, static_blocks)
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.kv_cache import KVCache
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.model import Transformer, attention_rows, set_invariant_rows, set_kv_dtype

TREE = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
CHUNK, MAX_CTX = 8, 60
N_SLOTS = MAX_CTX + max(TREE.verify_width, TREE.tree_size) + 1
PROMPTS = [list(range(5, 12)), [(7 * i) % 90 + 3 for i in range(23)]]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0) -> Transformer:
    return tiny_model(max_pos=256, seed=seed)


class FakeRunner:
    """Stands in for an AOTIModelPackageLoader of one (kind, W, C): checks the shape it was
    'compiled' for, and that every call passes inputs of the shapes of the first (a package is
    compiled for one signature: the slots with or without the row window, say), and runs the
    exported function eagerly on the flat inputs."""

    def __init__(self, block, w, c) -> None:
        self.fn, self.w, self.c, self.calls = _BlockFn(block), w, c, 0
        self.signature = None

    def run(self, args):
        assert args[0].shape[1] == self.w and args[4].shape[-1] == self.c
        assert all(a.is_contiguous() for a in args[:5])
        signature = [(tuple(a.shape), a.dtype) for a in args[:6]]  # activations, slots, mask, cache
        assert self.signature in (None, signature), (self.signature, signature)
        self.signature = signature
        self.calls += 1
        return [self.fn(*args)]


def fake_packages(blocks, shapes) -> PackageSet:
    """Runners for each block kind; each runs a fresh copy of the block class (every weight and
    the cache come from the call's inputs, so any block of the kind will do)."""
    runners = {}
    for b in blocks:
        cfg = b.self_attn.cfg
        clean = type(b)(cfg).eval().requires_grad_(False)
        clean.self_attn.invariant_rows = b.self_attn.invariant_rows  # compiled into a real package
        clean.self_attn.cache = KVCache.zeros(1, cfg.num_kv_heads, 1, cfg.head_dim, torch.float32, "cpu")
        for w, c in shapes:
            runners[(block_key(b), w, c)] = FakeRunner(clean, w, c)
    return PackageSet(runners, N_SLOTS)


def make(mode, drafter_kind, packages_for=None, tree=TREE, kv_cache=None, head_rows=False):
    target = tiny()
    set_kv_dtype(target, kv_cache)
    if drafter_kind == "self":
        drafter = LMDrafter(target.shared_copy(), mode)
    else:
        n = 2 if drafter_kind == "eagle-2-layers" else 1
        drafter = EagleDrafter.random(target, mode, max_depth=tree.draft_depth, seed=3, num_layers=n)
    if packages_for is not None:  # installed as build_engine installs a plan's packages
        set_invariant_rows(target, attention_rows(CHUNK))
        dmodel = drafter.graphs.model
        if head_rows:  # the drafter's calls row by row up to the target's width (a plan's row kernel on both)
            set_invariant_rows(dmodel, attention_rows(CHUNK))
        pset = fake_packages([target.layers[0], dmodel.layers[0]], packages_for)
        install_packages(target, pset)
        install_packages(dmodel, pset)
    cfg = EngineConfig(mode=mode, max_context=MAX_CTX, prefill_chunk=CHUNK, tree=tree)
    return Engine(target, cfg, drafter)


@pytest.mark.parametrize("drafter_kind", ["self", "eagle", "eagle-2-layers"])
def test_packaged_engine_equals_reference_without_dynamo(drafter_kind):
    from torch._dynamo.utils import counters

    widths = {CHUNK, 1, TREE.verify_width, TREE.draft_width, TREE.draft_depth + 1}
    eng = make("performance", drafter_kind, packages_for=[(w, N_SLOTS) for w in widths])
    assert isinstance(static_blocks(eng.target), PackageSet)
    ref = make("reference", drafter_kind)
    frames = counters["frames"]["total"]
    for p in PROMPTS:
        params = SamplingParams(max_new_tokens=12)
        assert eng.generate(p, params).token_ids == ref.generate(p, params).token_ids
    assert counters["frames"]["total"] == frames  # dynamo never ran
    runners = eng.target.layers[0].forward.runners
    assert sum(r.calls for r in runners.values()) > 0


@pytest.mark.parametrize("drafter_kind", ["self", "eagle"])
def test_a_16_bit_target_cache_and_its_drafter_run_the_packages_of_their_caches(drafter_kind):
    """A package takes the cache as an input of the dtype it was compiled for (unchecked in a real
    one). A target over a float16 cache and an EAGLE head of its shapes (a float32 cache) shared
    the prefill chunk's package where both compute its rows alike, which filled the head's cache
    with garbage: the fake runners' signature (dtypes included) refuses a second dtype. A
    self-drafter's twin keeps its cache in the weights' dtype, and so packages of its own. Tokens
    as reference mode's."""
    widths = {CHUNK, 1, TREE.verify_width, TREE.draft_width, TREE.draft_depth + 1}
    eng = make("performance", drafter_kind, packages_for=[(w, N_SLOTS) for w in widths], kv_cache="float16",
               head_rows=True)
    ref = make("reference", drafter_kind, kv_cache="float16")
    assert eng.drafter.graphs.model.kv.kv.dtype == torch.float32
    for p in PROMPTS:
        params = SamplingParams(max_new_tokens=12)
        assert eng.generate(p, params).token_ids == ref.generate(p, params).token_ids
    for model in (eng.target, eng.drafter.graphs.model):
        assert sum(r.calls for r in model.layers[0].forward.runners.values()) > 0


def test_an_eagle_head_shaped_like_the_target_runs_packages_of_its_own():
    """The head's block has the target's weight shapes, but the target's narrow calls compute
    attention row by row over windowed slots and the head's do not: one package each. Here the
    target verifies 4 rows and the head is called with 4 (D_max + 1): sharing the (kind, 4, S)
    package ran the head on the target's signature (an index out of bounds in a real package)."""
    tree = TreeParams(draft_width=2, draft_depth=3, verify_width=4, top_k=2)
    widths = {CHUNK, 1, tree.verify_width, tree.draft_width, tree.draft_depth + 1}
    eng = make("performance", "eagle", packages_for=[(w, N_SLOTS) for w in widths], tree=tree)
    head = eng.drafter.graphs.model.layers[0]
    assert block_key(head) != block_key(eng.target.layers[0])
    ref = make("reference", "eagle", tree=tree)
    for p in PROMPTS:
        params = SamplingParams(max_new_tokens=12)
        assert eng.generate(p, params).token_ids == ref.generate(p, params).token_ids
    assert sum(r.calls for r in head.forward.runners.values()) > 0


def test_missing_width_is_refused():
    with pytest.raises(YggError, match=r"width 6 is not in the compiled set \[1, 2, 4, 8\]"):
        make("performance", "self", packages_for=[(w, N_SLOTS) for w in (1, 2, 4, CHUNK)])


def test_wrong_cache_size_is_refused():
    pset = fake_packages([tiny().layers[0]], [(1, 99)])
    target = tiny()
    install_packages(target, PackageSet(pset.runners, 99))
    with pytest.raises(YggError, match="99-slot KV cache"):
        Engine(target, EngineConfig(mode="performance", max_context=MAX_CTX, prefill_chunk=1))


def test_loading_packages_registers_the_ops_they_call():
    """A package of a quantized block calls yggtree::int4_mm: importing the package runtime alone
    (as a plan engine does before any model is quantized) must register it, or the first package
    fails to load ("Could not find schema for yggtree::int4_mm")."""
    import subprocess
    import sys

    code = ("import torch, yggtree.runtime.aoti; "
            "print(torch.ops.yggtree.int4_mm.default.name(), torch.ops.yggtree.packed_linear.default.name())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["yggtree::int4_mm", "yggtree::packed_linear"]


class FakeCallRunner:
    """Stands in for a drafter-call package: runs the exported function (:class:`_DrafterCallFn`)
    eagerly on the flat inputs, checking the width and tree size it was 'compiled' for."""

    def __init__(self, net, kind, w, k, nodes) -> None:
        self.fn = _DrafterCallFn(net, EagleDrafter.call_fns[kind], kind, k)
        self.kind, self.w, self.nodes, self.calls = kind, w, nodes, 0

    def run(self, args):
        n = DRAFTER_CALLS[self.kind]
        assert args[n].shape[0] == self.nodes  # node_feat rows
        if self.kind == "draft":
            assert args[0].shape[0] == self.w and args[4].shape == (self.w, self.nodes)
        self.calls += 1
        return list(self.fn(*args))


def eagle_call_engine(k=TREE.top_k, nodes=None):
    """A performance engine whose EAGLE drafter's head and draft calls run fake call packages
    (blocks eager), installed as a compiled plan installs them."""
    target = tiny()
    drafter = EagleDrafter.random(target, "reference", max_depth=TREE.draft_depth, seed=3)
    nodes = nodes or 1 + TREE.draft_depth * TREE.draft_width
    eng = Engine(target, EngineConfig(mode="reference", max_context=MAX_CTX, prefill_chunk=CHUNK, tree=TREE), drafter)
    runners = {(drafter_call_key(drafter, "head", k, nodes), w, N_SLOTS): FakeCallRunner(drafter.net, "head", w, k, nodes)
               for w in drafter.head_widths}
    runners[(drafter_call_key(drafter, "draft", k, nodes), TREE.draft_width, N_SLOTS)] = FakeCallRunner(
        drafter.net, "draft", TREE.draft_width, k, nodes)
    install_drafter_calls(drafter, PackageSet(runners, N_SLOTS), k, nodes)
    return eng, runners


def test_drafter_call_packages_replace_the_eager_calls():
    """The head and draft calls through their (fake) packages: the tokens of the eager drafter,
    every head and draft call through a package, and none where the packages were made for
    another top-k (nor a draft call where they take a smaller tree): those calls run eagerly."""
    ref = make("reference", "eagle")
    eng, runners = eagle_call_engine()
    for p in PROMPTS:
        params = SamplingParams(max_new_tokens=12)
        out = eng.generate(p, params)
        assert out.token_ids == ref.generate(p, params).token_ids
    heads, drafts = (sum(r.calls for r in runners.values() if r.kind == kind) for kind in ("head", "draft"))
    assert heads > 0 and drafts > 0
    for other, kinds in ((dict(k=TREE.top_k + 1), ("head", "draft")), (dict(nodes=4), ("draft",))):
        eng, runners = eagle_call_engine(**other)
        eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=6))
        assert sum(r.calls for r in runners.values() if r.kind in kinds) == 0


@pytest.mark.slow
def test_a_compiled_drafter_call_computes_the_eager_call(tmp_path):
    """Real AOTInductor packages of the head and a draft call of a tiny EAGLE head: the same top-k
    tokens as the eager call and log-probabilities within float rounding (the numerics only shape
    proposals; the target decides every token), and the same feature rows written."""
    from torch._C._aoti import AOTIModelPackageLoader

    from yggtree.runtime.graphs import inductor_cache

    target = tiny()
    # two target layers, normed and reduced: the head call fuses the target's features itself
    drafter = EagleDrafter.random(target, "reference", max_depth=3, seed=3, target_layers=(0, 1), input_norm=True)
    drafter.setup(N_SLOTS, [1, 2], CHUNK)
    k, nodes = 2, 1 + 3 * 2
    with inductor_cache(tmp_path / "inductor"):
        loaders = {kind: AOTIModelPackageLoader(str(compile_drafter_call_package(
            drafter, kind, w, k, nodes, tmp_path / f"{kind}.pt2")), "model", False, 1, -1)
            for kind, w in (("head", 2), ("draft", 2))}
        # the same graph again: inductor reuses its wrapper file, which must still split
        loaders["again"] = AOTIModelPackageLoader(str(compile_drafter_call_package(
            drafter, "head", 2, k, nodes, tmp_path / "again.pt2")), "model", False, 1, -1)
    # every package links the one runtime interface compiled for them (runtime/aoti_cxx.py)
    assert len(list((tmp_path / "inductor" / "yggtree-aoti-interface").glob("*.o"))) == 1
    drafter.prefill(torch.arange(3, 14), tuple(torch.randn(11, target.cfg.hidden_size) for _ in range(2)))
    state = [drafter.net.embed_weight, *(b.self_attn.cache.kv for b in drafter.net.layers),
             *(t for _, t in model_tensors(drafter.net))]
    L = torch.tensor(11)
    nf = drafter.node_feat[:nodes]
    drafter.pend_tok[0] = 9  # one pending pair beside the root's: a head call of 2 rows, the first
    # row's feature fused at the prefill, the second the target's, fused in the call
    drafter._pend_true_features(tuple(torch.randn(2, target.cfg.hidden_size) for _ in range(2)))
    drafter.pend_true[0] = False
    drafter.pend_n.fill_(1)
    got = loaders["head"].run([torch.tensor(5), L + 1, drafter.pend_tok[:2], drafter.pend_feat[:2],
                               drafter.pend_raw[:2], drafter.pend_true[:2], drafter.pend_n, nf, *state])
    row0 = drafter.node_feat[0].clone()
    want = drafter.head(torch.tensor(5), L + 1, k)
    assert torch.equal(got[0], want.token) and torch.allclose(got[1], want.logp, atol=1e-5)
    assert torch.allclose(row0, drafter.node_feat[0], atol=1e-5)
    tok, depth, node, parent = torch.tensor([7, 9]), torch.tensor([1, 1]), torch.tensor([1, 2]), torch.tensor([0, 0])
    anc = torch.zeros(2, nodes, dtype=torch.bool)
    anc[:, 0], anc[0, 1], anc[1, 2] = True, True, True
    got = loaders["draft"].run([tok, depth, node, parent, anc, L, nf, *state])
    rows = drafter.node_feat[1:3].clone()
    want = drafter.step(tok, depth, node, parent, anc[:, :3], L, k)
    assert torch.equal(got[0], want.token) and torch.allclose(got[1], want.logp, atol=1e-5)
    assert torch.allclose(rows, drafter.node_feat[1:3], atol=1e-5)


def test_packages_extract_under_the_cache_per_process_and_dead_processes_dirs_are_removed(monkeypatch, tmp_path):
    """AOTInductor extracts each loaded package under $TMPDIR and removes it when the loader is freed, so a
    killed run or build left 2-3 MB a package in /tmp for good: loads extract to this process's directory under
    the cache instead, and the directories of processes no longer alive are removed by the next load."""
    import os
    import subprocess
    import sys

    from yggtree.runtime.aoti import EXTRACT_DIR, extracting_here

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TMPDIR", "/somewhere")
    root = tmp_path / "yggtree" / EXTRACT_DIR
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = root / gone.stdout.strip()  # a process that has ended
    live = root / str(os.getppid())
    for d in (dead / "aotinductor_x", live / "aotinductor_y", root / "notes"):
        d.mkdir(parents=True)
    with extracting_here():
        assert os.environ["TMPDIR"] == str(root / str(os.getpid()))
        assert (root / str(os.getpid())).is_dir()
    assert os.environ["TMPDIR"] == "/somewhere"
    assert not dead.exists() and (live / "aotinductor_y").is_dir() and (root / "notes").is_dir()
    monkeypatch.delenv("TMPDIR")
    with extracting_here():
        assert "TMPDIR" in os.environ
    assert "TMPDIR" not in os.environ


def test_a_killed_loaders_directory_goes_with_the_next_load(monkeypatch, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from yggtree.runtime.aoti import extracting_here

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = ("import os, time, tempfile\nfrom yggtree.runtime.aoti import extracting_here\n"
            "with extracting_here():\n"
            "    d = tempfile.mkdtemp(prefix='aotinductor_', dir=os.environ['TMPDIR'])\n"  # as the loader does
            "    print(d, flush=True)\n    time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    try:
        extracted = child.stdout.readline().strip()
        assert extracted.startswith(str(tmp_path)) and os.path.isdir(extracted)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert os.path.isdir(extracted)  # killed: left behind
    with extracting_here():
        pass
    assert not os.path.exists(os.path.dirname(extracted))


def test_an_unwritable_cache_leaves_the_extraction_where_it_was(monkeypatch, tmp_path):
    import os

    from yggtree.runtime.aoti import extracting_here

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setenv("TMPDIR", "/somewhere")
    with extracting_here():
        assert os.environ["TMPDIR"] == "/somewhere"
