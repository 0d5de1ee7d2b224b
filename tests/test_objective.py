"""The latency objective: calibrated path values, AAL per W_v, the W_v / (D, W_d) choices against
brute force on synthetic costs, pruning by top-k == DP == brute force on calibrated values, and
refusal of missing / malformed / foreign profiles and calibrations."""

from __future__ import annotations

from dataclasses import replace

import json
import math
from pathlib import Path

import pytest
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_prune import prune_bruteforce, random_parents
from yggtree.errors import YggError
from yggtree.plan import validate_plan
from yggtree.runtime.artifacts import CALIBRATION_KIND, FORMAT_VERSION, PROFILE_KIND, pair_identity, timing_identity
from yggtree.runtime.calibration import Calibration, aal_by_width, path_values
from yggtree.runtime.cost import CostModel, Curve
from yggtree.runtime.objective import ObjectivePolicy, best_verify
from yggtree.runtime.policy import StepChoice
from yggtree.runtime.lookup import Proposal
from yggtree.runtime.prune import prune_dp, prune_topk
from yggtree.runtime.tree import Tree


def topo_tree(parent: list[int], logq: list[float]) -> Tree:
    """A Tree whose node i has parent[i] < i (slot order like EGT) and edge log-prob logq[i]."""
    n = len(parent)
    depth, logp = [0] * n, [0.0] * n
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
        logp[i] = logp[parent[i]] + logq[i]
    return Tree(
        token=torch.arange(n), parent=torch.tensor(parent), depth=torch.tensor(depth),
        valid=torch.ones(n, dtype=torch.bool), logp=torch.tensor(logp, dtype=torch.float32),
    )


def topo_parents(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [0] + [rng.randrange(i) for i in range(1, n)]


def egt_parents(seed: int, wd: int, d: int) -> list[int]:
    """Parents of a drafted tree as EGT lays it out: level l (1..d) holds wd slots, each the
    child of a random slot of level l - 1 (the root for level 1), so the tree is exactly d deep."""
    import random

    rng = random.Random(seed)
    parent = [0] * (1 + wd)
    for level in range(2, d + 1):
        first = 1 + (level - 2) * wd  # the previous level's first slot
        parent += [first + rng.randrange(wd) for _ in range(wd)]
    return parent


CAL = Calibration((0.0, 0.3, 1.0), (0.05, 0.2, 0.9))


def cal_scalar(q: float) -> float:
    xs, ys = CAL.xs, CAL.ys
    q = min(max(q, xs[0]), xs[-1])
    for a, b, ya, yb in zip(xs, xs[1:], ys, ys[1:]):
        if a <= q <= b:
            return ya + (q - a) / (b - a) * (yb - ya)
    return ys[-1]


trees = st.tuples(st.integers(1, 9), st.integers(0, 2**31 - 1),
                  st.lists(st.floats(0.01, 1.0), min_size=9, max_size=9))


def drawn_tree(t) -> tuple[int, list[float], list[int], Tree]:
    """(n, qs, parent, tree) of a drawn ``trees`` example: n nodes in topological order, node u's
    edge probability qs[u]."""
    n, seed, qs = t
    parent = topo_parents(seed, n)
    return n, qs, parent, topo_tree(parent, [0.0] + [math.log(q) for q in qs[1:n]])


@settings(max_examples=60, deadline=None)
@given(trees)
def test_path_values_equal_products_along_paths(t):
    n, qs, parent, tree = drawn_tree(t)
    got = path_values(tree, CAL.edge_prob, d_max=n).tolist()
    for i in range(n):
        want, u = 1.0, i
        while u != 0:
            want *= cal_scalar(qs[u])
            u = parent[u]
        assert got[i] == pytest.approx(want, rel=1e-5, abs=1e-7)
    # monotone along paths: the device top-k is exact for them
    assert all(got[i] <= got[parent[i]] + 1e-7 for i in range(1, n))


@settings(max_examples=60, deadline=None)
@given(trees, st.integers(1, 10))
def test_topk_dp_bruteforce_agree_on_calibrated_values(t, w_v):
    n, qs, parent, tree = drawn_tree(t)
    val = path_values(tree, CAL.edge_prob, d_max=n)
    kept, ok = prune_topk(tree, val, w_v)
    topk_value = float(val[kept[ok]].sum())
    dp_value, _ = prune_dp(parent, val.tolist(), w_v)
    brute = prune_bruteforce(parent, val.tolist(), w_v)
    assert topk_value == pytest.approx(dp_value, rel=1e-5)
    assert dp_value == pytest.approx(brute, rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_aal_by_width_is_one_plus_top_values_by_key(t):
    n, qs, parent, tree = drawn_tree(t)
    val = path_values(tree, CAL.edge_prob, d_max=n)
    widths = [1, 2, 3, 5, 8, 16]
    got = aal_by_width(val, tree, widths)
    # brute force: the engine keeps prune_topk(tree, logp, w); AAL = 1 + their values (root 1)
    for w, a in zip(widths, got):
        kept, ok = prune_topk(tree, tree.logp, w)
        assert a == pytest.approx(float(val[kept[ok]].sum()), rel=1e-5)


@settings(max_examples=80, deadline=None)
@given(trees, st.integers(1, 9), st.lists(st.booleans(), min_size=9, max_size=9), st.booleans())
def test_host_aal_by_width_is_the_tensor_one(t, d_max, dead, tie):
    """``aal_by_width_lists`` (the policy's host path on a CPU) equals ``aal_by_width`` of
    ``path_values`` up to float32 rounding: any depth bound, invalid leaves (padding slots), and
    equal log-probabilities (the tie-breaks by depth, then slot)."""
    from yggtree.runtime.calibration import aal_by_width_lists

    n, qs, parent, tree = drawn_tree(t)
    leaf = [i > 0 and i not in parent for i in range(n)]
    valid = torch.tensor([not (leaf[i] and dead[i]) for i in range(n)])
    logp = torch.where(valid, tree.logp, float("-inf"))
    if tie:
        logp = torch.where(valid & (torch.arange(n) > 0), logp.round(decimals=1), logp)
    tree = Tree(tree.token, tree.parent, tree.depth, valid, logp)
    widths = [1, 2, 3, 5, 8, 16]
    want = aal_by_width(path_values(tree, CAL.edge_prob, d_max), tree, widths)
    got = aal_by_width_lists(tree, CAL, d_max, widths)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_best_verify_is_the_argmax():
    widths = [1, 4, 8, 16]
    aal = [1.0, 1.8, 2.1, 2.2]
    step = [30.0, 40.0, 44.0, 60.0]
    w, s = best_verify(aal, widths, step, 30.0)
    cands = [a * 30.0 / t for a, t in zip(aal, step)]
    assert w == widths[cands.index(max(cands))] and s == pytest.approx(max(cands))


# ----------------------------------------------------------------------------- synthetic costs


def flat_curve(ms_at: dict[int, float], buckets=(256, 1024)) -> Curve:
    xs = tuple(float(w) for w in sorted(ms_at))
    ys = tuple(ms_at[w] for w in sorted(ms_at))
    return Curve(tuple(buckets), (xs, xs), (ys, tuple(y * 1.2 for y in ys)))


def cost_model(draft_ms=2.0) -> CostModel:
    verify = flat_curve({1: 30.0, 4: 31.0, 8: 33.0, 16: 38.0, 32: 48.0})
    draft = flat_curve({1: draft_ms, 2: draft_ms * 1.05, 4: draft_ms * 1.1, 8: draft_ms * 1.3})
    head = Curve((256, 1024), ((7.0,), (7.0,)), ((draft_ms,), (draft_ms,)))
    stages = {"egt": {"1": 0.05, "8": 0.08}, "prune": {"4": 0.1, "32": 0.2}, "accept": 0.1,
              "commit": 0.1, "policy": 0.2, "plain_accept": 0.05}
    return CostModel(verify, draft, head, stages)


def test_step_cost_counts_the_drafter_calls_a_tree_makes():
    """A KV-cache drafter feeds all D levels after its head; an EAGLE head skips the last one."""
    from dataclasses import replace

    lm = cost_model()
    eagle = replace(lm, feeds_leaves=False)
    for d in (1, 3, 6):
        assert lm.step_ms(d, 4, 8, 100) - eagle.step_ms(d, 4, 8, 100) == pytest.approx(lm.t_draft(4, 100))
    assert eagle.step_ms(1, 4, 4, 100) == pytest.approx(
        2.0 + 31.0 + eagle.overhead_ms(1, 4, 4))  # the head, the verify call, the stages


def table(aal_fn, wds=(1, 2, 4, 8), d_max=6, wvs=(4, 8, 16, 32)) -> dict:
    return {str(wd): [[aal_fn(wd, d, wv) for wv in wvs] for d in range(1, d_max + 1)] for wd in wds}


def policy(calib, draft_ms=2.0) -> ObjectivePolicy:
    return ObjectivePolicy(cost_model(draft_ms), calib, (1, 2, 4, 8), (4, 8, 16, 32), 6)


def saturating_aal(wd: int, d: int, wv: int) -> float:
    """A calibration's AAL that grows with depth and width, saturating."""
    return 1 + min(d, 1 + wv // 4) * (1 - 0.5 ** wd) * 0.9


def run_steps(pol: ObjectivePolicy, tree: Tree, n: int, drafted) -> list[int]:
    """``n`` steps of ``pol`` at context 100, each reported as it ran: a drafted step with the
    record ``drafted(i, choice)`` gives, a plain step at its predicted time. The depth of each."""
    out = []
    for i in range(n):
        c = pol.choose_draft(torch.zeros(8), 100)
        out.append(c.draft_depth)
        if c.draft_depth:
            pol.choose_verify(tree, c, 100)
            pol.observe(drafted(i, c))
        else:
            pol.observe(_record(c, 0, pol.cost.plain_ms(100)))
    return out


def brute_plan(pol: ObjectivePolicy, ctx: int) -> tuple[StepChoice, float]:
    plain = pol.cost.plain_ms(ctx)
    best = (StepChoice(0, 1), 1.0)
    for d in range(1, 7):
        for wd in (1, 2, 4, 8):
            for wv in (1, 4, 8, 16, 32):
                a = 1.0 if wv == 1 else pol.calib.expected_aal(wd, d, wv)
                s = a * plain / pol.cost.step_ms(d, wd, wv, ctx)
                if s > best[1]:
                    best = (StepChoice(d, wd), s)
    return best


def test_weak_drafter_means_plain_steps():
    weak = Calibration((0.0, 1.0), (0.0, 0.02), table(lambda wd, d, wv: 1.02), (4, 8, 16, 32))
    pol = policy(weak)
    assert pol.choose_draft(torch.zeros(8), 100) == StepChoice(0, 1)
    assert brute_plan(pol, 100)[0] == StepChoice(0, 1)


@pytest.mark.parametrize("draft_ms", [0.5, 2.0, 8.0])
def test_draft_choice_equals_brute_force(draft_ms):
    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(saturating_aal), (4, 8, 16, 32))
    pol = policy(cal, draft_ms)
    for ctx in (100, 600):
        want, s = brute_plan(pol, ctx)
        got, s2 = pol.plan_choice(ctx)
        assert got == want and s2 == pytest.approx(s)
        assert pol.choose_draft(torch.zeros(8), ctx) == want
    assert want.draft_depth > 0  # a good, cheap drafter speculates


def test_given_depth_chooses_width_only():
    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + 0.3 * d + 0.1 * wd),
                      (4, 8, 16, 32))
    pol = ObjectivePolicy(cost_model(), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, depth_fn=lambda h, c: 3)
    assert pol.choose_draft(torch.zeros(8), 100).draft_depth == 3
    pol0 = ObjectivePolicy(cost_model(), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, depth_fn=lambda h, c: 0)
    assert pol0.choose_draft(torch.zeros(8), 100).draft_depth == 0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(1, 6), (2, 4), (4, 3), (8, 2)]),
       st.lists(st.floats(0.01, 1.0), min_size=49, max_size=49))
