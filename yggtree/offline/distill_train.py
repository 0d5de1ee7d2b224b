"""Training of a ``yggtree distill`` head: its starting point (the target's rows, a damped block,
or a head to continue from), the AdamW loop with warm-up and cosine decay, data-parallel under
torchrun, and resumable checkpoints that end with the weights of an uninterrupted run."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import YggError
from ..files import atomic_path
from ..runtime.model import rope_table
from .distill_config import DistillConfig
from .distill_data import FeatureLayout, TeacherData, plain_log, rank_and_world
from .distill_eval import evaluate
from .distill_loss import TargetHead, feature_dim_std, make_batch, step_losses, train_autocast, unrolled_forward


@torch.no_grad()
def init_head(net, target, vmap: torch.Tensor, cfg: DistillConfig, layout: FeatureLayout) -> None:
    """The head's starting point: the target's norm and LM head rows (``init_from_target``), fc
    passing the feature through and every decoder layer damped (``fc_init`` identity), the fusion
    of several layers starting as the last layer alone (``reduce_init`` last)."""
    h = target.cfg.hidden_size
    if cfg.init_from_target:
        net.norm.weight.copy_(target.norm.weight)
        net.lm_head.weight.copy_(target.lm_head.weight[vmap])
    if cfg.fc_init == "identity":
        # the target's features are large (std ~40, outlier dims in the thousands for
        # SmolLM2): start from f̂_{p+1} = f_p and let the block learn the change
        net.fc.weight[:, h:].copy_(torch.eye(h))
        net.fc.bias.zero_()
        for block in net.layers:
            block.self_attn.o_proj.weight.mul_(0.1)
            block.mlp.down_proj.weight.mul_(0.1)
    if len(layout.inputs) > 1 and cfg.reduce_init == "last" and layout.last < len(layout.inputs):
        # the fused feature starts as the (RMS-scaled) last layer alone: the single-layer head's
        # starting point, from which the other layers' blocks learn what they add
        net.reduce.weight.zero_()
        net.reduce.weight[:, layout.last * h : (layout.last + 1) * h].copy_(torch.eye(h))


def warm_start_head(cfg: DistillConfig, target, layout: FeatureLayout, v_d: int):
    """The head ``cfg.init_from`` to continue training from; refused (one line naming the
    directory) unless it has the shape this run asks for."""
    from ..runtime.eagle import load_eagle

    base = load_eagle(cfg.init_from, target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll))
    hc = base.cfg
    for name, theirs, ours in (
        ("target layers", tuple(hc.target_layers), tuple(layout.inputs)),
        ("draft vocabulary", hc.draft_vocab_size, v_d),
        ("decoder layers", hc.num_layers, cfg.draft_layers),
        ("input norm", hc.input_norm, cfg.input_norm),
    ):
        if theirs != ours:
            raise YggError(f"--init-from {cfg.init_from}: the head has {name} {theirs}, this run asks for {ours}")
    base.net.float()
    return base


CHECKPOINT_FILE = "checkpoint.pt"
# settings that may change between a run and its resumption (they do not change the result)
RESUMABLE_FIELDS = ("out", "threads", "budget_minutes", "checkpoint_every", "cache_dir", "feature_cache")


def checkpoint_identity(cfg: DistillConfig, data_sha: str) -> dict:
    """What a checkpoint must match to be resumed: every result-changing setting and the data."""
    d = {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_FIELDS}
    d["target_layers"] = list(d["target_layers"])
    if d["draft_layers"] == 1:  # the default: checkpoints written before the option still resume
        del d["draft_layers"]
    if d["init_from"] is None:  # likewise
        del d["init_from"]
    return d | {"data_sha256": data_sha}


def save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, identity: dict) -> dict | None:
    """The checkpoint at ``path`` if there is one; refused (one line) when it belongs to another run."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=False)
        assert isinstance(state, dict) and "identity" in state
    except Exception:  # noqa: BLE001 - torch.load raises many types for damaged files
        raise YggError(f"cannot read checkpoint {path}: damaged or not a yggtree distill checkpoint "
                       "(delete it to start over)") from None
    theirs = state["identity"]
    diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
    if diff:
        k = diff[0]
        raise YggError(f"checkpoint {path} belongs to another run: {k} is {theirs.get(k)!r} there, "
                       f"{identity.get(k)!r} here (use another --out, or delete the checkpoint)")
    return state


