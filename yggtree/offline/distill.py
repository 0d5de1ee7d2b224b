"""Train an EAGLE-style drafter head for a target by distillation (``yggtree distill``).

Pipeline (every stage deterministic given ``--seed``; docs/design.md sections 11 and 12)::

    calibration chat prompts        data.calibration_chat_prompts (stdlib source / pydoc topics,
      (chat template)               decontaminated against the evaluation prompts)
    teacher data                    the target answers each prompt greedily (batched, static
                                    cache); the features f_p of prompt and answer (the
                                    ``--target-layers`` outputs, plus the last layer for the
                                    training targets) are captured in the same pass ->
                                    safetensors cache on disk
    draft vocabulary                the V_d most frequent target ids in the teacher data, plus
                                    every special token (<|im_end|>, ...)
    training                        the head sees pairs (t_{p+1}, f_p) and is trained to
                                      - match the target's next-token distribution restricted to
                                        the draft vocabulary (soft cross-entropy = KL + const)
                                      - regress the target's next feature f_{p+1} (smooth L1)
                                    unrolled over ``--unroll`` draft steps: step k feeds the
                                    head's own predicted features exactly as a chain of depth k
                                    does at run time (EAGLE-3's "training-time test")
    output                          config.json + model.safetensors (save_eagle), manifest.json,
                                    report/{loss.png, acceptance.png, train_log.csv,
                                    acceptance.csv}

The target's distribution is never stored: with the last-layer feature ``f`` the target's logits
are ``lm_head(norm(f))``, recomputed on the draft vocabulary for each training batch.

Teacher data cache: ``<cache-dir>/<key>/teacher.safetensors`` where ``key`` hashes the target's
weights fingerprint, the prompt texts and the generation parameters; its sha256 goes into the
manifest. A second run with the same data options reuses it (training only).

Pair/slot layout of the head (see runtime/eagle.py): pair ``p`` is ``(t_{p+1}, f_p)`` at RoPE
position ``p``; its output predicts ``f_{p+1}`` and the target's distribution at position
``p + 1`` (i.e. of ``t_{p+2}``). In the unrolled step ``k`` pair ``p`` reads the step ``k-1``
output at pair ``p-1`` instead of ``f_p`` and attends to the step-0 keys of pairs ``<= p-k`` and
to the step-``j`` key of pair ``p-k+j`` for ``j = 1..k``: the path of a depth-``k`` draft node.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import YggError, run_reporting
from ..files import file_sha256
from ..progress import stderr_progress
from ..runtime.loading import load_model, load_tokenizer, resolve_model
from .distill_config import DistillConfig, check_config
from .distill_data import (
    build_draft_vocab,
    prompt_data,
    rank_and_world,
    special_ids,
    target_fingerprint,
    transcript_data,
    vocab_coverage,
)
from .distill_eval import write_report
from .distill_loss import TargetHead
from .distill_train import (
    CHECKPOINT_FILE, checkpoint_identity, grow_layers, init_head, join_process_group, train, warm_start_head,
)
from .teacher_data import FeatureLayout


def _progress():
    return stderr_progress()


def _load_target(cfg: DistillConfig, target, tokenizer):
    """``(target, tokenizer, model_path)``: the given tiny target (tests), else ``cfg.model`` in
    float32 (model_path: its file, for the manifest)."""
    if target is not None:
        return target, tokenizer, None
    src = resolve_model(cfg.model)
    return load_model(src, "float32"), load_tokenizer(src), str(src.path)


def _new_head(cfg: DistillConfig, target, layout: FeatureLayout, vmap: torch.Tensor, base):
    """The EAGLE head to train: ``base``'s weights (``--init-from``) or a fresh initialisation,
    over the draft vocabulary ``vmap``; its net is in training mode."""
    from ..runtime.eagle import EagleDrafter

    drafter = EagleDrafter.random(
        target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll), draft_vocab=vmap,
        seed=cfg.seed, target_layers=layout.inputs, input_norm=cfg.input_norm,
        num_layers=cfg.draft_layers,
    )
    net = drafter.net
    if base is not None:
        grow_layers(net, base.net)
    else:
        init_head(net, target, vmap, cfg, layout)
    net.train().requires_grad_(True)
    return net


def _target_head(target, vmap: torch.Tensor) -> TargetHead:
    """The target's final norm and LM head (full and on the draft vocabulary) in float32."""
    w = target.lm_head.weight.detach()
    return TargetHead(norm_weight=target.norm.weight.detach().float(), eps=target.cfg.rms_norm_eps,
                      w_draft=w[vmap].float(), w_full=w.float())


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / max(len(rows), 1)


