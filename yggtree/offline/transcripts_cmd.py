"""``yggtree transcripts``: generate teacher transcript shards (resumable, shardable).

    yggtree transcripts --out data/transcripts --shards 0:40            # shards 0..39 of split train
    yggtree transcripts --out data/transcripts --shards 0:40 --worker 1/2   # this process: odd shards
    yggtree transcripts --out data/transcripts --split heldout --shards 0:2

A shard already in ``--out`` (complete and for this target) is skipped, so an interrupted run
continues where it stopped; a shard is written only when complete (write-then-rename). ``--worker
i/n`` takes the shards whose index is ``i`` modulo ``n``: run it on several processes or machines
over the same range and copy the files together. Features of the stored target layers are cached
locally as a by-product (``--feature-cache``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from ..errors import YggError
from ..progress import PlainLog, stderr_progress
from . import transcripts as tr
from .distill_data import target_fingerprint

DEFAULT_LAYERS = (2, 15, -1)


def parse_range(text: str) -> range:
    """``A:B`` (half-open) or ``N`` (= ``0:N``)."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            r = range(int(a), int(b))
        else:
            r = range(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A:B, got {text!r}") from None
    if len(r) == 0 or r.start < 0:
        raise argparse.ArgumentTypeError(f"empty or negative shard range {text!r}")
    return r


def parse_worker(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected i/n, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"worker {text!r}: need 0 <= i < n")
    return i, n


def resolve_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Layer indices made non-negative, the last layer appended when absent (training targets)."""
    res = tuple(i if i >= 0 else num_layers + i for i in layers)
    if any(not 0 <= i < num_layers for i in res) or len(set(res)) != len(res):
        raise YggError(f"target-layers {list(layers)} are out of range or repeated for {num_layers} layers")
    return res if num_layers - 1 in res else res + (num_layers - 1,)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = tr.ShardSpec()
    p.add_argument("--model", default="default", help="target: 'default', a HF directory or a .gguf file")
    p.add_argument("--out", required=True, help="directory of the shard files")
    p.add_argument("--split", default=d.split, choices=["train", "heldout"])
    p.add_argument("--shards", type=parse_range, required=True, metavar="N|A:B", help="shard indices")
    p.add_argument("--worker", type=parse_worker, default=(0, 1), metavar="i/n",
                   help="take the shards with index = i mod n (several processes or machines)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--shard-size", type=int, default=d.size, help="conversations per shard")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="per answer")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help="rows per generation batch")
    p.add_argument("--teacher-dtype", default=d.teacher_dtype, choices=["float32", "bfloat16"])
    p.add_argument("--target-layers", default="2,15,-1", help="layers whose features are cached as a by-product")
    p.add_argument("--feature-cache", default=None, help="default: ~/.cache/yggtree/features")
    p.add_argument("--threads", type=int, default=None)


def run(args) -> int:
    from ..runtime.loading import load_model, load_tokenizer, resolve_model

    for name, v, lo in (("shard-size", args.shard_size, 2), ("max-new-tokens", args.max_new_tokens, 1),
                        ("gen-batch", args.gen_batch, 1), ("threads", args.threads or 1, 1)):
        if v < lo:
            raise YggError(f"{name} must be >= {lo}, got {v}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        layers_given = tuple(int(x) for x in args.target_layers.split(","))
    except ValueError:
        raise YggError(f"target-layers must be comma-separated integers, got {args.target_layers!r}") from None
    out = Path(args.out).expanduser()
    src = resolve_model(args.model)
    target = load_model(src, "float32")
    tokenizer = load_tokenizer(src)
    fp = target_fingerprint(target)
    tok_fp = tr.tokenizer_fingerprint(tokenizer)
    layers = resolve_layers(layers_given, target.cfg.num_layers)
    teacher = target if args.teacher_dtype == "float32" else copy.deepcopy(target).to(getattr(torch, args.teacher_dtype))
    del target
    cache = tr.feature_cache_root(args.feature_cache)
    i, n = args.worker
    todo = [k for k in args.shards if k % n == i]
    log = PlainLog(20.0)
    made, skipped, tokens = 0, 0, 0
    t0 = time.perf_counter()
    with stderr_progress() as progress:
        task = progress.add_task("transcript shards", total=len(todo))
        for k in todo:
            spec = tr.ShardSpec(args.split, k, args.seed, args.shard_size, args.max_new_tokens, args.gen_batch,
                                args.teacher_dtype)
            path = out / f"{spec.name()}.safetensors"
            if path.exists():
                shard = tr.load_shard(path, fp, tok_fp)
                if shard.meta["spec"] != spec.__dict__:
                    raise YggError(f"{path} was made with other settings ({shard.meta['spec']}); "
                                   f"use another --out or the same settings")
                skipped += 1
                progress.update(task, advance=1)
                continue
            ts = time.perf_counter()
            sub = progress.add_task(f"  {spec.name()} (tokens)", total=None)
            n_tok = [0]

            def on_tokens(rows: int, toks: int) -> None:
                n_tok[0] += toks
                rate = n_tok[0] / (time.perf_counter() - ts)
                progress.update(sub, advance=toks, description=f"  {spec.name()} ({rate:.0f} tok/s)")
                log(f"{spec.name()}: {n_tok[0]} tokens, {rate:.0f} tok/s")

            shard, feats = tr.build_shard(teacher, tokenizer, spec, fp, layers, log, on_tokens)
            tr.save_features(feats, tr.feature_path(cache, shard, layers, args.teacher_dtype),
                             tr.feature_identity(shard, fp, layers, args.teacher_dtype))
            tr.save_shard(shard, path)  # last: its presence marks the shard done
            progress.update(sub, visible=False)
            made += 1
            tokens += shard.n_tokens
            answer = int((shard.role > 0).sum())
            msg = (f"{path.name}: {shard.n_seq} conversations, {shard.n_tokens} tokens ({answer} generated) "
                   f"in {time.perf_counter() - ts:.0f} s; {json.dumps(shard.meta['counts'])}")
            log(msg, force=True)
            progress.update(task, advance=1)
    wall = time.perf_counter() - t0
    print(json.dumps({"out": str(out), "made": made, "skipped": skipped, "tokens": tokens, "wall_s": round(wall, 1),
                      "tok_per_s": round(tokens / wall, 1) if wall > 0 else None}), flush=True)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``transcripts`` on a CLI's subparsers (help line, description, flags), handled by :func:`run`."""
    p = subparsers.add_parser("transcripts", help="generate teacher transcript shards for drafter training",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


if __name__ == "__main__":
    from ..errors import run_reporting

    parser = argparse.ArgumentParser(prog="python -m yggtree.offline.transcripts_cmd")
    add_arguments(parser)
    a = parser.parse_args()
    a.argv = sys.argv[1:]
    sys.exit(run_reporting("yggtree transcripts", run, a))
