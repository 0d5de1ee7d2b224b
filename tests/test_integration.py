"""Integration tests on the real embedded model (SmolLM2-135M-Instruct GGUF, float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from yggtree.data import humaneval_prompts, mtbench_first_turns
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams, TreeParams
from yggtree.runtime.loading import encode_prompt, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow  # those also marked integration run in the default run (README)
NEW = 32


@pytest.fixture(scope="module")
def prompts():
    src = resolve_model("default")
    tok = load_tokenizer(src)
    texts = [p.text for p in mtbench_first_turns(2)] + [p.text for p in humaneval_prompts(1)]
    return [encode_prompt(tok, t) for t in texts]


@pytest.fixture(scope="module")
def reference():
    return build_engine(EngineSpec(mode="reference"))[0]


@pytest.fixture(scope="module")
def hf_outputs(prompts):
    from transformers import AutoModelForCausalLM

    src = resolve_model("default")
    hf = AutoModelForCausalLM.from_pretrained(
        str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
    ).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            g = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=2
            )
        outs.append(g[0, len(ids) :].tolist())
    return outs


@pytest.mark.integration
def test_chat_template_matches_transformers(prompts):
    src = resolve_model("default")
    tok = load_tokenizer(src)
    text = mtbench_first_turns(1)[0].text
    want = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert prompts[0] == list(want)


@pytest.mark.integration
def test_greedy_equals_transformers_generate(reference, prompts, hf_outputs):
    for ids, want in zip(prompts, hf_outputs):
        assert reference.generate(ids, SamplingParams(max_new_tokens=NEW)).token_ids == want


@pytest.mark.integration
def test_self_drafted_tree_equals_plain(prompts, hf_outputs):
    spec = EngineSpec(
        mode="reference",
        drafter="self",
        tree=TreeParams(draft_width=4, draft_depth=3, verify_width=10, top_k=4),
    )
    eng = build_engine(spec)[0]
    for ids, want in zip(prompts, hf_outputs):
        res = eng.generate(ids, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == want
        assert res.stats["aal"] > 2


def test_compiled_plain_decoding_no_recompiles(reference, prompts):
    from torch._dynamo.utils import counters

    eng = build_engine(EngineSpec(mode="performance", prefill_chunk=32))[0]
    graphs = counters["stats"]["unique_graphs"]
    for ids in prompts:  # different prompt lengths, more than one prefill chunk
        got = eng.generate(ids, SamplingParams(max_new_tokens=16))
        want = reference.generate(ids, SamplingParams(max_new_tokens=16))
        assert got.token_ids == want.token_ids
    assert counters["stats"]["unique_graphs"] == graphs


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "yggtree.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.integration
def test_cli_json_output():
    r = run_cli("run", "--prompt", "Say hi.", "--max-new-tokens", "8", "--mode", "reference", "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert set(obj) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
    assert {"new_tokens", "tokens_per_s", "ttft_ms", "tpot_ms", "compile_s"} <= set(obj["stats"])
    assert obj["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--model", "/no/such/model"], "does not exist"),
        (["--prompt", "hi", "--max-new-tokens", "100000"], "context window"),
        (["--prompt", "x " * 1100], "context window is 1024"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "1.5"], "top-p"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt", "hi", "--dtype", "float16"], "invalid choice"),
        (["--prompt", "hi", "--drafter", "self", "--verify-width", "99"], "exceeds the drafted tree"),
    ],
)
def test_cli_bad_input_is_one_line(args, message):
    r = run_cli("run", "--mode", "reference", *args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr
