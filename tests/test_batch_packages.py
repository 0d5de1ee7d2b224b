"""Batched decoding on compiled graphs (runtime/batch_packages.py, offline/batch_build.py): real
AOTInductor packages of a tiny target -- its own block packages for requests decoded alone, its
batch packages over a 2-row cache -- and every request of a batch, joining and leaving mid-run,
plain and speculative, gets exactly the tokens it gets decoded alone on the block packages. The
packages are built once, kept, and a damaged one is built again."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers import perturbed, tiny_model
from yggtree.errors import YggError
from yggtree.offline import batch_build
from yggtree.runtime.aoti import PackageSet, ShapeRecorder, compile_package, install_packages, install_recorder, package_name
from yggtree.runtime.batch import BatchDecoder, plain_policy
from yggtree.runtime.batch_packages import batch_dir
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.kernels import library_missing
from yggtree.runtime.packed import pack_linears

pytestmark = [
    pytest.mark.slow,  # builds ~8 real packages
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(bool(library_missing()), reason="the kernel library needs AVX2 with FMA and F16C (or AVX-512)"),
]

VOCAB, EOS, CHUNK, MAX_CTX = 97, 3, 16, 120
TREE = TreeParams(draft_width=2, draft_depth=2, verify_width=4, top_k=2)


def engine(root: Path | None = None, packages: PackageSet | None = None) -> Engine:
    """A tiny speculative engine on the tiled kernel (rows independent of the call's other rows),
    its target's blocks on ``packages`` (their directory ``root``) where given."""
    target = tiny_model(VOCAB, 64, 2, max_pos=1024, eos=(EOS,), seed=0)
    pack_linears(target, kernel="tiled")
    draft = perturbed(tiny_model(VOCAB, 64, 2, max_pos=1024, seed=0), 0.05)
    pack_linears(draft, kernel="tiled")
    cfg = EngineConfig(mode="reference", max_context=MAX_CTX, prefill_chunk=CHUNK, tree=TREE, verify_widths=(4,))
    eng = Engine(target, cfg, LMDrafter(draft, "reference"), eos_ids=(EOS,))
    if packages is not None:  # as a compiled plan's engine gets them (runtime/build.py)
        install_packages(target, packages)
        target.package_root = root
    return eng


def requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [dict(key=i, prompt=[rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 40))],
                 params=SamplingParams(rng.randint(8, 30), 0.0, 1.0, seed=i), plain=i % 3 == 2,
                 arrive=[0, 0, 3, 9, 10, 12][i % 6], leave=6 if i == 1 else None)
            for i in range(n)]


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """The target's block packages at every shape a request decoded alone calls: (root, set)."""
    root = tmp_path_factory.mktemp("packages")
    eng = engine()
    rec = ShapeRecorder()
    install_recorder(eng.target, rec)
    for r in requests(3):
        eng.generate(r["prompt"], r["params"])
        eng.generate(r["prompt"], r["params"], policy=plain_policy(eng))
    for block in eng.target.layers:
        block.__dict__.pop("forward", None)
    for key, example in rec.examples.items():
        compile_package(rec.blocks[key[0]], example, root / package_name(*key))
    return root, PackageSet.load(root, list(rec.examples), eng.n_slots)


def test_batched_compiled_requests_equal_their_decoding_alone(blocks):
    root, pset = blocks
    reqs = requests(6)  # request 1 leaves (a client gone) after 6 steps
    eng = engine(root, pset)
    alone = {}
    for r in reqs:
        kw = {"policy": plain_policy(eng)} if r["plain"] else {}
        alone[r["key"]] = eng.generate(r["prompt"], r["params"], **kw).token_ids

    eng = engine(root, pset)
    said = []
    packages = batch_build.batch_packages(eng, 2, say=said.append)
    assert said and "once for this plan" in said[0]
    assert packages.step_contexts and sorted(packages.runners) == sorted(batch_build.engine_batch_shapes(eng, 2))
    dec = BatchDecoder(eng, 2, packages=packages)
    got, pending, step, solo_steps, batched_steps = {}, list(reqs), 0, 0, 0
    joined = {}
    while pending or dec.running:
        for r in reqs:
            if r["leave"] is not None and joined.get(r["key"]) == step - r["leave"]:
                dec.remove(r["key"])
        for r in [r for r in pending if r["arrive"] <= step]:
            if not dec.free:
                break
            pending.remove(r)
            joined[r["key"]] = step
            dec.add(r["key"], r["prompt"], r["params"], plain_policy(eng) if r["plain"] else None)
        decoding = sum(s.req is not None for s in dec.slots)
        for e in dec.step():
            assert e.error is None, e.error
            got.setdefault(e.key, []).extend(e.tokens)
        solo_steps += decoding == 1
        batched_steps += decoding == 2
        step += 1
        assert step < 2000
    left = reqs[1]["key"]
    cut = got.pop(left)
    assert 0 < len(cut) < len(alone[left]) and cut == alone.pop(left)[: len(cut)]  # what it got before it left
    assert got == alone
    assert solo_steps and batched_steps  # both paths ran, and requests moved between them

    # built once: a second decoder loads them; a damaged package is built again
    eng = engine(root, pset)
    said.clear()
    batch_build.batch_packages(eng, 2, say=said.append)
    assert not said
    victim = sorted(batch_dir(root, 2).glob("*.pt2"))[0]
    victim.write_bytes(victim.read_bytes()[:-7])
    with pytest.raises(YggError, match="damaged"):
        type(packages).load(batch_dir(root, 2), eng.target, batch_build.engine_batch_shapes(eng, 2), 2, eng.n_slots)
    batch_build.batch_packages(eng, 2, say=said.append)
    assert len(said) == 1


def test_a_shape_without_a_batch_package_is_refused(blocks):
    root, pset = blocks
    eng = engine(root, pset)
    packages = batch_build.batch_packages(eng, 2, say=lambda line: None)
    dec = BatchDecoder(eng, 2, packages=packages)
    with pytest.raises(YggError, match="no batched graph for 2 rows of width 3"):
        dec.packages.layers(eng.target, dec.buckets[2], torch.zeros(2, 3, dtype=torch.int64),
                            torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64),
                            torch.ones(2, 3, eng.n_slots, dtype=torch.bool))
