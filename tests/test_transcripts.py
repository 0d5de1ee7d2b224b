"""Teacher transcripts and resumable drafter training, on a tiny random target with the real
tokenizer: batched generation equals one-row generation, captured features equal a prefill, shards
round-trip and are refused when foreign or damaged, decontamination, and interrupted generation and
training (between chunks and inside one) resume to exactly the uninterrupted result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from yggtree.errors import YggError
from yggtree.offline import distill as D
from yggtree.offline import distill_config as DC
from yggtree.offline import distill_data as DD
from yggtree.offline import teacher_data as TD
from yggtree.offline import distill_eval as DE
from yggtree.offline import distill_train as DT
from yggtree.offline import requests as rq
from yggtree.offline import transcripts as tr
from yggtree.runtime.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer(real_tokenizer):
    return real_tokenizer


def tiny(vocab: int, seed: int = 0, dtype=torch.float64) -> Transformer:
    return tiny_model(vocab, 16, 3, max_pos=4096, eos=(2,), seed=seed, std=0.5, dtype=dtype)


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny(len(tokenizer))


SPEC = dict(size=6, max_new_tokens=6, gen_batch=4, teacher_dtype="float64")


def make(target, tokenizer, index: int = 0, split: str = "train"):
    spec = tr.ShardSpec(split=split, index=index, **SPEC)
    return tr.build_shard(target, tokenizer, spec, DD.target_fingerprint(target), (0, 2))


@pytest.fixture(scope="module")
def built(target, tokenizer):
    """``make(target, tokenizer)`` once for the module (deterministic; no test changes it):
    the shard and its features. Its self-synthesised (Magpie) requests are sampled up to 12
    tokens, not 96: a random target never ends one, so each is rejected either way (a template
    takes its place), and sorting the 49k-token vocabulary for every sampled token was most of
    this fixture's time. The slow tests' shards (``shard_dir``, the command) keep 96."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tr, "MAGPIE_MAX_TOKENS", 12)
        return make(target, tokenizer)


# ---------------------------------------------------------------- generation


def test_batched_generation_equals_one_row_at_a_time(target):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    batched = tr.generate(target, prompts, 7, (2,), [0.0] * 4, seed=0, layers=(0, 2))
    for p, b in zip(prompts, batched):
        one = tr.generate(target, [p], 7, (2,), [0.0], seed=0, layers=(0, 2))[0]
        assert one.answer == b.answer
        torch.testing.assert_close(one.feats, b.feats)
        assert b.feats.shape == (len(p) + len(b.answer), 2 * 16)


