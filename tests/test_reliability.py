"""Reliability: one engine shared by threads, sizes and values refused before anything is built,
the CLI's failure modes (broken pipe, undecodable prompt, absurd temperature) as one line."""

from __future__ import annotations

import contextlib
import io
import threading

import pytest

from yggtree.cli import main
from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import (
    MAX_DRAFT_DEPTH,
    MAX_TEMPERATURE,
    EngineConfig,
    SamplingParams,
    TreeParams,
    check_sizes,
)

from test_engine import engine, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(5, 12)), [(7 * i) % 90 + 3 for i in range(23)], [1] * 40, [50, 3, 9]]


def test_concurrent_generate_calls_equal_their_sequential_results():
    """Six threads, four prompts, greedy and sampled, on one speculative engine: every output
    is the one the same call gives alone (the engine's lock serialises them)."""
    target = tiny()
    tp = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)
    eng = engine(target, tp, LMDrafter(tiny(seed=1, std=0.25), "reference"))
    calls = [(p, SamplingParams(12, t, 1.0, seed)) for seed, (p, t) in
             enumerate([(p, t) for p in PROMPTS for t in (0.0, 0.8)])][:6]
    want = [eng.generate(p, s).token_ids for p, s in calls]
    assert len({tuple(w) for w in want}) == len(want)  # different answers: a mix-up would show
    got: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def work(i):
        barrier.wait()
        for _ in range(2):
            got[i] = eng.generate(*calls[i]).token_ids
            if got[i] != want[i]:
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    assert got == want


def test_api_refuses_wrong_types_with_one_clear_error():
    eng = engine(tiny())
    with pytest.raises(YggError, match=r"list of token ids .*got str"):
        eng.generate("Hello!", SamplingParams(max_new_tokens=2))
    with pytest.raises(YggError, match=r"prompt token id must be an integer, got float 3\.0"):
        eng.generate([1, 3.0], SamplingParams(max_new_tokens=2))
    with pytest.raises(YggError, match="prompt token id must be an integer, got True"):
        eng.generate([1, True], SamplingParams(max_new_tokens=2))
    with pytest.raises(YggError, match="max-new-tokens must be an integer"):
        eng.generate([1, 2], SamplingParams(max_new_tokens=2.5))
    with pytest.raises(YggError, match="params must be SamplingParams"):
        eng.generate([1, 2], {"max_new_tokens": 2})
    with pytest.raises(YggError, match="temperature must be a number"):
        eng.generate([1, 2], SamplingParams(2, "0.5"))
    # numpy and torch integers are token ids too
    import numpy as np
    import torch

    plain = eng.generate([5, 6, 7], SamplingParams(max_new_tokens=3)).token_ids
    assert eng.generate(np.array([5, 6, 7]), SamplingParams(max_new_tokens=3)).token_ids == plain
    assert eng.generate(torch.tensor([5, 6, 7]), SamplingParams(max_new_tokens=3)).token_ids == plain


@pytest.mark.parametrize(
    "params,message",
    [
        (SamplingParams(temperature=float("inf")), r"temperature must be 0 \(greedy\) or in 0.01..10"),
        (SamplingParams(temperature=1e9), r"temperature must be 0 \(greedy\) or in 0.01..10, got 1e\+?0?9|1000000000"),
        (SamplingParams(temperature=float("nan")), "temperature must be 0"),
        (SamplingParams(temperature=-0.5), "temperature must be 0"),
        (SamplingParams(temperature=1e-144), "temperature must be 0"),
        (SamplingParams(top_p=0.0), r"top-p must be in \(0, 1\]"),
        (SamplingParams(seed=-1), r"seed must be in 0..2\*\*63-1"),
        (SamplingParams(seed=2**64), "seed must be in"),
        (SamplingParams(max_new_tokens=0), "max-new-tokens must be >= 1"),
    ],
)
def test_sampling_values_are_bounded(params, message):
    with pytest.raises(YggError, match=message):
        params.validate()


