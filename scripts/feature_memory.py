"""Peak memory and step time of ``yggtree distill --transcripts`` on synthetic features (issue #19).

No real model: a small random target, random token shards and random float16 features written
straight into a feature cache (as ``yggtree transcripts`` or the prefill would leave them).

    python scripts/feature_memory.py prepare --dir /tmp/ygg_fm --tokens 200000   # ~300 MB of features
    python scripts/feature_memory.py train --dir /tmp/ygg_fm --steps 40          # one process
    torchrun --standalone --nproc-per-node 2 scripts/feature_memory.py train --dir /tmp/ygg_fm --steps 40

``train`` prints one JSON line per process: VmHWM / VmRSS / RssAnon / RssFile (kB, from
/proc/self/status; RssFile counts page-cache pages of the feature files this process touched,
shared with every other process mapping them) and Pss / Pss_Anon / Pss_File (kB,
/proc/self/smaps_rollup: shared pages divided among the processes that map them), at the start,
their maxima sampled before every training step and at the end of training (the data still
held), and after the run; the mean training step time (s, steps after the first) and the mean
time of assembling a batch (``make_batch``: the data loading part).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HIDDEN, VOCAB, SEQ, PROMPT = 256, 512, 240, 40
LAYERS = (0, 1, -1)


def target():
    from yggtree.runtime.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=HIDDEN // 4, tie_word_embeddings=True, eos_token_ids=(2,))
    torch.manual_seed(0)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m.eval().requires_grad_(False)


def make_shard(index: int, n_seq: int, fp: str):
    from yggtree.offline import transcripts as tr

    g = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(3, VOCAB, (n_seq * SEQ,), generator=g)
    role = torch.ones(n_seq, SEQ, dtype=torch.uint8)
    role[:, :PROMPT] = tr.ROLE_PROMPT
    role = role.flatten()
    offsets = torch.arange(n_seq + 1, dtype=torch.int64) * SEQ
    meta = {"format": tr.SHARD_FORMAT, "target_fingerprint": fp, "tokenizer_fingerprint": "synthetic",
            "vocab_size": VOCAB, "counts": {"requests": n_seq}, "sequences": [],
            "sha256": tr.tensors_sha256(tokens, offsets, role)}
    return tr.Shard(tokens, offsets, role, meta)


def prepare(args) -> None:
    from yggtree.offline import transcripts as tr
    from yggtree.offline.distill_data import target_fingerprint
    from yggtree.offline.teacher_data import FeatureLayout

    t = target()
    fp = target_fingerprint(t)
    layout = FeatureLayout.make(LAYERS, t.cfg.num_layers, HIDDEN)
    root = Path(args.dir)
    per_shard = args.tokens // args.shards // SEQ
    jobs = [("train", k, per_shard) for k in range(args.shards)] + [("heldout", 0, 32)]
    for split, k, n_seq in jobs:
        sh = make_shard(k + (10_000 if split == "heldout" else 0), n_seq, fp)
        tr.save_shard(sh, root / "shards" / f"{split}-{k:05d}.safetensors")
        g = torch.Generator().manual_seed(k)
        feats = (torch.randn(sh.n_tokens, layout.width, generator=g) * 4).to(torch.float16)
        path = tr.feature_path(root / "features", sh, layout.stored, "float32")
        if hasattr(tr, "feature_identity"):
            tr.save_features(feats, path, tr.feature_identity(sh, fp, layout.stored, "float32"))
        else:  # an older yggtree (the in-memory feature buffer): no identity in the file
            tr.save_features(feats, path)
    size = sum(p.stat().st_size for p in (root / "features").rglob("*.safetensors"))
    print(json.dumps({"dir": str(root), "feature_bytes": size}))


def memory() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k = line.split(":")[0]
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[k] = int(line.split()[1])
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        k = line.split(":")[0]
        if k in ("Pss", "Pss_Anon", "Pss_File"):
            out[k] = int(line.split()[1])
    return out


def train(args) -> None:
    from yggtree.offline import distill as D
    from yggtree.offline import distill_config as DC
    from yggtree.offline import distill_train as DT
    from yggtree.offline import transcripts as tr

    torch.set_num_threads(1)
    t = target()
    root = Path(args.dir)
    n_seq = sum(tr.load_shard(p).n_seq for p in tr.shard_paths(root / "shards", "train"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    before = memory()
    calls: list[tuple[float, float]] = []
    peak: dict[str, int] = {}

    def sample() -> None:
        for k, v in memory().items():
            peak[k] = max(peak.get(k, 0), v)

    real, real_train = DT.make_batch, D.train

    def timed(*a, **k):
        sample()
        t0 = time.perf_counter()
        b = real(*a, **k)
        calls.append((t0, time.perf_counter() - t0))
        return b

    def train_then_sample(*a, **k):
        out = real_train(*a, **k)
        sample()  # the data are still held here
        return out

    DT.make_batch, D.train = timed, train_then_sample
    steps_per_epoch = -(-n_seq // args.batch_size)
    cfg = DC.DistillConfig(
        out=str(root / f"out-{args.tag}-w{world}"), transcripts=str(root / "shards"), feature_cache=str(root / "features"),
        target_layers=LAYERS, teacher_dtype="float32", draft_vocab=256, max_seq_len=SEQ, batch_size=args.batch_size,
        epochs=args.steps / steps_per_epoch, lr=1e-3, unroll=3, eval_depth=3, eval_every=10**6, heldout_seqs=8,
        checkpoint_every=10**6, train_autocast="none", save_dtype="float32", threads=1,
    )
    t0 = time.perf_counter()
    m = D.distill(cfg, target=t, tokenizer=None)
    wall = time.perf_counter() - t0
    after = memory()
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
    print(json.dumps({
        "tag": args.tag, "rank": int(os.environ.get("RANK", "0")), "world": world, "steps": len(calls),
        "wall_s": round(wall, 2), "step_s": round(sum(gaps) / max(len(gaps), 1), 4),
        "make_batch_s": round(sum(d for _, d in calls[1:]) / max(len(calls) - 1, 1), 4),
        "start_kB": before, "peak_in_training_kB": peak, "end_kB": after, "complete": bool(m.get("complete", True)),
    }), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["prepare", "train"])
    p.add_argument("--dir", required=True)
    p.add_argument("--tokens", type=int, default=200_000, help="prepare: train tokens (width 768 float16: 1.5 kB each)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tag", default="run")
    args = p.parse_args()
    (prepare if args.what == "prepare" else train)(args)
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    raise SystemExit(run_reporting("feature_memory", lambda _: main(), None))