def test_rows_leave_the_batch_when_they_stop(target):
    """A row that emits the stop token leaves the batch; the others continue unchanged."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (6,), generator=g).tolist() for _ in range(3)]
    free = tr.generate(target, prompts, 5, (), [0.0] * 3, seed=0)
    stop = free[0].answer[1]  # row 0 stops at its second token
    outs = tr.generate(target, prompts, 5, (stop,), [0.0] * 3, seed=0, layers=(1,))
    assert outs[0].stopped and outs[0].answer == free[0].answer[:2]
    for o, f in zip(outs[1:], free[1:]):
        k = f.answer.index(stop) + 1 if stop in f.answer else len(f.answer)
        assert o.answer == f.answer[:k]
        assert o.feats.shape[0] == 6 + len(o.answer)


def test_captured_features_equal_a_prefill(target, built):
    shard, feats = built
    again = tr.prefill_features(target, shard, (0, 2), batch=3)
    torch.testing.assert_close(feats, again)


def test_sampling_is_seeded_and_temperature_zero_is_greedy(target):
    p = [[5, 6, 7, 8]] * 3
    a = tr.generate(target, p, 6, (), [1.0, 1.0, 0.0], seed=3)
    b = tr.generate(target, p, 6, (), [1.0, 1.0, 0.0], seed=3)
    greedy = tr.generate(target, p[:1], 6, (), [0.0], seed=9)[0]
    assert [o.answer for o in a] == [o.answer for o in b]
    assert a[2].answer == greedy.answer
    assert a[0].answer != a[1].answer  # two draws at temperature 1 over a 49k vocabulary


# ---------------------------------------------------------------- requests


def test_decontamination_and_dedup():
    from yggtree.data import mtbench_first_turns

    d = rq.Decontaminator(["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting"])
    assert d.contaminated("please compose an engaging travel blog post about a recent trip to Hawaii now")
    assert not d.contaminated("compose an engaging travel blog post about Rome")
    real = rq.Decontaminator([q.text for q in mtbench_first_turns(5)])
    assert real.contaminated(mtbench_first_turns(1)[0].text)
    assert rq.normalised("Hello,  World!") == rq.normalised("hello world")


def test_template_requests_are_deterministic_and_split(monkeypatch):
    """The bug and function kinds draw documented stdlib functions: from every fourth stdlib file
    here (sorted order; some 170 functions), as parsing them all was nearly all of this test's
    time. The chunk corpus the other kinds use is the whole one."""
    import random

    from yggtree import data

    rq.corpus_split("train")  # the whole corpus, cached before the file list is cut
    every = data.stdlib_source_paths
    monkeypatch.setattr(data, "stdlib_source_paths", lambda root=None: every(root)[::4])
    rq._stdlib_functions_all.cache_clear()
    try:
        assert len(rq.stdlib_functions("train")) > 100 and rq.stdlib_functions("heldout")
        a = [rq.template_request(k, random.Random(1), "train") for k in rq.KINDS if k != "magpie"]
        b = [rq.template_request(k, random.Random(1), "train") for k in rq.KINDS if k != "magpie"]
    finally:
        rq._stdlib_functions_all.cache_clear()  # later callers parse the whole stdlib
    assert a == b
    train_code, _ = rq.corpus_split("train")
    held_code, _ = rq.corpus_split("heldout")
    assert not {c.text for c in train_code} & {c.text for c in held_code}
    assert rq.plant_bug("if a == b:\n    return x[0]\n", random.Random(0)) != "if a == b:\n    return x[0]\n"


def test_follow_up_turn_continues_the_template(tokenizer):
    fmt = tr.ChatFormat(tokenizer)
    p1 = fmt.first("Hi")
    ans = tokenizer("Hello there", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    whole = p1 + ans + fmt.follow_up(ans, "And?")
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "And?"}],
        add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(whole) == want


# ---------------------------------------------------------------- shards


def test_shard_roundtrip_and_refusals(target, tokenizer, built, tmp_path):
    shard, _ = built
    path = tmp_path / "train-00000.safetensors"
    tr.save_shard(shard, path)
    fp, tfp = DD.target_fingerprint(target), tr.tokenizer_fingerprint(tokenizer)
    back = tr.load_shard(path, fp, tfp)
    assert torch.equal(back.tokens, shard.tokens) and torch.equal(back.role, shard.role)
    assert back.meta["counts"]["requests"] == shard.n_seq == 6
    assert path.stat().st_size < 8 * shard.n_tokens + 20000  # token ids only
    with pytest.raises(YggError, match="another target"):
        tr.load_shard(path, DD.target_fingerprint(tiny(len(tokenizer), seed=1)), tfp)
    with pytest.raises(YggError, match="another tokenizer"):
        tr.load_shard(path, fp, "0" * 16)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(YggError, match=f"cannot read transcript shard {cut}"):
        tr.load_shard(cut)
    from safetensors.numpy import save_file

    forged = tmp_path / "forged.safetensors"
    bad = shard.tokens.numpy().astype("uint16").copy()
    bad[3] += 1
    save_file({"tokens": bad, "offsets": shard.offsets.numpy(), "role": shard.role.numpy()}, str(forged),
              metadata={"yggtree": "transcripts", "meta": json.dumps(shard.meta)})
    with pytest.raises(YggError, match="damaged"):
        tr.load_shard(forged)


# ---------------------------------------------------------------- resumable pipeline


class Boom(Exception):
    pass


def _run_transcripts(out: Path, cache: Path, shards: str, monkeypatch=None, target=None, tokenizer=None):
    """The ``yggtree transcripts`` command body on the tiny target (model loading patched)."""
    from yggtree.offline import transcripts_cmd as cmd

    import argparse

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    args = p.parse_args(["--out", str(out), "--shards", shards, "--shard-size", "6", "--max-new-tokens", "6",
                         "--gen-batch", "4", "--teacher-dtype", "float32", "--target-layers", "0,2",
                         "--feature-cache", str(cache)])
    return cmd.run(args)


@pytest.fixture()
def patched_loading(monkeypatch, target, tokenizer):
    from yggtree.runtime import loading

    monkeypatch.setattr(loading, "load_model", lambda src, dtype="float32": target.float())
    monkeypatch.setattr(loading, "load_tokenizer", lambda src: tokenizer)
    yield
    target.double()


@pytest.mark.slow
def test_generation_resumes_after_an_interruption(tmp_path, patched_loading, monkeypatch):
    _run_transcripts(tmp_path / "a", tmp_path / "fa", "0:3")
    real = tr.generate_all
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # inside the third shard (each makes 2 calls here: self-synthesis, answers)
            raise Boom()
        return real(*a, **k)

    monkeypatch.setattr(tr, "generate_all", flaky)
    with pytest.raises(Boom):
        _run_transcripts(tmp_path / "b", tmp_path / "fb", "0:3")
    monkeypatch.setattr(tr, "generate_all", real)
    done = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert done == ["train-00000.safetensors", "train-00001.safetensors"]  # nothing half-written
    _run_transcripts(tmp_path / "b", tmp_path / "fb", "0:3")
    for k in range(3):
        a = tr.load_shard(tmp_path / "a" / f"train-{k:05d}.safetensors")
        b = tr.load_shard(tmp_path / "b" / f"train-{k:05d}.safetensors")
        assert a.meta["sha256"] == b.meta["sha256"]


def _distill_cfg(data: Path, out: Path, cache: Path, **kw) -> DC.DistillConfig:
    base = dict(out=str(out), transcripts=str(data), feature_cache=str(cache), target_layers=(0, -1),
                teacher_dtype="float32", draft_vocab=64, max_seq_len=24, epochs=2.0, batch_size=2, lr=3e-3,
                unroll=2, eval_depth=3, eval_every=4, heldout_seqs=4, checkpoint_every=3, train_autocast="none",
                save_dtype="float32")
    base.update(kw)
    return DC.DistillConfig(**base)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, target, tokenizer):
    root = tmp_path_factory.mktemp("transcripts")
    t32 = target.float()
    fp = DD.target_fingerprint(t32)
    for split, k in (("train", 0), ("train", 1), ("heldout", 0)):
        spec = tr.ShardSpec(split=split, index=k, size=6, max_new_tokens=6, gen_batch=4, teacher_dtype="float32")
        shard, feats = tr.build_shard(t32, tokenizer, spec, fp, (0, 2))
        tr.save_shard(shard, root / f"{spec.name()}.safetensors")
    target.double()
    return root


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_training_resumes_to_the_same_weights(shard_dir, target, tokenizer, tmp_path, monkeypatch):
    t32 = target.float()
    try:
        whole = D.distill(_distill_cfg(shard_dir, tmp_path / "whole", tmp_path / "c"), target=t32, tokenizer=tokenizer)
        assert whole["data"]["n_train_shards"] == 2 and whole["data"]["features_reused"] == 0
        steps = whole["training"]["steps"]
        # between chunks: a budget that ends every invocation after one step
        cfg = _distill_cfg(shard_dir, tmp_path / "chunks", tmp_path / "c", budget_minutes=1e-9)
        runs = 0
        while True:
            m = D.distill(cfg, target=t32, tokenizer=tokenizer)
            runs += 1
            if m.get("complete") is not False:
                break
        assert runs == steps
        # inside a chunk: killed at step 5, after the checkpoint at step 3
        real = DT.make_batch
        calls = {"n": 0}

        def dies(*a, **k):
            calls["n"] += 1
            if calls["n"] == 5:
                raise Boom()
            return real(*a, **k)

        monkeypatch.setattr(DT, "make_batch", dies)  # training and validation batches, as in one module before
        monkeypatch.setattr(DE, "make_batch", dies)
        with pytest.raises(Boom):
            D.distill(_distill_cfg(shard_dir, tmp_path / "killed", tmp_path / "c"), target=t32, tokenizer=tokenizer)
        monkeypatch.setattr(DT, "make_batch", real)
        monkeypatch.setattr(DE, "make_batch", real)
        assert torch.load(tmp_path / "killed" / DT.CHECKPOINT_FILE, weights_only=False)["step"] == 3
        resumed = D.distill(_distill_cfg(shard_dir, tmp_path / "killed", tmp_path / "c"), target=t32, tokenizer=tokenizer)
        assert resumed["data"]["features_reused"] == 3
        want = _weights(tmp_path / "whole")
        for out in ("chunks", "killed"):
            got = _weights(tmp_path / out)
            assert set(got) == set(want)
            for k in want:
                assert torch.equal(got[k], want[k]), (out, k)
        # a checkpoint of another head shape is refused, naming the file and the mismatch
        with pytest.raises(YggError, match=r"checkpoint .*checkpoint.pt belongs to another run: draft_vocab is 64 there, 32 here"):
            D.distill(_distill_cfg(shard_dir, tmp_path / "killed", tmp_path / "c", draft_vocab=32), target=t32,
                      tokenizer=tokenizer)
    finally:
        target.double()


def _tensors(x, at=""):
    """Every tensor inside a (nested) checkpoint state, by path."""
    if isinstance(x, torch.Tensor):
        return {at: x}
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{at}/{k}"))
    return out


def _mapped_from(path: Path, t: torch.Tensor) -> bool:
    """Whether tensor ``t``'s memory lies in a mapping of the file ``path`` (/proc/self/maps)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split(maxsplit=5)
        if len(f) == 6 and f[5] == str(path):
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
@pytest.mark.slow
def test_memory_mapped_features_train_exactly_the_in_memory_weights(shard_dir, target, tokenizer, tmp_path, monkeypatch):
    """The features stay in their cache files (memory-mapped, not copied), and the trained
    checkpoint equals, tensor for tensor, the one trained from the features copied into one
    float16 buffer (the layout before memory mapping)."""
    t32 = target.float()
    real = DD.transcript_data
    seen = {}

    def keep(*a, **k):
        out = real(*a, **k)
        seen["data"] = out[0]
        return out

    try:
        monkeypatch.setattr(D, "transcript_data", keep)
        D.distill(_distill_cfg(shard_dir, tmp_path / "mapped", tmp_path / "c", checkpoint_every=100), target=t32,
                  tokenizer=tokenizer)
        feats = seen["data"].feats
        assert isinstance(feats, TD.FeatureBlocks) and len(feats.blocks) == 3
        files = sorted((tmp_path / "c").rglob("features.safetensors"))
        assert len(files) == 3
        for blk in feats.blocks:
            assert blk.dtype == torch.float16
            assert any(_mapped_from(f, blk) for f in files)
        monkeypatch.setattr(D, "transcript_data", lambda *a, **k: keep(*a, **k, in_memory=True))
        D.distill(_distill_cfg(shard_dir, tmp_path / "memory", tmp_path / "c", checkpoint_every=100), target=t32,
                  tokenizer=tokenizer)
        assert isinstance(seen["data"].feats, torch.Tensor) and seen["data"].feats.dtype == torch.float16
        assert torch.equal(seen["data"].feats, feats.materialize())
    finally:
        target.double()
    for name in ("model.safetensors", DT.CHECKPOINT_FILE):
        if name.endswith(".pt"):
            a = _tensors(torch.load(tmp_path / "mapped" / name, weights_only=False)["net"])
            a |= _tensors(torch.load(tmp_path / "mapped" / name, weights_only=False)["opt"], "opt")
            b = _tensors(torch.load(tmp_path / "memory" / name, weights_only=False)["net"])
            b |= _tensors(torch.load(tmp_path / "memory" / name, weights_only=False)["opt"], "opt")
        else:
            a, b = _weights(tmp_path / "mapped"), _weights(tmp_path / "memory")
        assert set(a) == set(b) and len(a) > 5
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_feature_blocks_read_as_one_tensor():
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(n, 6, generator=g).to(torch.float16) for n in (5, 1, 7, 4)]
    fb = TD.FeatureBlocks(blocks)
    whole = torch.cat(blocks)
    assert fb.shape == whole.shape and len(fb) == 17 and fb.dtype == torch.float16
    for a in range(18):
        for b in range(a, 18):
            assert torch.equal(fb[a:b], whole[a:b])
    for key in (slice(None, None, 3), slice(2, 15, 4), slice(None, None, 20), slice(16, None, 2)):
        assert torch.equal(fb[key], whole[key])
    assert fb[0:5].data_ptr() == blocks[0].data_ptr() and fb[6:9].data_ptr() == blocks[2][0:].data_ptr()
    cols = fb[..., 2:4]
    assert isinstance(cols, TD.FeatureBlocks) and torch.equal(cols[3:12], whole[3:12, 2:4])
    assert torch.equal(cols[::2], whole[::2, 2:4]) and torch.equal(fb[:, 1:2].materialize(), whole[:, 1:2])
    mixed = TD.FeatureBlocks([blocks[0], blocks[1].float()])  # a shard that overflowed float16 is float32
    assert mixed.dtype == torch.float32 and torch.equal(mixed[3:6], torch.cat(blocks[:2]).float()[3:6])
    assert torch.equal(mixed.materialize(), torch.cat(blocks[:2]).float())