@pytest.mark.parametrize(
    "context,chunk,tree,message",
    [
        (1024, 5000, None, r"prefill-chunk must be in 1..max-context \(1024\), got 5000"),
        (1, 1, None, "max-context must be >= 2"),
        (1024, 64, TreeParams(4, 1000, 16, 4), f"draft-depth 1000 exceeds the limit of {MAX_DRAFT_DEPTH}"),
        (1024, 64, TreeParams(5000, 1, 2, 4), "draft-width 5000 exceeds the limit of 64"),
        (1024, 64, TreeParams(4, 4, 16, 100000), "top-k 100000 exceeds the limit of 64"),
        (1024, 64, TreeParams(4, 4, 1000, 4), "verify-width 1000 exceeds the limit of 256"),
        (64, 16, TreeParams(8, 8, 16, 4), r"65 nodes\) does not fit in the context window \(64\)"),
        (64, 16, TreeParams(4, 4, 18, 4), "verify-width 18 exceeds the drafted tree"),
    ],
)
def test_sizes_are_refused_with_the_limit_named(context, chunk, tree, message):
    with pytest.raises(YggError, match=message):
        check_sizes(context, chunk, tree)


def test_engine_checks_sizes_before_allocating():
    target = tiny()
    with pytest.raises(YggError, match="prefill-chunk must be in 1..max-context"):
        engine(target, chunk=500)
    assert target.cache_slots == 0  # refused before the cache was allocated
    small = tiny(vocab=50)
    with pytest.raises(YggError, match=r"top-k 60 exceeds the vocabulary \(50\)"):
        engine(small, TreeParams(4, 2, 8, 60), LMDrafter(small.shared_copy(), "reference"))
    drafter = LMDrafter(target.shared_copy(), "reference")
    with pytest.raises(YggError, match="draft-depth 40 exceeds the limit"):
        engine(target, TreeParams(1, 40, 8, 1), drafter)
    with pytest.raises(YggError, match="max-context 600 exceeds the model's context window"):
        from yggtree.runtime.engine import Engine

        Engine(target, EngineConfig(mode="reference", max_context=600, prefill_chunk=16))


# ----------------------------------------------------------------------------- the CLI


def cli(argv, stdout=None) -> tuple[int, str, str]:
    out, err = stdout or io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue() if stdout is None else "", err.getvalue()


def refuses_before_loading(monkeypatch):
    import yggtree.runtime.prepare  # noqa: F401  (imported unpatched: it binds resolve_model)
    import yggtree.runtime.loading as loading

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(loading, "resolve_model", boom)
    monkeypatch.setattr("yggtree.runtime.prepare.resolve_model", boom)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--prompt", "ab\udcff\udcfecd"], "the prompt is not valid UTF-8 (undecodable byte at position 2)"),
        (["--prompt", "hi", "--temperature", "inf"], "temperature must be 0 (greedy) or in 0.01..10, got inf"),
        (["--prompt", "hi", "--temperature", "1e9"], "temperature must be 0 (greedy) or in 0.01..10, got 1000000000.0"),
        (["--prompt", "hi", "--prefill-chunk", "5000"], "prefill-chunk must be in 1..max-context (1024), got 5000"),
        (["--prompt", "hi", "--drafter", "self", "--draft-depth", "1000"], "draft-depth 1000 exceeds the limit of 32"),
        (["--prompt", "hi", "--drafter", "self", "--draft-depth", "300", "--draft-width", "1",
          "--verify-width", "4"], "draft-depth 300 exceeds the limit of 32"),
        (["--prompt", "hi", "--drafter", "self", "--top-k", "100000"], "top-k 100000 exceeds the limit of 64"),
        (["--prompt", "hi", "--drafter", "self", "--draft-width", "300", "--draft-depth", "4"],
         "draft-width 300 exceeds the limit of 64"),
        (["--prompt", "hi", "--drafter", "self", "--max-context", "64", "--draft-width", "8",
          "--draft-depth", "8"],
         "the drafted tree (1 + draft-width 8 x draft-depth 8 = 65 nodes) does not fit in the context window (64)"),
        (["--prompt", "hi", "--seed", "-3"], "seed must be in 0..2**63-1, got -3"),
    ],
)
def test_cli_refuses_before_the_model_loads(monkeypatch, extra, message):
    refuses_before_loading(monkeypatch)
    code, out, err = cli(["run", *extra, "--max-new-tokens", "4"])
    assert code == 1 and out == ""
    assert err == f"yggtree: error: {message}\n"


