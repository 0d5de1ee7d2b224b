"""Depth predictor: monotone outputs, the depth choice against brute force, training on synthetic
data beating the constant predictor, load refusals (hidden size, pair identity, corrupt files),
records round-trip, and records from a tiny engine. Tiny random models and synthetic data only."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import pytest
import numpy as np
import torch

from test_eagle import bigram_head, tiny
from test_objective import cost_model, flat_curve, policy, table
from yggtree.errors import YggError
from yggtree.offline.predictor_fit import (
    MLPParams, constant_p_ge, evaluate, fit_baseline, holdout_mask, length_targets, train_mlp,
)
from yggtree.offline.predictor_records import (
    Records, collect_records, data_hash, load_records, save_records, sidecar_path,
)
from yggtree.offline.train_predictor import save_predictor
from yggtree.plan import validate_plan
from yggtree.runtime.engine import Engine, EngineConfig, TreeParams
from yggtree.runtime.calibration import Calibration
from yggtree.runtime.cost import CostModel, Curve
from yggtree.runtime.policy import StepChoice
from yggtree.runtime.predictor import (
    LOGP_FLOOR, MANIFEST_FILE, MODEL_FILES, DepthFn, features, DepthPredictor, LinearDepthPredictor, choose_depth,
    depth_fn_for, expected_aal, load_predictor, numpy_features, numpy_forward, policy_with_predictor, verify_width_for,
)


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- models


def randomised(model: torch.nn.Module, seed: int, scale: float = 3.0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name == "std":
                t.copy_(torch.rand(t.shape, generator=g) + 0.1)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * scale)
        for t in model.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * scale)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("kind", ["mlp", "logistic"])
@pytest.mark.parametrize("seed", range(5))
def test_outputs_are_probabilities_non_increasing_in_depth(kind, seed):
    model = DepthPredictor(16, 6, units=8) if kind == "mlp" else LinearDepthPredictor(16, 6)
    model = randomised(model, seed)
    h = torch.randn(200, 16, generator=torch.Generator().manual_seed(100 + seed)) * 4
    p = model(h)
    assert p.shape == (200, 6)
    assert bool(((p >= 0) & (p <= 1)).all())
    assert bool((p[:, 1:] <= p[:, :-1]).all())
    one = model(h[7])  # a single hidden state, as at run time
    assert torch.allclose(one, p[7])
    assert torch.allclose(expected_aal(p), 1 + torch.cumsum(p, -1))


@pytest.mark.parametrize("kind", ["mlp", "logistic"])
@pytest.mark.parametrize("seed", range(5))
def test_the_numpy_forward_is_the_modules(kind, seed):
    """The numpy forward a decode step consults (and its features, the head's top log-probs sorted
    and floored) gives the module's P(len >= d) to float32 rounding, monotone as the module's."""
    model = DepthPredictor(16, 6, units=8, head_k=2) if kind == "mlp" else LinearDepthPredictor(16, 6, head_k=2)
    model = randomised(model, seed)
    f = numpy_forward(model)
    g = torch.Generator().manual_seed(200 + seed)
    for _ in range(20):
        h, head = torch.randn(16, generator=g) * 4, torch.randn(4, generator=g) * 3
        head[int(torch.randint(0, 4, (1,), generator=g))] = float("-inf")  # a missing child
        x = numpy_features(h, head, 2)
        assert x.dtype == np.float32 and np.array_equal(x, features(h, head, 2).numpy())
        got, want = f(x), model(features(h, head, 2)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert bool((np.diff(got) <= 0).all())
    with pytest.raises(YggError, match="top 2 log-probs, got none"):
        numpy_features(torch.zeros(16), None, 2)


# ----------------------------------------------------------------------------- the depth choice


def random_cost(rng: random.Random) -> CostModel:
    plain = rng.uniform(20, 80)
    vw = sorted(rng.sample([2, 4, 8, 16, 32, 64], 4))
    v_ms = {1: plain}
    for w in vw:
        v_ms[w] = v_ms[max(k for k in v_ms if k < w)] + rng.uniform(0, 10)
    d_ms = {1: rng.uniform(0.5, 15)}
    for w in (2, 4, 8):
        d_ms[w] = d_ms[w // 2] + rng.uniform(0, 3)
    h = rng.uniform(0, 10)
    head = Curve((256, 1024), ((7.0,), (7.0,)), ((h,), (h * 1.2,)))
    stages = {"egt": rng.uniform(0, 1), "prune": rng.uniform(0, 1), "accept": 0.1, "commit": 0.1,
              "policy": rng.uniform(0, 0.5), "plain_accept": rng.uniform(0, 0.2)}
    return CostModel(flat_curve(v_ms), flat_curve(d_ms), head, stages)


def brute_depth(p: list[float], cost: CostModel, ctx: int, wd: int, wvs: list[int], extra: float) -> int:
    cands = [(1.0, 0)]  # (speed-up, D); plain decoding is speed-up 1
    for d in range(1, len(p) + 1):
        aal = 1 + sum(p[:d])
        cands.append((aal * cost.plain_ms(ctx) / (cost.step_ms(d, wd, wvs[d - 1], ctx) + extra), d))
    best = max(s for s, _ in cands)
    if best <= 1.0:
        return 0
    return min(d for s, d in cands if s == best)


@pytest.mark.parametrize("seed", range(300))
def test_choose_depth_equals_brute_force(seed):
    rng = random.Random(seed)
    cost = random_cost(rng)
    d_max = rng.randint(1, 8)
    p = [1.0]
    for _ in range(d_max):
        p.append(p[-1] * rng.random() ** rng.choice([0.2, 1, 3]))
    p = p[1:]
    wd = rng.choice([1, 2, 4, 8])
    verify = sorted(w for w in cost.verify.xs[0] if w > 1)
    wvs = [verify_width_for(d, wd, [int(w) for w in verify]) for d in range(1, d_max + 1)]
    ctx, extra = rng.randint(1, 900), rng.choice([0.0, 0.05, 1.0])
    got = choose_depth(torch.tensor(p), cost, ctx, wd, wvs, extra)
    assert got == brute_depth(p, cost, ctx, wd, wvs, extra)


def test_choose_depth_plain_when_nothing_pays():
    cost = cost_model(draft_ms=2.0)
    assert choose_depth([0.01] * 6, cost, 100, 4, [8, 16, 16, 32, 32, 32]) == 0
    assert choose_depth([0.99] * 6, cost, 100, 4, [8, 16, 16, 32, 32, 32]) > 0


def test_verify_width_for_holds_the_tree_or_takes_the_largest():
    assert [verify_width_for(d, 4, (4, 8, 16, 32)) for d in range(1, 9)] == [8, 16, 16, 32, 32, 32, 32, 32]
    assert verify_width_for(1, 1, (4, 8)) == 4


# ----------------------------------------------------------------------------- training


def synthetic(n_prompts: int = 30, steps: int = 25, h: int = 16, d_max: int = 6, seed: int = 0,
              head_noise: float = 0.5) -> Records:
    """Lengths driven by two feature directions plus noise; per-prompt offsets in the features.
    The head's top log-probs see the noise term (a drafter sure of its next token is accepted
    more), so they carry information the hidden state does not."""
    g = torch.Generator().manual_seed(seed)
    s = n_prompts * steps
    prompt = torch.arange(n_prompts).repeat_interleave(steps)
    x = torch.randn(s, h, generator=g) + 0.3 * torch.randn(n_prompts, h, generator=g)[prompt]
    noise = head_noise * torch.randn(s, generator=g)
    score = 2.5 + 1.6 * x[:, 0] - 1.0 * torch.relu(x[:, 1]) + noise
    n_acc = score.round().clamp(0, d_max).to(torch.int64)
    lbd = torch.minimum(n_acc[:, None], torch.arange(1, d_max + 1)[None])
    top1 = torch.nn.functional.logsigmoid(4 * noise + 0.2 * torch.randn(s, generator=g))
    head = torch.stack([top1, top1 - 0.5 - torch.rand(s, generator=g)], dim=1)
    return Records(x * 3 + 1, n_acc, lbd, prompt, torch.arange(s) + 50, head)


def test_mlp_beats_constant_on_held_out_prompts():
    rec = synthetic()
    hold = holdout_mask(rec.prompt, 8)
    tr, te = rec.select(~hold), rec.select(hold)
    hp = MLPParams(units=16, dropout=0.1, lr=3e-3, weight_decay=1e-2, epochs=30, batch=64)
    mlp = train_mlp(tr.h, tr.n_accepted, 6, hp, seed=0)
    base = fit_baseline(tr.h, tr.n_accepted, 6)
    const = constant_p_ge(tr.n_accepted, 6)
    m_mlp = evaluate(mlp(te.h), te.n_accepted)
    m_base = evaluate(base(te.h), te.n_accepted)
    m_const = evaluate(const.expand(te.h.shape[0], 6), te.n_accepted)
    assert abs(const.sum().item() - tr.n_accepted.float().mean().item()) < 1e-5  # mean length
    assert m_mlp["mae"] < 0.75 * m_const["mae"]
    assert m_base["mae"] < m_const["mae"]
    assert m_mlp["steps"] == te.h.shape[0] == 8 * 25


def test_head_features_add_what_the_hidden_state_misses():
    """Trained with the head's top-2 log-probs, the MLP and the baseline predict the synthetic
    lengths better on held-out prompts than from the hidden state alone."""
    rec = synthetic(head_noise=1.2)
    hold = holdout_mask(rec.prompt, 8)
    tr, te = rec.select(~hold), rec.select(hold)
    hp = MLPParams(units=16, dropout=0.1, lr=3e-3, weight_decay=1e-2, epochs=30, batch=64)
    mae = {}
    for k in (0, 2):
        x_tr, x_te = features(tr.h, tr.head_logp, k), features(te.h, te.head_logp, k)
        assert x_tr.shape == (tr.h.shape[0], 16 + k)
        mlp = train_mlp(x_tr, tr.n_accepted, 6, hp, seed=0, head_k=k)
        base = fit_baseline(x_tr, tr.n_accepted, 6, head_k=k)
        assert mlp.hidden_size == base.hidden_size == 16 and mlp.head_k == base.head_k == k
        mae[k] = (evaluate(mlp(x_te), te.n_accepted)["mae"], evaluate(base(x_te), te.n_accepted)["mae"])
    assert mae[2][0] < 0.85 * mae[0][0] and mae[2][1] < 0.85 * mae[0][1]


def test_features_sort_floor_and_refuse_missing_head():
    h = torch.arange(3.0)
    got = features(h, torch.tensor([-3.0, float("-inf"), -0.5]), 2)
    assert got.tolist() == [0.0, 1.0, 2.0, -0.5, -3.0]
    assert features(h, torch.tensor([float("-inf"), -1.0]), 2).tolist()[-1] == LOGP_FLOOR
    assert torch.equal(features(h, None, 0), h)
    with pytest.raises(YggError, match="top 2 log-probs, got 1"):
        features(h, torch.tensor([-1.0]), 2)
    with pytest.raises(YggError, match="top 2 log-probs, got none"):
        features(h, None, 2)


def test_length_targets_and_holdout_by_prompt():
    y = length_targets(torch.tensor([0, 2, 6]), 4)
    assert y.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    m = holdout_mask(torch.tensor([0, 0, 1, 2, 2, 3]), 2)
    assert m.tolist() == [False, False, False, True, True, True]
    m = holdout_mask(torch.tensor([40, 41, 7, 7, 43, 41]), 2)  # global prompt indices, any order
    assert m.tolist() == [False, True, False, False, True, True]


# ----------------------------------------------------------------------------- files


@pytest.fixture
def plan(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x" * 100)
    return validate_plan({"name": "t", "target": str(model), "drafter": "self", "dtype": "float32",
                          "draft_widths": [1, 2, 4], "d_max": 3, "verify_widths": [4, 8, 12]})


@pytest.fixture
def saved(tmp_path, plan):
    mlp = randomised(DepthPredictor(16, 3, units=8, draft_width=2), 0, scale=0.5)
    base = randomised(LinearDepthPredictor(16, 3, draft_width=2), 1, scale=0.5)
    out = tmp_path / "pred"
    save_predictor(out, plan, mlp, base, {"metrics": {}})
    return out, mlp, base


def test_saved_predictor_loads_identically(saved, plan):
    out, mlp, base = saved
    h = torch.randn(5, 16)
    got = load_predictor(out, plan, hidden_size=16)
    assert torch.equal(got(h), mlp(h)) and got.draft_width == 2
    assert torch.equal(load_predictor(out / MANIFEST_FILE, plan, "baseline")(h), base(h))


def test_refuses_other_hidden_size(saved, plan):
    out, _, _ = saved
    with pytest.raises(YggError, match=re.escape(str(out / MANIFEST_FILE)) + ".*hidden size 16, the target has 32"):
        load_predictor(out, plan, hidden_size=32)
    m = json.loads((out / MANIFEST_FILE).read_text())
    m["feature"]["hidden_size"] = 32  # manifest and weights disagree
    (out / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(YggError, match=re.escape(str(out / MODEL_FILES["mlp"])) + ": tensor mean has shape"):
        load_predictor(out, plan)


def test_depth_fn_refuses_hidden_state_of_other_size(saved, plan):
    out, _, _ = saved
    fn = depth_fn_for(load_predictor(out, plan), cost_model(), plan, overhead_ms=0.0)
    with pytest.raises(YggError, match="hidden size 16, the target's hidden state has 24"):
        fn(torch.zeros(24), 100)


@pytest.mark.parametrize("change, key", [
    ({"dtype": "bfloat16"}, "dtype"),
    ({"drafter": None}, "drafter"),
])
def test_refuses_other_pair(saved, plan, change, key):
    out, _, _ = saved
    with pytest.raises(YggError, match=f"trained for another target/drafter/dtype .*differs in {key}"):
        load_predictor(out, replace(plan, **change))


def test_refuses_other_target(saved, plan, tmp_path):
    out, _, _ = saved
    other = tmp_path / "other.gguf"
    other.write_bytes(b"y" * 200)
    with pytest.raises(YggError, match="another target/drafter/dtype .*differs in target"):
        load_predictor(out, replace(plan, target=str(other)))


def test_refuses_truncated_or_edited_weights(saved, plan):
    out, _, _ = saved
    f = out / MODEL_FILES["mlp"]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(YggError, match="cannot read depth predictor weights " + re.escape(str(f))):
        load_predictor(out, plan)
    f.write_bytes(data[:-4] + b"\0\0\0\0")  # same size, last weight bytes changed
    with pytest.raises(YggError, match=re.escape(str(f)) + " do not match .*sha256"):
        load_predictor(out, plan)


def test_refuses_missing_or_foreign_manifest(tmp_path, plan):
    with pytest.raises(YggError, match="manifest .* does not exist .*yggtree train-predictor"):
        load_predictor(tmp_path, plan)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"kind": "yggtree-profile", "version": 1}))
    with pytest.raises(YggError, match="is not a yggtree-depth-predictor file"):
        load_predictor(tmp_path, plan)


def test_policy_with_predictor(saved, plan):
    out, mlp, _ = saved
    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + 0.4 * d, wds=(1, 2, 4), d_max=3,
                                                    wvs=(4, 8, 12)), (4, 8, 12))
    pol = replace(policy(cal), draft_widths=(1, 2, 4), verify_widths=(4, 8, 12), d_max=3)
    assert policy_with_predictor(plan, pol) is pol  # the plan names no predictor
    with_pred = replace(plan, predictor=str(out))
    with pytest.raises(YggError, match="names a depth predictor but no profile and calibration"):
        policy_with_predictor(with_pred, None)
    got = policy_with_predictor(with_pred, pol, hidden_size=16)
    fn = got.predictor
    assert isinstance(fn, DepthFn) and fn.draft_width == 2 and fn.verify_widths == (4, 8, 8)
    assert fn.overhead_ms > 0 and pol.predictor is None and got.depth_fn is None
    h = torch.randn(16)
    d = choose_depth(mlp(h), pol.cost, 100, 2, (4, 8, 8), fn.overhead_ms)
    assert fn(h, 100) == d
    # the predictor scales the calibration's drafted tokens per depth: its expectation for this
    # context over the calibration's for its own tree shape (W_d 2, W_v 4, 8, 8)
    scale = np.cumsum(fn.p_ge(h).double().numpy()) / np.array([cal.expected_aal(2, dd, wv) - 1
                                                           for dd, wv in ((1, 4), (2, 8), (3, 8))])
    np.testing.assert_array_equal(fn.aal_scale(h, cal), scale)
    # the calibration's side is cached per calibration: another one gives its own factors
    cal2 = Calibration(cal.xs, cal.ys, table(lambda wd, d, wv: 1 + 0.2 * d, wds=(1, 2, 4), d_max=3,
                                             wvs=(4, 8, 12)), (4, 8, 12))
    np.testing.assert_allclose(fn.aal_scale(h, cal2), 2 * scale)
    np.testing.assert_array_equal(fn.aal_scale(h, cal), scale)
    best = brute_choice(pol, cal, scale, fn.overhead_ms, allow_plain=True)
    choice = got.choose_draft(h, 100)
    assert (choice.draft_depth, choice.draft_width if choice.draft_depth else None) == best


def brute_choice(pol, cal, scale, extra_ms: float, allow_plain: bool, ctx: int = 100):
    """(D, W_d) maximising the scaled objective over the policy's (D, W_d, W_v) in its order,
    ``extra_ms`` paid by plain and tree steps alike; (0, None) when plain decoding wins."""
    best, best_s = (0, None), (1.0 if allow_plain else -np.inf)
    plain = pol.cost.plain_ms(ctx) + extra_ms
    for dd in range(1, pol.d_max + 1):
        for wd in pol.draft_widths:
            for wv in (1, *pol.verify_widths):
                a = cal.expected_aal(wd, dd, wv) if wv > 1 else 1.0
                if a is None:
                    continue
                sp = (1 + (a - 1) * scale[dd - 1]) * plain / (pol.cost.step_ms(dd, wd, wv, ctx) + extra_ms)
                if sp > best_s:
                    best, best_s = (dd, wd), sp
    return best


def test_a_head_reading_predictor_picks_the_depth_after_the_head(tmp_path, plan):
    """A predictor trained with the head's top-2 log-probs: saved and loaded identically; before
    the head the policy decides as it would without a predictor, after it the (D >= 1, W_d)
    maximising the objective with the context's AAL factors (brute force), then W_v with them."""
    mlp = randomised(DepthPredictor(16, 3, units=8, draft_width=2, head_k=2), 0, scale=0.5)
    base = randomised(LinearDepthPredictor(16, 3, draft_width=2, head_k=2), 1, scale=0.5)
    out = tmp_path / "pred"
    save_predictor(out, plan, mlp, base, {"metrics": {}})
    assert json.loads((out / MANIFEST_FILE).read_text())["feature"]["head_k"] == 2
    x = torch.randn(5, 18)
    assert torch.equal(load_predictor(out, plan)(x), mlp(x))
    assert torch.equal(load_predictor(out, plan, "baseline")(x), base(x))
    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + 0.4 * d, wds=(1, 2, 4), d_max=3,
                                                    wvs=(4, 8, 12)), (4, 8, 12))
    pol = replace(policy(cal), draft_widths=(1, 2, 4), verify_widths=(4, 8, 12), d_max=3)
    got = policy_with_predictor(replace(plan, predictor=str(out)), pol, hidden_size=16)
    fn = got.predictor
    assert fn.uses_head and not depth_fn_for(load_predictor(saved_plain(tmp_path, plan), plan),
                                             pol.cost, plan, overhead_ms=0.0).uses_head
    h = torch.randn(16)
    with pytest.raises(YggError, match="top 2 log-probs, got none"):
        fn.p_ge(h)
    assert got.choose_draft(h, 100) == pol.fresh().choose_draft(h, 100)  # no predictor before the head
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(16, generator=g)
        head = -torch.rand(3, generator=g) * 4
        scale = fn.aal_scale(h, cal, head)
        base = np.array([cal.expected_aal(2, dd, wv) - 1 for dd, wv in ((1, 4), (2, 8), (3, 8))])
        np.testing.assert_array_equal(scale, np.cumsum(fn.p_ge(h, head).double().numpy()) / base)
        module = np.cumsum(fn.predictor(features(h, head, 2)).double().numpy()) / base  # its forward, in torch
        np.testing.assert_allclose(scale, module, rtol=1e-5)
        best = brute_choice(pol, cal, scale, fn.overhead_ms, allow_plain=False)  # the head has run
        assert got.after_head(h, head, StepChoice(1, 1), 100) == StepChoice(*best)
    # a policy without a head-reading predictor keeps the choice made before the head
    assert pol.after_head(h, head, StepChoice(2, 4), 100) == StepChoice(2, 4)


