"""Drafter distillation on a tiny random target: the unrolled training forward equals the runtime
head, training lowers the loss, the draft vocabulary, the manifest, determinism; and the shipped
default head (load, and refusal of a corrupted copy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from yggtree.errors import YggError
from yggtree.offline import distill as D
from yggtree.offline import distill_config as DC
from yggtree.offline import distill_data as DD
from yggtree.offline import distill_loss as DL
from yggtree.offline import distill_train as DT
from yggtree.offline import teacher_data as TD
from yggtree.runtime import steps
from yggtree.runtime.eagle import EagleDrafter, load_eagle
from yggtree.runtime.model import Transformer, rope_table

DEFAULT_DIR = Path(D.__file__).resolve().parent.parent / "assets" / "drafters" / "smollm2-135m-eagle"
REPO = Path(__file__).resolve().parent.parent


def tiny(seed: int = 0) -> Transformer:
    return tiny_model(eos=(2,), seed=seed)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny()


def prompts(n: int = 24, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 6 + (i * 7) % 13
        # a skewed token distribution, so frequencies are meaningful
        out.append((torch.randint(3, 40, (length,), generator=g) // (1 + i % 3) + 3).tolist())
    return out


def small_cfg(tmp: Path, **kw) -> DC.DistillConfig:
    base = dict(
        out=str(tmp / "out"),
        cache_dir=str(tmp / "cache"),
        prompts=24,
        max_new_tokens=12,
        gen_batch=5,
        max_seq_len=40,
        val_frac=0.2,
        draft_vocab=48,
        epochs=15.0,
        batch_size=4,
        lr=3e-3,
        unroll=2,
        eval_depth=3,
        eval_every=10,
        save_dtype="float32",
        teacher_dtype="float32",
    )
    base.update(kw)
    return DC.DistillConfig(**base)


# ---------------------------------------------------------------- the training forward


@pytest.mark.parametrize("input_norm,layers,blocks", [
    (False, (1,), 1), (True, (1,), 1), (True, (0, 1), 1), (False, (1, 0), 1), (True, (1,), 2), (False, (0, 1), 2),
])
def test_unrolled_forward_equals_runtime_chain(target, input_norm, layers, blocks):
    """Step k of the unrolled forward at pair p equals a depth-k chain through the head's caches
    (one target layer, or several fused; one decoder layer or two). Step 0 is the runtime's causal
    forward."""
    drafter = EagleDrafter.random(
        target, "reference", max_depth=4, seed=3, input_norm=input_norm, target_layers=layers,
        num_layers=blocks,
    )
    net = drafter.net
    if input_norm:  # non-trivial norm weights, so a missed norm would show
        with torch.no_grad():
            net.embed_norm.weight.uniform_(0.5, 1.5)
            net.feat_norm.weight.uniform_(0.5, 1.5)
    seq = torch.tensor(prompts(1, seed=5)[0] + [7, 8, 9, 10, 11, 12])
    n = seq.shape[0]
    target.setup_cache(1, 64)
    _, _, caps = steps.prefill_chunk(target, seq[None], torch.tensor(0), torch.tensor(n), layers)
    f = torch.cat([c[0] for c in caps], dim=-1)  # [n, L*H]: the layers side by side
    tok, feat = seq[1:], f[:-1]  # pairs p = 0..n-2
    fused = net.fuse_target(tuple(c[0][:-1] for c in caps))  # [n-1, H]: what the runtime feeds
    t = tok.shape[0]
    rope = rope_table(net.cfg.layer_config(), 64)
    outs = DL.unrolled_forward(net, tok[None], feat[None], 3, rope)

    s = 64
    net.setup_cache(s)
    cols = torch.arange(s)
    for k in range(3):
        for p in range(k, t):
            # committed pairs 0..p-k with true features at slots 1..p-k+1
            r = p - k
            slot = torch.arange(1, r + 2)
            mask = (cols[None, :] >= 1) & (cols[None, :] <= slot[:, None])
            out = net(tok[: r + 1], fused[: r + 1], slot - 1, slot, mask)
            x = out[-1]
            chain = [r + 1]  # slots on the path
            for j in range(1, k + 1):
                q = r + j
                chain.append(q + 1)
                m = ((cols >= 1) & (cols <= r + 1)) | torch.isin(cols, torch.tensor(chain))
                x = net(tok[q : q + 1], x[None], torch.tensor([q]), torch.tensor([q + 1]), m[None])[0]
            torch.testing.assert_close(outs[k][0, p], x, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layers", [(1,), (1, 0)])
def test_generate_batch_equals_single_rows(target, layers):
    """Batched greedy answers (padded prompts, early EOS) equal one-row runs, features included."""
    ps = prompts(4, seed=9)
    batched = DD.generate_batch(target, ps, 10, (2,), layers)
    for p, (toks, feats, n) in zip(ps, batched):
        (one_t, one_f, one_n) = DD.generate_batch(target, [p], 10, (2,), layers)[0]
        assert toks == one_t and n == one_n == len(p)
        assert feats.shape == (len(toks), len(layers) * target.cfg.hidden_size)
        torch.testing.assert_close(feats, one_f, atol=1e-5, rtol=1e-4)
        # features are the target's causal layer outputs, side by side in the order asked
        target.setup_cache(1, 64)
        _, _, caps = steps.prefill_chunk(
            target, torch.tensor([toks]), torch.tensor(0), torch.tensor(len(toks)), layers
        )
        torch.testing.assert_close(feats, torch.cat([c[0] for c in caps], -1), atol=1e-5, rtol=1e-4)


def test_feature_layout_stores_the_last_layer_once():
    lay = TD.FeatureLayout.make((2, -1), 30, 8)
    assert lay.inputs == (2, 29) and lay.stored == (2, 29) and lay.last == 1 and lay.width == 16
    lay = TD.FeatureLayout.make((2, 15), 30, 8)
    assert lay.stored == (2, 15, 29) and lay.last == 2 and lay.width == 24
    f = torch.arange(24.0)[None].repeat(3, 1)  # [3, 24]
    assert torch.equal(lay.head_input(f), f[:, :16]) and torch.equal(lay.last_layer(f), f[:, 16:])
    for bad, msg in (((30,), "out of range"), ((1, -29), "twice"), ((), "empty")):
        with pytest.raises(YggError, match=msg):
            TD.FeatureLayout.make(bad, 30, 8)


# ---------------------------------------------------------------- vocabulary


def test_draft_vocab_covers_the_most_frequent_tokens():
    g = torch.Generator().manual_seed(0)
    tokens = torch.cat([torch.full((100 - i,), i) for i in range(60)])  # id i appears 100 - i times
    tokens = tokens[torch.randperm(tokens.shape[0], generator=g)]
    vmap = DD.build_draft_vocab(tokens, 97, 20, specials=[2, 95])
    assert vmap.tolist() == sorted(set(vmap.tolist())) and vmap.shape == (20,)
    assert {2, 95} <= set(vmap.tolist())
    assert set(range(18)) <= set(vmap.tolist())  # the 18 most frequent + the 2 specials (2 is one)
    assert DD.vocab_coverage(tokens, vmap, 97) > 0.3
    with pytest.raises(YggError, match="smaller than"):
        DD.build_draft_vocab(tokens, 97, 1, specials=[2, 95])


# ---------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def run_a(target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill_a")
    cfg = small_cfg(tmp)
    return tmp, D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())


def test_training_reduces_the_loss(run_a):
    tmp, manifest = run_a
    rows = list(csv_rows(tmp / "out" / "report" / "train_log.csv"))
    for key in ("kl", "reg"):  # the target's entropy is a floor of the loss; KL and regression are not
        first = sum(float(r[key]) for r in rows[:5]) / 5
        last = sum(float(r[key]) for r in rows[-5:]) / 5
        assert last < 0.7 * first, (key, first, last)
    assert manifest["training"]["steps"] == len(rows)


def csv_rows(path: Path):
    import csv

    with path.open() as f:
        yield from csv.DictReader(f)


def test_manifest_and_report(run_a, target):
    tmp, manifest = run_a
    out = tmp / "out"
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    for key in ("seed", "hyperparameters", "data", "draft_vocab", "training", "wall_time_s", "torch", "target"):
        assert key in on_disk, key
    data = on_disk["data"]
    for key in ("corpus_hash", "teacher_sha256", "n_tokens", "n_answer_tokens", "n_sequences", "teacher_cache_key"):
        assert key in data, key
    assert data["n_sequences"] == 24 and data["n_tokens"] > 24 * 6
    assert on_disk["hyperparameters"]["lr"] == 3e-3
    assert on_disk["torch"] == torch.__version__
    assert 2 in on_disk["draft_vocab"]["specials"]
    val = on_disk["training"]["val"]
    assert len(val["accept_by_depth"]) == 3
    assert all(0 <= a <= 1 for a in val["accept_by_depth"])
    assert val["accept_by_depth"] == sorted(val["accept_by_depth"], reverse=True)
    for f in ("loss.png", "acceptance.png", "train_log.csv", "acceptance.csv"):
        assert (out / "report" / f).is_file(), f
    # the head loads back for the target it was trained for
    d = load_eagle(out, target, "reference", max_depth=3)
    assert d.cfg.draft_vocab_size == 48
    assert 2 in d.net.draft_vocab.tolist()


def test_fused_layers_pipeline(target, tmp_path):
    """Two target layers fused (EAGLE-3): the teacher stores both side by side, the head starts
    as the last layer alone, trains, and loads back reading both layers."""
    layout = TD.FeatureLayout.make((0, -1), target.cfg.num_layers, target.cfg.hidden_size)
    cfg = small_cfg(tmp_path, target_layers=(0, -1), epochs=4.0, feature_noise=0.05)
    vmap = torch.arange(48)
    drafter = EagleDrafter.random(target, "reference", max_depth=3, seed=0, target_layers=layout.inputs,
                                  input_norm=True, draft_vocab=vmap)
    DT.init_head(drafter.net, target, vmap, cfg, layout)
    f0, f1 = torch.randn(5, 32), 30 * torch.randn(5, 32)
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    torch.testing.assert_close(drafter.net.fuse_target((f0, f1)), rms(f1))

    manifest = D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())
    assert manifest["target"]["feature_layers"] == [0, 1]
    assert manifest["data"]["teacher_meta"]["target_layers"] == [0, 1]
    key = manifest["data"]["teacher_cache_key"]
    data = TD.load_teacher(Path(cfg.cache_dir) / key / TD.TEACHER_FILE, 2 * target.cfg.hidden_size)
    assert data.feats.shape == (manifest["data"]["n_tokens"], 64)
    rows = list(csv_rows(tmp_path / "out" / "report" / "train_log.csv"))
    first = sum(float(r["kl"]) for r in rows[:5]) / 5
    last = sum(float(r["kl"]) for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    d = load_eagle(tmp_path / "out", target, "reference", max_depth=3)
    assert d.target_layers == (0, 1)
    assert not torch.equal(d.net.reduce.weight[:, :32], torch.zeros(32, 32))  # the first layer is used


@pytest.mark.slow
def test_deterministic_given_the_seed(run_a, target, tmp_path):
    tmp_a, manifest_a = run_a
    # same seed, same teacher cache (reused), separate output
    cfg = small_cfg(tmp_a, out=str(tmp_path / "again"))
    manifest_b = D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())
    assert manifest_b["data"]["teacher_reused"] and not manifest_a["data"]["teacher_reused"]
    assert manifest_b["data"]["teacher_sha256"] == manifest_a["data"]["teacher_sha256"]
    a = weights(tmp_a / "out")
    b = weights(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a fresh teacher build gives the same data file
    cfg = small_cfg(tmp_path, epochs=0.5, out=str(tmp_path / "fresh"))
    manifest_c = D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())
    assert not manifest_c["data"]["teacher_reused"]
    assert manifest_c["data"]["teacher_sha256"] == manifest_a["data"]["teacher_sha256"]
    # another seed trains another head
    cfg = small_cfg(tmp_a, seed=1, epochs=0.5, out=str(tmp_path / "seed1"))
    D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())
    c = weights(tmp_path / "seed1")
    assert not torch.equal(c["fc.weight"], a["fc.weight"])


def weights(d: Path) -> dict[str, torch.Tensor]:
    """The tensors (file bytes are not stable: safetensors orders its metadata map arbitrarily)."""
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_bad_options_are_refused(target, tmp_path):
    with pytest.raises(YggError, match="unroll"):
        D.distill(small_cfg(tmp_path, unroll=0), target=target, prompt_ids=prompts())
    with pytest.raises(YggError, match="target-layer"):
        D.distill(small_cfg(tmp_path, target_layers=(5,)), target=target, prompt_ids=prompts())
    with pytest.raises(YggError, match="twice"):
        D.distill(small_cfg(tmp_path, target_layers=(1, -1)), target=target, prompt_ids=prompts())
    with pytest.raises(YggError, match="prompts given"):
        D.distill(small_cfg(tmp_path, prompts=50), target=target, prompt_ids=prompts())
    with pytest.raises(YggError, match="draft-layers must be >= 1, got 0"):
        D.distill(small_cfg(tmp_path, draft_layers=0), target=target, prompt_ids=prompts())


def test_cli_parser_registers_distill():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    D.add_parser(sub)
    args = parser.parse_args(["distill", "--draft-vocab", "4096", "--unroll", "2", "--target-layers", "2,15,-1"])
    assert args.func is D.run
    cfg = D._cfg_from_args(args)
    assert cfg.draft_vocab == 4096 and cfg.unroll == 2 and cfg.model == "default"
    assert cfg.target_layers == (2, 15, -1)
    assert cfg.draft_layers == 1
    assert D._cfg_from_args(parser.parse_args(["distill", "--draft-layers", "2"])).draft_layers == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["distill", "--target-layers", "2,x"])


def test_checkpoint_identity_of_one_layer_is_unchanged():
    """A 1-layer run's checkpoint identity has no draft_layers entry (checkpoints written before the
    option resume); any other count is part of it."""
    assert "draft_layers" not in DT.checkpoint_identity(DC.DistillConfig(), "sha")
    assert DT.checkpoint_identity(DC.DistillConfig(draft_layers=2), "sha")["draft_layers"] == 2


def test_two_layer_head_pipeline(target, tmp_path):
    """--draft-layers 2: both decoder layers start damped (fc identity), train, and the head loads
    back with two layers."""
    cfg = small_cfg(tmp_path, draft_layers=2, epochs=2.0, fc_init="identity")
    layout = TD.FeatureLayout.make(cfg.target_layers, target.cfg.num_layers, target.cfg.hidden_size)
    vmap = torch.arange(48)
    drafter = EagleDrafter.random(target, "reference", max_depth=3, seed=0, target_layers=layout.inputs,
                                  draft_vocab=vmap, num_layers=2)
    before = [b.mlp.down_proj.weight.clone() for b in drafter.net.layers]
    DT.init_head(drafter.net, target, vmap, cfg, layout)
    for b, w in zip(drafter.net.layers, before, strict=True):
        torch.testing.assert_close(b.mlp.down_proj.weight, 0.1 * w)

    manifest = D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())
    assert manifest["hyperparameters"]["draft_layers"] == 2 and manifest["training"]["steps"] > 0
    d = load_eagle(tmp_path / "out", target, "reference", max_depth=3)
    assert d.cfg.num_layers == 2 and len(d.net.layers) == 2


def test_warm_start_continues_from_a_head(run_a, target, tmp_path):
    """--init-from: the run starts from the given head (its draft vocabulary kept, its first losses
    those of a trained head), records the head's hash in its checkpoint identity, and refuses a head
    of another shape with one line naming it."""
    tmp_a, _ = run_a
    head = tmp_a / "out"
    cfg = small_cfg(tmp_a, init_from=str(head), epochs=1.0, out=str(tmp_path / "warm"), checkpoint_every=1)
    D.distill(cfg, ["--test"], target=target, prompt_ids=prompts())
    assert torch.equal(weights(tmp_path / "warm")["draft_vocab"], weights(head)["draft_vocab"])
    cold = list(csv_rows(head / "report" / "train_log.csv"))
    warm = list(csv_rows(tmp_path / "warm" / "report" / "train_log.csv"))
    assert float(warm[0]["kl"]) < 0.7 * float(cold[0]["kl"])
    ident = torch.load(tmp_path / "warm" / DT.CHECKPOINT_FILE, weights_only=False)["identity"]
    assert ident["init_from"] == str(head) and len(ident["init_sha256"]) == 64
    with pytest.raises(YggError, match=r"--init-from .*out: the head has draft vocabulary 48, this run asks for 40"):
        D.distill(small_cfg(tmp_path, init_from=str(head), draft_vocab=40), target=target, prompt_ids=prompts())
    assert "init_from" not in DT.checkpoint_identity(DC.DistillConfig(), "sha")


def test_warm_start_grows_a_head_and_refuses_to_cut_one(run_a, target, tmp_path):
    """--init-from a 1-layer head with --draft-layers 2: the added layer starts as an identity, so
    the grown head's unrolled outputs equal the base head's bitwise; a head with more layers than the
    run asks for is refused in one line."""
    tmp_a, _ = run_a
    head = tmp_a / "out"
    cfg = small_cfg(tmp_a, init_from=str(head), draft_layers=2)
    layout = TD.FeatureLayout.make(cfg.target_layers, target.cfg.num_layers, target.cfg.hidden_size)
    base = DT.warm_start_head(cfg, target, layout, 48)
    grown = D._new_head(cfg, target, layout, base.net.draft_vocab, base)
    assert len(grown.layers) == 2 and len(base.net.layers) == 1
    tok = torch.randint(3, 48, (2, 9))
    feat = torch.randn(2, 9, len(layout.inputs) * target.cfg.hidden_size)
    rope = rope_table(base.net.cfg.layer_config(), 64)
    with torch.no_grad():
        a = DL.unrolled_forward(base.net, tok, feat, 3, rope)
        b = DL.unrolled_forward(grown, tok, feat, 3, rope)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)

    manifest = D.distill(small_cfg(tmp_path, init_from=str(head), draft_layers=2, epochs=1.0,
                                   out=str(tmp_path / "grown")), ["--test"], target=target, prompt_ids=prompts())
    assert manifest["training"]["steps"] > 0
    with pytest.raises(YggError, match="the head has 2 decoder layers, this run asks for 1"):
        D.distill(small_cfg(tmp_path, init_from=str(tmp_path / "grown")), target=target, prompt_ids=prompts())


# ---------------------------------------------------------------- the shipped default head


@pytest.mark.slow
def test_shipped_default_head_loads_and_corruption_is_refused(tmp_path):
    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.prepare import load_drafter
    from yggtree.runtime.engine import TreeParams
    from yggtree.runtime.loading import load_model, load_tokenizer, resolve_model

    assert (DEFAULT_DIR / "model.safetensors").is_file(), "the default drafter is not shipped"
    assert (DEFAULT_DIR / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    manifest = json.loads((DEFAULT_DIR / "manifest.json").read_text())
    # trained on committed transcript shards: the manifest names each with its checksum
    assert manifest["data"]["data_sha256"] and manifest["seed"] is not None
    assert all(sh["sha256"] and (REPO / "data" / "transcripts" / sh["file"]).is_file()
               for sh in manifest["data"]["shards"])
    src = resolve_model("default")
    target = load_model(src, "float32")
    tok = load_tokenizer(src)
    spec = EngineSpec(model="default", drafter="default", mode="reference", tree=TreeParams(2, 3, 6, 2))
    drafter = load_drafter(spec, target, tok)
    assert isinstance(drafter, EagleDrafter)
    assert drafter.cfg.hidden_size == target.cfg.hidden_size
    assert tok.convert_tokens_to_ids("<|im_end|>") in drafter.net.draft_vocab.tolist()

    # a truncated copy is refused, naming the file (the shipped file is never touched)
    bad = tmp_path / "bad"
    shutil.copytree(DEFAULT_DIR, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(YggError, match=r"bad/model\.safetensors"):
        load_eagle(bad, target, "reference")
    # a config for another hidden size is refused, naming the config
    cfgf = bad / "config.json"
    cfg = json.loads((DEFAULT_DIR / "config.json").read_text())
    cfg["hidden_size"] = cfg["target_hidden_size"] = cfg["target"]["hidden_size"] = 512
    cfgf.write_text(json.dumps(cfg))
    with pytest.raises(YggError, match=r"config\.json.*hidden size"):
        load_eagle(bad, target, "reference")


def test_default_drafter_refused_for_other_targets(target):
    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.prepare import load_drafter

    spec = EngineSpec(model="/some/other/model", drafter="default")
    with pytest.raises(YggError, match="no default drafter"):
        load_drafter(spec, target, None)


def test_cli_records_the_command_in_the_manifest(monkeypatch, capsys):
    """``yggtree distill ...`` passes its own arguments on, so the manifest names the command
    that made the weights (it used to record None unless run as ``python -m``)."""
    from yggtree.cli import main

    seen = {}

    def fake(cfg, argv=None, **kw):
        seen["argv"] = argv
        raise D.YggError("stop here")

    monkeypatch.setattr(D, "distill", fake)
    assert main(["distill", "--out", "somewhere", "--epochs", "3"]) == 1
    assert seen["argv"] == ["--out", "somewhere", "--epochs", "3"]
    assert "stop here" in capsys.readouterr().err