def test_verify_choice_equals_brute_force(seed, shape, qs):
    wd, d = shape
    n = 1 + wd * d
    parent = egt_parents(seed, wd, d)
    tree = topo_tree(parent, [0.0] + [math.log(q) for q in qs[1:n]])
    assert int(tree.depth.max()) == d
    cal = Calibration((0.0, 0.5, 1.0), (0.0, 0.6, 0.95))
    pol = policy(cal)
    wv = pol.choose_verify(tree, StepChoice(d, wd), 100)
    vals = path_values(tree, cal.edge_prob, n)
    best, best_s = None, -1.0
    for w in (1, 4, 8, 16, 32):
        kept, ok = prune_topk(tree, tree.logp, w)
        s = float(vals[kept[ok]].sum()) * pol.cost.plain_ms(100) / pol.cost.step_ms(d, wd, w, 100)
        if s > best_s + 1e-9:
            best, best_s = w, s
    assert wv == best
    assert pol.log[-1].speedup == pytest.approx(best_s, rel=1e-5)


def test_curve_interpolates_knots_and_picks_buckets():
    c = Curve((256, 1074), ((1.0, 8.0, 32.0), (1.0, 8.0, 32.0)), ((10.0, 12.0, 20.0), (15.0, 18.0, 30.0)))
    assert c.predict(8, 100) == 12.0
    assert c.predict(16, 100) == pytest.approx(12 + 8 / 24 * 8)
    assert c.predict(8, 300) == 18.0  # ctx + W beyond 256: the next bucket
    assert c.predict(64, 2000) == pytest.approx(30 + 12 / 24 * 32)  # extrapolated, last bucket


def test_plain_time_is_priced_once_per_context_bucket():
    """``plain_ms`` (asked every step) is read from a per-bucket table: equal to pricing the
    width-1 call and the token choice at every context, past the last bucket included."""
    from dataclasses import replace

    verify = Curve((256, 512, 1074), ((1.0, 8.0),) * 3, ((10.0, 12.0), (11.0, 13.5), (14.0, 17.0)))
    c = replace(cost_model(), verify=verify)
    for ctx in range(0, 1300, 7):
        assert c.plain_ms(ctx) == c.t_verify(1, ctx) + c._stage("plain_accept"), ctx


# ----------------------------------------------------------------------------- files