def saved_plain(tmp_path, plan):
    """A predictor reading the hidden state alone, saved under tmp_path / "plain"."""
    out = tmp_path / "plain"
    save_predictor(out, plan, DepthPredictor(16, 3, units=8), LinearDepthPredictor(16, 3), {})
    return out


def test_refuses_head_k_disagreeing_with_weights(saved, plan):
    out, _, _ = saved
    m = json.loads((out / MANIFEST_FILE).read_text())
    m["feature"]["head_k"] = 2
    (out / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(YggError, match=r"tensor mean has shape \[16\], expected \[18\] \(hidden size 16, head_k 2"):
        load_predictor(out, plan)


# ----------------------------------------------------------------------------- records


def test_records_round_trip_and_tamper(tmp_path):
    rec = synthetic(n_prompts=3, steps=4)
    p = save_records(tmp_path / "r.safetensors", rec, {"seed": 7, "identity": {"dtype": "float32"}})
    got, meta = load_records(p)
    for k, v in rec.tensors().items():
        assert torch.equal(getattr(got, k), v)
    assert meta["seed"] == 7 and meta["data_hash"] == data_hash(rec) and meta["steps"] == 12
    side = json.loads(sidecar_path(p).read_text())
    side["data_hash"] = "0" * 64
    sidecar_path(p).write_text(json.dumps(side))
    with pytest.raises(YggError, match="do not match .*data hash differs"):
        load_records(p)
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(YggError, match="cannot read depth records"):
        load_records(p)


def test_records_from_a_tiny_engine():
    target = tiny()
    wd, d_max = 2, 3
    tree = TreeParams(draft_width=wd, draft_depth=d_max, verify_width=1 + wd * d_max, top_k=2)
    cfg = EngineConfig(mode="reference", max_context=128, prefill_chunk=8, tree=tree)
    engine = Engine(target, cfg, bigram_head(target, max_depth=d_max))
    prompts = [list(range(5, 14)), [(7 * i) % 90 + 3 for i in range(15)]]
    rec = collect_records(engine, prompts, d_max, wd, max_new_tokens=20)
    s = rec.h.shape[0]
    assert rec.h.shape == (s, 64) and rec.h.dtype == torch.float32
    assert torch.equal(rec.len_by_depth[:, -1], rec.n_accepted)
    assert bool((rec.len_by_depth[:, 1:] >= rec.len_by_depth[:, :-1]).all())
    assert bool((rec.len_by_depth <= torch.arange(1, d_max + 1)).all())
    assert sorted(set(rec.prompt.tolist())) == [0, 1]
    assert int(rec.n_accepted.sum()) > 0  # the bigram head gets accepted sometimes
    first = rec.committed[rec.prompt == 1][0]
    assert int(first) == len(prompts[1])  # the first step starts right after the prefill
    # the head's top-W_d log-probs at the root: the tree's depth-1 nodes, descending
    assert rec.head_logp.shape == (s, wd) and bool((rec.head_logp <= 0).all())
    assert bool((rec.head_logp[:, :-1] >= rec.head_logp[:, 1:]).all())


def two_record_files(tmp_path):
    """A plan for a stand-in model file and synthetic records (12 prompts x 20 steps) stored as
    two disjoint files, prompts 0-7 and 8-11: (plan, plan path, file a, file b, the records)."""
    import yaml

    from yggtree.plan import load_plan
    from yggtree.runtime.artifacts import pair_identity

    (tmp_path / "model.gguf").write_bytes(b"x" * 100)
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({"name": "t", "target": "model.gguf", "drafter": "self",
                                         "draft_widths": [1, 2], "d_max": 6, "verify_widths": [4, 8]}))
    plan = load_plan(plan_path)
    rec = synthetic(n_prompts=12, steps=20)
    meta = {"identity": pair_identity(plan), "d_max": 6, "draft_width": 2, "verify_width": 13}
    a = save_records(tmp_path / "a.safetensors", rec.select(rec.prompt < 8), meta)
    b = save_records(tmp_path / "b.safetensors", rec.select(rec.prompt >= 8), meta)
    return plan, plan_path, a, b, rec


