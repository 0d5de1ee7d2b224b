"""The depth predictor's models fitted and judged (``yggtree train-predictor``, steps 2 and 3): the MLP
(:class:`yggtree.runtime.predictor.DepthPredictor`) with a per-head BCE on y_d = 1[len >= d], a
scikit-learn logistic baseline per depth, the constant predictor; the held-out split (by prompt),
each model's MAE and Brier scores, the depth bias of the objective's AAL and what choosing D per
step could gain (the headroom)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .predictor_records import Records



@dataclass(frozen=True)
class MLPParams:
    """Defaults chosen by 5-fold grouped (by prompt) cross-validation on the training prompts of
    the default pair's records: the data is small (a few thousand steps from tens of prompts), so
    a narrow, heavily regularised encoder trained briefly generalises best."""

    units: int = 16  # encoder width
    dropout: float = 0.5
    lr: float = 3e-4
    weight_decay: float = 1.0  # AdamW
    epochs: int = 20
    batch: int = 128


def length_targets(n_accepted, d_max: int):
    """[S] int lengths -> [S, d_max] float32 targets y_d = 1[len >= d], d = 1..d_max."""
    import torch

    d = torch.arange(1, d_max + 1)
    return (n_accepted[:, None] >= d).to(torch.float32)


def standardiser(x) -> tuple:
    """[S, H] -> ([H] mean, [H] std) of the rows; std floored so constant features stay finite."""
    mean = x.mean(0)
    std = x.std(0, unbiased=False)
    return mean, std.clamp_min(1e-3 * float(std.max()) + 1e-6)


def bce_ge(log_p, y):
    """Per-head BCE of log P(len >= d) [S, D] against y [S, D], averaged over heads and rows."""
    import torch

    log_p = log_p.clamp(max=-1e-6)
    log_q = torch.log(-torch.expm1(log_p))  # log(1 - p), stable
    return -(y * log_p + (1 - y) * log_q).mean()


def train_mlp(x, n_accepted, d_max: int, hp: MLPParams, seed: int = 0, draft_width: int = 0,
              head_k: int = 0):
    """A DepthPredictor fitted to (x [S, H + head_k] features, lengths [S]) with AdamW on
    :func:`bce_ge`."""
    import torch

    from ..runtime.predictor import DepthPredictor

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DepthPredictor(x.shape[1] - head_k, d_max, hp.units, hp.dropout, draft_width, head_k)
    mean, std = standardiser(x)
    model.mean.copy_(mean)
    model.std.copy_(std)
    y = length_targets(n_accepted, d_max)
    opt = torch.optim.AdamW(model.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
    n = x.shape[0]
    model.train()
    for _ in range(hp.epochs):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, hp.batch):
            idx = perm[i : i + hp.batch]
            loss = bce_ge(model.log_p_ge(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval().requires_grad_(False)


def fit_baseline(x, n_accepted, d_max: int, c: float = 1.0, seed: int = 0, draft_width: int = 0,
                 head_k: int = 0):
    """scikit-learn LogisticRegression per depth on the standardised features (x [S, H + head_k]), as a
    LinearDepthPredictor (a depth whose training targets are all equal gets a constant)."""
    import torch
    from sklearn.linear_model import LogisticRegression

    from ..runtime.predictor import LinearDepthPredictor

    mean, std = standardiser(x)
    z = ((x - mean) / std).numpy().astype(np.float64)
    y = length_targets(n_accepted, d_max).numpy()
    model = LinearDepthPredictor(x.shape[1] - head_k, d_max, draft_width, head_k)
    model.mean.copy_(mean)
    model.std.copy_(std)
    for d in range(d_max):
        if y[:, d].min() == y[:, d].max():
            p = float(np.clip(y[:, d].mean(), 1e-4, 1 - 1e-4))
            model.bias[d] = float(np.log(p / (1 - p)))
            continue
        lr = LogisticRegression(C=c, max_iter=2000, random_state=seed).fit(z, y[:, d])
        model.weight[d] = torch.from_numpy(lr.coef_[0]).to(torch.float32)
        model.bias[d] = float(lr.intercept_[0])
    return model.eval().requires_grad_(False)


def constant_p_ge(n_accepted, d_max: int):
    """[D] the training rows' P(len >= d): the constant predictor (expected length = mean length)."""
    return length_targets(n_accepted, d_max).mean(0)