def _training_record(log: dict, ev: dict) -> dict:
    """The manifest's ``training``: steps, feature scale, the last 20 logged steps' means, validation."""
    tail = log.get("curve", [])[-20:]
    return {"steps": log.get("steps"), "steps_per_epoch": log.get("steps_per_epoch"),
            "feature_scale": log.get("feat_scale"), "train_loss": _mean(tail, "loss"),
            "train_kl": _mean(tail, "kl"), "train_top1": _mean(tail, "top1"), "val": ev}


def _target_record(cfg: DistillConfig, tc, model_path: str | None, fp: str, layout: FeatureLayout) -> dict:
    return {"model": cfg.model, "file": Path(model_path).name if model_path else None,
            "fingerprint": fp, "feature_layers": list(layout.inputs),
            "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size, "num_layers": tc.num_layers}


def distill(
    cfg: DistillConfig,
    argv: list[str] | None = None,
    target=None,
    tokenizer=None,
    prompt_ids: list[list[int]] | None = None,
) -> dict:
    """The whole pipeline; returns the manifest. ``target``, ``tokenizer`` and ``prompt_ids``
    (token ids of chat-templated prompts) may be given directly: tests use a tiny random target.

    It reads better whole: one pipeline in the order it runs (data, draft vocabulary, head,
    training, the head saved, the manifest), whose steps share a dozen values the manifest
    records; split, each part would take most of them as arguments."""
    from ..runtime.eagle import EagleDrafter, save_eagle

    check_config(cfg)
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise YggError(f"threads must be >= 1, got {cfg.threads}")
        torch.set_num_threads(cfg.threads)
    join_process_group()
    t_start = time.perf_counter()
    out = Path(cfg.out).expanduser()
    target, tokenizer, model_path = _load_target(cfg, target, tokenizer)
    tc = target.cfg
    layout = FeatureLayout.make(tuple(cfg.target_layers), tc.num_layers, tc.hidden_size)
    progress = _progress()
    with progress:
        t0 = time.perf_counter()
        if cfg.transcripts is not None:
            data, train_idx, val_idx, data_info = transcript_data(cfg, target, tokenizer, layout, progress)
        else:
            data, train_idx, val_idx, data_info = prompt_data(cfg, target, tokenizer, prompt_ids, layout, progress)
        data_s = time.perf_counter() - t0
        fp = target_fingerprint(target)
        train_tokens = torch.cat([data.seq(i)[0] for i in train_idx])
        val_tokens = torch.cat([data.seq(i)[0] for i in val_idx]) if val_idx else torch.zeros(0, dtype=torch.int64)

        specials = special_ids(tokenizer, tc)
        v_d = min(cfg.draft_vocab, tc.vocab_size)
        base = warm_start_head(cfg, target, layout, v_d) if cfg.init_from is not None else None
        vmap = base.net.draft_vocab if base is not None else build_draft_vocab(train_tokens, tc.vocab_size, v_d, specials)
        net = _new_head(cfg, target, layout, vmap, base)
        torch.manual_seed(cfg.seed)
        log: dict = {}
        identity = checkpoint_identity(cfg, data_info["data_sha256"])
        if base is not None:
            identity["init_sha256"] = file_sha256(Path(cfg.init_from) / "model.safetensors")
        ev = train(net, _target_head(target, vmap), data, train_idx, val_idx, cfg, progress, log, layout,
                   out / CHECKPOINT_FILE, identity)
    if rank_and_world()[0] != 0:  # data-parallel: rank 0 writes the head
        return {"complete": bool(log.get("complete")), "rank": rank_and_world()[0]}
    if not log.get("complete"):
        return {"complete": False, "out": str(out), "data": {"n_tokens": int(data.tokens.shape[0])},
                "training": {"steps": None, "val": {}}, "wall_time_s": {"train": log.get("train_s"), "data": data_s}}

    net.eval().requires_grad_(False)
    if cfg.save_dtype == "bfloat16":
        net.to(torch.bfloat16)
    save_eagle(EagleDrafter(net, target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll)), out)
    write_report(out / "report", log.get("curve", []), ev)
    manifest = {
        "kind": "eagle-distill",
        "command": "yggtree distill " + " ".join(argv) if argv is not None else None,
        "seed": cfg.seed,
        "hyperparameters": asdict(cfg),
        "target": _target_record(cfg, tc, model_path, fp, layout),
        "data": data_info | {
            "n_sequences": data.n_seq,
            "n_tokens": int(data.tokens.shape[0]),
            "n_answer_tokens": int((data.role > 0).sum()),
            "n_train_sequences": len(train_idx),
            "n_val_sequences": len(val_idx),
            "n_train_tokens": int(train_tokens.shape[0]),
        },
        "draft_vocab": {
            "size": int(vmap.shape[0]),
            "specials": specials,
            "train_coverage": vocab_coverage(train_tokens, vmap, tc.vocab_size),
            "val_coverage": vocab_coverage(val_tokens, vmap, tc.vocab_size),
        },
        "training": _training_record(log, ev),
        "wall_time_s": {"data": data_s, "train": log.get("train_s"), "total": time.perf_counter() - t_start},
        "weights_dtype": cfg.save_dtype,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def run(args) -> int:
    """The ``distill`` subcommand. Returns the exit code."""
    cfg = _cfg_from_args(args)
    manifest = distill(cfg, getattr(args, "argv", None))
    if manifest.get("rank", 0) != 0:  # data-parallel: rank 0 reports and writes the head
        return 0
    if manifest.get("complete") is False:
        sys.stderr.write(f"stopped after the {cfg.budget_minutes} min budget; the checkpoint in {cfg.out} holds the "
                         "run: repeat the same command to continue\n")
        print(json.dumps({"distill": str(cfg.out), "complete": False}), flush=True)
        return 0
    tr = manifest["training"]
    ev = tr.get("val") or {}
    sys.stderr.write(
        f"wrote {cfg.out}: {manifest['data']['n_tokens']} teacher tokens, "
        f"{tr['steps']} steps in {manifest['wall_time_s']['train']:.0f} s, "
        f"val KL {ev.get('val_kl', float('nan')):.3f}, "
        f"est. chain-4 AAL {ev.get('est_chain4_aal', float('nan')):.2f}\n"
    )
    summary = {
        "distill": str(cfg.out),
        "n_tokens": manifest["data"]["n_tokens"],
        "train_s": manifest["wall_time_s"]["train"],
        "data_s": manifest["wall_time_s"]["data"],
        "val_kl": ev.get("val_kl"),
        "accept_by_depth": ev.get("accept_by_depth"),
        "est_chain4_aal": ev.get("est_chain4_aal"),
    }
    print(json.dumps(summary), flush=True)
    return 0


def _cfg_from_args(args) -> DistillConfig:
    fields = DistillConfig.__dataclass_fields__
    return DistillConfig(**{k: getattr(args, k) for k in fields if hasattr(args, k)})


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DistillConfig()
    p.add_argument("--model", default=d.model, help="target: 'default', a HF directory or a .gguf file")
    p.add_argument("--out", default=d.out, help="output directory (config.json, model.safetensors, manifest.json, report/)")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("teacher data")
    g.add_argument("--prompts", type=int, default=d.prompts, help="calibration chat prompts answered by the target")
    g.add_argument("--snippet-chars", type=int, default=d.snippet_chars)
    g.add_argument("--prompt-style", default=d.prompt_style, choices=["basic", "varied"],
                   help="request templates around the calibration snippets (varied: more kinds of request)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="answer length cap")
    g.add_argument("--gen-batch", type=int, default=d.gen_batch)
    g.add_argument("--teacher-dtype", default=d.teacher_dtype, choices=["float32", "bfloat16"],
                   help="target dtype while answering the prompts (bfloat16: faster on CPUs with AVX-512 BF16)")
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    g.add_argument("--val-frac", type=float, default=d.val_frac)
    g.add_argument("--cache-dir", default=None, help="teacher data cache (default ~/.cache/yggtree/distill)")
    g.add_argument("--text-chars", type=int, default=d.text_chars,
                   help="characters of raw calibration text teacher-forced through the target (cheap extra data)")
    g.add_argument("--text-batch", type=int, default=d.text_batch, help="sequences per teacher-forcing forward")
    g = p.add_argument_group("head")
    g.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="reduced draft vocabulary size")
    g.add_argument("--target-layers", type=_layer_list, default=d.target_layers, metavar="I[,J,...]",
                   help="target layers the head reads (negative: from the end). Several, e.g. 2,15,-1: "
                   "their features are fused as in EAGLE-3")
    g.add_argument("--reduce-init", default=d.reduce_init, choices=["last", "random"],
                   help="several layers: start the fusion as the last layer alone, or random")
    g.add_argument("--no-init-from-target", dest="init_from_target", action="store_false")
    g.add_argument("--no-input-norm", dest="input_norm", action="store_false",
                   help="feed the raw embedding and feature to fc (no RMSNorm on either)")
    g.add_argument("--fc-init", default=d.fc_init, choices=["identity", "random"],
                   help="identity: the fused input starts as the target feature itself")
    g.add_argument("--draft-layers", type=int, default=d.draft_layers, metavar="N",
                   help="decoder layers of the head (1: EAGLE's single layer)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="continue from this EAGLE head (same shape; its draft vocabulary is kept)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=d.epochs)
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--min-lr-frac", type=float, default=d.min_lr_frac)
    g.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g.add_argument("--unroll", type=int, default=d.unroll, help="training-time-test draft steps")
    g.add_argument("--unroll-decay", type=float, default=d.unroll_decay)
    g.add_argument("--ce-weight", type=float, default=d.ce_weight)
    g.add_argument("--reg-weight", type=float, default=d.reg_weight)
    g.add_argument("--prompt-weight", type=float, default=d.prompt_weight, help="loss weight inside prompts")
    g.add_argument("--feature-noise", type=float, default=d.feature_noise)
    g.add_argument("--eval-depth", type=int, default=d.eval_depth)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--train-autocast", default=d.train_autocast, choices=["none", "bfloat16"],
                   help="matmul dtype of the training forward")
    g.add_argument("--save-dtype", default=d.save_dtype, choices=["float32", "bfloat16"])
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g = p.add_argument_group("transcripts and resumable training")
    g.add_argument("--transcripts", default=None, metavar="DIR",
                   help="train on transcript shards (yggtree transcripts) instead of calibration prompts")
    g.add_argument("--max-tokens", type=int, default=None, help="train shards in index order up to this many tokens")
    g.add_argument("--heldout-seqs", type=int, default=d.heldout_seqs, help="held-out conversations per validation pass")
    g.add_argument("--feature-cache", default=None, help="default ~/.cache/yggtree/features")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    g.add_argument("--budget-minutes", type=float, default=None,
                   help="stop after this many minutes of training with a checkpoint; the same command continues")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``distill`` on a CLI's subparsers (help line, description, flags), handled by :func:`run`."""
    p = subparsers.add_parser(
        "distill",
        help="train an EAGLE-style drafter head for a target from the calibration corpus",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.offline.distill ...``: the same options as ``yggtree distill``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m yggtree.offline.distill", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run_reporting("yggtree distill", run, args)


if __name__ == "__main__":
    sys.exit(main())