@pytest.fixture
def plan(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x" * 100)
    return validate_plan({"name": "t", "target": str(model), "drafter": "self", "dtype": "float32",
                          "draft_widths": [1, 2], "d_max": 2, "verify_widths": [2, 4]})


def profile_dict(plan) -> dict:
    c = {"buckets": [256], "xs": [[1, 4]], "ys": [[10.0, 11.0]]}
    return {"kind": PROFILE_KIND, "version": FORMAT_VERSION, "name": "cpu-test",
            "identity": timing_identity(plan), "fit": {"verify": c, "draft": c, "head": c},
            "stage_ms": {"policy": 0.1}}


def write(tmp_path, d, name="p.json"):
    p = tmp_path / name
    p.write_text(d if isinstance(d, str) else json.dumps(d))
    return p


def test_profile_loads_for_its_plan(tmp_path, plan):
    from yggtree.runtime.device import detect_device, device_record

    here = detect_device()
    d = profile_dict(plan) | {"hardware": device_record(here)}
    cm = CostModel.from_profile(write(tmp_path, d), plan)
    assert cm.t_verify(4, 10) == 11.0 and cm.plain_ms(10) == 10.0


@pytest.mark.parametrize(
    "mutate, match",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        (lambda d: d | {"kind": "other"}, "is not a yggtree-profile file"),
        (lambda d: d | {"version": 99}, "format version 99"),
        (lambda d: d | {"identity": d["identity"] | {"dtype": "bfloat16"}}, "another setup .*dtype"),
        (lambda d: d | {"identity": d["identity"] | {"target": [{"name": "other.gguf", "size": 1}]}},
         "another setup .*target"),
        (lambda d: {k: v for k, v in d.items() if k != "fit"}, "no 'fit' section"),
        (lambda d: d | {"fit": d["fit"] | {"verify": {"buckets": [256], "xs": [[4, 1]], "ys": [[1, 2]]}}},
         "malformed latency curve"),
        (lambda d: d | {"fit": d["fit"] | {"draft": {"buckets": [256]}}}, "malformed latency curve"),
        (lambda d: d | {"hardware": {"device": "cuda", "device_name": "NVIDIA A100-SXM4-80GB"}},
         "made on cuda 'NVIDIA A100-SXM4-80GB', this process runs on cpu .*yggtree profile"),
    ],
)
def test_bad_profiles_are_refused(tmp_path, plan, mutate, match):
    if mutate is None:
        path = tmp_path / "missing.json"
    elif isinstance(mutate, str):
        path = write(tmp_path, mutate)
    else:
        path = write(tmp_path, mutate(profile_dict(plan)))
    with pytest.raises(YggError, match=match):
        CostModel.from_profile(path, plan)


def calib_dict(plan) -> dict:
    return {"kind": CALIBRATION_KIND, "version": FORMAT_VERSION, "identity": pair_identity(plan),
            "map": {"x": [0.0, 1.0], "y": [0.1, 0.8]}, "verify_widths": [2, 4],
            "aal": {"1": [[1.1, 1.2], [1.2, 1.3]]}}


def test_calibration_loads_and_refuses(tmp_path, plan):
    cal = Calibration.load(write(tmp_path, calib_dict(plan)), plan)
    assert cal.expected_aal(1, 2, 4) == 1.3 and cal.expected_aal(2, 1, 4) is None
    assert torch.allclose(cal.edge_prob(torch.tensor([0.0, 0.5, 1.0])), torch.tensor([0.1, 0.45, 0.8]))
    bad = calib_dict(plan)
    bad["identity"] = bad["identity"] | {"dtype": "bfloat16"}
    with pytest.raises(YggError, match="another target/drafter/dtype"):
        Calibration.load(write(tmp_path, bad, "b.json"), plan)
    bad = calib_dict(plan) | {"map": {"x": [0.5, 0.1], "y": [0.1, 0.2]}}
    with pytest.raises(YggError, match="malformed map"):
        Calibration.load(write(tmp_path, bad, "c.json"), plan)
    with pytest.raises(YggError, match="does not exist"):
        Calibration.load(tmp_path / "none.json", plan)


def test_plan_policy_needs_both_files_and_checks_them(tmp_path):
    from yggtree.plan import default_plan
    from yggtree.runtime.objective import plan_policy

    base = default_plan()
    assert plan_policy(base) is None  # neither file: one fixed tree
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    with pytest.raises(YggError, match="names a profile but no calibration.*yggtree calibrate"):
        plan_policy(replace(base, profile=str(prof)))
    with pytest.raises(YggError, match="names a calibration but no profile.*yggtree profile"):
        plan_policy(replace(base, calibration=str(prof)))
    with pytest.raises(YggError, match=f"profile {prof} is not a yggtree-profile file"):
        plan_policy(replace(base, profile=str(prof), calibration=str(prof)))
    with pytest.raises(YggError, match="does not exist"):
        plan_policy(replace(base, profile=str(tmp_path / "nope.json"), calibration=str(prof)))


def tiny_objective_plan(d: Path, name: str) -> Path:
    """``d`` with a tiny checkpoint and plan.yaml (self-drafting, eager, D <= 2, W_v in {2, 4})
    naming a profile and a calibration made up so that speculation pays: wide steps cost about one
    token, acceptance is high. Returns ``d``."""
    from helpers import tiny_plan_dir

    from yggtree.plan import load_plan
    from yggtree.runtime.device import detect_device, device_record

    tiny_plan_dir(d, f"name: {name}\ntarget: model\ndrafter: self\nbackend: eager\nmax_context: 64\n"
                     "prefill_chunk: 4\ndraft_widths: [1, 2]\nd_max: 2\ntop_k: 2\nverify_widths: [2, 4]\n"
                     "sampling: {max_new_tokens: 12}\nprofile: prof.json\ncalibration: cal.json\n")
    write(d, "{}", "prof.json")
    write(d, "{}", "cal.json")
    bare = load_plan(d / "plan.yaml")
    here = detect_device()
    cheap = {"buckets": [128], "xs": [[1, 8]], "ys": [[10.0, 10.5]]}  # wide steps cost ~ one token
    write(d, {"kind": PROFILE_KIND, "version": FORMAT_VERSION, "name": "t", "identity": timing_identity(bare),
              "fit": {"verify": cheap, "draft": cheap | {"ys": [[0.5, 0.6]]}, "head": cheap | {"ys": [[0.5, 0.6]]}},
              "hardware": device_record(here)}, "prof.json")
    write(d, {"kind": CALIBRATION_KIND, "version": FORMAT_VERSION, "identity": pair_identity(bare),
              "map": {"x": [0.0, 1.0], "y": [0.2, 0.9]}, "verify_widths": [2, 4],
              "aal": {"1": [[1.5, 1.5], [1.6, 2.2]], "2": [[1.7, 1.7], [1.9, 2.6]]}}, "cal.json")
    return d


