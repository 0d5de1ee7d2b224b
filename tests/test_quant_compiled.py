"""Quantized weight formats in performance mode: the engine's compiled graphs (torch.compile,
whole steps) and ``yggtree compile``'s AOTInductor packages call the weight-only kernels
(``aten._weight_int8pack_mm`` as inductor's extern call, ``aten._weight_int4pack_mm_for_cpu``
through the one-call op ``yggtree::int4_mm``, runtime/quant.py), and greedy speculation equals
plain decoding in the same format, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import perturbed
from test_compile import PLAN as TINY_PLAN
from test_quant import quantized, tiny
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.errors import YggError
from yggtree.runtime.quant import Int4Linear, Int8Linear
from yggtree.runtime.w4a8 import W4A8Linear, load_kernel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TREE = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
PROMPTS = ([5, 6, 7, 8, 9], [(7 * i) % 90 + 3 for i in range(23)])
KINDS = {"int8": Int8Linear, "gguf-native": Int4Linear, "int4@32": Int4Linear, "w4a8": W4A8Linear}


def _w4a8_problem() -> str | None:
    try:
        load_kernel()
    except YggError as e:  # pragma: no cover - a CPU without AVX2, or no compiler
        return str(e)
    return None


W4A8 = pytest.param("w4a8", marks=pytest.mark.skipif(_w4a8_problem() is not None, reason=str(_w4a8_problem())))


@pytest.mark.parametrize("fmt", ["int8", "gguf-native", W4A8])
def test_compiled_quantized_engine_speculates_exactly(fmt):
    """torch.compile'd step graphs over a quantized target and drafter (gguf-native: Q4_0/Q4_1
    blocks and the Q8_0 head's two planes on the int4 kernel; w4a8: the same blocks on
    ``yggtree::w4a8_mm``) emit plain decoding's tokens."""
    from yggtree.runtime.drafters import LMDrafter

    cfg = dict(mode="performance", max_context=80, prefill_chunk=8)
    plain = Engine(quantized(fmt), EngineConfig(**cfg))
    drafter = LMDrafter(quantized(fmt, model=perturbed(tiny())), "performance")  # agrees at times
    spec = Engine(quantized(fmt), EngineConfig(**cfg, tree=TREE), drafter)
    assert plain.graphs.compiled and isinstance(spec.target.lm_head, KINDS[fmt])
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        got = spec.generate(prompt, SamplingParams(max_new_tokens=24))
        assert got.token_ids == want, prompt
        accepted += got.stats["accepted_tokens"]
    assert accepted > 0  # trees were partly accepted, not only rejected


