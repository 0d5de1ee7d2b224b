#!/usr/bin/env python
"""The bad-input and failure cases of issue #24 as command lines, each run in a fresh process.

For every case: exit status, whether stderr is exactly one line, whether a Python traceback
appears, wall and CPU time. Every case is bounded, so a hang shows as ``timeout``: by CPU seconds
of its process group (``--timeout``, 60 by default; a busy hang such as compiling forever) and by
``--wall-factor`` times that of wall time (a hang that waits; on a loaded machine a niced case
gets a small share of a core, and a wall budget alone would call a slow start a hang). A case
whose flag or subcommand the checkout does not have is reported as unsupported (its help text
is read first). Prints a markdown table and writes JSON.

The code under test is the checkout ``--root`` (default: this script's repository): every
command runs as ``python -m yggtree.cli ...`` with ``PYTHONPATH=<root>`` (checked: ``yggtree``
must import from there, not from an editable install elsewhere), in a scratch directory that
holds the setups (a tiny random-weight Llama checkpoint, plans, a compiled plan, transcript
shards and drafter heads of a tiny chat model). The setups are made by ``--root``'s own code.

    python scripts/reliability_cases.py --out after.json                 # this checkout
    PYTHONPATH=/work/rel-before python scripts/reliability_cases.py \\
        --root /work/rel-before --out before.json                         # an old worktree
    python scripts/reliability_cases.py --merge before.json after.json   # the before/after table

Run it niced on a shared machine (``nice -n 10 env OMP_NUM_THREADS=1 ...``); times under load
are only indicative. ``--only a,b`` runs some cases (their setups included), ``--list`` names them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- setups

TINY_MODEL = """
import sys, torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
path, vocab = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True)
LlamaForCausalLM(cfg).save_pretrained(path)
tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
tk.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", eos_token="t2").save_pretrained(path)
"""

# a tiny Llama with the embedded model's tokenizer (chat template): transcripts and distill run on it
TINY_CHAT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from yggtree.runtime.loading import load_tokenizer, resolve_model
torch.manual_seed(0)
tok = load_tokenizer(resolve_model("default"))
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=512,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
m = LlamaForCausalLM(cfg)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.5)
m.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
"""

PLANS = {
    # one compiled AOTInductor package (target width 1, one context bucket): the cheapest compile
    "plain.yaml": "name: plain\ntarget: model\nmax_context: 32\nprefill_chunk: 1\nsampling: {max_new_tokens: 8}\n",
    "eager.yaml": ("name: eager\ntarget: model\ndrafter: self\nbackend: eager\nmax_context: 96\n"
                   "prefill_chunk: 4\ndraft_widths: [1, 2]\nd_max: 2\ntop_k: 2\nverify_widths: [2, 4]\n"
                   "sampling: {max_new_tokens: 8}\n"),
    "bad_field.yaml": "name: bad\ntarget: model\ndrafter: self\ndraft_widths: [0]\nverify_widths: [4]\n",
    "unknown_key.yaml": "name: bad\ntarget: model\nfrobnicate: 3\n",
    "not_yaml.yaml": "name: [unclosed\n  target: : :\n",
}

TRANSCRIPT_ARGS = ("--model chat --shards 0:1 --shard-size 2 --max-new-tokens 6 --gen-batch 2 "
                   "--target-layers 0,-1 --feature-cache fc --threads 1")
DISTILL_ARGS = ("--model chat --feature-cache fc --cache-dir dcache --target-layers 0,-1 --max-seq-len 24 "
                "--epochs 1 --batch-size 2 --unroll 2 --eval-depth 2 --eval-every 4 --heldout-seqs 2 "
                "--checkpoint-every 1 --threads 1")