def test_run_with_a_plan_decodes_with_the_objective(tmp_path, capsys):
    """`yggtree run --plan` with a profile and a calibration: the objective chooses every step,
    the output equals plain decoding, and --json reports the choices and the prediction."""
    pytest.importorskip("transformers")
    from yggtree.cli import main

    tiny_objective_plan(tmp_path, "obj")
    args = ["run", "--plan", str(tmp_path / "plan.yaml"), "--raw", "--prompt", "t3 t4 t5 t6",
            "--max-new-tokens", "12", "--json", "--no-feedback"]  # deterministic choices
    assert main(args) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(args + ["--no-speculate"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    chosen = spec["stats"]["steps_by_choice"]
    assert chosen and all(k.split(",")[0] != "0" for k in chosen)  # speculation pays here
    assert spec["stats"]["predicted_speedup"] > 1
    assert "steps_by_choice" not in plain["stats"]  # --no-speculate: the plan's plain engine, no drafter
    # one of the two files alone is refused with one line
    (tmp_path / "half.yaml").write_text((tmp_path / "plan.yaml").read_text().replace("calibration: cal.json\n", ""))
    assert main(["run", "--plan", str(tmp_path / "half.yaml"), "--raw", "--prompt", "t3"]) != 0
    err = capsys.readouterr().err
    assert "names a profile but no calibration" in err and len(err.strip().splitlines()) == 1
    # --depth N fixes D and keeps the objective's widths; outside 1..d_max it is refused
    assert main(args + ["--depth", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["token_ids"] == plain["token_ids"]
    assert all(k.startswith("1,") for k in one["stats"]["steps_by_choice"])
    for bad, msg in (("3", "--depth 3 is outside the plan's 1..d_max (2)"), ("x", "--depth must be auto"),
                     ("1 --draft-depth 1", "--depth and --draft-depth exclude each other")):
        assert main(args + ["--depth", *bad.split()]) != 0
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- online feedback


def _record(choice: StepChoice, n_accepted: int, ms: float, verify_ms: float | None = None):
    """A finished step of ``ms`` in all, ``verify_ms`` of it (default: all) in the verify call."""
    from yggtree.runtime.policy import StepRecord

    v = ms if verify_ms is None else verify_ms
    return StepRecord(torch.zeros(8), 100, choice, 1, n_accepted, {"verify": v, "draft": ms - v})


def test_feedback_tracks_measured_ratios():
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(alpha=0.2, accept_alpha=0.2, prior_tokens=0.0)  # the steps' own rate
    spec = Prediction(100, 2, 8, aal=3.0, step_ms=40.0, plain_ms=30.0)
    plain = Prediction(100, 0, 1, aal=1.0, step_ms=30.0, plain_ms=30.0)
    for _ in range(200):  # the drafter delivers half of what was expected; steps run 1.5x longer
        fb.update(spec, n_accepted=1, step_ms=60.0)
        fb.update(plain, n_accepted=0, step_ms=33.0)
    assert fb.accept_scale_at(2) == pytest.approx(0.5)
    assert fb.step_ms(40.0, 0.0, 8) == pytest.approx(60.0) and fb.plain_ms(30.0) == pytest.approx(33.0)
    assert fb.aal(3.0, 2) == pytest.approx(2.0)
    fresh = Feedback()  # starts at the offline model
    assert fresh.accept_scale_at(1) == 1.0 and fresh.aal(2.5, 1) == 2.5 and fresh.aal(2.5, 3) == 2.5
    assert fresh.plain_ms(30.0) == 30.0 and fresh.step_ms(40.0, 30.0, 8) == 40.0


def test_feedback_scales_acceptance_per_depth():
    """Deep trees deliver half the calibrated tokens, one-call trees all of them: each depth
    keeps its own scale (no prior here)."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(alpha=0.2, accept_alpha=0.2, prior_tokens=0.0)
    deep = Prediction(100, 3, 16, aal=3.0, step_ms=40.0, plain_ms=30.0)
    one = Prediction(100, 1, 4, aal=1.6, step_ms=35.0, plain_ms=30.0)
    for _ in range(200):
        fb.update(deep, n_accepted=1, step_ms=40.0)  # expected 2 drafted tokens
        fb.update(one, n_accepted=0.6, step_ms=35.0)  # expected 0.6 (a mean over steps)
    assert fb.accept_scale_at(3) == pytest.approx(0.5) and fb.accept_scale_at(1) == pytest.approx(1.0)
    assert fb.accept_scale_at(2) == pytest.approx(1.0) and fb.aal(2.0, 2) == pytest.approx(2.0)
    assert fb.aal(3.0, 3) == pytest.approx(2.0) and fb.aal(1.6, 1) == pytest.approx(1.6)
    np.testing.assert_allclose(fb.aal(np.array([3.0, 1.6, 2.0]), np.array([3, 1, 2])), [2.0, 1.6, 2.0])


def test_feedback_depth_not_run_inherits_the_shallower_scale():
    """One-call trees deliver 40% of the calibrated tokens: a depth not run yet starts at that
    scale (a deeper tree multiplies more over-rated edges), not at the offline model's 1; its own
    steps then take over, the prior weighing ``prior_tokens`` expected tokens."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(accept_alpha=0.02, prior_tokens=2.0, age_alpha=0.0)  # (aging: its own test)
    one = Prediction(100, 1, 4, aal=1.5, step_ms=35.0, plain_ms=30.0)
    for _ in range(500):
        fb.update(one, n_accepted=0.2, step_ms=35.0)  # expected 0.5
    s1 = fb.global_scale_at(1)
    g = (1 - 0.98**500) / 0.02  # the discounted weight of 500 steps
    assert s1 == pytest.approx((0.2 * g + 2 * 1.0) / (0.5 * g + 2), rel=1e-12)  # 0.4, pulled up by the prior 1
    assert fb.global_scale_at(2) == pytest.approx(s1) and fb.global_scale_at(5) == pytest.approx(s1)
    two = Prediction(100, 2, 8, aal=2.0, step_ms=45.0, plain_ms=30.0)
    for _ in range(500):
        fb.update(two, n_accepted=0.8, step_ms=45.0)  # expected 1: depth 2 does better
    s2 = fb.global_scale_at(2)
    assert s2 == pytest.approx((0.8 * g + 2 * s1) / (1.0 * g + 2), rel=1e-12)  # prior: depth 1's
    assert fb.global_scale_at(3) == pytest.approx(s2)


def test_feedback_learns_each_request_from_the_all_requests_scale():
    """Requests differ: the first delivers 40% of the calibrated tokens, the next all of them.
    A request starts at the all-requests scale and moves to its own within a few steps."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(request_prior_tokens=3.0)
    one = Prediction(100, 1, 4, aal=1.5, step_ms=35.0, plain_ms=30.0)
    fb.start_request()
    for _ in range(100):
        fb.update(one, n_accepted=0.2, step_ms=35.0)  # expected 0.5
    g = fb.global_scale_at(1)
    assert fb.accept_scale_at(1) == pytest.approx((20 + 3 * g) / (50 + 3))
    fb.start_request()
    assert fb.accept_scale_at(1) == pytest.approx(g) and fb.accept_scale_at(3) == pytest.approx(g)
    for _ in range(12):
        fb.update(one, n_accepted=0.5, step_ms=35.0)
    assert fb.accept_scale_at(1) == pytest.approx((6 + 3 * fb.global_scale_at(1)) / (6 + 3))
    assert fb.accept_scale_at(1) > 0.8 > fb.global_scale_at(1)


def test_feedback_without_per_request_acceptance_keeps_the_all_requests_scale():
    """``request_prior_tokens=None``: a request's own steps move no separate estimate; every
    request, from its first step, is priced at the all-requests scale (scalar and array paths)."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(request_prior_tokens=None, accept_alpha=0.1)
    one = Prediction(100, 1, 4, aal=1.5, step_ms=35.0, plain_ms=30.0)
    fb.start_request()
    for _ in range(30):
        fb.update(one, n_accepted=0.1, step_ms=35.0)
    g = [fb.global_scale_at(d) for d in range(4)]
    assert g[1] < 0.5 and [fb.accept_scale_at(d) for d in range(4)] == g
    assert list(fb.aal(np.full(4, 2.0), np.arange(4))) == pytest.approx([1 + x for x in g])
    fb.start_request()
    assert [fb.accept_scale_at(d) for d in range(4)] == g


def test_feedback_acceptance_evidence_ages_with_the_steps_that_add_nothing_to_it():
    """Plain steps age every depth's acceptance sums by ``age_alpha`` a step, applied
    ``age_every`` steps at a time (the feedback's state moves then, not before); a drafted step
    ages the depths it does not draft by one step more than the pending ones, its own depth by
    ``accept_alpha`` as it adds to it. Over enough plain steps the estimate returns to the prior;
    ``age_alpha=0`` keeps it for good (the old lock-in)."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(accept_alpha=0.02, prior_tokens=2.0, age_alpha=0.01, age_every=16)
    one = Prediction(100, 1, 4, aal=1.5, step_ms=35.0, plain_ms=30.0)
    two = Prediction(100, 2, 8, aal=2.0, step_ms=45.0, plain_ms=30.0)
    plain = Prediction(100, 0, 1, aal=1.0, step_ms=30.0, plain_ms=30.0)
    for _ in range(100):
        fb.update(one, n_accepted=0.1, step_ms=35.0)  # expected 0.5: a fifth
    fb.update(two, n_accepted=0.2, step_ms=45.0)  # ages depth 1 by one step
    (a1, e1), (a2, e2) = fb._by_depth[1], fb._by_depth[2]
    state, s1 = fb.state, fb.global_scale_at(1)
    assert s1 < 0.3
    for _ in range(15):
        fb.update(plain, 0, 30.0)
    assert fb.state == state and fb.global_scale_at(1) == s1  # pending: no repricing yet
    fb.update(plain, 0, 30.0)
    f = 0.99**16
    assert fb.state == state + 1 and fb._by_depth[1] == pytest.approx((f * a1, f * e1), rel=1e-12)
    assert fb.global_scale_at(1) == pytest.approx((f * a1 + 2) / (f * e1 + 2), rel=1e-12)
    for _ in range(5):
        fb.update(plain, 0, 30.0)
    fb.update(two, n_accepted=1.0, step_ms=45.0)  # 5 pending steps and its own
    g = 0.99**5
    assert fb._by_depth[1] == pytest.approx((f * g * 0.99 * a1, f * g * 0.99 * e1), rel=1e-12)
    assert fb._by_depth[2] == pytest.approx((f * g * 0.98 * a2 + 1.0, f * g * 0.98 * e2 + 1.0), rel=1e-12)
    for _ in range(2000):
        fb.update(plain, 0, 30.0)
    assert fb.global_scale_at(1) == pytest.approx(1.0, abs=1e-3)  # back at the offline model
    kept = Feedback(accept_alpha=0.02, prior_tokens=2.0, age_alpha=0.0)
    for _ in range(100):
        kept.update(one, n_accepted=0.1, step_ms=35.0)
    s = kept.global_scale_at(1)
    for _ in range(2000):
        kept.update(plain, 0, 30.0)
    assert kept.global_scale_at(1) == s
    learnt = Feedback().with_learnt(fb.learnt())  # the pending aging is part of what a run keeps
    assert learnt._by_depth == fb._by_depth and fb._aging == 0


def test_a_policy_that_fell_back_to_plain_steps_drafts_again_as_its_evidence_ages():
    """A stretch of text the drafter does badly on turns the policy to plain steps; with no
    probe (``probe_every`` beyond the run) it drafts again on its own merit once the aged
    estimate prices a tree above a plain step, where without aging it never would."""
    from yggtree.runtime.feedback import Feedback

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(saturating_aal), (4, 8, 16, 32))
    tree = topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1])
    firsts = {}
    for age in (0.0, 0.02):
        pol = ObjectivePolicy(cost_model(), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6,
                              feedback=Feedback(accept_alpha=0.2, age_alpha=age), probe_every=10**6)
        choices = run_steps(pol, tree, 600, lambda i, c: _record(c, 0 if i < 50 else 4, 60.0, 40.0))  # bad text, then good
        first_plain = choices.index(0)
        assert first_plain < 50
        firsts[age] = next((i for i in range(first_plain, 600) if choices[i]), None)
    assert firsts[0.0] is None  # locked into plain steps for good
    assert firsts[0.02] is not None and firsts[0.02] < 400


def test_lookup_only_steps_learn_their_own_overhead_factor():
    """A lookup-only step (D = 0, W_v > 1) whose non-verify part runs 3x its price moves
    ``lookup_extra``, not the drafted steps' ``spec_extra``: drafted trees stay priced at what
    drafted steps showed. Both are kept across runs (``learnt``); an older record has none."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(alpha=0.5)
    lk = Prediction(100, 0, 4, aal=1.5, step_ms=32.0, plain_ms=30.0, verify_ms=31.0)
    spec = Prediction(100, 2, 4, aal=2.0, step_ms=40.0, plain_ms=30.0, verify_ms=31.0)
    for _ in range(20):
        fb.update(lk, 1, step_ms=34.0, verify_ms=31.0)  # rest 3 ms against 1
        fb.update(spec, 1, step_ms=40.0, verify_ms=31.0)  # as priced
    assert fb.lookup_extra == pytest.approx(3.0, rel=1e-3) and fb.spec_extra == pytest.approx(1.0)
    assert fb.step_ms(32.0, 31.0, 4, lookup=True) == pytest.approx(34.0, rel=1e-3)
    assert fb.step_ms(40.0, 31.0, 4) == pytest.approx(40.0)
    again = Feedback().with_learnt(fb.learnt())
    assert again.lookup_extra == fb.lookup_extra and again.spec_extra == fb.spec_extra
    old = {k: v for k, v in fb.learnt().items() if k != "lookup_extra"}
    assert Feedback().with_learnt(old).lookup_extra == 1.0


def test_feedback_machine_factor_follows_the_verify_calls_of_drafted_steps():
    """With no plain step at all, the plain-time estimate still follows the machine: drafted
    steps' verify calls run 1.3x slower than profiled, so plain steps would too; the rest of the
    drafted step runs 2.6x its prediction (1.3 of it the machine's)."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback(alpha=0.2, accept_alpha=0.2)
    spec = Prediction(100, 2, 8, aal=3.0, step_ms=40.0, plain_ms=30.0, verify_ms=32.0)
    for _ in range(200):
        fb.update(spec, n_accepted=2, step_ms=32.0 * 1.3 + 8.0 * 2.6, verify_ms=32.0 * 1.3)
    assert fb.step_ms(40.0, 32.0, 8) == pytest.approx(32.0 * 1.3 + 8.0 * 2.6)
    # the width-8 factor took a small share of the slow-down while ``machine`` caught up
    # (~2% of a 30% step from a cold start, alpha 0.2): plain steps are predicted within 3%
    assert 1.0 < fb.width_factor(8) < 1.03 and fb.plain_ms(30.0) == pytest.approx(39.0, rel=0.03)
    assert fb.machine * fb.spec_extra == pytest.approx(2.6)


def test_feedback_learns_each_verify_width_relative_to_the_machine():
    """Plain (width-1) calls run 1.1x the profile, width-4 verify calls 0.95x, steps of both
    kinds interleaved: each width's corrected time converges to its own measured time, though
    one machine factor follows both (the profile had the widths' ratio wrong by 16%)."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import Prediction

    fb = Feedback()
    spec = Prediction(100, 1, 4, aal=1.5, step_ms=50.0, plain_ms=30.0, verify_ms=30.0)
    plain = Prediction(100, 0, 1, aal=1.0, step_ms=30.0, plain_ms=30.0)
    for _ in range(2000):
        fb.update(spec, n_accepted=1, step_ms=30.0 * 0.95 + 20.0, verify_ms=30.0 * 0.95)
        fb.update(plain, n_accepted=0, step_ms=33.0)
    assert fb.plain_ms(30.0) == pytest.approx(33.0, rel=0.01)  # just after a plain step
    fb.update(spec, n_accepted=1, step_ms=30.0 * 0.95 + 20.0, verify_ms=30.0 * 0.95)
    assert fb.step_ms(50.0, 30.0, 4) == pytest.approx(30.0 * 0.95 + 20.0, rel=0.01)
    assert fb.plain_ms(30.0) == pytest.approx(33.0, rel=0.02)  # one drafted step later


def test_feedback_falls_back_to_plain_and_probes():
    """Speculation predicted to pay but measured not to: the policy turns to plain steps, and
    after ``probe_every`` plain steps tries the best tree once; each losing probe doubles the
    gap to the next (up to ``probe_max``)."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.prediction import predicted_speedup

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(saturating_aal), (4, 8, 16, 32))
    pol = ObjectivePolicy(cost_model(), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6,
                          feedback=Feedback(alpha=0.5, accept_alpha=0.5, age_alpha=0.0), probe_every=4, probe_max=16,
                          probe_share=100.0)  # the probes' cost does not stretch the gaps here (see below)
    offline = policy(cal)
    tree = topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1])
    # nothing accepted, drafting 10x slower than predicted
    choices = run_steps(pol, tree, 80, lambda i, c: _record(c, 0, 500.0, 40.0))
    assert offline.choose_draft(torch.zeros(8), 100).draft_depth > 0  # offline: speculate
    first = choices.index(0)
    assert 1 <= first <= 6  # a few bad steps suffice (alpha 0.5, time ratios clipped to 1.5x; each
    # depth tried keeps its own acceptance scale, so a second depth may be tried first)
    spec_at = [i for i, d in enumerate(choices) if d and i >= first]
    gaps = [b - a - 1 for a, b in zip([first - 1, *spec_at], spec_at)]  # plain steps before each probe
    assert gaps == [4, 8, 16, 16, 16] and len(choices) - spec_at[-1] - 1 < 16  # every probe lost: back off
    # every depth tried is priced at under a third of the calibration (discounted sums at alpha
    # 0.5 hold a few steps' evidence against 2 pseudo-tokens at the shallower depth's scale)
    assert max(map(pol.feedback.accept_scale_at, pol.feedback._by_depth)) < 0.3
    assert pol.feedback.spec_extra > 4  # rises 1.25x per step
    assert predicted_speedup(pol.log, online=True) < predicted_speedup(pol.log)
    fresh = pol.fresh()
    assert fresh.feedback is not pol.feedback and fresh.feedback.spec_extra == 1.0 and not fresh.log
    while not (c := pol.choose_draft(torch.zeros(8), 100)).draft_depth:  # up to the next probe
        pol.observe(_record(c, 0, pol.cost.plain_ms(100)))
    pol.choose_verify(tree, c, 100)
    assert pol._probe_share() < 100.0  # every probe before lost: the share shrank
    pol.observe(_record(c, 4, 1.0))  # this one wins: probes come every 4 plain steps again
    assert pol._probe_gap == 4 and pol._probe_share() == 100.0  # and may take their full share


def test_probes_cost_at_most_their_share_of_the_plain_steps_before_them():
    """A probe that costs as much as 8 plain steps (a fast target: the drafter's catch-up and a
    wide verify against a 5 ms step) comes after 8 / share plain steps, not probe_every: the
    first one (its cost not yet measured) after probe_every, the next after 128 (losing, the gap
    doubled to 8, x 8 / (0.125 x 4): the share halved by the losing probe), the third not within
    200 steps (16 / 4 x 8 / 0.0625). The measured cost and the share are kept across requests
    (they are the machine's, the plan's and the text's), the gap is not; the share stops at its
    floor, and a fresh policy starts from the full share."""
    from yggtree.runtime.feedback import Feedback

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1.05), (4, 8, 16, 32))
    pol = ObjectivePolicy(cost_model(), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, feedback=Feedback(),
                          probe_every=4, probe_max=64, probe_share=0.25)
    assert pol.plan_choice(100)[1] <= 1.0  # every tree predicted to lose: plain steps and probes
    tree = topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1])

    def run(n):  # n steps: the depth of each; probes cost 8 plain steps and accept nothing
        return run_steps(pol, tree, n, lambda i, c: _record(c, 0, 8 * pol.feedback.plain_ms(pol.cost.plain_ms(100))))

    steps = run(200)
    at = [i for i, d in enumerate(steps) if d]
    gaps = [b - a - 1 for a, b in zip([-1, *at], at)]
    assert gaps == [4, 128]  # after the first probe: 2 x 4 / 4 x (8 / 0.125) = 128; then 512
    assert pol.feedback.probe_cost == pytest.approx(8.0, rel=0.01)
    assert pol._probe_share() == pytest.approx(0.25 / 4)  # halved by each losing probe
    pol.start_request()  # a new request: the gap starts again, the probe's cost and share stay
    assert pol._probe_after() == 128  # 8 / 0.0625 plain steps
    for _ in range(10):  # losing probes, each as soon as it may come: the share stops at its floor
        pol._plain_run = 10_000
        assert run(1)[0] > 0
    assert pol._probe_share() == pytest.approx(0.25 / 16)  # probe_floor x probe_share
    fresh = pol.fresh()
    assert fresh.feedback.probe_cost is None and fresh._probe_share() == 0.25


@pytest.mark.parametrize("seed", range(4))
def test_plain_steps_shortcut_chooses_as_full_pricing(seed, monkeypatch):
    """``_best_tree`` (a step's choice from the best tree and rate kept per feedback state), and its
    bound where lookup candidates join (plain or lookup-only wherever every drafted tree loses), make
    the same choices as pricing every tree each step (with and without lookup candidates), over random steps whose measured times and
    acceptance move the feedback both ways (machine slower and faster, widths drifting, trees
    accepting more or less than expected, new requests), across context buckets, with the
    drafter's catch-up growing over plain steps, emptied by drafted ones and learnt from them."""
    import random

    from yggtree.runtime.feedback import Feedback

    def aal(wd, d, wv):
        return 1 + min(d, 1 + wv // 4) * (1 - 0.5 ** wd) * 0.45

    def make():
        cal = Calibration((0.0, 1.0), (0.0, 0.9), table(aal), (4, 8, 16, 32))
        return ObjectivePolicy(catch_up_model(0.3), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6,
                               feedback=Feedback(alpha=0.3, accept_alpha=0.3), probe_every=3, probe_max=12)

    fast, full = make(), make()
    behind, remaining = 0, 10_000
    monkeypatch.setattr(full, "_best_tree", lambda ctx: None, raising=False)
    bounded = []  # steps with lookup candidates that the bound decided (every drafted tree losing)
    kept = []  # steps without candidates that the kept best tree decided, and whether it drafted
    best_of = fast._best_tree

    def spy(ctx):
        best = best_of(ctx)
        bounded.append(bool(fast._lookup) and best is not None and best[1] < 1.0 - 1e-6)
        if best is not None and not fast._lookup:
            kept.append(best[1] > 1.0)
        return best

    monkeypatch.setattr(fast, "_best_tree", spy, raising=False)
    rng = random.Random(seed)
    tree = topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1])
    kinds = set()
    for step in range(400):
        ctx = rng.choice((60, 100, 300, 700))
        if rng.random() < 0.02:
            fast.start_request(), full.start_request()
            behind, remaining = rng.choice((0, 40, 400)), rng.choice((16, 64, 10_000))
        fast.see_catch_up(behind, remaining), full.see_catch_up(behind, remaining)
        prop = lookup_chain([rng.uniform(0.0, 0.99) for _ in range(rng.randrange(1, 9))]) if rng.random() < 0.5 else Proposal()
        fast.see_lookup(prop, ctx), full.see_lookup(prop, ctx)
        a, b = fast.choose_draft(torch.zeros(8), ctx), full.choose_draft(torch.zeros(8), ctx)
        assert a == b, step
        assert fast.takes_lookup_only() == full.takes_lookup_only(), step
        kinds.add(a.draft_depth > 0)
        slow = rng.choice((0.6, 1.0, 1.7))
        if a.draft_depth:
            assert fast.choose_verify(tree, a, ctx) == full.choose_verify(tree, a, ctx)
            rec = _record(a, rng.randrange(5), slow * rng.uniform(20.0, 60.0), slow * 25.0)
            rec.stage_ms["resync"] = slow * 0.3 * behind
            behind = 0
        else:
            rec = _record(a, 0, slow * fast.cost.plain_ms(ctx))
            behind += 1
        remaining = max(remaining - 1, 1)
        fast.observe(rec), full.observe(rec)
    assert kinds == {False, True}  # both kinds of step were chosen
    assert fast._best_rate and any(bounded)  # and plain steps took the shortcut, with candidates too
    assert set(kept) == {False, True}  # the kept tree decided plain and drafted steps alike


def lookup_chain(values: list[float]):
    """A lookup chain whose edges are accepted with ``values`` (tokens 10, 11, ...)."""
    path, v = [], 1.0
    for p in values:
        v *= p
        path.append(v)
    n = len(values)
    return Proposal(tuple(range(10, 10 + n)), tuple(range(n)), tuple(range(1, n + 1)), (1.0,) * n, tuple(values),
                    tuple(path), 3)


def catch_up_model(per_token: float) -> CostModel:
    """:func:`cost_model` with a profiled drafter catch-up of ``per_token`` ms a token."""
    c = cost_model()
    return replace(c, stage_ms=c.stage_ms | {"resync": {"256": 256 * per_token}})


def test_the_catch_up_runs_the_cheaper_way_chunks_or_head_calls():
    """A drafter whose head takes in ``absorbs`` tokens: a catch-up of n tokens costs a chunk's
    call per chunk of the prefill grid it redoes, or ceil((n - absorbs) / (absorbs + 1)) head
    calls at the profile's head price (times the machine factor); the policy asks for head calls
    where they cost less, prices the catch-up at the cheaper way, and learns a chunk call's cost
    only from catch-ups that ran in chunks."""
    from yggtree.runtime.cost import catch_up_calls, catch_up_heads
    from yggtree.runtime.feedback import Feedback

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + min(d, 3) * 0.3), (4, 8, 16, 32))
    chunked = replace(catch_up_model(0.5), absorbs=0)  # 64-token chunks: 32 ms a call here
    pol = ObjectivePolicy(chunked, cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, chunk=64, feedback=Feedback())
    assert not pol.catch_up_by_heads(40, 200) and pol._catch_up_ways(40, 200)[1] == math.inf
    heads = ObjectivePolicy(replace(chunked, absorbs=6), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, chunk=64,
                            feedback=Feedback())
    head = heads.cost.head_ms(200)  # cost_model's: the draft call's 2 ms
    for behind in (7, 13, 20, 60, 190):
        by_chunks = catch_up_calls(behind, 200, 64) * 32.0
        by_heads = catch_up_heads(behind, 6) * head
        assert heads._catch_up_ways(behind, 200) == pytest.approx((by_chunks, by_heads))
        assert heads.catch_up_by_heads(behind, 200) == (by_heads < by_chunks)
        heads.see_catch_up(behind, 100)
        assert heads.catch_up_ms(200) == pytest.approx(min(by_chunks, by_heads))
    heads.feedback.machine = 2.0  # a slower machine: head calls priced at its pace
    assert heads._catch_up_ways(190, 200)[1] == pytest.approx(2.0 * catch_up_heads(190, 6) * head)
    heads.see_catch_up(13, 100)  # by heads: no chunk call's cost to learn from this step
    c = heads.choose_draft(torch.zeros(8), 200)
    assert c.draft_depth > 0 and heads._step_calls == 0
    heads.feedback.machine = 20.0  # head calls now dearer than the chunks: a chunked catch-up, learnt from
    heads.see_catch_up(190, 10_000)
    assert not heads.catch_up_by_heads(190, 200)
    assert heads.choose_draft(torch.zeros(8), 200).draft_depth > 0 and heads._step_calls == catch_up_calls(190, 200, 64)


def test_a_tree_starts_only_where_it_repays_the_drafters_catch_up():
    """The drafter behind by n tokens (plain steps, or a request's deferred prefill): the best
    tree, predicted s x faster than plain steps of T_plain, is chosen only where its catch-up
    (n x the profile's ms a token) costs less than the remaining budget's saving,
    remaining x T_plain x (1 - 1 / s); in step (n = 0), not told, or without a price, as before."""
    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + min(d, 3) * 0.3), (4, 8, 16, 32))
    per = 0.5
    pol = ObjectivePolicy(catch_up_model(per), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6)
    best, s = pol.plan_choice(100)
    assert best.draft_depth > 0 and s > 1
    assert pol.choose_draft(torch.zeros(8), 100) == best  # not told: the tree
    plain, seen = pol.cost.plain_ms(100), set()
    for behind in (0, 10, 100, 1000):
        for remaining in (1, 4, 16, 64, 512):
            pol.see_catch_up(behind, remaining)
            pays = behind * per < remaining * plain * (1 - 1 / s)
            assert pol.choose_draft(torch.zeros(8), 100) == (best if pays else StepChoice(0, 1)), (behind, remaining)
            seen.add(pays)
    assert seen == {True, False}
    unpriced = ObjectivePolicy(cost_model(), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6)  # a profile without it
    unpriced.see_catch_up(1000, 1)
    assert unpriced.choose_draft(torch.zeros(8), 100) == best


def test_the_catch_up_is_learnt_from_the_drafted_steps_that_paid_it():
    """A drafted step after a lag reports its resync stage: the feedback's ms a token replaces
    the profile's at once, then moves by ``alpha`` (clipped), and prices the next catch-up."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.policy import StepRecord

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + min(d, 3) * 0.3), (4, 8, 16, 32))
    pol = ObjectivePolicy(catch_up_model(0.5), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6,
                          feedback=Feedback(alpha=0.5))
    tree = topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1])
    pol.see_catch_up(40, 10_000)
    assert pol.catch_up_ms(100) == pytest.approx(40 * 0.5)
    for measured, want in ((1.0, 1.0), (1.2, 1.1)):  # ms a token: set, then halfway (alpha 0.5)
        pol.see_catch_up(40, 10_000)
        c = pol.choose_draft(torch.zeros(8), 100)
        assert c.draft_depth > 0
        pol.choose_verify(tree, c, 100)
        pol.observe(StepRecord(torch.zeros(8), 100, c, 8, 1, {"verify": 31.0, "draft": 10.0, "resync": 40 * measured}))
        assert pol.feedback.catch_up == pytest.approx(want)
    pol.see_catch_up(10, 10_000)
    assert pol.catch_up_ms(100) == pytest.approx(10 * 1.1)
    pol.see_catch_up(0, 10_000)  # in step: a drafted step without a catch-up teaches nothing
    c = pol.choose_draft(torch.zeros(8), 100)
    pol.choose_verify(tree, c, 100)
    pol.observe(StepRecord(torch.zeros(8), 100, c, 8, 1, {"verify": 31.0, "draft": 10.0, "resync": 0.001}))
    assert pol.feedback.catch_up == pytest.approx(1.1)


def test_a_catch_up_is_priced_per_call_of_the_drafters_prefill_chunks():
    """The drafter absorbs a lag in calls of its prefill chunk (static width: a call costs the same
    however few of its rows are new), redoing the grid's chunks from the one holding the first
    missing token: one token behind costs a call, a whole prompt ceil((n - 1) / chunk) calls. The
    profile's catch-up of N tokens and each measured one are divided by their calls, so one lost
    plain step does not price a prompt's catch-up at its length times a call."""
    from yggtree.runtime.cost import catch_up_calls
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.policy import StepRecord

    assert [catch_up_calls(b, 150, 64) for b in (0, 1, 21, 22, 85, 86, 150)] == [0, 1, 1, 2, 2, 3, 3]
    assert catch_up_calls(30, 30, 64) == 1 and catch_up_calls(7, 30, 1) == 7  # a prompt; per token
    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + min(d, 3) * 0.3), (4, 8, 16, 32))
    pol = ObjectivePolicy(catch_up_model(0.5), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, feedback=Feedback(alpha=0.5),
                          chunk=64)
    per_call = 256 * 0.5 / 4  # the profile's 256 tokens from the start: 4 calls of 64
    assert pol.cost.resync_per_call(64) == pytest.approx(per_call)
    pol.see_catch_up(100, 10_000)  # a prompt of 100 tokens: 2 calls, not 100 tokens' worth
    assert pol.catch_up_ms(100) == pytest.approx(2 * per_call)
    pol.see_catch_up(1, 10_000)  # one plain step behind: a whole call
    assert pol.catch_up_ms(100) == pytest.approx(per_call)
    c = pol.choose_draft(torch.zeros(8), 100)
    pol.choose_verify(topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1]), c, 100)
    pol.observe(StepRecord(torch.zeros(8), 100, c, 8, 1, {"verify": 31.0, "draft": 10.0, "resync": 3.0}))
    assert pol.feedback.catch_up == pytest.approx(3.0)  # ms a call: the prompt's catch-up then 2 x 3 ms
    pol.see_catch_up(100, 10_000)
    assert pol.catch_up_ms(100) == pytest.approx(6.0)


