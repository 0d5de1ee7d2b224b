"""The latency objective with lookup candidates: the inverse calibration map, lookup-only steps
chosen when they are fastest (against brute force on synthetic costs), W_v on a lookup tree, and
the feedback treating a lookup-only step as a verify call, not as a plain step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_objective import cost_model, lookup_chain as chain, policy, table
from yggtree.runtime.lookup import Proposal
from yggtree.runtime.merge import merge_lookup, root_tree
from yggtree.runtime.calibration import Calibration
from yggtree.runtime.feedback import Feedback
from yggtree.runtime.objective import ObjectivePolicy
from yggtree.runtime.prediction import Prediction
from yggtree.runtime.policy import StepChoice

CAL = Calibration((0.0, 0.2, 0.5, 1.0), (0.0, 0.1, 0.6, 0.95), table(lambda wd, d, wv: 1.05), (4, 8, 16, 32))


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 0.95))
def test_drafter_logq_inverts_the_map(p):
    q = math.exp(CAL.drafter_logq(p))
    assert 0 < q <= 1
    assert float(CAL.edge_prob(torch.tensor(q))) == pytest.approx(p, abs=1e-5)


def brute_lookup_only(pol: ObjectivePolicy, prop: Proposal, ctx: int) -> float:
    plain = pol.cost.plain_ms(ctx)
    vals = sorted(prop.value, reverse=True)
    return max((1 + sum(vals[: w - 1])) * plain / pol.cost.lookup_ms(w, ctx) for w in (4, 8, 16, 32))


def test_weak_drafter_strong_lookup_takes_lookup_only_steps():
    pol = policy(CAL)  # the drafter's trees never pay (AAL 1.05)
    assert pol.choose_draft(torch.zeros(8), 100) == StepChoice(0, 1)
    prop = chain([0.95] * 6)
    pol.see_lookup(prop, 100)
    choice, s = pol.plan_choice(100)
    assert choice.draft_depth == 0 and s == pytest.approx(brute_lookup_only(pol, prop, 100))
    assert s > 1.5
    # the engine then shows the lookup tree: a lookup-only W_v, one prediction for the step
    pol.choose_draft(torch.zeros(8), 100)
    n_log = len(pol.log)
    tree, _ = merge_lookup(root_tree(torch.tensor(5)), prop, [pol.lookup_logq(p) for p in prop.edge], 6)
    wv = pol.choose_verify(tree, StepChoice(0, 1), 100)
    assert wv == 8  # 7 useful nodes: the smallest width that holds them
    assert len(pol.log) == n_log  # the plain prediction was replaced, not added to
    pred = pol.log[-1]
    assert (pred.draft_depth, pred.verify_width) == (0, 8)
    assert pred.aal == pytest.approx(1 + sum(prop.value), rel=1e-4)


def test_weak_lookup_keeps_plain_steps():
    pol = policy(CAL)
    pol.see_lookup(chain([0.01, 0.01]), 100)
    assert pol.plan_choice(100) == (StepChoice(0, 1), 1.0)
    tree, _ = merge_lookup(root_tree(torch.tensor(5)), chain([0.01, 0.01]),
                           [pol.lookup_logq(p) for p in (0.01, 0.01)], 2)
    assert pol.choose_verify(tree, StepChoice(0, 1), 100) == 1  # verifying them does not pay


def test_a_lookup_only_tree_is_built_only_where_it_was_priced_above_a_plain_step():
    pol = policy(CAL)
    pol.see_lookup(chain([0.01, 0.01]), 100)
    assert pol.choose_draft(torch.zeros(8), 100) == StepChoice(0, 1) and not pol.takes_lookup_only()
    pol.see_lookup(chain([0.95] * 6), 100)
    assert pol.choose_draft(torch.zeros(8), 100) == StepChoice(0, 1) and pol.takes_lookup_only()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.0, 0.99), min_size=1, max_size=12), st.sampled_from([40, 100, 300, 700]))
def test_a_lookup_only_step_priced_below_plain_verifies_the_root_alone(values, ctx):
    """Where ``choose_draft`` priced the best lookup-only step at or below a plain one (the
    engine then builds no lookup tree), ``choose_verify`` on that tree would have chosen W_v = 1:
    skipping it changes no choice."""
    pol = policy(CAL)
    prop = chain(values)
    pol.see_lookup(prop, ctx)
    if pol.choose_draft(torch.zeros(8), ctx).draft_depth or pol.takes_lookup_only():
        return
    tree, _ = merge_lookup(root_tree(torch.tensor(5)), prop, [pol.lookup_logq(p) for p in prop.edge], 12)
    assert pol.choose_verify(tree, StepChoice(0, 1), ctx) == 1


def test_lookup_raises_a_drafter_tree_to_at_least_its_own_value():
    good = Calibration((0.0, 1.0), (0.0, 0.9), table(lambda wd, d, wv: 1.3), (4, 8, 16, 32))
    pol = policy(good)
    base, s0 = pol.plan_choice(100)
    assert base.draft_depth > 0
    pol.see_lookup(chain([0.1]), 100)  # worth less than the drafter's tree: nothing changes
    assert pol.plan_choice(100) == (base, s0)
    pol.see_lookup(chain([0.97] * 6), 100)  # worth more: a lookup-only step or a better tree
    assert pol.plan_choice(100)[1] > s0
    pol.see_lookup(Proposal(), 100)
    assert pol.plan_choice(100) == (base, s0)


def test_feedback_counts_a_lookup_only_step_as_a_verify_call():
    fb = Feedback(alpha=0.5)
    pred = Prediction(100, 0, 8, 3.0, 40.0, 30.0, verify_ms=33.0)
    fb.update(pred, n_accepted=1, step_ms=40.0, verify_ms=33.0)
    assert fb.width_factor(1) == 1.0  # not learnt as a plain (width-1) step
    assert fb.accept_scale_at(0) < 1.0  # 1 accepted of 2 expected
    plain = Prediction(100, 0, 1, 1.0, 30.0, 30.0)
    fb.update(plain, n_accepted=0, step_ms=45.0)
    assert fb.machine > 1.0


def test_a_policy_without_drafter_depths_chooses_plain_or_lookup_only():
    """The bench's lookup-only system: the objective with d_max 0 (and feedback) never drafts."""
    pol = ObjectivePolicy(cost_model(), CAL, (1, 2, 4, 8), (4, 8, 16, 32), 0, feedback=Feedback())
    assert pol.plan_choice(100) == (StepChoice(0, 1), 1.0)
    pol.see_lookup(chain([0.95] * 6), 100)
    choice, s = pol.plan_choice(100)
    assert choice.draft_depth == 0 and s > 1.5
    for _ in range(40):  # probes included: still no drafter step
        assert pol.choose_draft(torch.zeros(8), 100).draft_depth == 0
