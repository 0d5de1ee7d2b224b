"""``yggtree compile`` on a tiny random HF checkpoint: two AOTInductor packages are built (target
widths 1 and 2, one context bucket; the self-drafter shares them), found up to date the second
time, and loaded by a fresh process in which a step policy drives every (D, W_d, W_v) choice of
the plan over three prompts of different lengths at temperatures 0 and 0.7, without dynamo ever
running (no frame, graph, recompile or graph break) and with the reference engine's greedy tokens."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from yggtree.cli import main as cli_main
from yggtree.compiled import check_artifacts
from yggtree.errors import YggError
from yggtree.offline.compile import main, prepare_run
from yggtree.offline.compile_packages import BUILD_KEY
from yggtree.plan import load_plan
from yggtree.runtime.artifacts import CACHE_SUBDIR, MANIFEST
from yggtree.runtime.model import attention_formulation

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("onednn_unpadded")]  # about oneDNN's padding

PLAN = """\
name: tiny
target: model
drafter: self
max_context: 32
prefill_chunk: 2
draft_widths: [1, 2]
d_max: 2
top_k: 2
verify_widths: [1, 2]
sampling: {max_new_tokens: 8}
"""


def tiny_plan(verify_widths: str = "[2, 4]") -> str:
    """The plan text of the tiny checkpoint (saved as ``model`` beside it) drafting for itself."""
    return f"""\
name: tiny
target: model
drafter: self
backend: eager
max_context: 96
prefill_chunk: 4
draft_widths: [1, 2]
d_max: 2
top_k: 2
verify_widths: {verify_widths}
sampling: {{max_new_tokens: 8}}
"""


def save_tiny_checkpoint(path: Path, intermediate: int = 48, heads: int = 4, kv_heads: int = 2) -> None:
    """A 2-layer random Llama (vocabulary 128, hidden 32) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", eos_token="t2").save_pretrained(path)


