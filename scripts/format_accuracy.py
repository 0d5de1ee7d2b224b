#!/usr/bin/env python
"""Accuracy of each weight format against float32 (issue #20 item 4): what a format costs in
output, reported rather than hidden.

For every ``--formats`` entry (runtime/quant.py; ``float32`` is the reference) the target is
loaded in a float32 run with that weight format (on torch's kernels its products take bfloat16
activations; on the tiled kernel, ``--kernel tiled``, float32 ones: runtime/quant.py), or for
``bfloat16`` in a bfloat16 run (weights and activations); an entry ``FMT/kv=DTYPE`` runs format
FMT over a KV cache in DTYPE (a 16-bit cache of a float32 run: yggtree.shapes.kv_cache_dtype).
Each is measured on:

- greedy token agreement: plain greedy decoding (the engine, reference mode) of the first
  ``--prompts`` evaluation prompts (MT-Bench first turns, then HumanEval, chat template applied)
  for ``--tokens`` new tokens each, against float32's tokens: the fraction of positions equal,
  the mean length of the common prefix, and how many sequences are identical;
- perplexity on the calibration corpus (``yggtree.data.calibration_texts``: the standard
  library's sources and docs, decontaminated against the evaluation texts), teacher-forced in
  chunks of ``--ppl-window`` tokens, ``--ppl-texts`` texts.

Output: a table, then one JSON line (also written to ``--out``). One model is in memory at a time.

    python scripts/format_accuracy.py --formats float32,bfloat16,int8,int4,int4@64,gguf-native \\
        --prompts 20 --tokens 128 --ppl-texts 32 --out runs/format_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from yggtree.errors import run_reporting


def token_agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """How far ``got`` follows ``ref``, sequence by sequence: the fraction of positions (over
    ``ref``'s lengths) with equal tokens, the mean common-prefix length, identical sequences."""
    same = total = prefix = identical = 0
    for a, b in zip(ref, got, strict=True):
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
        p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += p
        identical += a == b
    return {"match": same / max(total, 1), "prefix_mean": prefix / max(len(ref), 1),
            "identical": identical, "sequences": len(ref)}


@torch.no_grad()
def perplexity(model, chunks: list[list[int]]) -> float:
    """exp of the mean next-token negative log-likelihood over ``chunks`` (each one causal
    forward from an empty cache)."""
    n, nll = 0, 0.0
    for ids in chunks:
        if len(ids) < 2:
            continue
        w = len(ids)
        model.setup_cache(1, w)
        pos = torch.arange(w)[None]
        mask = torch.ones(1, w, w, dtype=torch.bool).tril()
        logits = model.logits(model(torch.tensor([ids]), pos, pos, mask).hidden)[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="sum").item()
        n += w - 1
    return math.exp(nll / max(n, 1))


def greedy(model, prompts: list[list[int]], tokens: int, eos: tuple[int, ...] = ()) -> list[list[int]]:
    """Plain greedy decoding of every prompt (the engine in reference mode)."""
    from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams

    longest = max(len(p) for p in prompts) + tokens + 1
    engine = Engine(model, EngineConfig(mode="reference", max_context=longest,
                                              prefill_chunk=min(64, longest)), None, eos)
    return [engine.generate(p, SamplingParams(max_new_tokens=tokens)).token_ids for p in prompts]


def measure(load, formats: list[str], prompts: list[list[int]], tokens: int, chunks: list[list[int]],
            eos: tuple[int, ...] = (), done=None) -> dict:
    """``{format: {"agreement": ..., "perplexity": ...}}``; ``load(fmt)`` returns the model in
    format ``fmt`` (float32 is measured first: it is the reference); ``done(results so far)`` is
    called after each format."""
    order = ["float32", *(f for f in formats if f != "float32")]
    out, ref = {}, None
    for fmt in order:
        model = load(fmt)
        toks = greedy(model, prompts, tokens, eos)
        ref = toks if ref is None else ref
        out[fmt] = {"agreement": token_agreement(ref, toks), "perplexity": perplexity(model, chunks)}
        del model
        if done is not None:
            done(out)
    return out


def run_dtype(fmt: str) -> str:
    """The dtype a format runs in here: its own for bfloat16, float32 for the others."""
    return "bfloat16" if split_entry(fmt)[0] == "bfloat16" else "float32"


def split_entry(entry: str) -> tuple[str, str | None]:
    """``FMT/kv=DTYPE`` -> (FMT, DTYPE); a plain ``FMT`` -> (FMT, None)."""
    fmt, sep, kv = entry.partition("/kv=")
    return fmt, (kv if sep else None)


def loader(model_name: str, kernel: str = "torch"):
    """``load(fmt)`` for the real model: a float32 run, ``fmt`` weights (prepare.quantize_models);
    ``bfloat16``: the model in bfloat16. ``kernel`` ``torch``: quantized layers on torch's kernels,
    float ones on ``F.linear``; ``tiled``: every product on the tiled kernel, as an engine whose
    profile chose it runs them (prepare.pack_models)."""
    from yggtree.runtime.prepare import pack_models, quantize_models
    from yggtree.runtime.loading import load_model, resolve_model
    from yggtree.runtime.model import set_kv_dtype
    from yggtree.shapes import kv_cache_dtype

    src = resolve_model(model_name)

    def load(entry: str):
        fmt, kv = split_entry(entry)
        m = load_model(src, run_dtype(fmt))
        set_kv_dtype(m, kv_cache_dtype(kv, run_dtype(fmt)))
        if kernel == "tiled":
            pack_models(m, None, weights=None if fmt in ("float32", "bfloat16") else fmt, src=src, kernel="tiled")
        else:
            quantize_models(m, None, fmt, src)  # float formats: nothing to do
        return m

    return load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--formats", default="float32,bfloat16,int8,int4,int4@64,gguf-native,w4a8")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ppl-texts", type=int, default=32)
    ap.add_argument("--ppl-window", type=int, default=256)
    ap.add_argument("--kernel", default="torch", choices=("torch", "tiled"),
                    help="the product kernel (runtime/packed.py KERNELS): torch's, or the tiled one for every product")
    ap.add_argument("--out", type=Path)
    return run_reporting("format_accuracy", run, ap.parse_args(argv))