@pytest.mark.parametrize("fmt", ["int4@32", W4A8])
def test_compiled_plan_runs_quantized_packages_exactly(fmt, tmp_path, monkeypatch):
    """``yggtree compile`` of a plan with ``weights: FMT`` builds AOTInductor packages of the
    quantized blocks (the self-drafter shares them); an engine loaded from them runs no dynamo
    and its greedy tree speculation emits its plain steps' tokens."""
    from torch._dynamo.utils import counters

    from test_compile import run_main, save_tiny_checkpoint
    from yggtree.compiled import artifact_dir
    from yggtree.plan import load_plan
    from yggtree.runtime.aoti import PackageSet, static_blocks, step_packages
    from yggtree.runtime.build import build_plan_engine, fixed_policy
    from yggtree.runtime.policy import FixedPolicy, StepChoice

    # int4@32 divides every input width; w4a8: head dim 16, which its attention kernel takes
    save_tiny_checkpoint(tmp_path / "model", intermediate=64, **({"heads": 2, "kv_heads": 1} if fmt == "w4a8" else {}))
    (tmp_path / "plan.yaml").write_text(TINY_PLAN.replace("name: tiny\n", f"name: tiny-q\nweights: {fmt}\n"))
    monkeypatch.setenv("YGGTREE_LOOPS", "pool")  # where its loops are serial, the plan takes the pool
    torch.set_num_threads(2)  # the pool is for 2+ threads (the fixture restores the count)
    code, stdout = run_main([tmp_path / "plan.yaml", "--out", tmp_path / "compile"])
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["graphs"] == 4, stdout  # two widths, as blocks and whole
    plan = load_plan(tmp_path / "compile" / "tiny-q" / "plan.yaml")
    if fmt == "w4a8":  # the packages call the kernel's C shim, not AOTInductor's proxy executor
        import zipfile

        for pt2 in (tmp_path / "compile" / "tiny-q").rglob("*.pt2"):
            with zipfile.ZipFile(pt2) as z:
                src = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
            assert "aoti_torch_cpu_w4a8_mm(" in src and "proxy_executor_call_function" not in src, pt2
            assert "aoti_torch_cpu_rows_attention(" in src, pt2
    engine, _ = build_plan_engine(plan, artifact_dir(plan))
    # inductor's loops serial where the library runs every product, the self-drafter's too (aoti.loops_serial:
    # w4a8; int4 where this machine's kernel choice is the tiled one), and then the loops where YGGTREE_LOOPS
    # put them; elsewhere OpenMP's loops and inductor's own parallel ones
    manifest = json.loads((tmp_path / "compile" / "tiny-q" / "manifest.json").read_text())
    serial = manifest["serial_loops"]
    assert serial == (fmt == "w4a8" or manifest["packed_kernel"] == "tiled")
    assert ("loops" in manifest) == serial and engine.cfg.loop_pool == serial
    assert isinstance(static_blocks(engine.target), PackageSet)
    assert step_packages(engine.target).runners.keys() == {(1, engine.n_slots), (2, engine.n_slots)}  # steps whole
    assert isinstance(engine.target.layers[0].mlp.down_proj, KINDS[fmt])
    assert bool(engine.target.layers[0].self_attn.native_rows) == (fmt == "w4a8")
    tree, plain = fixed_policy(engine, plan), FixedPolicy(StepChoice(0, 1), 1)
    frames = counters["frames"]["total"]
    for prompt in ([3, 4, 5], list(range(10, 23))):
        params = SamplingParams(max_new_tokens=8)
        want = engine.generate(prompt, params, policy=plain)
        got = engine.generate(prompt, params, policy=tree)
        assert got.token_ids == want.token_ids and got.stats["verify_calls"] < want.stats["verify_calls"]
    assert counters["frames"]["total"] == frames  # the packages ran, dynamo never did
    # a fresh process loads the packages before any layer is quantized: the ops they call must be
    # registered first (yggtree::w4a8_mm is loaded on demand; this failed before the installer did)
    import subprocess
    import sys

    code = ("from yggtree.compiled import artifact_dir\n"
            "from yggtree.plan import load_plan\n"
            "from yggtree.runtime.build import build_plan_engine\n"
            f"plan = load_plan({str(tmp_path / 'compile' / 'tiny-q' / 'plan.yaml')!r})\n"
            "build_plan_engine(plan, artifact_dir(plan))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.skipif(_w4a8_problem() is not None, reason=str(_w4a8_problem()))
@pytest.mark.parametrize("fmt", ["w4a8", "int4@32"])
def test_a_plain_library_plan_decodes_on_the_pool_exactly(fmt, tmp_path, monkeypatch):
    """A plain plan (no drafter) whose products all run on the kernel library (w4a8; int4 on the
    tiled kernel) is compiled with inductor's loops serial and records where its kernel loops run
    (forced to the pool here; ``yggtree compile`` measures it otherwise); its engine decodes on the
    pool at 2 threads, the tokens those of the same packages on OpenMP."""
    import zipfile
    from dataclasses import replace

    from test_compile import run_main, save_tiny_checkpoint
    from yggtree.compiled import artifact_dir
    from yggtree.plan import load_plan
    from yggtree.runtime.build import build_plan_engine

    save_tiny_checkpoint(tmp_path / "model", intermediate=64, heads=2, kv_heads=1)
    text = TINY_PLAN.replace("name: tiny\n", f"name: tiny-p\nweights: {fmt}\n").replace("drafter: self\n", "")
    (tmp_path / "plan.yaml").write_text(text)
    monkeypatch.setenv("YGGTREE_LOOPS", "pool")
    monkeypatch.setenv("YGGTREE_KERNEL", "tiled")  # int4's products on the library (w4a8's always are)
    torch.set_num_threads(2)  # the fixture restores the count
    code, stdout = run_main([tmp_path / "plan.yaml", "--out", tmp_path / "compile"])
    assert code == 0, stdout
    art = tmp_path / "compile" / "tiny-p"
    assert json.loads((art / "manifest.json").read_text())["loops"] == {"choice": "pool", "forced": "YGGTREE_LOOPS"}
    for pt2 in art.rglob("*.pt2"):  # no OpenMP region of inductor's own
        with zipfile.ZipFile(pt2) as z:
            assert not any("omp parallel" in z.read(n).decode() for n in z.namelist() if n.endswith(".cpp")), pt2
    plan = load_plan(art / "plan.yaml")
    engine, _ = build_plan_engine(plan, artifact_dir(plan))
    assert engine.cfg.loop_pool and isinstance(engine.target.layers[0].mlp.down_proj, KINDS[fmt])
    assert getattr(engine.target.layers[0].mlp.down_proj, "kernel", "tiled") == "tiled"
    pooled = [engine.generate(p, SamplingParams(max_new_tokens=8)).token_ids for p in ([3, 4, 5], list(range(10, 23)))]
    engine.cfg = replace(engine.cfg, loop_pool=False)
    assert [engine.generate(p, SamplingParams(max_new_tokens=8)).token_ids for p in ([3, 4, 5], list(range(10, 23)))] == pooled
    # measured (as `yggtree compile` does unforced): both loops decode the calibration prompts
    import yggtree.measure.loops_choice as loops_choice
    import yggtree.measure.paired_decode as paired_decode

    monkeypatch.setenv("YGGTREE_LOOPS", "auto")
    monkeypatch.setattr(paired_decode, "ROUNDS", 1)
    lines = []
    record = loops_choice.measure_compiled(plan, art, say=lines.append)
    assert record["choice"] in ("openmp", "pool") and record["threads"] == 2
    assert 1 <= len(record["ms_per_token"]) <= 6 and min(min(p) for p in record["ms_per_token"]) > 0
    assert lines and "kernel loops measured" in lines[0]
    # the products' prefetch confirmed by decoding (a setting of the packages' manifest here: the
    # tests measure no product kernel): both settings decode the calibration prompts; a record
    # choosing the library's default for the engine's very setting gives it the default, a record of
    # another setting changes nothing
    import yggtree.measure.prefetch_choice as prefetch_choice

    monkeypatch.setenv("YGGTREE_PREFETCH", "auto")
    manifest = json.loads((art / "manifest.json").read_text()) | {"packed_prefetch": [2048, 8192]}
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert build_plan_engine(plan, artifact_dir(plan))[0].cfg.prefetch == (2048, 8192)
    record = prefetch_choice.measure_compiled(plan, art, say=lines.append)
    assert record["choice"] in ("measured", "default") and record["setting"] == [2048, 8192]
    assert 1 <= len(record["ms_per_token"]) <= 6 and "prefetch measured by decoding" in lines[-1]
    for recorded, runs in (([2048, 8192], None), ([64, 64], (2048, 8192))):
        (art / "manifest.json").write_text(json.dumps(manifest | {"prefetch": {"choice": "default", "setting": recorded}}))
        assert build_plan_engine(plan, artifact_dir(plan))[0].cfg.prefetch == runs