def join_process_group() -> None:
    """Under torchrun (WORLD_SIZE > 1) join the process group: gloo on CPUs, nccl on GPUs."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _all_reduce_grads(params, world: int) -> None:
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def any_rank(flag: bool, world: int) -> bool:
    """True on every process when it is true on any: a decision (the time budget is used up) that
    the ranks must take at the same step, or the ones still training wait for gradients forever."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def train(
    net, th: TargetHead, data: TeacherData, train_idx, val_idx, cfg: DistillConfig, progress, log,
    layout: FeatureLayout, ckpt: Path | None = None, identity: dict | None = None,
) -> dict:
    """AdamW + linear warm-up + cosine decay; returns the final validation metrics (empty when the
    ``budget_minutes`` ran out first: ``log["complete"]`` is False and ``ckpt`` holds the state).

    With ``ckpt``, the state (weights, optimizer, data order, random state, log) is written there
    every ``checkpoint_every`` steps and at the end; a run started with a checkpoint present
    continues from it and ends with the same weights as an uninterrupted run. Under torchrun each
    rank takes its share of every batch and the gradients are averaged (gloo)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    rope = rope_table(net.cfg.layer_config(), cfg.max_seq_len + 8)
    params = [p for p in net.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    steps_per_epoch = math.ceil(len(train_idx) / cfg.batch_size)
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    warm = max(1, int(cfg.warmup_frac * total))

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    # feature scale for the regression loss (scale-free smooth L1)
    feat_scale = feature_dim_std(layout.last_layer(data.feats))
    log["feat_scale"] = {"dim_std_min": float(feat_scale.min()), "dim_std_max": float(feat_scale.max())}
    rank, world = rank_and_world()
    if cfg.batch_size % world:
        raise YggError(f"batch-size {cfg.batch_size} is not a multiple of the {world} processes")
    order: list[int] = []
    step = 0
    ema = None
    trained_s = 0.0
    state = load_checkpoint(ckpt, identity or {}) if ckpt is not None else None
    if state is not None:
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, order, ema, trained_s = state["step"], state["order"], state["ema"], state["trained_s"]
        log.update(state["log"])
        plain_log(f"resumed from {ckpt} at step {step}/{total}", force=True)
    rows = log.setdefault("curve", [])

    def checkpoint() -> None:
        if ckpt is not None and rank == 0:
            save_checkpoint(ckpt, {
                "identity": identity or {}, "net": net.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                "step": step, "order": order, "ema": ema, "trained_s": trained_s + time.perf_counter() - t0,
                "log": log,
            })

    task = progress.add_task("training", total=total, completed=step)
    t0 = time.perf_counter()
    budget_s = cfg.budget_minutes * 60 if cfg.budget_minutes is not None else None
    log["complete"] = step >= total
    while step < total:
        if not order:
            order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=gen).tolist()]
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        if world > 1:
            idx = idx[rank::world] or idx[:1]
        batch = make_batch(data, idx, cfg.max_seq_len, layout, cfg.prompt_weight)
        if cfg.feature_noise > 0:
            u = torch.rand(batch.feat.shape, generator=gen) * 2 - 1
            per_layer = batch.feat.unflatten(-1, (-1, layout.hidden))  # [B, T, L, H]
            rms = per_layer.pow(2).mean(-1, keepdim=True).sqrt().expand_as(per_layer).flatten(-2)
            batch.feat = batch.feat + u * (cfg.feature_noise * rms)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with train_autocast(cfg):
            outs = unrolled_forward(net, batch.tok, batch.feat, cfg.unroll, rope)
        loss, metrics = step_losses(net, th, outs, batch, feat_scale, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            _all_reduce_grads(params, world)
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        row = {
            "step": step,
            "epoch": step / steps_per_epoch,
            "lr": lr_at(step - 1),
            "loss": lv,
            "ce": metrics[0]["ce"],
            "kl": metrics[0]["kl"],
            "reg": metrics[0]["reg"],
            "top1": metrics[0]["top1"],
            "top1_last_step": metrics[-1]["top1"],
            "grad_norm": float(gnorm),
            "elapsed_s": trained_s + time.perf_counter() - t0,
            "tokens_seen": log.get("tokens_seen", 0) + int(batch.valid.sum()) * world,
        }
        log["tokens_seen"] = row["tokens_seen"]
        if val_idx and rank == 0 and (step % cfg.eval_every == 0 or step == total):
            net.eval()
            ev = evaluate(net, th, data, val_idx, cfg, feat_scale, rope, layout)
            row.update(val_ce=ev["val_ce"], val_kl=ev["val_kl"], val_reg=ev["val_reg"],
                       val_top1=ev["val_top1_by_step"][0], est_chain4_aal=ev["est_chain4_aal"],
                       est_tree4_aal=ev["est_tree4_aal"], walk_chain4_aal=ev["walk_chain4_aal"],
                       walk_tree4_aal=ev["walk_tree4_aal"])
            log["last_eval"] = ev
        rows.append(row)
        desc = (
            f"training (loss {ema:.3f}, top1 {metrics[0]['top1']:.2f}"
            + (f", val est. chain-4 AAL {log['last_eval']['est_chain4_aal']:.2f}" if "last_eval" in log else "")
            + ")"
        )
        progress.update(task, advance=1, description=desc)
        plain_log(f"{desc}: step {step}/{total}", force="val_kl" in row)
        over = budget_s is not None and step < total and any_rank(time.perf_counter() - t0 >= budget_s, world)
        if step % cfg.checkpoint_every == 0 or step == total or over:
            checkpoint()
        if over:
            log["train_s"] = trained_s + time.perf_counter() - t0
            plain_log(f"budget of {cfg.budget_minutes} min used: checkpoint at step {step}/{total}", force=True)
            return {}
    log["train_s"] = trained_s + time.perf_counter() - t0
    log["steps"] = total
    log["steps_per_epoch"] = steps_per_epoch
    log["complete"] = True
    return log.get("last_eval", {})
