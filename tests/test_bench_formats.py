"""scripts/bench_formats.py (issue #20: every weight format against transformers and llama.cpp in
one run) end to end on a tiny random checkpoint drafting for itself, eager engines, llama.cpp
skipped; llama.cpp's command and log parsing against a stand-in binary; the streamed weight bytes
of float, packed and quantized models; bad input as one line, exit 1. A smoke test, not a
measurement."""

from __future__ import annotations

import json
import statistics
import stat

import pytest

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

from helpers import load_script, tiny_model  # noqa: E402
from test_compile import save_tiny_checkpoint  # noqa: E402

LOG = """llama_perf_sampler_print:    sampling time =       1.10 ms /    75 runs   (    0.01 ms per token)
llama_perf_context_print:        load time =      80.15 ms
llama_perf_context_print: prompt eval time =      40.50 ms /    12 tokens (    3.38 ms per token,   296.30 tokens per second)
llama_perf_context_print:        eval time =     945.00 ms /    63 runs   (   15.00 ms per token,    66.67 tokens per second)
llama_perf_context_print:       total time =    1000.00 ms /    75 tokens
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    save_tiny_checkpoint(root / "model", intermediate=64)  # int4@32 needs widths divisible by 32
    return root / "model"


@pytest.mark.slow
def test_every_format_plain_and_speculative_in_one_run(model_dir, tmp_path, capsys):
    mod = load_script("bench_formats")
    out = tmp_path / "out"
    assert mod.main(["--model", str(model_dir), "--formats", "float32,bfloat16,int8,int4@32", "--drafter", "self",
                     "--spec-tree", "2,2,4,2", "--synthetic", "3", "--max-new-tokens", "6", "--threads", "1",
                     "--repeats", "2", "--mode", "reference", "--max-context", "96", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "llama.cpp: skipped" in captured.err and "x hf-f32" in captured.out
    res = json.loads((out / "results.json").read_text())
    names = ["ygg/float32/plain", "ygg/float32/spec", "ygg/bfloat16/plain", "ygg/bfloat16/spec",
             "ygg/int8/plain", "ygg/int8/spec", "ygg/int4@32/plain", "ygg/int4@32/spec", "hf/float32", "hf/bfloat16"]
    assert list(res["systems"]) == names and res["llama_cpp"] is None and res["threads"] == 1
    assert res["bandwidth"]["gbps"] >= max(res["bandwidth"]["copy_gbps"], res["bandwidth"]["sum_gbps"]) > 0
    probes = res["bandwidth"]["probes_gbps"]  # one before the passes, one after each prompt's systems
    assert len(probes) == 1 + 2 * 3 and res["bandwidth"]["probe_gbps"] == pytest.approx(statistics.median(probes), rel=1e-3)
    rows = {r["system"]: r for r in res["table"]}
    for name in names:
        r = rows[name]
        if r["note"].startswith("refused"):  # a kernel not batch-invariant on this CPU: speculation only
            assert name.endswith("/spec") and res["systems"][name]["refused"]
            continue
        assert r["decode_tok_s"] > 0 and r["weight_bytes"] > 0 and r["limit_tok_s"] > 0
        assert r["limit_tok_s"] == pytest.approx(res["bandwidth"]["probe_gbps"] * 1e9 / r["weight_bytes"])
        per_prompt = []  # each pass against the bandwidth probed around it, medians over passes then prompts
        for p in res["per_prompt"]:
            q = p[name]
            assert len(q["gbps_all"]) == 2 and all(g > 0 for g in q["gbps_all"])
            per_prompt.append(statistics.median((q["new_tokens"] - 1) / d / (g * 1e9 / r["weight_bytes"])
                                                for d, g in zip(q["decode_s_all"], q["gbps_all"])))
        assert r["limit_fraction"] == pytest.approx(statistics.median(per_prompt))
        assert r["x_hf_float32_lo"] <= r["x_hf_float32"] <= r["x_hf_float32_hi"]
        assert r["x_ygg_float32_lo"] <= r["x_ygg_float32"] <= r["x_ygg_float32_hi"]
        assert (r["compared"] == 3) == name.endswith("/spec")
    assert rows["ygg/float32/plain"]["x_ygg_float32"] == pytest.approx(1.0)
    for name in names:  # --min-rows auto: float weights padded as measured, quantized ones not packed
        pad = res["systems"][name].get("padding")
        if name.startswith(("ygg/float32", "ygg/bfloat16")) and pad and pad["products"]:
            assert rows[name]["min_rows"] == pad["min_rows"] and str(pad["min_rows"]) in pad["median_ms"]
        elif name.startswith("ygg/int"):
            assert rows[name]["min_rows"] == 1
    assert rows["ygg/float32/spec"]["identical_to_plain"] == 3  # greedy float32: exact
    assert rows["hf/float32"]["weight_bytes"] == rows["ygg/float32/plain"]["weight_bytes"]
    assert rows["ygg/int8/plain"]["weight_bytes"] < rows["ygg/bfloat16/plain"]["weight_bytes"] \
        < rows["ygg/float32/plain"]["weight_bytes"]
    assert len(res["per_prompt"]) == 3
    for p in res["per_prompt"]:
        assert len(p["ygg/float32/plain"]["decode_s_all"]) == 2  # one per pass, the median kept
        assert p["ygg/float32/plain"]["tokens"] == p["hf/float32"]["tokens"]
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("system,format,dtype") and len(csv_lines) == 1 + len(names)


@pytest.mark.slow
def test_a_plan_is_its_formats_speculative_system(model_dir, tmp_path, capsys):
    """--plan: a plan's engine and policy (here its largest tree: the plan names no profile) as
    ``ygg/FMT/plan:NAME``, and its plain engine (no drafter) as ``ygg/FMT/plan:NAME/plain``, both
    checked against that format's plain decoding; no fixed-tree or transformers systems when asked."""
    from test_compile import tiny_plan

    mod = load_script("bench_formats")
    plan = model_dir.parent / "int8plan.yaml"
    plan.write_text(tiny_plan("[4]").replace("name: tiny", "name: q8") + "weights: int8\n")
    out = tmp_path / "out"
    assert mod.main(["--model", str(model_dir), "--formats", "float32,int8", "--plan", str(plan), "--spec-tree", "none",
                     "--no-hf", "--synthetic", "3", "--max-new-tokens", "8", "--threads", "1", "--mode",
                     "reference", "--max-context", "96", "--min-rows", "1",  # torch's kernels, as the plan
                     "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["systems"]) == ["ygg/float32/plain", "ygg/int8/plain", "ygg/int8/plan:q8",
                                    "ygg/int8/plan:q8/plain"]
    assert res["systems"]["ygg/int8/plan:q8"]["policy"] == "largest tree"
    rows = {r["system"]: r for r in res["table"]}
    assert rows["ygg/int8/plan:q8"]["identical_to_plain"] == rows["ygg/int8/plan:q8"]["compared"] == 3
    assert rows["ygg/int8/plan:q8/plain"]["identical_to_plain"] == 3 and rows["ygg/int8/plan:q8/plain"]["aal"] == 1.0
    assert rows["ygg/int8/plan:q8"]["aal"] > 1.0  # it speculated
    assert rows["ygg/int8/plan:q8"]["weight_bytes"] == rows["ygg/int8/plain"]["weight_bytes"]
    # a plan whose format the run does not decode plainly: refused before anything loads
    assert mod.main(["--model", str(model_dir), "--formats", "float32", "--plan", str(plan), "--synthetic", "1",
                     "--threads", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bench_formats: error:") and "runs weights int8 in float32: add them to --formats" in err[-1]


def test_streamed_weight_bytes_of_float_packed_and_quantized_models():
    from test_quant import quantized

    from yggtree.measure.floor import weight_bytes
    from yggtree.runtime.packed import pack_linears

    mod = load_script("bench_formats")
    m = tiny_model(hidden=64)
    norms = sum(p.numel() * 4 for n, p in m.named_parameters() if "norm" in n)
    want = weight_bytes(m.matmul_weights()) + norms  # products (tied head once) and norms, no embedding
    assert mod.streamed_weight_bytes(m) == want
    m.setup_cache(1, 64)  # caches are not weights
    pack_linears(m)  # the packed copies replace the weights they were made from
    assert mod.streamed_weight_bytes(m) == want
    q8 = mod.streamed_weight_bytes(quantized("int8"))
    q4 = mod.streamed_weight_bytes(quantized("int4@32"))
    assert q4 < q8 < want / 3
    # Q4_0 / Q4_1 blocks of 32 run on the int4 kernel exactly as int4@32 codes are held
    assert mod.streamed_weight_bytes(quantized("gguf-native")) == q4


def test_llama_cpp_command_and_timings_from_a_stand_in_binary(tmp_path):
    mod = load_script("bench_formats")
    assert mod.parse_llama_timings(LOG) == {"prompt_ms": 40.5, "prompt_tokens": 12, "eval_ms": 945.0,
                                            "eval_runs": 63}
    with pytest.raises(mod.YggError, match="no eval timings"):
        mod.parse_llama_timings("error: unknown argument")
    fake = tmp_path / "bin" / "llama-completion"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    'case "$1" in --version) echo "version: 1 (build 0, commit 0c1e57098)" >&2; exit 0;;\n'
                    '  --help) echo "-lm, --load-mode MODE"; exit 0;; esac\n'
                    f'echo "$@" > {tmp_path}/argv\necho " generated text"\ncat <<EOF >&2\n{LOG}EOF\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    info = mod.llama_info(mod.llama_binary(str(tmp_path)))  # found under bin/
    assert info["commit"] == "0c1e57098" and info["no_mmap"] == ["-lm", "none"]
    rec = mod.llama_runner(info, tmp_path / "m.gguf", 2, 512)(list(range(12)), "<|im_start|>hi", 64)
    assert rec["decode_s"] == pytest.approx(0.945) and rec["new_tokens"] == 64 and rec["steps"] == 63
    assert rec["prompt_tokens"] == rec["prompt_tokens_ours"] == 12 and rec["text"] == " generated text\n"
    argv = (tmp_path / "argv").read_text().split()
    for flag in ("--temp 0", "-n 64", "-t 2", "-tb 2", "-c 512", "-lm none", "-no-cnv", "--no-escape"):
        assert flag in " ".join(argv)
    mod.llama_check(info, tmp_path / "m.gguf", 2)  # one token answers: the build runs here
    # a build for another CPU dies of SIGILL on its first product: refused at the start, in words
    ill = tmp_path / "ill" / "llama-completion"
    ill.parent.mkdir()
    ill.write_text('#!/bin/sh\ncase "$1" in --version|--help) exit 0;; esac\necho "threadpool init" >&2\nkill -ILL $$\n')
    ill.chmod(ill.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(mod.YggError, match="was killed by SIGILL .*build it for this machine.*threadpool init"):
        mod.llama_check(mod.llama_info(ill), tmp_path / "m.gguf", 2)


def test_bad_input_is_one_line(model_dir, tmp_path, capsys):
    mod = load_script("bench_formats")
    base = ["--model", str(model_dir), "--synthetic", "1", "--max-new-tokens", "2", "--threads", "1"]
    cases = [
        (["--formats", "float32,int5"], "unknown weight format 'int5'"),
        (["--formats", "float32,float32"], "names a format twice"),
        (["--formats", "gguf-native"], "need a GGUF model"),
        (["--formats", "float32", "--llama-cpp", str(tmp_path / "none")], "no such directory"),
        (["--formats", "float32", "--llama-cpp", str(tmp_path)], "holds none of llama-completion"),
        (["--formats", "float32", "--spec-tree", "1,2"], "--spec-tree wants four integers"),
        (["--formats", "float32", "--threads", "999"], "exceeds this machine's"),
        (["--formats", "float32", "--min-rows", "0"], "--min-rows must be 'auto' or an integer >= 1"),
    ]
    for more, said in cases:
        assert mod.main(base + more) == 1, more
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("bench_formats: error:") and said in err[0], (more, err)