class Setups:
    """The scratch directory's fixtures, made once on first use (by the checkout under test)."""

    def __init__(self, runner: "Runner"):
        self.r = runner
        self.w = runner.work
        self.done: dict[str, str | None] = {}  # name -> None (ok) or why it failed

    def need(self, name: str) -> str | None:
        if name not in self.done:
            for dep in DEPENDS.get(name, ()):
                why = self.need(dep)
                if why:
                    self.done[name] = f"setup {dep} failed: {why}"
                    return self.done[name]
            t = time.perf_counter()
            try:
                getattr(self, "make_" + name)()
                self.done[name] = None
            except SetupFailed as e:
                self.done[name] = str(e)
            self.r.log(f"setup {name}: {'ok' if self.done[name] is None else self.done[name]} "
                       f"({time.perf_counter() - t:.0f} s)")
        return self.done[name]

    def sh(self, cmd: str, timeout: float = 900) -> None:
        res = self.r.execute(["bash", "-c", cmd], timeout)
        if res["exit"] != 0:
            tail = (res["stderr"].strip().splitlines() or [""])[-1][:200]
            raise SetupFailed(f"`{cmd[:80]}` exit {res['exit']}: {tail}")

    def py(self, code: str, *args: str, timeout: float = 300) -> None:
        self.sh(" ".join([shlex.quote(sys.executable), "-c", shlex.quote(code), *map(shlex.quote, args)]), timeout)

    def make_model(self):
        self.py(TINY_MODEL, "model", "128")
        (self.w / "exists.jsonl").write_text("{}\n")
        (self.w / "afile").write_text("a file, not a directory\n")
        (self.w / "empty_dir").mkdir(exist_ok=True)
        for name, text in PLANS.items():
            (self.w / name).write_text(text)

    def make_other(self):  # another vocabulary and tokenizer: a foreign drafter
        self.py(TINY_MODEL, "other", "96")

    def make_truncated(self):
        self.sh("cp -r model truncated")
        f = self.w / "truncated" / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def make_compiled(self):
        self.sh(f"{self.r.cli} compile plain.yaml --out compile --json")
        if not list((self.w / "compile" / "plain").rglob("*.pt2")):
            raise SetupFailed("the compile wrote no .pt2 package")

    def make_chat(self):
        self.py(TINY_CHAT, "chat")

    def make_transcripts(self):
        for split in ("train", "heldout"):
            self.sh(f"{self.r.cli} transcripts --out tr --split {split} {TRANSCRIPT_ARGS}")
        self.sh("cp -r tr tr_cut")
        shard = self.w / "tr_cut" / "train-00000.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    def make_head(self):  # a finished head (draft vocabulary 64)
        self.sh(f"{self.r.cli} distill --transcripts tr --out head --draft-vocab 64 {DISTILL_ARGS}")

    def make_checkpoint(self):  # a run stopped by its budget after one step: checkpoint.pt stays
        self.sh(f"{self.r.cli} distill --transcripts tr --out ckpt --draft-vocab 64 --budget-minutes 1e-9 "
                f"{DISTILL_ARGS}")
        if not (self.w / "ckpt" / "checkpoint.pt").exists():
            raise SetupFailed("no ckpt/checkpoint.pt after a budget-stopped distill")


DEPENDS = {"other": ("model",), "truncated": ("model",), "compiled": ("model",),
           "transcripts": ("chat",), "head": ("transcripts",), "checkpoint": ("transcripts",)}


class SetupFailed(Exception):
    pass


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Case:
    name: str
    what: str
    cmd: str  # a bash command line; `yggtree` stands for `python -m yggtree.cli` of the root
    expect: str = "refuse"  # refuse (non-zero, one stderr line) | ok (exit 0) | quiet (exit 0, no stderr)
    needs: tuple[str, ...] = ("model",)
    flags: tuple[str, ...] = ()  # "subcommand --flag" the case needs; absent -> unsupported
    timeout: float | None = None
    before: str | None = None  # a Runner method run first (changes the scratch directory)
    after: str | None = None


def run_(n: str = "4") -> str:
    return f"yggtree run --model model --raw --mode reference --max-context 96 --max-new-tokens {n}"


RUN = run_()
SELF = f"{RUN} --drafter self --prompt 't5 t9 t11'"
P = "--prompt 't5 t9 t11'"
PLAN_P = f"--raw {P}"  # (the tiny model has no chat template)
API = ("python -c \"$API\" model")  # the snippet is in $API (the runner's environment), see api_snippet

CASES = [
    # --- prompts
    Case("empty-prompt", "empty prompt", f"{RUN} --prompt ''"),
    Case("blank-prompt", "prompt of spaces", f"{RUN} --prompt '   '"),
    Case("long-prompt", "prompt longer than the context", f"{RUN} --max-context 64 --prompt \"$(printf 't5 %.0s' {{1..200}})\""),
    Case("nonutf8-prompt", "undecodable prompt bytes (issue 3; default model)",
         "yggtree run --mode reference --max-new-tokens 4 --prompt \"$(printf 'ab\\xff\\xfecd')\"", needs=(),
         timeout=120),
    Case("nonutf8-prompt-tiny", "undecodable prompt bytes (tiny model)",
         f"{RUN} --prompt \"$(printf 't5 \\xff\\xfe t9')\""),
    # --- flags argparse refuses
    Case("max-new-tokens-0", "--max-new-tokens 0", f"{run_('0')} {P}"),
    Case("max-new-tokens-abc", "--max-new-tokens abc", f"{run_('abc')} {P}"),
    Case("unknown-flag", "unknown flag", f"{RUN} {P} --frobnicate"),
    Case("bad-dtype", "--dtype float16", f"{RUN} {P} --dtype float16"),
    Case("bad-mode", "--mode fast", f"yggtree run --model model --raw --mode fast {P}"),
    # --- sampling values (issue 5)
    Case("temperature-inf", "--temperature inf (issue 5)", f"{RUN} {P} --temperature inf"),
    Case("temperature-1e9", "--temperature 1e9 (issue 5)", f"{RUN} {P} --temperature 1e9"),
    Case("temperature-nan", "--temperature nan", f"{RUN} {P} --temperature nan"),
    Case("temperature-neg", "--temperature -1", f"{RUN} {P} --temperature -1"),
    Case("temperature-tiny", "--temperature 1e-300 (logits / T overflow)", f"{RUN} {P} --temperature 1e-300"),
    Case("top-p-0", "--top-p 0", f"{RUN} {P} --temperature 0.7 --top-p 0"),
    Case("top-p-1.5", "--top-p 1.5", f"{RUN} {P} --temperature 0.7 --top-p 1.5"),
    Case("seed-neg", "--seed -3", f"{RUN} {P} --seed -3 --temperature 0.7"),
    # --- sizes (issue 2, deliver 2)
    Case("draft-depth-1000", "--draft-depth 1000 with --drafter self (issue 2; default model)",
         "yggtree run --prompt hi --drafter self --draft-depth 1000 --max-new-tokens 4", needs=(), timeout=120),
    Case("draft-depth-300-tiny", "--draft-depth 300 (tiny model, W_d 1)",
         f"{SELF} --draft-depth 300 --draft-width 1 --verify-width 4"),
    Case("draft-width-300", "--draft-width 300", f"{SELF} --draft-width 300 --draft-depth 2"),
    Case("verify-width-1000", "--verify-width 1000", f"{SELF} --verify-width 1000"),
    Case("verify-width-over-tree", "--verify-width larger than the drafted tree",
         f"{SELF} --draft-width 2 --draft-depth 2 --verify-width 20"),
    Case("top-k-100000", "--top-k 100000", f"{SELF} --top-k 100000"),
    Case("prefill-chunk-5000", "--prefill-chunk 5000 (issue 3; default model)",
         "yggtree run --prompt hi --prefill-chunk 5000 --max-new-tokens 4", needs=(), timeout=120),
    Case("prefill-chunk-5000-tiny", "--prefill-chunk 5000 (tiny model)", f"{RUN} {P} --prefill-chunk 5000"),
    Case("max-context-1", "--max-context 1", f"{RUN} {P} --max-context 1"),
    Case("max-context-100000", "--max-context beyond the model's window (128)", f"{RUN} {P} --max-context 100000"),
    Case("tree-over-context", "drafted tree (1 + 8 x 8) larger than the context (64)",
         f"{SELF} --max-context 64 --draft-width 8 --draft-depth 8"),
    Case("lookup-over-verify", "--lookup above the verify width", f"{SELF} --verify-width 4 --lookup 9",
         flags=("run --lookup",)),
    Case("threads-64", "--threads 64 (more than the cores)", f"{RUN} {P} --threads 64", flags=("run --threads",)),
    Case("stages-split-over-cores", "--stages overlap@2+2: a thread split larger than the cores",
         f"{SELF} --stages overlap@2+2", flags=("run --stages",)),
    Case("stages-threads-over-cores", "--stages ahead@64", f"{SELF} --stages ahead@64", flags=("run --stages",)),
    Case("stages-split-garbled", "--stages overlap@1+x", f"{SELF} --stages overlap@1+x", flags=("run --stages",)),
    # --- plans
    Case("plan-missing", "--plan of a missing file", f"yggtree run --plan nope.yaml {PLAN_P}"),
    Case("plan-name", "--plan of an unknown plan name", f"yggtree run --plan nosuchplan {PLAN_P}"),
    Case("plan-bad-field", "plan with draft_widths: [0]", f"yggtree run --plan bad_field.yaml {PLAN_P}"),
    Case("plan-unknown-key", "plan with an unknown key", f"yggtree run --plan unknown_key.yaml {PLAN_P}"),
    Case("plan-not-yaml", "plan that is not YAML", f"yggtree run --plan not_yaml.yaml {PLAN_P}"),
    Case("stages-unknown", "--stages of an unknown execution plan", f"{SELF} --stages warp",
         flags=("run --stages",)),
    Case("depth-without-plan", "--depth without --plan", f"{SELF} --depth 2"),
    Case("depth-out-of-range", "--depth 99 with a plan of d_max 2", f"yggtree run --plan eager.yaml {PLAN_P} --depth 99"),
    # --- models and files
    Case("model-missing", "--model of a missing path", f"{RUN.replace('model model', 'model /nonexistent/model')} {P}",
         needs=()),
    Case("model-empty-dir", "--model of an empty directory", f"{RUN.replace('model model', 'model empty_dir')} {P}"),
    Case("model-truncated", "--model with a truncated model.safetensors",
         f"{RUN.replace('model model', 'model truncated')} {P}", needs=("truncated",)),
    Case("drafter-missing", "--drafter of a missing path", f"{RUN} {P} --drafter /nonexistent/drafter"),
    Case("drafter-foreign", "--drafter with another tokenizer", f"{RUN} {P} --drafter other", needs=("other",)),
    Case("trace-exists", "--trace onto an existing file", f"{RUN} {P} --trace exists.jsonl"),
    Case("trace-no-dir", "--trace into a missing directory", f"{RUN} {P} --trace nodir/t.jsonl"),
    Case("trace-performance", "--trace without --mode reference",
         f"yggtree run --model model --raw --mode performance {P} --trace t.jsonl"),
    # --- output
    Case("broken-pipe", "stdout closed early (`| head -c1`, issue 3)",
         f"{run_('60')} --max-context 100 --prompt 't5 t9' | head -c1 >/dev/null; exit ${{PIPESTATUS[0]}}",
         expect="quiet"),
    # --- compiled artifacts (issue 3, deliver 3) and an interrupted compile (chaos)
    Case("pt2-truncated", "run --plan with a truncated .pt2 package (issue 3)",
         f"yggtree run --plan plain.yaml {PLAN_P} --max-new-tokens 2", needs=("compiled",),
         before="truncate_package", after="restore_package"),
    Case("pt2-missing", "run --plan with a .pt2 package removed",
         f"yggtree run --plan plain.yaml {PLAN_P} --max-new-tokens 2", needs=("compiled",),
         before="remove_package", after="restore_package"),
    Case("manifest-truncated", "run --plan with a truncated manifest.json",
         f"yggtree run --plan plain.yaml {PLAN_P} --max-new-tokens 2", needs=("compiled",),
         before="truncate_manifest", after="restore_package"),
    Case("compile-sigint", "compile --force, SIGINT (Ctrl-C to its process group) mid-compile",
         "yggtree compile plain.yaml --out compile --force", needs=("compiled",), expect="interrupted"),
    Case("run-after-sigint", "run --plan after the interrupted compile",
         f"yggtree run --plan plain.yaml {PLAN_P} --max-new-tokens 2", needs=("compiled",)),
    Case("rerun-compile-missing", "run --plan --compile-missing after the interrupted compile (rebuilds)",
         f"yggtree run --plan plain.yaml {PLAN_P} --max-new-tokens 2 --compile-missing", needs=("compiled",),
         expect="ok", timeout=600),
    Case("compile-plan-missing", "compile of a missing plan file", "yggtree compile nope.yaml --out compile"),
    Case("compile-bad-field", "compile of a plan with a bad field", "yggtree compile bad_field.yaml --out compile"),
    # --- transcripts and distill
    Case("transcripts-truncated-shard", "transcripts rerun over a truncated shard",
         f"yggtree transcripts --out tr_cut --split train {TRANSCRIPT_ARGS}", needs=("transcripts",)),
    Case("distill-truncated-shard", "distill on a truncated transcript shard",
         f"yggtree distill --transcripts tr_cut --out d_cut --draft-vocab 64 {DISTILL_ARGS}", needs=("transcripts",)),
    Case("distill-checkpoint-shape", "distill resuming a checkpoint of another head shape",
         f"yggtree distill --transcripts tr --out ckpt --draft-vocab 32 {DISTILL_ARGS}", needs=("checkpoint",)),
    Case("distill-init-from-shape", "distill --init-from a head of another shape",
         f"yggtree distill --transcripts tr --out d_init --init-from head --draft-vocab 32 {DISTILL_ARGS}",
         needs=("head",), flags=("distill --init-from",)),
    Case("transcripts-shard-size-1", "transcripts --shard-size 1",
         "yggtree transcripts --out tr_x --model model --shards 0:1 --shard-size 1", needs=("model",)),
    Case("transcripts-worker-2/2", "transcripts --worker 2/2", "yggtree transcripts --out tr_x --shards 0:1 --worker 2/2",
         needs=()),
    # --- other commands
    Case("tune-workers-over-cores", "tune --workers 3 --threads 2 (a thread split larger than the cores)",
         "yggtree tune --hw t --plan eager.yaml --out-dir tune --compile-root tunec --trials 1 --quick-profile "
         "--workers 3 --threads 2", flags=("tune --workers",)),
    Case("tune-space-impossible", "tune --space d_max=100", "yggtree tune --hw t --plan eager.yaml --out-dir tune "
         "--compile-root tunec --space d_max=100", flags=("tune --space",)),
    Case("tune-workers-0", "tune --workers 0", "yggtree tune --hw t --plan eager.yaml --out-dir tune --workers 0",
         flags=("tune --workers",)),
    Case("profile-bad-hw", "profile --hw a/b", "yggtree profile --hw a/b --plan eager.yaml --out-dir prof"),
    Case("calibrate-plan-missing", "calibrate --plan of a missing file", "yggtree calibrate --plan nope.yaml", needs=()),
    Case("train-predictor-records-missing", "train-predictor --records of a missing file",
         "yggtree train-predictor --plan eager.yaml --records nope.safetensors --out-dir pred"),
    Case("bench-threads-0", "bench --threads 0", "yggtree bench --threads 0 --prompts 1", needs=()),
    # --- output paths that are files (afile is an existing file)
    Case("compile-out-file", "compile --out onto a file", "yggtree compile eager.yaml --out afile"),
    Case("calibrate-out-file", "calibrate --out-dir onto a file",
         "yggtree calibrate --plan eager.yaml --prompts 1 --max-new-tokens 2 --out-dir afile"),
    Case("profile-cache-under-file", "profile --cache-dir under a file",
         "yggtree profile --hw x --plan eager.yaml --quick --out-dir prof --cache-dir afile/c"),
    Case("transcripts-out-file", "transcripts --out onto a file",
         f"yggtree transcripts --out afile --split train {TRANSCRIPT_ARGS}", needs=("chat",)),
    Case("distill-out-file", "distill --out onto a file",
         f"yggtree distill --transcripts tr --out afile --draft-vocab 64 {DISTILL_ARGS}", needs=("transcripts",)),
    Case("tune-out-file", "tune --out-dir onto a file", "yggtree tune --hw t --plan eager.yaml --out-dir afile --trials 1",
         flags=("tune --out-dir",)),
    # --- the Python API (issue 1, 4, 5): a YggError is printed as one line and exits 1
    Case("api-str-prompt", "generate(\"t5 t9\") (a str prompt, issue 4)", API + " str"),
    Case("api-float-id", "generate([5, 9.0]) (a float token id, issue 4)", API + " float"),
    Case("api-bool-id", "generate([5, True])", API + " bool"),
    Case("api-temperature-inf", "SamplingParams(temperature=inf)", API + " inf"),
    Case("api-threads", "6 threads share one speculative engine (issue 1): each output = its sequential one",
         API + " threads", expect="ok", timeout=300),
]

API_SNIPPET = r"""
import sys, threading
from yggtree.errors import YggError
from yggtree.runtime.build import EngineSpec, build_engine
from yggtree.runtime.engine import SamplingParams, TreeParams
import torch
torch.set_num_threads(1)
eng, tok = build_engine(EngineSpec(model=sys.argv[1], drafter="self", mode="reference", max_context=96,
                                   prefill_chunk=8, tree=TreeParams(2, 3, 6, 2)))
what = sys.argv[2]
try:
    if what == "str":
        print(eng.generate("t5 t9", SamplingParams(max_new_tokens=4)).token_ids)
    elif what == "float":
        print(eng.generate([5, 9.0], SamplingParams(max_new_tokens=4)).token_ids)
    elif what == "bool":
        print(eng.generate([5, True], SamplingParams(max_new_tokens=4)).token_ids)
    elif what == "inf":
        print(eng.generate([5, 9], SamplingParams(max_new_tokens=4, temperature=float("inf"))).token_ids)
    elif what == "threads":
        prompts = [list(range(5, 12)), [(7 * i) % 90 + 3 for i in range(23)], [1] * 40, [50, 3, 9]]
        calls = [(p, SamplingParams(24, t, 1.0, s)) for s, (p, t) in
                 enumerate([(p, t) for p in prompts for t in (0.0, 0.8)])][:6]
        want = [eng.generate(p, s).token_ids for p, s in calls]
        got = [None] * len(calls)
        barrier = threading.Barrier(len(calls))
        def work(i):
            barrier.wait()
            got[i] = eng.generate(*calls[i]).token_ids
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = sum(g != w for g, w in zip(got, want))
        if bad:
            print(f"{bad} of {len(calls)} concurrent outputs differ from their sequential result", file=sys.stderr)
            sys.exit(3)
        print(f"{len(calls)} of {len(calls)} concurrent outputs equal their sequential result")
except YggError as e:
    print(f"YggError: {e}", file=sys.stderr)
    sys.exit(1)
"""


