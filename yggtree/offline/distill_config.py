"""Every knob of one ``yggtree distill`` run (:class:`DistillConfig`, written verbatim into the
manifest) and its checks. Each stage of the pipeline (teacher data, training, evaluation) reads it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YggError


@dataclass(frozen=True)
class DistillConfig:
    """Every knob of one distillation run (written verbatim into the manifest)."""

    model: str = "default"
    out: str = "drafter-out"
    seed: int = 0
    # data
    prompts: int = 640  # calibration chat prompts answered by the target
    snippet_chars: int = 400  # max characters of the calibration snippet inside each prompt
    prompt_style: str = "basic"  # request templates (data.PROMPT_STYLES): basic | varied
    max_new_tokens: int = 128  # greedy answer length cap
    gen_batch: int = 16  # rows per batched generation call
    teacher_dtype: str = "bfloat16"  # dtype of the target while building teacher data
    max_seq_len: int = 640  # training window (tokens); longer sequences are cut
    val_frac: float = 0.04  # held-out sequences (validation loss, acceptance estimate)
    cache_dir: str | None = None  # teacher data cache (default ~/.cache/yggtree/distill)
    text_chars: int = 0  # raw calibration text (calibration_texts) teacher-forced, in characters
    text_batch: int = 8  # sequences per teacher-forcing forward
    # head
    draft_vocab: int = 8192
    # target layers whose outputs the head reads (negative: from the end; -1 the last). Several:
    # their features are RMS-scaled, concatenated and reduced to H (EAGLE-3's feature fusion)
    target_layers: tuple[int, ...] = (-1,)
    reduce_init: str = "last"  # several layers: start the reduction as the last layer alone (or random)
    init_from_target: bool = True  # norm + LM head rows initialised from the target's
    fc_init: str = "random"  # identity: fc passes f_p through (f_{p+1} ~ f_p), block damped
    input_norm: bool = True  # RMSNorm on the embedding and the feature before fc
    draft_layers: int = 1  # decoder layers of the head
    init_from: str | None = None  # warm start: an EAGLE head directory of this shape (and its draft vocabulary)
    # training
    epochs: float = 2.0
    batch_size: int = 4  # sequences per step
    lr: float = 6e-4
    min_lr_frac: float = 0.05
    warmup_frac: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    unroll: int = 2  # training-time-test steps
    unroll_decay: float = 0.8  # loss weight of step k: decay**k
    ce_weight: float = 1.0
    reg_weight: float = 1.0
    prompt_weight: float = 0.5  # loss weight of positions inside the prompt (answers: 1)
    feature_noise: float = 0.0  # uniform noise on the true input features, x feature std
    eval_depth: int = 6  # depth of the offline acceptance estimate
    eval_every: int = 80  # training steps between validation passes
    save_dtype: str = "bfloat16"
    train_autocast: str = "bfloat16"  # matmul dtype of the training forward (none | bfloat16)
    threads: int | None = None
    # transcript training (yggtree transcripts): shards replace the calibration prompts
    transcripts: str | None = None  # directory of train-*.safetensors (and heldout-*.safetensors)
    max_tokens: int | None = None  # use train shards in index order up to this many tokens
    heldout_seqs: int = 96  # held-out conversations in each validation pass (heldout shards)
    feature_cache: str | None = None  # default ~/.cache/yggtree/features
    # resumable training
    checkpoint_every: int = 200  # steps between checkpoints (out/checkpoint.pt)
    budget_minutes: float | None = None  # stop after this much training, checkpointed; rerun continues


def check_config(cfg: DistillConfig) -> None:
    checks = [
        (cfg.prompts >= 2, f"prompts must be >= 2, got {cfg.prompts}"),
        (cfg.max_new_tokens >= 1, f"max-new-tokens must be >= 1, got {cfg.max_new_tokens}"),
        (cfg.gen_batch >= 1, f"gen-batch must be >= 1, got {cfg.gen_batch}"),
        (cfg.max_seq_len >= 8, f"max-seq-len must be >= 8, got {cfg.max_seq_len}"),
        (0 <= cfg.val_frac < 1, f"val-frac must be in [0, 1), got {cfg.val_frac}"),
        (cfg.epochs > 0, f"epochs must be > 0, got {cfg.epochs}"),
        (cfg.batch_size >= 1, f"batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.lr > 0, f"lr must be > 0, got {cfg.lr}"),
        (cfg.unroll >= 1, f"unroll must be >= 1, got {cfg.unroll}"),
        (cfg.eval_depth >= 1, f"eval-depth must be >= 1, got {cfg.eval_depth}"),
        (cfg.save_dtype in ("float32", "bfloat16"), f"save-dtype must be float32 or bfloat16, got {cfg.save_dtype}"),
        (cfg.fc_init in ("identity", "random"), f"fc-init must be identity or random, got {cfg.fc_init}"),
        (cfg.train_autocast in ("none", "bfloat16"), f"train-autocast must be none or bfloat16, got {cfg.train_autocast}"),
        (cfg.teacher_dtype in ("float32", "bfloat16"), f"teacher-dtype must be float32 or bfloat16, got {cfg.teacher_dtype}"),
        (cfg.snippet_chars >= 50, f"snippet-chars must be >= 50, got {cfg.snippet_chars}"),
        (cfg.max_tokens is None or cfg.max_tokens >= 1, f"max-tokens must be >= 1, got {cfg.max_tokens}"),
        (cfg.heldout_seqs >= 1, f"heldout-seqs must be >= 1, got {cfg.heldout_seqs}"),
        (cfg.checkpoint_every >= 1, f"checkpoint-every must be >= 1, got {cfg.checkpoint_every}"),
        (cfg.budget_minutes is None or cfg.budget_minutes > 0, f"budget-minutes must be > 0, got {cfg.budget_minutes}"),
        (cfg.reduce_init in ("last", "random"), f"reduce-init must be last or random, got {cfg.reduce_init}"),
        (cfg.draft_layers >= 1, f"draft-layers must be >= 1, got {cfg.draft_layers}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise YggError(msg)