def run_main(argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    save_tiny_checkpoint(root / "model")
    plan_path = root / "plan.yaml"
    plan_path.write_text(PLAN)
    code, stdout = run_main([plan_path, "--out", root / "compile"])
    assert code == 0, stdout
    return root, plan_path, stdout


def test_compile_builds_every_graph_once(compiled):
    root, plan_path, stdout = compiled
    last = json.loads(stdout.strip().splitlines()[-1])  # one JSON line last
    assert last["status"] == "compiled" and last["plan"] == "tiny"
    assert "target" in stdout and "plain+verify" in stdout  # the per-graph table
    art = root / "compile" / "tiny"
    m = json.loads((art / MANIFEST).read_text())
    plan = load_plan(plan_path)
    assert m["plan_hash"] == plan.hash() == last["plan_hash"]
    n_slots = plan.max_context + plan.max_tree + 1
    assert m["n_slots"] == n_slots
    assert m["attention"] == attention_formulation(plan.prefill_chunk)  # the engine's formulation
    target = [(r["scope"], r["width"], r["context"], r["cache"]) for r in m["graphs"] if r["model"] == "target"]
    # each built exactly once, and every tree step whole too (a whole step computes the blocks'
    # step bitwise; the self-drafter runs the blocks)
    assert target == [("block", 1, n_slots, "compiled"), ("block", 2, n_slots, "compiled"),
                      ("step", 1, n_slots, "compiled"), ("step", 2, n_slots, "compiled")]
    drafter = {r["width"]: r["cache"] for r in m["graphs"] if r["model"] == "drafter"}
    assert drafter == {1: "shared", 2: "shared"}  # the self-drafter shares the target's graphs
    assert m["n_graphs"] == last["graphs"] == 4
    assert all(r["compile_s"] > 0 for r in m["graphs"] if r["cache"] == "compiled")
    cache = art / CACHE_SUBDIR  # the packages, each with its checksum beside it, and the build key
    files = sorted(p.name for p in cache.iterdir() if p.suffix == ".pt2")
    assert files == sorted({r["file"] for r in m["graphs"]}) and len(files) == 4
    assert sorted(p.name for p in cache.iterdir() if p.suffix != ".pt2") == sorted(
        [BUILD_KEY] + [f.replace(".pt2", ".sha256") for f in files])
    assert all((cache / f).with_suffix(".sha256").read_text().strip() == r["sha256"]
               for r in m["graphs"] for f in [r["file"]])
    assert sum(f.startswith("step-") for f in files) == 2
    assert not list(art.glob("build-*")) and m["size_bytes"] > 0  # the scratch build dir is gone
    # model files (and the embedded plan's paths) are recorded relative to the artifact directory
    assert m["plan"]["target"] == "../../model"
    paths = [f["path"] for f in m["models"]]
    assert "../../model/model.safetensors" in paths and all(p.startswith("../../model/") for p in paths)
    copy = load_plan(art / "plan.yaml")
    assert copy.hash() == plan.hash() and check_artifacts(copy, art) == []


def test_second_compile_is_a_noop(compiled, monkeypatch):
    root, plan_path, _ = compiled
    import yggtree.runtime.loading as loading
    import yggtree.runtime.prepare as prepare

    def boom(*a, **k):
        raise AssertionError("an up-to-date compile must not load models")

    for where in (loading, prepare):  # prepare binds load_model by name
        monkeypatch.setattr(where, "load_model", boom)
    code, stdout = run_main([plan_path, "--out", root / "compile", "--json"])
    (line,) = stdout.strip().splitlines()
    last = json.loads(line)
    assert code == 0 and last["status"] == "up-to-date"  # and no model was loaded (above)


WARM = textwrap.dedent(
    """
    import itertools, json, sys
    import torch
    from torch._dynamo.utils import counters
    from yggtree.compiled import artifact_dir
    from yggtree.errors import YggError
    from yggtree.plan import load_plan
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.policy import StepChoice, StepPolicy

    class EveryChoice(StepPolicy):  # steps through every (D, W_d, W_v) of the plan, plain steps (D = 0) included
        def __init__(self, plan):
            self.choices = [(0, 1, 1)] + [
                (d, wd, wv) for d, wd, wv in itertools.product(
                    range(1, plan.d_max + 1), plan.draft_widths, plan.verify_widths)
                if wv <= 1 + d * wd
            ]
            self.i, self.used = 0, set()

        def choose_draft(self, h_root, committed):
            d, wd, _ = self.choices[self.i % len(self.choices)]
            return StepChoice(d, wd)

        def choose_verify(self, tree, choice, committed):
            return self.choices[self.i % len(self.choices)][2]

        def on_step(self, rec):
            self.i += 1
            d = rec.choice.draft_depth
            self.used.add((d, rec.choice.draft_width if d else 1, rec.verify_width))

    from yggtree.runtime.aoti import StepPackages

    whole_steps, run_step = set(), StepPackages.__call__

    def counted(self, tokens, *args):
        whole_steps.add(int(tokens.shape[0]))
        return run_step(self, tokens, *args)

    StepPackages.__call__ = counted
    torch.set_num_threads(1)
    plan = load_plan(sys.argv[1])
    engine, _ = build_plan_engine(plan, artifact_dir(plan))
    reference, _ = build_plan_engine(plan, None, mode="reference")
    prompts = ([3, 4, 5], list(range(10, 23)), list(range(30, 37)))
    runs, same = 0, 0
    policy = EveryChoice(plan)
    for temp, prompt in itertools.product((0.0, 0.7), prompts):
        params = SamplingParams(max_new_tokens=8, temperature=temp, seed=1)
        out = engine.generate(prompt, params, policy=policy, on_step=policy.on_step)
        runs += 1
        if temp == 0.0:
            same += out.token_ids == reference.generate(prompt, params).token_ids
    # the plan's plain engine (run --no-speculate): no drafter, the packages' slot count, plain tokens
    plain, _ = build_plan_engine(plan, artifact_dir(plan), speculate=False)
    plain_same = sum(plain.generate(p, SamplingParams(max_new_tokens=8)).token_ids
                     == reference.generate(p, SamplingParams(max_new_tokens=8)).token_ids for p in prompts)
    plain_ok = plain.drafter is None and plain.cfg.tree is None and plain.n_slots == engine.n_slots
    try:
        engine.graphs.warm_up([3])
        refused = ""
    except YggError as e:
        refused = str(e)
    print(json.dumps({
        "runs": runs, "same": same, "refused": refused, "plain_same": plain_same, "plain_ok": plain_ok,
        "whole_steps": sorted(whole_steps),
        "used": sorted(policy.used), "choices": sorted(policy.choices),
        "frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()), "breaks": sum(counters["graph_break"].values()),
        "inductor": dict(counters["inductor"]),
    }))
    """
)


def test_fresh_process_runs_the_packages_without_dynamo(compiled):
    root, _, _ = compiled
    copy = root / "compile" / "tiny" / "plan.yaml"
    out = subprocess.run(
        [sys.executable, "-c", WARM, str(copy)], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["runs"] == 6 and r["same"] == 3  # performance == reference, greedy
    assert r["plain_ok"] and r["plain_same"] == 3  # the plan's plain engine on the same packages
    assert r["whole_steps"] == [1, 2]  # plain and verify steps ran whole steps
    # a step policy drove every (D, W_d, W_v) of the plan, plain steps included, over 3 prompt
    # lengths at temperatures 0 and 0.7 ...
    assert r["used"] == r["choices"] and len(r["choices"]) == 9
    # ... and dynamo never ran: no frame, no graph, no recompile, no graph break
    assert (r["frames"], r["graphs"], r["recompiles"], r["breaks"]) == (0, 0, 0, 0)
    assert r["inductor"] == {}
    assert "width 3 is not in the compiled set [1, 2]" in r["refused"]


@pytest.fixture(scope="module")
def compiled_plain(tmp_path_factory):
    """The tiny checkpoint's plan without a drafter, compiled: its plain steps run a whole-step
    package (one context bucket)."""
    root = tmp_path_factory.mktemp("compile_plain")
    save_tiny_checkpoint(root / "model")
    plan_path = root / "plan.yaml"
    plan_path.write_text(PLAN.replace("drafter: self", "drafter: null"))
    code, stdout = run_main([plan_path, "--out", root / "compile"])
    assert code == 0, stdout
    return root


def test_whole_step_package_computes_the_block_packages_step(compiled, compiled_plain):
    """A whole-step package computes the step its block packages do, bitwise: the same logits,
    hidden state and cache writes (it ends before the final norm, which both paths then run
    eagerly; fused in, the norm would reduce in another order). The self-drafted plan's one-row
    blocks are built for its drafter; a plain plan builds no block package for a step a whole-step
    package runs (only its prefill chunk's). A speculative plan's verify steps are whole too
    (test_bfloat16_whole_step... checks a two-node step)."""
    import torch

    from yggtree.compiled import artifact_dir
    from yggtree.runtime.aoti import step_packages
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams

    m = json.loads((compiled_plain / "compile" / "tiny" / MANIFEST).read_text())
    assert [(g["scope"], g["width"]) for g in m["graphs"]] == [("block", 2), ("step", 1)]  # prefill chunk, step
    root = compiled[0]
    plan = load_plan(root / "compile" / "tiny" / "plan.yaml")
    engine, _ = build_plan_engine(plan, artifact_dir(plan))
    engine.generate(list(range(10, 23)), SamplingParams(max_new_tokens=4))  # a real cache
    model, graphs = engine.target, engine.graphs
    whole = step_packages(model)
    assert whole is not None
    one = torch.ones(1, 1, dtype=torch.bool)
    zero = torch.zeros(1, dtype=torch.int64)
    committed = torch.tensor(15)
    before = model.kv.kv.clone()
    outs, caches = [], []
    for path in (whole, None):
        model.kv.kv.copy_(before)
        model.step_packages = path
        with torch.no_grad():
            outs.append(graphs.tree_step(torch.tensor([7]), zero, zero, one, committed, (), graphs.bucket(17, 1)))
        caches.append(model.kv.kv.clone())
    model.step_packages = whole
    (la, ha, _), (lb, hb, _) = outs
    for a, b in ((la, lb), (ha, hb), caches):
        assert torch.equal(a, b)
    assert not torch.equal(caches[0], before)  # the step wrote its slot


def test_moved_compiled_directory_still_loads(compiled, tmp_path):
    """The whole tree (model, plan, compiled directory) copied elsewhere: its manifest and plan
    copy hold relative paths and no location enters the plan's identity, so the copy is up to
    date and its packages run, with the reference engine's greedy tokens."""
    import shutil

    from yggtree.compiled import artifact_dir
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams

    root, _, _ = compiled
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)  # copy2: file times kept, as a move keeps them
    assert str(root) not in (moved / "compile" / "tiny" / MANIFEST).read_text()
    plan = prepare_run(moved / "compile" / "tiny" / "plan.yaml", compile_missing=False)
    art = artifact_dir(plan)
    assert art == moved / "compile" / "tiny" and plan.target == str(moved / "model")
    engine, _ = build_plan_engine(plan, art)
    reference, _ = build_plan_engine(plan, None, mode="reference")
    params = SamplingParams(max_new_tokens=8)
    for prompt in ([3, 4, 5], list(range(10, 23))):
        assert engine.generate(prompt, params).token_ids == reference.generate(prompt, params).token_ids


def test_packages_of_a_variant_padding_are_refused(compiled, monkeypatch):
    """Packages compiled with products padded to 1 row (the plan has no profile) where one-row
    products round otherwise than wider ones (a kernel made so here): the engine would pad to 2,
    which the packages do not; it refuses them in one line naming them, never runs them."""
    import yggtree.runtime.packed as packed
    from yggtree.runtime.build import build_plan_engine

    root, plan_path, _ = compiled
    plan = load_plan(plan_path)
    real = packed.packed_linear

    def one_row_differs(x, p, out, bias=None, min_rows=1):
        y = real(x, p, out, bias, min_rows)
        return y + 1e-3 if max(x.numel() // x.shape[-1], min_rows) == 1 else y

    monkeypatch.setattr(packed, "packed_linear", one_row_differs)
    with pytest.raises(YggError, match=r"compiled graphs in .*(block|step)-.*\.pt2.* pad short packed products to 1 rows, "
                                       r"this engine to 2 .*recompile the plan"):
        build_plan_engine(plan, root / "compile" / "tiny")


def test_interrupted_compile_is_refused_then_rebuilt(compiled_plain, monkeypatch):
    """Chaos: a forced recompile stopped (Ctrl-C) while writing its second package leaves no
    manifest and a half-written package under a temporary name: a run refuses the directory in
    one line, and --compile-missing rebuilds it whole. (The plain plan: two packages to rebuild,
    its whole one-row step first, then its prefill chunk's block.)"""
    import yggtree.runtime.aoti as aoti
    from yggtree.offline.compile import compile_plan

    root = compiled_plain
    plan_path = root / "plan.yaml"
    art = root / "compile" / "tiny"
    real, real_step, calls = aoti.compile_package, aoti.compile_step_package, []

    def step(model, width, context, capture, path, **kw):
        calls.append(path.name)
        return real_step(model, width, context, capture, path, **kw)

    def stopped(block, example, path, **kw):
        calls.append(path.name)
        path.write_bytes(b"half a package")
        raise KeyboardInterrupt

    monkeypatch.setattr(aoti, "compile_package", stopped)
    monkeypatch.setattr(aoti, "compile_step_package", step)
    with pytest.raises(KeyboardInterrupt):
        compile_plan(load_plan(plan_path), root / "compile", force=True)
    monkeypatch.undo()
    assert len(calls) == 2 and calls[1].startswith("partial-") and (art / CACHE_SUBDIR / calls[1]).exists()
    assert not (art / MANIFEST).exists() and not list(art.glob("build-*"))
    with pytest.raises(YggError, match=r"not usable: no compiled artifacts: .*manifest.json is missing"):
        prepare_run(plan_path, compile_missing=False, compile_root=root / "compile")
    again = []
    monkeypatch.setattr(aoti, "compile_package", lambda block, example, path, **kw: again.append(path.name)
                        or real(block, example, path, **kw))
    monkeypatch.setattr(aoti, "compile_step_package", lambda *a, **kw: again.append(a[4].name) or real_step(*a, **kw))
    plan = prepare_run(plan_path, compile_missing=True, compile_root=root / "compile")
    assert check_artifacts(plan, art) == []
    assert not list((art / CACHE_SUBDIR).glob("partial-*"))
    assert calls[0] not in again and calls[1] in again  # resumed: the finished package is kept


def test_prepare_run_refuses_or_compiles_stale_artifacts(compiled_plain):
    """(The plain plan: a rebuild compiles two packages.)"""
    root = compiled_plain
    plan_path = root / "plan.yaml"
    art = root / "compile" / "tiny"
    copy = art / "plan.yaml"
    assert prepare_run(copy, compile_missing=False) == load_plan(copy)
    # a truncated package: refused by its checksum, in one line naming the file, by the run's
    # artifact check and by the loader itself
    m = json.loads((art / MANIFEST).read_text())
    victim = art / CACHE_SUBDIR / m["graphs"][0]["file"]
    good = victim.read_bytes()
    assert m["graphs"][0]["sha256"] == hashlib.sha256(good).hexdigest()
    victim.write_bytes(good[: len(good) // 2])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(["run", "--plan", str(copy), "--raw", "--prompt", "t3 t4", "--max-new-tokens", "2"])
    assert code == 1 and err.getvalue().count("\n") == 1
    assert f"compiled graph file {victim} is corrupted" in err.getvalue()
    from yggtree.runtime.build import _package_installer

    with pytest.raises(YggError, match=f"compiled graph {re.escape(str(victim))} is corrupted"):
        _package_installer(art)
    m["versions"]["torch"] = "0.0.1"
    (art / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(YggError, match=r"torch version changed: compiled with 0\.0\.1.*--compile-missing"):
        prepare_run(copy, compile_missing=False)
    plan = prepare_run(plan_path, compile_missing=True, compile_root=root / "compile")
    assert check_artifacts(plan, art) == [] and check_artifacts(load_plan(copy), art) == []
    m = json.loads((art / MANIFEST).read_text())  # --compile-missing rebuilt the truncated package
    assert {g["file"]: g["sha256"] for g in m["graphs"]}[victim.name] == hashlib.sha256(
        victim.read_bytes()).hexdigest()
    assert victim.stat().st_size > len(good) // 2
    assert not list((art / CACHE_SUBDIR).glob("partial-*"))  # packages are written, then renamed


def test_profile_of_the_compiled_packages(compiled, tmp_path, monkeypatch, capsys):
    """`yggtree profile --compiled` times the plan's packages (what `yggtree run --plan` runs) at
    the widths they were compiled for, without dynamo tracing anything, and keeps the padding of
    the plan's profile (the packages hold it); without usable artifacts it is refused in one line."""
    import torch

    root, _, _ = compiled
    (root / "prof.json").write_text(json.dumps({"packed_padding": {"min_rows": 1, "products": 0, "median_ms": {}}}))
    plan_path = root / "plan-profiled.yaml"
    plan_path.write_text(PLAN + "profile: prof.json\n")  # the profile is no graph field: still compiled
    args = ["profile", "--hw", "t", "--plan", str(plan_path), "--compiled", "--quick", "--out-dir", str(tmp_path)]
    monkeypatch.chdir(root)  # the artifacts are found in ./compile/<plan>, as `yggtree run --plan` finds them
    before = dict(torch._dynamo.utils.counters["stats"])
    assert cli_main(args) == 0
    assert dict(torch._dynamo.utils.counters["stats"]) == before  # nothing traced or compiled
    prof = json.loads((tmp_path / "t.json").read_text())
    assert {r["width"] for r in prof["points"] if r["kind"] == "verify"} == {1, 2}  # 1 row and the plan's W_v
    assert {r["width"] for r in prof["points"] if r["kind"] == "draft"} == {1, 2}
    assert all(r["median_ms"] > 0 for r in prof["points"])
    assert "AOTInductor packages" in prof["software"]["graphs"] and prof["packed_padding"]["min_rows"] == 1
    assert str(root) not in (tmp_path / "t.json").read_text()  # no absolute path (profiles are shipped)
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # no compiled artifacts here
    assert cli_main([*args, "--force"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compiled: the artifacts of plan 'tiny'" in err[0] and "yggtree compile" in err[0]


def test_bfloat16_whole_step_rounds_as_its_blocks_and_speculation_is_exact(tmp_path):
    """A speculative bfloat16 plan's whole steps compute its block packages' steps bitwise (its
    packages round every fused intermediate to bfloat16 as the unfused ops do:
    ``aoti.package_config``; without that every step differed), at one row and at the verify
    width, and speculation gives plain decoding's tokens."""
    import torch

    from yggtree.compiled import artifact_dir
    from yggtree.runtime.aoti import step_packages
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams

    save_tiny_checkpoint(tmp_path / "model")
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(PLAN + "dtype: bfloat16\n")
    code, stdout = run_main([plan_path, "--out", tmp_path / "compile"])
    assert code == 0, stdout
    m = json.loads((tmp_path / "compile" / "tiny" / MANIFEST).read_text())
    assert [g["width"] for g in m["graphs"] if g.get("scope") == "step"] == [1, 2]
    plan = load_plan(tmp_path / "compile" / "tiny" / "plan.yaml")
    spec, _ = build_plan_engine(plan, artifact_dir(plan, tmp_path / "compile"))
    plain, _ = build_plan_engine(plan, artifact_dir(plan, tmp_path / "compile"), speculate=False)
    assert step_packages(spec.target) is not None and step_packages(plain.target) is not None
    params = SamplingParams(max_new_tokens=8)
    for prompt in ([5, 9, 17, 3], list(range(20, 31)), [7] * 6):
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    # the same step, whole and over the blocks, on the cache of the last request: a plain step,
    # and a verify step of two nodes (a root and its child; the self-drafter's plan builds their
    # blocks for its drafter, which runs them)
    for engine, w in ((plain, 1), (spec, 2)):
        model, graphs = engine.target, engine.graphs
        whole, before = step_packages(model), model.kv.kv.clone()
        ar = torch.arange(w)
        anc = ar[None, :] <= ar[:, None]
        for token in range(0, 128, 9):
            outs = []
            for path in (whole, None):
                model.kv.kv.copy_(before)
                model.step_packages = path
                with torch.no_grad():
                    outs.append((*graphs.tree_step((token + ar) % 128, ar, ar, anc, torch.tensor(8), (),
                                                   graphs.bucket(8 + w, w))[:2], model.kv.kv.clone()))
            model.step_packages = whole
            assert all(torch.equal(a, b) for a, b in zip(*outs)), (w, token)


def test_a_padding_not_invariant_here_is_raised_in_the_packages(tmp_path, monkeypatch):
    """A speculative plan whose padding (forced, measured, or another machine's profile) is not
    batch-invariant on this CPU: the compile raises it as the engine will (prepare.invariant_padding;
    standing in here for a CPU whose one-row product rounds otherwise), the packages hold the
    raised padding (the self-drafter's too), the manifest says from what, the artifacts stay
    current, and the engine runs them (plain decoding's tokens)."""
    import yggtree.runtime.prepare as prepare
    from yggtree.compiled import artifact_dir
    from yggtree.runtime.build import build_plan_engine
    from yggtree.runtime.engine import SamplingParams
    from yggtree.runtime.packed import min_rows_of, packed_layers

    def raised(target, widths, threads=0):  # one row is "not invariant" on this stand-in CPU
        for layer in packed_layers(target):
            layer.min_rows = max(layer.min_rows, 2)
        return min_rows_of(target)

    monkeypatch.setattr(prepare, "invariant_padding", raised)
    save_tiny_checkpoint(tmp_path / "model")
    (tmp_path / "plan.yaml").write_text(PLAN)
    code, stdout = run_main([tmp_path / "plan.yaml", "--out", tmp_path / "compile"])
    assert code == 0, stdout
    art = tmp_path / "compile" / "tiny"
    m = json.loads((art / MANIFEST).read_text())
    assert (m["packed_min_rows"], m["packed_min_rows_raised_from"]) == (2, 1)
    # the self-drafter's products at the raised padding too, as the engine packs them: its blocks
    # run the target's packages (the one-row one included, which only the drafter calls)
    blocks = [(g["model"], g["width"], g["key"], g["cache"]) for g in m["graphs"] if g["scope"] == "block"]
    assert len({key for _, _, key, _ in blocks}) == 1 and ("drafter", 1) in {b[:2] for b in blocks}
    plan = load_plan(tmp_path / "plan.yaml")
    assert check_artifacts(plan, art) == []
    spec, _ = build_plan_engine(plan, artifact_dir(plan, tmp_path / "compile"))
    plain, _ = build_plan_engine(plan, artifact_dir(plan, tmp_path / "compile"), speculate=False)
    params = SamplingParams(max_new_tokens=8)
    for prompt in ([5, 9, 17, 3], list(range(20, 31))):
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_allocator_measured_on_the_compiled_plan(compiled_plain, tmp_path, monkeypatch):
    """The allocator measurement (yggtree.measure.allocator_choice) runs the compiled plan's decoding in
    one child per allocator, each on its own preloaded library (libm stands for one here), and
    caches what it chose with every round's times."""
    import yggtree.measure.allocator_choice as ac
    from yggtree.runtime import allocator

    libm = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if "/libm.so" in line), None)
    if libm is None:
        pytest.skip("libm is not mapped in this process")
    monkeypatch.setenv(allocator.ALLOCATOR_ENV, "auto")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ac, "installed", lambda: {"jemalloc": Path(libm)})
    monkeypatch.setattr(ac, "ROUNDS", 2)
    art = compiled_plain / "compile" / "tiny"
    record = ac.measure_compiled(art / "plan.yaml", compiled_plain / "compile")
    assert record["choice"] in ("system", "jemalloc") and len(record["rounds"]) == 2
    assert all(set(r) == {"system", "jemalloc"} and min(r.values()) > 0 for r in record["rounds"])
    assert record["stats"]["jemalloc"]["won"] in (0.0, 0.5, 1.0)
    assert ac.measure_compiled(art / "plan.yaml", compiled_plain / "compile") == record  # cached now