def evaluate(p_ge, n_accepted) -> dict:
    """Expected-length MAE and per-depth Brier scores of predictions p_ge [S, D] vs lengths [S]."""
    y = length_targets(n_accepted, p_ge.shape[1])
    exp_len = p_ge.sum(-1)
    true = n_accepted.to(exp_len.dtype)
    return {
        "mae": float((exp_len - true).abs().mean()),
        "mean_pred_len": float(exp_len.mean()),
        "mean_true_len": float(true.mean()),
        "brier": [float(v) for v in ((p_ge - y) ** 2).mean(0)],
        "steps": int(true.shape[0]),
    }


def holdout_mask(prompt, n_hold: int):
    """[S] bool, True for rows of the ``n_hold`` last prompts (highest prompt indices)."""
    import torch

    ids = torch.unique(prompt)  # sorted
    return prompt >= ids[len(ids) - n_hold] if n_hold > 0 else torch.zeros_like(prompt, dtype=torch.bool)


def depth_bias(p_ge, rec: Records) -> list[dict]:
    """Per D: predicted 1 + sum_{d<=D} p_ge (the objective's AAL) vs the realised mean accepted
    length + 1 of a D-call tree (the approximation behind using D_max-tree lengths for every D)."""
    aal = 1.0 + p_ge.cumsum(-1).mean(0)
    real = 1.0 + rec.len_by_depth.to(p_ge.dtype).mean(0)
    return [{"depth": d + 1, "pred_aal": float(aal[d]), "realised_aal": float(real[d])}
            for d in range(p_ge.shape[1])]


def depth_headroom(len_by_depth, step_ms, plain_ms, p_ge: dict) -> dict:
    """What choosing D per step could gain on recorded steps, by the profile's step times.

    ``len_by_depth`` [S, D] accepted lengths had each step drafted 1..D levels (the records'
    tree shape), ``step_ms`` [S, D] the profile's time of those steps, ``plain_ms`` [S] of a plain
    step, ``p_ge`` {name: [S, D] P(len >= d)} predictions. Speed-ups over plain decoding (tokens
    per ms over plain's) of: every fixed D; each predictor choosing per step the D >= 1 with the
    best expected tokens per ms (the head has run: no plain step); and the oracle, the per-step
    choice of D >= 1 maximising the total tokens per ms given the realised lengths (Dinkelbach
    iteration), the most any depth predictor could reach."""
    tok = 1.0 + np.asarray(len_by_depth, dtype=np.float64)  # [S, D]
    t = np.asarray(step_ms, dtype=np.float64)  # [S, D]
    base = len(tok) / float(np.sum(plain_ms))
    rows = np.arange(len(tok))

    def speedup(d_idx) -> float:
        return float(tok[rows, d_idx].sum() / t[rows, d_idx].sum() / base)

    out = {"fixed": [speedup(np.full(len(tok), d)) for d in range(tok.shape[1])]}
    out["best_fixed_depth"] = int(np.argmax(out["fixed"])) + 1
    for name, p in p_ge.items():
        exp = 1.0 + np.cumsum(np.asarray(p, dtype=np.float64), axis=1)
        pick = np.argmax(exp / t, axis=1)
        out[name] = speedup(pick)
        out[f"{name}_depth_share"] = np.bincount(pick, minlength=tok.shape[1]) / len(tok)
    lam = tok[:, 0].sum() / t[:, 0].sum()
    for _ in range(100):
        pick = np.argmax(tok - lam * t, axis=1)
        new = tok[rows, pick].sum() / t[rows, pick].sum()
        if new <= lam * (1 + 1e-12):
            break
        lam = new
    out["oracle"] = speedup(pick)
    out["oracle_depth_share"] = np.bincount(pick, minlength=tok.shape[1]) / len(tok)
    return {k: ([round(float(x), 4) for x in v] if isinstance(v, (list, np.ndarray)) else
                (round(v, 4) if isinstance(v, float) else v)) for k, v in out.items()}