def run(args) -> int:
    from yggtree.data import calibration_texts, load_prompts
    from yggtree.errors import YggError
    from yggtree.runtime.loading import load_config, load_tokenizer, resolve_model
    from yggtree.shapes import kv_cache_dtype, weight_format

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    src = resolve_model(args.model)
    cfg = load_config(src)
    for f in formats:  # refused before anything loads
        kv_cache_dtype(split_entry(f)[1], run_dtype(f))
        _, group = weight_format(split_entry(f)[0], run_dtype(f))
        widths = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
        if group is not None and any(w % group for w in widths):
            raise YggError(f"weights {f}: the group size does not divide the model's input widths {widths}")
    tok = load_tokenizer(src)
    n_mt = min(args.prompts, 80)
    prompts = [ids for _, ids in load_prompts(n_mt, args.prompts - n_mt, tok)]
    chunks = []
    for text in calibration_texts()[: args.ppl_texts]:
        ids = tok(text)["input_ids"]
        chunks += [ids[i : i + args.ppl_window] for i in range(0, len(ids), args.ppl_window)]
    eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    torch.manual_seed(0)
    head = {"model": args.model, "prompts": len(prompts), "tokens": args.tokens,
            "ppl_tokens": sum(len(c) for c in chunks), "kernel": args.kernel}

    def done(res: dict) -> None:  # each format's result kept as it comes: a long run loses nothing
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**head, "formats": res, "partial": True}) + "\n")

    res = measure(loader(args.model, args.kernel), formats, prompts, args.tokens, chunks, eos, done)
    print(f"{'format':<14} {'match':>7} {'prefix':>8} {'identical':>10} {'ppl':>9}")
    for fmt, r in res.items():
        a = r["agreement"]
        print(f"{fmt:<14} {a['match']:>7.3f} {a['prefix_mean']:>8.1f} "
              f"{a['identical']:>4}/{a['sequences']:<5} {r['perplexity']:>9.3f}")
    line = json.dumps({**head, "formats": res, "partial": False})
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