def test_train_command_on_stored_records(tmp_path, capsys):
    """``train-predictor --records A B``: two disjoint record files -> a loadable predictor, the
    metrics and one JSON line; outputs are not overwritten without --force."""
    from yggtree.offline.train_predictor import main

    plan, plan_path, a, b, rec = two_record_files(tmp_path)
    out = tmp_path / "out"
    argv = ["--plan", str(plan_path), "--records", str(a), str(b), "--epochs", "3", "--holdout", "3",
            "--out-dir", str(out)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 240 and summary["heldout_prompts"] == 3 and summary["heldout_steps"] == 60
    man = json.loads((out / MANIFEST_FILE).read_text())
    assert man["data"]["data_hash"] == data_hash(rec) and man["draft_width"] == 2
    assert man["feature"] == man["feature"] | {"layer": "final_norm", "hidden_size": 16}
    assert set(man["metrics"]["heldout"]) == {"mlp", "baseline", "constant"}
    assert load_predictor(out, plan).d_max == 6 and load_predictor(out, plan, "baseline").d_max == 6
    for f in ("depth_metrics.csv", "depth_calibration.png"):
        assert (out / f).stat().st_size > 0
    assert main(argv) == 1  # exists: refused without --force
    assert "already exists (pass --force" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    repeated = ["--plan", str(plan_path), "--records", str(a), "--records", str(b), "--epochs", "3",
                "--holdout", "3", "--out-dir", str(tmp_path / "o1")]
    assert main(repeated) == 0  # the flag given twice reads both files, as one flag with two
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 240
    assert main(["--plan", str(plan_path), "--records", str(a), str(a), "--out-dir", str(tmp_path / "o2")]) == 1
    assert "share prompts" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(20))