def test_feature_cache_is_mapped_checked_and_recomputed_when_damaged(target, built, tmp_path):
    shard, feats = built
    fp = DD.target_fingerprint(target)
    ident = tr.feature_identity(shard, fp, (0, 2), "float32")
    path = tr.feature_path(tmp_path, shard, (0, 2), "float32")
    tr.save_features(feats, path, ident)
    assert not list(path.parent.glob(".*partial*"))  # written then renamed
    got = tr.map_features(path, shard.n_tokens, 32, ident)
    assert torch.equal(got, feats.to(torch.float16)) and _mapped_from(path, got)
    assert tr.map_features(path, shard.n_tokens + 1, 32, ident) is None  # another shape: recomputed
    for k, v in (("target_fingerprint", "0" * 16), ("layers", [0, 1]), ("shard_sha256", "ab" * 32)):
        with pytest.raises(YggError, match=rf"^feature cache {path} holds other features: {k} is "):
            tr.map_features(path, shard.n_tokens, 32, ident | {k: v})
    legacy = tmp_path / "legacy" / "features.safetensors"
    tr.save_features(feats, legacy)  # written before identities: used when its shape fits
    assert torch.equal(tr.map_features(legacy, shard.n_tokens, 32, ident), got)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-10])
    assert tr.map_features(cut, shard.n_tokens, 32, ident) is None
    assert tr.map_features(tmp_path / "absent.safetensors", shard.n_tokens, 32, ident) is None


