"""Training of a ``yggtree distill`` head: its starting point (the target's rows, a damped block,
or a head to continue from), the AdamW loop with warm-up and cosine decay, data-parallel under
torchrun, and resumable checkpoints that end with the weights of an uninterrupted run."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import YggError
from ..files import atomic_path
from ..runtime.model import rope_table
from .distill_config import DistillConfig
from .distill_data import plain_log, rank_and_world
from .teacher_data import FeatureLayout, TeacherData
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
    directory) unless it has the shape this run asks for. It may have fewer decoder layers than
    the run asks for: the run then grows it (:func:`grow_layers`)."""
    from ..runtime.eagle import load_eagle

    base = load_eagle(cfg.init_from, target, "reference", max_depth=max(cfg.eval_depth, cfg.unroll))
    hc = base.cfg
    for name, theirs, ours in (
        ("target layers", tuple(hc.target_layers), tuple(layout.inputs)),
        ("draft vocabulary", hc.draft_vocab_size, v_d),
        ("input norm", hc.input_norm, cfg.input_norm),
    ):
        if theirs != ours:
            raise YggError(f"--init-from {cfg.init_from}: the head has {name} {theirs}, this run asks for {ours}")
    if hc.num_layers > cfg.draft_layers:
        raise YggError(f"--init-from {cfg.init_from}: the head has {hc.num_layers} decoder layers, this run "
                       f"asks for {cfg.draft_layers} (a head can be grown, not cut)")
    base.net.float()
    return base


@torch.no_grad()
def grow_layers(net, base_net) -> None:
    """``net`` starts as ``base_net`` with its extra decoder layers on top as identities: their
    attention and MLP output projections are zero, so each added layer passes its input through
    (the residual stream) and the grown head computes exactly what ``base_net`` did. Training then
    moves the added layers away from zero (depth growth, as in progressive stacking)."""
    n = len(base_net.layers)
    own = net.state_dict()
    for k, v in base_net.state_dict().items():
        own[k].copy_(v)
    for block in net.layers[n:]:
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()


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


def make_optimizer(params: list, cfg: DistillConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms and biases)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )


@dataclass(frozen=True)
class Schedule:
    """The run's length and learning rate: linear warm-up over ``warm`` steps, then cosine decay
    to ``min_lr_frac`` of the peak at step ``total``."""

    steps_per_epoch: int
    total: int
    warm: int
    lr: float
    min_lr_frac: float

    @classmethod
    def of(cls, cfg: DistillConfig, n_train: int) -> "Schedule":
        steps_per_epoch = math.ceil(n_train / cfg.batch_size)
        total = max(1, int(round(cfg.epochs * steps_per_epoch)))
        return cls(steps_per_epoch, total, max(1, int(cfg.warmup_frac * total)), cfg.lr, cfg.min_lr_frac)

    def lr_at(self, step: int) -> float:
        if step < self.warm:
            return self.lr * (step + 1) / self.warm
        frac = (step - self.warm) / max(1, self.total - self.warm)
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class TrainState:
    """Where a run is: steps taken, the rest of this epoch's sequence order, the loss EMA and the
    training seconds of earlier invocations (kept in the checkpoint under these names)."""

    step: int = 0
    order: list[int] = field(default_factory=list)
    ema: float | None = None
    trained_s: float = 0.0

    def next_indices(self, train_idx: list[int], batch_size: int, gen: torch.Generator, rank: int, world: int):
        """This rank's sequences of the next batch; a new seeded order when the epoch is used up."""
        if not self.order:
            self.order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=gen).tolist()]
        idx, self.order = self.order[:batch_size], self.order[batch_size:]
        return (idx[rank::world] or idx[:1]) if world > 1 else idx

    def count(self, loss: float) -> None:
        self.step += 1
        self.ema = loss if self.ema is None else 0.95 * self.ema + 0.05 * loss