def test_depth_headroom_oracle_is_the_brute_force_best(seed):
    """The oracle's speed-up equals the best of every per-step choice of D (brute force); it is
    at least every fixed depth's and every predictor's; fixed depths by hand."""
    import itertools

    from yggtree.offline.predictor_fit import depth_headroom

    rng = np.random.default_rng(seed)
    s, d = 5, 3
    lens = np.sort(rng.integers(0, 4, size=(s, d)), axis=1)
    lens = np.minimum(lens, np.arange(1, d + 1))
    t = 40 + np.cumsum(rng.uniform(1, 15, size=(s, d)), axis=1)
    plain = rng.uniform(35, 45, size=s)
    p_ge = {"good": (lens[:, -1:] >= np.arange(1, d + 1)).astype(float),
            "ones": np.tile([1.0, 0.0, 0.0], (s, 1))}
    got = depth_headroom(lens, t, plain, p_ge)
    base = s / plain.sum()
    for k in range(d):
        assert got["fixed"][k] == pytest.approx((1 + lens[:, k]).sum() / t[:, k].sum() / base, abs=1e-4)
    best = max((1 + lens[range(s), c]).sum() / t[range(s), c].sum() / base
               for c in map(list, itertools.product(range(d), repeat=s)))
    assert got["oracle"] == pytest.approx(best, abs=1e-4)
    assert got["oracle"] >= max(got["fixed"]) - 1e-4 and got["oracle"] >= got["good"] - 1e-4
    assert got["ones"] == got["fixed"][0] and got["best_fixed_depth"] == int(np.argmax(got["fixed"])) + 1