# ----------------------------------------------------------------------------- running


class Runner:
    def __init__(self, root: Path, work: Path, timeout: float, wall_factor: float = 5.0, quiet: bool = False):
        self.root, self.work, self.timeout, self.quiet = root, work, timeout, quiet
        self.wall_factor = wall_factor
        self.cli = f"{shlex.quote(sys.executable)} -m yggtree.cli"
        self.env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "API": API_SNIPPET, "PYTHONDONTWRITEBYTECODE": "1"}
        self.env.pop("PYTHONSTARTUP", None)
        self.setups = Setups(self)
        self.helps: dict[str, str] = {}
        self.saved: bytes | None = None

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def execute(self, argv: list[str], timeout: float, interrupt=None) -> dict:
        """Run ``argv`` in its own session in the scratch directory, bounded by ``timeout`` seconds
        of CPU time of its process group (a busy hang: compiling forever) or ``wall_factor`` times
        that of wall time (a hang that waits, or a machine too busy to tell); then the whole group
        is killed. A niced case on a loaded machine gets a small share of a core, so a budget of
        wall time alone would call slow starts hangs. ``interrupt(proc)`` (optional) is called
        while the command runs; both budgets count from its return."""
        t = time.perf_counter()
        cpu0 = children_cpu()
        proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        box: dict = {}
        reader = threading.Thread(target=lambda: box.update(zip(("out", "err"), proc.communicate())), daemon=True)
        reader.start()
        note = interrupt(proc) if interrupt else None
        t_wait, cpu_wait = time.perf_counter(), group_cpu(proc.pid) if interrupt else 0.0
        code: int | str | None = None
        while reader.is_alive():
            reader.join(0.5)
            if reader.is_alive() and (group_cpu(proc.pid) - cpu_wait > timeout
                                      or time.perf_counter() - t_wait > timeout * self.wall_factor):
                with _suppress():
                    os.killpg(proc.pid, signal.SIGKILL)
                reader.join()
                code = "timeout"
        if code is None:
            code = proc.returncode
        with _suppress():  # children the command left behind (compile workers ...)
            os.killpg(proc.pid, signal.SIGKILL)
        if interrupt:
            note = f"{note}; ended {time.perf_counter() - t_wait:.1f} s later" if code != "timeout" else \
                f"{note}; still running {time.perf_counter() - t_wait:.0f} s later (killed)"
        return {"exit": code, "stdout": box.get("out", b"").decode("utf-8", "replace"),
                "stderr": box.get("err", b"").decode("utf-8", "replace"),
                "wall_s": round(time.perf_counter() - t, 1), "cpu_s": round(children_cpu() - cpu0, 1),
                "note": note}

    def help_text(self, sub: str) -> str:
        if sub not in self.helps:
            res = self.execute(["bash", "-c", f"{self.cli} {sub} --help"], 120)
            self.helps[sub] = res["stdout"] if res["exit"] == 0 else ""
        return self.helps[sub]

    def unsupported(self, case: Case) -> str | None:
        for need in case.flags:
            sub, flag = need.split()
            text = self.help_text(sub)
            if not text:
                return f"no `{sub}` command"
            if flag not in text.split() and flag + "," not in text and f"{flag} " not in text:
                return f"no `{sub} {flag}` flag"
        return None

    # --- changes to the scratch directory around a case

    def _package(self) -> Path:
        return sorted((self.work / "compile" / "plain").rglob("*.pt2"))[0]

    def truncate_package(self) -> None:
        f = self._package()
        self.saved_path, self.saved = f, f.read_bytes()
        f.write_bytes(self.saved[: len(self.saved) // 2])

    def remove_package(self) -> None:
        f = self._package()
        self.saved_path, self.saved = f, f.read_bytes()
        f.unlink()

    def truncate_manifest(self) -> None:
        f = self.work / "compile" / "plain" / "manifest.json"
        self.saved_path, self.saved = f, f.read_bytes()
        f.write_bytes(self.saved[: len(self.saved) // 2])

    def restore_package(self) -> None:  # (or the manifest)
        self.saved_path.write_bytes(self.saved)
        os.utime(self.saved_path)

    def sigint_mid_compile(self, proc) -> str:
        """Wait until the forced compile has cleared the old artifacts (its manifest is gone), give
        it a few seconds into compiling, then Ctrl-C its process group."""
        art = self.work / "compile" / "plain"
        t0 = time.perf_counter()
        while proc.poll() is None and (art / "manifest.json").exists() and time.perf_counter() - t0 < 600:
            time.sleep(0.2)
        time.sleep(SIGINT_DELAY_S)
        if proc.poll() is not None:
            return f"ended before the interrupt (exit {proc.returncode})"
        os.killpg(proc.pid, signal.SIGINT)
        return f"SIGINT {time.perf_counter() - t0:.0f} s after start ({SIGINT_DELAY_S:.0f} s after the manifest went)"

    def run_case(self, case: Case) -> dict:
        row = {"name": case.name, "what": case.what, "cmd": case.cmd, "expect": case.expect}
        why = self.unsupported(case)
        for need in case.needs:
            why = why or (self.setups.need(need) and f"setup failed: {self.setups.need(need)}")
        if why:
            row.update(status="unsupported" if why.startswith("no ") else "setup-failed", reason=why)
            return row
        if case.before:
            getattr(self, case.before)()
        try:
            cmd = case.cmd.replace("yggtree ", f"{self.cli} ").replace("python -c", shlex.quote(sys.executable) + " -c")
            res = self.execute(["bash", "-c", cmd], case.timeout or self.timeout,
                               self.sigint_mid_compile if case.expect == "interrupted" else None)
        finally:
            if case.after:
                getattr(self, case.after)()
        err = res["stderr"]
        lines = [ln for ln in err.splitlines()]
        row.update(
            status="ran", exit=res["exit"], wall_s=res["wall_s"], cpu_s=res["cpu_s"], stderr_lines=len(lines),
            one_line=len(lines) == 1 and err.endswith("\n"), traceback="Traceback (most recent call last)" in err,
            stderr_last=(lines[-1] if lines else "")[:300], stderr_head="\n".join(lines[:3])[:600],
            stdout_head=res["stdout"][:200], note=res["note"],
            # progress output first, then one error line last (long commands): the error is one line
            one_error=(not lines[:-1] or not any(ERROR.match(ln) for ln in lines[:-1])) and bool(lines)
            and bool(ERROR.match(lines[-1])),
        )
        row["verdict"] = verdict(row)
        return row


SIGINT_DELAY_S = 8.0
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) children and their own waited-for ones."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def group_cpu(pgid: int) -> float:
    """CPU seconds the live processes of group ``pgid`` used, with their finished children's (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # pgrp; then utime, stime, cutime, cstime are fields 11-14
            total += sum(int(x) for x in fields[11:15])
    return total / CLK_TCK
ERROR = re.compile(r"^(yggtree[\w -]*: (error: |interrupted)|YggError: )")


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError, OSError))


def verdict(row: dict) -> str:
    """'ok' when the case did what a user is due, else what went wrong."""
    if row.get("status") != "ran":
        return row.get("status", "?")
    code, expect = row["exit"], row["expect"]
    if code == "timeout":
        return "timeout"
    if row["traceback"]:
        return "traceback"
    if expect in ("refuse", "interrupted"):
        if code == 0:
            return "accepted" if expect == "refuse" else "not interrupted"
        if row["one_line"]:
            return "ok"
        return "ok (after progress output)" if row["one_error"] else f"{row['stderr_lines']} lines"
    if expect == "quiet":
        return "ok" if code in (0, 141) and row["stderr_lines"] == 0 else f"exit {code}, {row['stderr_lines']} lines"
    return "ok" if code == 0 else f"exit {code}"


# ----------------------------------------------------------------------------- reporting


# the merged table's abbreviations of the repeated parts of the command lines
ABBREVIATIONS = {
    "$RUN": RUN, "$P": P, "$T_ARGS": TRANSCRIPT_ARGS, "$D_ARGS": DISTILL_ARGS,
    "API": "the snippet API_SNIPPET in scripts/reliability_cases.py: an engine on the tiny model, drafter self",
}


def show_cmd(cmd: str, short: bool = False) -> str:
    cmd = cmd.replace("python -c \"$API\" model", "python -c API model")
    if short:
        for k in ("$RUN", "$P", "$T_ARGS", "$D_ARGS"):
            cmd = cmd.replace(ABBREVIATIONS[k], k)
    return cmd


def cell(row: dict | None) -> str:
    if row is None:
        return "(not run)"
    if row["status"] != "ran":
        return f"n/a: {row['reason']}"
    code = row["exit"]
    if code == "timeout":
        return f"**timeout** ({row['wall_s']:.0f} s, {row.get('cpu_s', 0):.0f} s CPU)"
    what = "traceback" if row["traceback"] else ("1 line" if row["one_line"] else f"{row['stderr_lines']} lines")
    if not row["one_line"] and row.get("one_error") and not row["traceback"]:
        what = f"{row['stderr_lines']} lines (progress, then 1 error line)"
    return f"{code}, {what}, {row['wall_s']:.0f} s ({row.get('cpu_s', 0):.0f} s CPU)"


def message(row: dict | None, width: int = 110) -> str:
    if not row or row.get("status") != "ran":
        return ""
    text = row["stderr_last"] if row["exit"] != 0 or row["expect"] == "interrupted" else (
        row["stdout_head"].strip().splitlines() or [""])[0]
    if row["traceback"]:
        text = row["stderr_last"]
    text = text.replace("|", "\\|").replace("`", "'")
    return text[:width] + ("..." if len(text) > width else "")


def markdown(result: dict) -> str:
    head = ["| case | command | expected | exit, stderr, time | verdict | last stderr line (or stdout) |",
            "|---|---|---|---|---|---|"]
    for r in result["cases"]:
        head.append(f"| {r['name']} | `{show_cmd(r['cmd']).replace('|', chr(92) + '|')}` | {r['expect']} | {cell(r)} | "
                    f"{r.get('verdict', r['status'])} | {message(r)} |")
    return "\n".join(head)


def merged(before: dict, after: dict) -> str:
    b = {r["name"]: r for r in before["cases"]}
    lines = [f"`{k}` = `{v}`" if k != "API" else f"`{k}` = {v}" for k, v in ABBREVIATIONS.items()]
    lines = ["Abbreviations: " + "; ".join(lines) + ".", "",
             "| case | command | before: exit, stderr, time | before: last stderr line | after: exit, stderr, time "
             "| after: last stderr line (or stdout) |",
             "|---|---|---|---|---|---|"]
    order = {c.name: i for i, c in enumerate(CASES)}
    for r in sorted(after["cases"], key=lambda r: order.get(r["name"], len(order))):
        old = b.get(r["name"])
        lines.append(f"| {r['name']} | `{show_cmd(r['cmd'], short=True).replace('|', chr(92) + '|')}` | {cell(old)}{' ' + verdict_mark(old)} | "
                     f"{message(old, 70)} | {cell(r)}{' ' + verdict_mark(r)} | {message(r, 120)} |")
    return "\n".join(lines)


def verdict_mark(row: dict | None) -> str:
    if not row or row.get("status") != "ran":
        return ""
    v = row["verdict"]
    return "✓" if v.startswith("ok") else f"✗ {v}"


def summary(result: dict) -> dict:
    counts: dict[str, int] = {}
    for r in result["cases"]:
        v = r.get("verdict", r["status"])
        counts[v] = counts.get(v, 0) + 1
    return counts


def machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "python": platform.python_version()}


def git_commit(root: Path) -> str:
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")


def load_results(files: str) -> dict:
    """Results from comma-separated JSON files: a later file's rows replace the earlier ones'
    (a rerun of some cases), new rows are appended."""
    res = None
    for f in files.split(","):
        part = json.loads(Path(f).read_text())
        if res is None:
            res = part
            continue
        rows = {r["name"]: i for i, r in enumerate(res["cases"])}
        for r in part["cases"]:
            if r["name"] in rows:
                res["cases"][rows[r["name"]]] = r
            else:
                res["cases"].append(r)
        res["commit"] = res["commit"] if res["commit"] == part["commit"] else f"{res['commit']}; {part['commit']}"
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(HERE), help="checkout whose yggtree is tested (default: this one)")
    p.add_argument("--out", default=None, help="JSON file of the results")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="CPU seconds per case (some cases set their own); wall time: --wall-factor x that")
    p.add_argument("--wall-factor", type=float, default=5.0)
    p.add_argument("--only", default=None, help="comma-separated case names or globs")
    p.add_argument("--list", action="store_true", help="list the cases")
    p.add_argument("--merge", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"),
                   help="print the before/after table (each a comma-separated list: later files' rows win)")
    args = p.parse_args(argv)
    if args.list:
        for c in CASES:
            print(f"{c.name:34s} {c.what}")
        return 0
    if args.merge:
        before, after = (load_results(f) for f in args.merge)
        print(f"before: {before['commit']}; after: {after['commit']}\n")
        print(merged(before, after))
        print(f"\nbefore: {summary(before)}\nafter: {summary(after)}")
        return 0
    # a command started in the background by a shell without job control inherits SIGINT ignored,
    # and Python then never raises KeyboardInterrupt: give the cases a Ctrl-C that works
    # (exec resets a handled signal to its default; an ignored one stays ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = Path(args.root).resolve()
    cases = CASES
    if args.only:
        pats = args.only.split(",")
        cases = [c for c in CASES if any(fnmatch.fnmatch(c.name, pat) for pat in pats)]
    tmp = None
    if args.work:
        work = Path(args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="yggtree-reliability-")
        work = Path(tmp.name)
    runner = Runner(root, work, args.timeout, args.wall_factor)
    probe = runner.execute([sys.executable, "-c", "import yggtree; print(yggtree.__file__)"], 120)
    where = probe["stdout"].strip()
    if probe["exit"] != 0 or not Path(where).resolve().is_relative_to(root):
        print(f"yggtree imports from {where or probe['stderr'][-300:]!r}, not from {root}", file=sys.stderr)
        return 1
    runner.log(f"yggtree from {where}; scratch directory {work}")
    result = {"root": str(root), "commit": git_commit(root), "yggtree_file": where,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "timeout_cpu_s": args.timeout, "wall_factor": args.wall_factor, "cases": []}
    t0 = time.perf_counter()
    for case in cases:
        row = runner.run_case(case)
        result["cases"].append(row)
        runner.log(f"{case.name}: {cell(row)} -> {row.get('verdict', row['status'])}  {message(row)[:90]}")
        if args.out:  # written after every case: a long run can be read while it goes on
            Path(args.out).write_text(json.dumps(result, indent=1))
    result["setups"] = runner.setups.done
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"\n{summary(result)}; {result['wall_s']:.0f} s; commit {result['commit']}; {result['machine']}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("reliability_cases", lambda _: main(), None))