def test_transcript_training_refuses_foreign_or_missing_shards(built, tokenizer, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train-00000", "heldout-00000"):  # the refusal comes before a shard's split matters
        tr.save_shard(built[0], data / f"{name}.safetensors")
    other = tiny(len(tokenizer), seed=5, dtype=torch.float32)
    with pytest.raises(YggError, match="another target"):
        D.distill(_distill_cfg(data, tmp_path / "o", tmp_path / "c"), target=other, tokenizer=tokenizer)
    with pytest.raises(YggError, match="does not exist"):
        D.distill(_distill_cfg(tmp_path / "nope", tmp_path / "o", tmp_path / "c"), target=other, tokenizer=tokenizer)


def _ranks_worker(rank: int, world: int, port: int, path: str) -> None:
    """One gloo group for both rank tests below: one pair of forked processes (starting fresh
    interpreters was nearly all of these tests' time)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    # rank 0 alone has used up its time budget: both must stop at this step
    budget = [DT.any_rank(rank == 0, world), DT.any_rank(False, world)]
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    lin(x).pow(2).mean().backward()
    DT._all_reduce_grads(list(lin.parameters()), world)
    torch.save({"rank": rank, "budget": budget, "grad": lin.weight.grad.clone()}, f"{path}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of two gloo ranks (``_ranks_worker``) saved."""
    import socket

    import torch.multiprocessing as mp

    path = tmp_path_factory.mktemp("ranks") / "r"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ranks_worker, args=(2, port, str(path)), nprocs=2, join=True, start_method="fork")
    return [torch.load(f"{path}.{r}") for r in range(2)]