def test_a_probe_waits_until_its_catch_up_is_a_small_share_of_the_plain_steps():
    """Trees predicted to lose: plain steps, and a probe after ``probe_every`` of them only once
    the drafter's catch-up (growing one token a plain step) costs at most ``probe_share`` of the
    plain steps run since: here after k plain steps, the first k >= 4 with
    (100 + k) x 1 ms <= 0.25 x k x T_plain."""
    from yggtree.runtime.feedback import Feedback

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1.05), (4, 8, 16, 32))
    pol = ObjectivePolicy(catch_up_model(1.0), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, feedback=Feedback(),
                          probe_every=4, probe_share=0.25)
    plain = pol.cost.plain_ms(100)
    k = next(k for k in range(4, 1000) if (100 + k) * 1.0 <= 0.25 * k * plain)
    assert k > 4  # the catch-up, not probe_every, sets it
    for i in range(k + 1):
        pol.see_catch_up(100 + i, 10_000)
        c = pol.choose_draft(torch.zeros(8), 100)
        assert (c.draft_depth > 0) == (i == k), i
        if not c.draft_depth:
            pol.observe(_record(c, 0, plain))


def test_no_probe_pays_a_catch_up_the_rest_of_the_request_cannot_repay():
    """A probe's catch-up must also be at most ``probe_share`` of the plain steps the request may
    still take: near a request's end (or in a short one) the policy stays on plain steps however
    long the run before."""
    from yggtree.runtime.feedback import Feedback

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1.05), (4, 8, 16, 32))
    pol = ObjectivePolicy(catch_up_model(1.0), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, feedback=Feedback(),
                          probe_every=4, probe_share=0.25)
    plain = pol.cost.plain_ms(100)
    for i in range(400):
        remaining = 400 - i
        pol.see_catch_up(100 + i, remaining)
        c = pol.choose_draft(torch.zeros(8), 100)
        if c.draft_depth:
            break
        pol.observe(_record(c, 0, plain))
    assert c.draft_depth > 0 and (100 + i) * 1.0 <= 0.25 * min(i, remaining) * plain  # the probe, when both allow it
    assert (100 + i - 1) * 1.0 > 0.25 * min(i - 1, remaining + 1) * plain  # and not a step before
    short = ObjectivePolicy(catch_up_model(1.0), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6, feedback=Feedback(),
                            probe_every=4, probe_share=0.25)
    for j in range(600):  # however long the run, 3 tokens to come never repay a probe's catch-up
        short.see_catch_up(100 + j, 3)
        c = short.choose_draft(torch.zeros(8), 100)
        assert c.draft_depth == 0, j
        short.observe(_record(c, 0, plain))