class ClosedPipe(io.StringIO):
    """stdout whose reader went away after ``n`` writes."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def write(self, s):
        self.n -= 1
        if self.n < 0:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)

    def fileno(self):
        raise io.UnsupportedOperation("no file")


def test_cli_broken_pipe_ends_quietly(tiny_checkpoint):
    for n in (0, 2):
        code, _, err = cli(["run", "--model", tiny_checkpoint, "--raw", "--prompt", "t5 t9 t11",
                            "--mode", "reference", "--max-new-tokens", "8", "--max-context", "64"],
                           stdout=ClosedPipe(n))
        assert (code, err) == (0, "")


@pytest.mark.slow
def test_cli_broken_pipe_in_a_real_pipeline(tiny_checkpoint):
    import subprocess
    import sys

    cmd = (f"{sys.executable} -m yggtree.cli run --model {tiny_checkpoint} --raw --prompt 't5 t9' "
           "--mode reference --max-new-tokens 60 --max-context 100 | head -c 1; exit ${PIPESTATUS[0]}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "" and len(r.stdout) == 1


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from test_compile import save_tiny_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_checkpoint(d)
    return str(d)


def test_tiny_top_p_keeps_the_most_likely_token():
    """Found by tests/test_fuzz.py: a top-p below float32's smallest number rounded to 0 and
    filtered out every token (NaN probabilities, a RuntimeError from torch.multinomial)."""
    import torch

    from yggtree.runtime.accept import filter_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 1.0]])
    for top_p in (1e-136, 1e-30, 1e-3):
        assert filter_probs(logits, 0.7, top_p).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_tune_refuses_more_worker_threads_than_cores(tmp_path, monkeypatch):
    """Found by scripts/reliability_cases.py: `tune --workers 3 --threads 2` on 2 cores started
    profiling with 6 threads (workers measure speed side by side: oversubscribed, they measure
    contention); refused in one line before anything is measured or written."""
    pytest.importorskip("optuna")
    import yggtree.runtime.schedule as schedule

    monkeypatch.setattr(schedule, "usable_cores", lambda: 2)
    out = tmp_path / "profiles"
    base = ["tune", "--hw", "t", "--out-dir", out, "--compile-root", tmp_path / "compile"]
    code, stdout, err = cli([*base, "--workers", "3", "--threads", "2"])
    assert (code, stdout) == (1, "")
    assert err == "yggtree: error: --workers 3 x --threads 2 = 6 threads exceeds this machine's 2 usable cores\n"
    code, _, err = cli([*base, "--threads", "3"])
    assert code == 1 and "--workers 1 x --threads 3 = 3 threads exceeds" in err
    assert not out.exists() and not (tmp_path / "compile").exists()


def test_an_output_path_that_is_a_file_is_one_line(tmp_path, capsys):
    """An OSError out of a command (here: --out names an existing file) is one error line and
    status 1, through the CLI and through the commands' ``python -m`` entry points."""
    from yggtree.cli import main
    from yggtree.errors import run_reporting

    afile = tmp_path / "afile"
    afile.write_text("mine")

    def writes_under(_args):
        (afile / "manifest.json").write_text("{}")

    import yggtree.offline.compile as compile_cmd

    real = compile_cmd.run
    compile_cmd.run = writes_under
    try:
        assert main(["compile", "plan.yaml", "--out", str(afile)]) == 1
    finally:
        compile_cmd.run = real
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("yggtree: error: Not a directory: ") and str(afile) in err
    assert run_reporting("yggtree compile", writes_under, None) == 1
    assert capsys.readouterr().err.startswith("yggtree compile: error: Not a directory: ")
    assert afile.read_text() == "mine"


@pytest.mark.slow
def test_script_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """Scripts report through errors.run_reporting: ``| head`` stops them quietly too (it printed
    a BrokenPipeError traceback: ab_versions' table piped into ``head -5``)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    rows = [{"prompt": f"p{i}", "plain": {"decode_s": 1.0 + i, "new_tokens": 9, "tokens": [1, 2]}} for i in range(40)]
    for name in ("a", "b"):
        (tmp_path / f"{name}.rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = Path(__file__).resolve().parents[1] / "scripts" / "ab_versions.py"
    cmd = (f"{sys.executable} {script} --a {tmp_path}/a.rows.jsonl --b {tmp_path}/b.rows.jsonl "
           "| head -c 1; exit ${PIPESTATUS[0]}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr


def test_every_script_reports_through_run_reporting():
    """A script's bad input is one line, as a command's (errors.run_reporting): every script's entry
    point goes through it (train_drafter through ``yggtree distill``'s)."""
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    missing = [p.name for p in sorted(scripts.glob("*.py"))
               if "run_reporting(" not in p.read_text() and "offline.distill import main" not in p.read_text()]
    assert missing == []


def test_a_script_given_a_missing_plan_says_so_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "spec_stages.py"
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "none.yaml"), "2", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("spec_stages: error:") and "none.yaml" in r.stderr