def resume(ckpt: Path | None, identity: dict | None, net, opt, gen: torch.Generator, log: dict, total: int) -> TrainState:
    """The state of the checkpoint at ``ckpt`` (weights, optimizer, random state and log restored
    in place), else a fresh start."""
    state = load_checkpoint(ckpt, identity or {}) if ckpt is not None else None
    if state is None:
        return TrainState()
    net.load_state_dict(state["net"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    log.update(state["log"])
    plain_log(f"resumed from {ckpt} at step {state['step']}/{total}", force=True)
    return TrainState(state["step"], state["order"], state["ema"], state["trained_s"])


def checkpoint_state(identity: dict | None, net, opt, gen: torch.Generator, st: TrainState, trained_s: float,
                     log: dict) -> dict:
    return {
        "identity": identity or {}, "net": net.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
        "step": st.step, "order": st.order, "ema": st.ema, "trained_s": trained_s, "log": log,
    }


def add_feature_noise(batch, noise: float, hidden: int, gen: torch.Generator) -> None:
    """Uniform noise on the input features, ``noise`` x each layer's RMS per position."""
    if noise > 0:
        u = torch.rand(batch.feat.shape, generator=gen) * 2 - 1
        per_layer = batch.feat.unflatten(-1, (-1, hidden))  # [B, T, L, H]
        rms = per_layer.pow(2).mean(-1, keepdim=True).sqrt().expand_as(per_layer).flatten(-2)
        batch.feat = batch.feat + u * (noise * rms)


def train_step(net, th: TargetHead, batch, opt, params: list, lr: float, cfg: DistillConfig, rope,
               feat_scale: torch.Tensor, world: int):
    """One optimizer step at learning rate ``lr``: (loss, per-step metrics, gradient norm before clipping)."""
    for g in opt.param_groups:
        g["lr"] = lr
    with train_autocast(cfg):
        outs = unrolled_forward(net, batch.tok, batch.feat, cfg.unroll, rope)
    loss, metrics = step_losses(net, th, outs, batch, feat_scale, cfg)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if world > 1:
        _all_reduce_grads(params, world)
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return float(loss.detach()), metrics, float(gnorm)


def curve_row(step: int, sched: Schedule, loss: float, metrics: list[dict], gnorm: float, elapsed_s: float,
              tokens_seen: int) -> dict:
    """The training log's row of the step just taken (``step`` counts it)."""
    return {
        "step": step,
        "epoch": step / sched.steps_per_epoch,
        "lr": sched.lr_at(step - 1),
        "loss": loss,
        "ce": metrics[0]["ce"],
        "kl": metrics[0]["kl"],
        "reg": metrics[0]["reg"],
        "top1": metrics[0]["top1"],
        "top1_last_step": metrics[-1]["top1"],
        "grad_norm": gnorm,
        "elapsed_s": elapsed_s,
        "tokens_seen": tokens_seen,
    }


def eval_columns(ev: dict) -> dict:
    """The training log's validation columns from :func:`evaluate`'s metrics."""
    return dict(val_ce=ev["val_ce"], val_kl=ev["val_kl"], val_reg=ev["val_reg"], val_top1=ev["val_top1_by_step"][0],
                est_chain4_aal=ev["est_chain4_aal"], est_tree4_aal=ev["est_tree4_aal"],
                walk_chain4_aal=ev["walk_chain4_aal"], walk_tree4_aal=ev["walk_tree4_aal"])


def progress_text(ema: float, top1: float, last_eval: dict | None) -> str:
    return (
        f"training (loss {ema:.3f}, top1 {top1:.2f}"
        + (f", val est. chain-4 AAL {last_eval['est_chain4_aal']:.2f}" if last_eval is not None else "")
        + ")"
    )


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
    opt = make_optimizer(params, cfg)
    sched = Schedule.of(cfg, len(train_idx))
    # feature scale for the regression loss (scale-free smooth L1)
    feat_scale = feature_dim_std(layout.last_layer(data.feats))
    log["feat_scale"] = {"dim_std_min": float(feat_scale.min()), "dim_std_max": float(feat_scale.max())}
    rank, world = rank_and_world()
    if cfg.batch_size % world:
        raise YggError(f"batch-size {cfg.batch_size} is not a multiple of the {world} processes")
    st = resume(ckpt, identity, net, opt, gen, log, sched.total)
    rows = log.setdefault("curve", [])
    task = progress.add_task("training", total=sched.total, completed=st.step)
    t0 = time.perf_counter()
    elapsed = lambda: st.trained_s + time.perf_counter() - t0  # noqa: E731 - this and earlier invocations
    budget_s = cfg.budget_minutes * 60 if cfg.budget_minutes is not None else None
    log["complete"] = st.step >= sched.total
    while st.step < sched.total:
        batch = make_batch(data, st.next_indices(train_idx, cfg.batch_size, gen, rank, world), cfg.max_seq_len,
                           layout, cfg.prompt_weight)
        add_feature_noise(batch, cfg.feature_noise, layout.hidden, gen)
        loss, metrics, gnorm = train_step(net, th, batch, opt, params, sched.lr_at(st.step), cfg, rope, feat_scale, world)
        st.count(loss)
        tokens_seen = log.get("tokens_seen", 0) + int(batch.valid.sum()) * world
        row = curve_row(st.step, sched, loss, metrics, gnorm, elapsed(), tokens_seen)
        log["tokens_seen"] = tokens_seen
        if val_idx and rank == 0 and (st.step % cfg.eval_every == 0 or st.step == sched.total):
            net.eval()
            log["last_eval"] = evaluate(net, th, data, val_idx, cfg, feat_scale, rope, layout)
            row.update(eval_columns(log["last_eval"]))
        rows.append(row)
        desc = progress_text(st.ema, metrics[0]["top1"], log.get("last_eval"))
        progress.update(task, advance=1, description=desc)
        plain_log(f"{desc}: step {st.step}/{sched.total}", force="val_kl" in row)
        over = budget_s is not None and st.step < sched.total and any_rank(time.perf_counter() - t0 >= budget_s, world)
        if (st.step % cfg.checkpoint_every == 0 or st.step == sched.total or over) and ckpt is not None and rank == 0:
            save_checkpoint(ckpt, checkpoint_state(identity, net, opt, gen, st, elapsed(), log))
        if over:
            log["train_s"] = elapsed()
            plain_log(f"budget of {cfg.budget_minutes} min used: checkpoint at step {st.step}/{sched.total}", force=True)
            return {}
    log.update(train_s=elapsed(), steps=sched.total, steps_per_epoch=sched.steps_per_epoch, complete=True)
    return log.get("last_eval", {})