def test_a_budget_stop_on_one_rank_stops_every_rank(ranks):
    """The ranks' clocks differ: the budget stop is agreed, so no rank waits for another's
    gradients after it stopped (a run once ended with 'Connection closed by peer')."""
    assert [r["budget"] for r in ranks] == [[True, False], [True, False]]


def test_data_parallel_gradients_are_averaged_over_processes(ranks):
    g0, g1 = ranks[0]["grad"], ranks[1]["grad"]
    assert torch.equal(g0, g1)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    grads = []
    for r in range(2):
        lin.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(r))
        lin(x).pow(2).mean().backward()
        grads.append(lin.weight.grad.clone())
    torch.testing.assert_close(g0, (grads[0] + grads[1]) / 2)


def _distill_rank(rank: int, world: int, port: int, data: str, out: str, cache: str, ret: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from yggtree.runtime.loading import load_tokenizer, resolve_model

    torch.set_num_threads(1)
    tok = load_tokenizer(resolve_model("default"))
    t = tiny(len(tok), dtype=torch.float32)
    t.double().float()  # the same rounding as the module's target
    m = D.distill(_distill_cfg(Path(data), Path(out), Path(cache), epochs=1.0), target=t, tokenizer=tok)
    torch.save(m, f"{ret}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_distill_runs_data_parallel_on_two_processes(shard_dir, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_distill_rank, args=(2, port, str(shard_dir), str(tmp_path / "out"), str(tmp_path / "c"),
                                  str(tmp_path / "m")), nprocs=2, join=True)
    m0 = torch.load(f"{tmp_path / 'm'}.0", weights_only=False)
    m1 = torch.load(f"{tmp_path / 'm'}.1", weights_only=False)
    assert m1 == {"complete": True, "rank": 1}
    assert m0["training"]["steps"] > 0 and (tmp_path / "out" / "model.safetensors").is_file()
    assert m0["training"]["val"]["val_kl"] == m0["training"]["val"]["val_kl"]  # evaluated (not NaN)


def test_cli_on_a_non_zero_rank_exits_cleanly(monkeypatch, capsys, tmp_path):
    """Under torchrun the ranks other than 0 return a short manifest: the command ends with 0 and
    prints nothing (an exception there made torchrun stop rank 0 during its final evaluation)."""
    import argparse

    p = argparse.ArgumentParser()
    D.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "o"), "--transcripts", str(tmp_path)])
    monkeypatch.setattr(D, "distill", lambda cfg, argv=None: {"complete": True, "rank": 1})
    assert D.run(args) == 0
    assert capsys.readouterr().out == ""