def test_feedback_learns_how_far_drafted_steps_fall_short_of_their_price():
    """``plan_ratio``: discounted sums of realised and planned speed-ups of drafted steps, with
    ``prior_tokens`` pseudo-steps at 1 (1 before any step)."""
    from yggtree.runtime.feedback import Feedback

    fb = Feedback(accept_alpha=0.5, prior_tokens=2.0)
    assert fb.plan_ratio() == 1.0
    fb.update_planned(1.3, 0.9)
    assert fb.plan_ratio() == pytest.approx((0.9 + 2) / (1.3 + 2))
    fb.update_planned(1.2, 1.0)  # the first step now weighs half
    assert fb.plan_ratio() == pytest.approx((0.45 + 1.0 + 2) / (0.65 + 1.2 + 2))
    fb.update_planned(0.0, 5.0)  # no planned price: nothing learnt
    assert fb.plan_ratio() == pytest.approx((0.45 + 1.0 + 2) / (0.65 + 1.2 + 2))


def test_the_catch_up_is_weighed_at_the_speed_up_drafted_steps_realised():
    """A policy whose drafted steps realised less than they were priced at (the best of ~100
    priced trees errs high) weighs a catch-up against the speed-up they realise: with a lag the
    priced speed-up would repay but the realised one does not, plain steps; in step, the tree.
    Each drafted step teaches the ratio through ``observe``: (1 + accepted) x T_plain' over its
    measured time (the catch-up left out), against the speed-up it was chosen for."""
    from yggtree.runtime.feedback import Feedback
    from yggtree.runtime.policy import StepRecord

    cal = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1 + min(d, 3) * 0.3), (4, 8, 16, 32))
    pol = ObjectivePolicy(catch_up_model(0.5), cal, (1, 2, 4, 8), (4, 8, 16, 32), 6,
                          feedback=Feedback(accept_alpha=0.0, prior_tokens=1e-9))
    best, s = pol.plan_choice(100)
    plain = pol.cost.plain_ms(100)
    realised = 1 + (s - 1) / 4  # its trees turn out to pay a quarter of their price
    remaining = 64
    behind = next(n for n in range(1, 10_000)
                  if n * 0.5 < remaining * plain * (1 - 1 / s) and not n * 0.5 < remaining * plain * (1 - 1 / realised))
    pol.see_catch_up(behind, remaining)
    assert pol.choose_draft(torch.zeros(8), 100) == best  # priced: it repays
    tree = topo_tree([0, 0, 1, 2, 3], [0.0, -0.1, -0.1, -0.1, -0.1])
    pol.see_catch_up(0, remaining)
    c = pol.choose_draft(torch.zeros(8), 100)
    assert c == best and pol._planned == pytest.approx(s)
    pol.choose_verify(tree, c, 100)
    ms = 2 * plain / realised  # two tokens (one accepted) in the time that realises it
    pol.observe(StepRecord(torch.zeros(8), 100, c, 8, 1, {"verify": ms / 2, "draft": ms / 2, "resync": 99.0}))
    assert pol.feedback.plan_ratio() == pytest.approx(realised / s)
    pol.see_catch_up(0, remaining)
    best2, s2 = pol.plan_choice(100)  # in step the price alone decides: a tree
    assert best2.draft_depth > 0 and behind * 0.5 < remaining * pol._online_plain(plain) * (1 - 1 / s2)
    pol.see_catch_up(behind, remaining)  # which would repay the catch-up at its price, but not as realised
    assert pol.choose_draft(torch.zeros(8), 100) == StepChoice(0, 1)
