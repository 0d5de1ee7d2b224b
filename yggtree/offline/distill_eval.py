"""Validation of a ``yggtree distill`` head (losses of every unrolled step, the offline chain and
tree acceptance estimates) and the run's report (curves and tables under ``<out>/report``)."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from .distill_config import DistillConfig
from .teacher_data import FeatureLayout, TeacherData
from .distill_loss import TargetHead, make_batch, step_losses, unrolled_forward


def decode_walk(hits: torch.Tensor, greedy: torch.Tensor) -> tuple[int, int]:
    """(tokens, verify steps) of decoding the greedy answers with chains of ``D`` drafts, walked
    as the engine walks them: from a root at pair ``p`` the chain accepts depth ``k`` while the
    step-``k`` draft at pair ``p + k`` hits (``hits[k, b, p + k]``) inside the answer; the step
    emits the accepted tokens plus the target's own and the next root is ``a + 1`` pairs on.

    Unlike the mean over every root (``est_*``), this weights hard stretches by the steps decoding
    spends in them, so tokens / steps is what the engine's mean accepted length comes to.

    hits: [D, B, T] bool; greedy: [B, T] bool (pair ``p``'s next token is a greedy answer token).
    """
    d = hits.shape[0]
    h, g = hits.tolist(), greedy.tolist()
    tokens = steps = 0
    for b, row in enumerate(g):
        t, p = len(row), 0
        while p < t:
            if not row[p]:
                p += 1
                continue
            a = 0
            while a < d and p + a < t and row[p + a] and h[a][b][p + a]:
                a += 1
            tokens += a + 1
            steps += 1
            p += a + 1
    return tokens, steps


@torch.no_grad()
def evaluate(
    net, th: TargetHead, data: TeacherData, idx: list[int], cfg: DistillConfig, feat_scale: torch.Tensor, rope,
    layout: FeatureLayout,
) -> dict:
    """Validation losses (step 0 and the unrolled steps) and the offline chain acceptance estimate.

    Acceptance by depth ``d``: over roots ``r`` inside greedy answers (so the tokens after the root
    are exactly what a fully accepted chain would feed), the fraction where the head's top-1 at
    draft depth ``j`` (unrolled step ``j`` at pair ``r+j``) equals the target's full-vocabulary
    argmax for every ``j < d``; and the same with top-k (k = 8) for the first miss."""
    steps = max(cfg.eval_depth, cfg.unroll)
    sums = None
    n_batches = 0
    acc_hits = torch.zeros(cfg.eval_depth)
    acc_roots = 0
    topk_hits = torch.zeros(cfg.eval_depth)
    tree_hits = torch.zeros(cfg.eval_depth)
    walk = {"chain": [0, 0], "tree": [0, 0]}  # [tokens, steps]
    for s in range(0, len(idx), cfg.batch_size):
        batch = make_batch(data, idx[s : s + cfg.batch_size], cfg.max_seq_len, layout)
        outs = unrolled_forward(net, batch.tok, batch.feat, steps, rope)
        _, metrics = step_losses(net, th, outs[: cfg.unroll], batch, feat_scale, cfg)
        sums = metrics if sums is None else [
            {k: a[k] + b[k] for k in a} for a, b in zip(sums, metrics)
        ]
        n_batches += 1
        # full-vocab argmax of the target at p+1
        arg_full = (th.normed(batch.nxt_feat) @ th.w_full.T).argmax(-1)  # [B, T]
        hit = []
        hitk = []
        hit4 = []
        for k in range(cfg.eval_depth):
            lq = net.logits(outs[k])
            top = net.draft_vocab[lq.topk(8, dim=-1).indices]  # [B, T, 8]
            hit.append(top[..., 0] == arg_full)
            hitk.append((top == arg_full[..., None]).any(-1))
            hit4.append((top[..., :4] == arg_full[..., None]).any(-1))
        greedy = batch.valid & batch.greedy
        for name, h in (("chain", torch.stack(hit[:4])), ("tree", torch.stack(hit4))):
            tok_n, step_n = decode_walk(h, greedy)
            walk[name][0] += tok_n
            walk[name][1] += step_n
        t = batch.tok.shape[1]
        d = cfg.eval_depth
        n_roots = t - d
        if n_roots > 0:
            ok = batch.valid & batch.greedy
            root_ok = ok.unfold(1, d, 1)[:, :n_roots].all(-1)  # [B, R]: window r..r+d-1 greedy
            h1 = torch.stack([hit[j][:, j : j + n_roots] for j in range(d)])  # [d, B, R]
            hk = torch.stack([hitk[j][:, j : j + n_roots] for j in range(d)])
            h4 = torch.stack([hit4[j][:, j : j + n_roots] for j in range(d)])
            tree_hits += (torch.cumprod(h4.int(), dim=0).bool() & root_ok).flatten(1).sum(1).float()
            chain = torch.cumprod(h1.int(), dim=0).bool()  # accepted through depth j
            before = torch.cat([torch.ones_like(chain[:1]), chain[:-1]])  # reached depth j
            acc_hits += (chain & root_ok).flatten(1).sum(1).float()
            topk_hits += (before & hk & root_ok).flatten(1).sum(1).float()
            acc_roots += int(root_ok.sum())
    val = [{k: v / max(n_batches, 1) for k, v in m.items()} for m in (sums or [])]
    acc = (acc_hits / max(acc_roots, 1)).tolist()
    acck = (topk_hits / max(acc_roots, 1)).tolist()
    return {
        "val_ce": val[0]["ce"] if val else float("nan"),
        "val_kl": val[0]["kl"] if val else float("nan"),
        "val_reg": val[0]["reg"] if val else float("nan"),
        "val_top1_by_step": [m["top1"] for m in val],
        "val_kl_by_step": [m["kl"] for m in val],
        "accept_by_depth": acc,  # P(chain accepts >= d tokens), d = 1..eval_depth
        "top8_at_depth": acck,  # P(chain reached depth d-1 and the target's token is in the top 8)
        "chain_roots": acc_roots,
        "est_chain4_aal": 1.0 + sum(acc[:4]),
        # a tree holding the head's top-4 at every node of the true path, eval_depth deep (an upper
        # bound of what W_d = 4 trees of that depth accept)
        "accept_top4_tree_by_depth": (tree_hits / max(acc_roots, 1)).tolist(),
        "est_tree4_aal": 1.0 + float((tree_hits / max(acc_roots, 1)).sum()),
        # the same two drafts decoded as the engine walks (tokens per verify step of the greedy
        # answers): what eval_drafter measures on these prompts
        "walk_chain4_aal": walk["chain"][0] / max(walk["chain"][1], 1),
        "walk_tree4_aal": walk["tree"][0] / max(walk["tree"][1], 1),
    }


def write_report(out: Path, curve: list[dict], ev: dict) -> None:
    """loss.png, acceptance.png, train_log.csv, acceptance.csv under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in curve for k in r}, key=lambda k: (k != "step", k))
    with (out / "train_log.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(curve)
    acc = ev.get("accept_by_depth", [])
    topk = ev.get("top8_at_depth", [])
    top1 = ev.get("val_top1_by_step", [])
    with (out / "acceptance.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["depth", "accept_chain_top1", "top8_hit", "val_top1_unrolled_step"])
        for d in range(len(acc)):
            w.writerow([d + 1, acc[d], topk[d] if d < len(topk) else "", top1[d] if d < len(top1) else ""])

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in curve]
    ax[0].plot(steps, [r["loss"] for r in curve], lw=0.6, alpha=0.5, label="train loss (weighted)")
    ax[0].plot(steps, [r["kl"] for r in curve], lw=0.6, alpha=0.5, label="train KL (step 0)")
    vs = [r for r in curve if "val_kl" in r]
    if vs:
        ax[0].plot([r["step"] for r in vs], [r["val_kl"] for r in vs], "o-", label="val KL (step 0)")
        ax[0].plot([r["step"] for r in vs], [r["val_reg"] for r in vs], "s-", label="val feature reg.")
    ax[0].set_xlabel("step")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[0].set_title("loss")
    ax[1].plot(steps, [r["top1"] for r in curve], lw=0.6, alpha=0.5, label="train top-1 (step 0)")
    ax[1].plot(steps, [r["top1_last_step"] for r in curve], lw=0.6, alpha=0.5, label="train top-1 (last unrolled)")
    if vs:
        ax[1].plot([r["step"] for r in vs], [r["val_top1"] for r in vs], "o-", label="val top-1 (step 0)")
    ax[1].set_xlabel("step")
    ax[1].set_ylim(0, 1)
    ax[1].legend()
    ax[1].set_title("agreement with the target")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    depth = list(range(1, len(acc) + 1))
    ax.plot(depth, acc, "o-", label="P(chain accepts >= d)")
    if topk:
        ax.plot(depth, topk, "s--", label="P(reached d-1, target token in top 8)")
    if top1:
        ax.plot(list(range(1, len(top1) + 1)), top1, "^:", label="top-1 agreement at unrolled step d-1")
    ax.set_xlabel("draft depth d")
    ax.set_ylim(0, 1)
    ax.set_title(f"held-out acceptance (est. chain-4 AAL {ev.get('est_chain4_aal', float('nan')):.2f})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
