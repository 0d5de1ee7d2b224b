"""The decode walk behind the offline ``walk_*`` acceptance figures."""

import torch

from yggtree.offline.distill_eval import decode_walk


def test_decode_walk_follows_the_engine_by_hand():
    """D = 2. Root 0 accepts both drafts (3 tokens); root 3 accepts one and stops at pair 4, which
    is outside the answer (2 tokens); the walk skips pair 4 and root 5 accepts both (3 tokens)."""
    hits = torch.tensor([[[1, 0, 1, 1, 0, 1, 0, 0]], [[0, 1, 0, 1, 1, 0, 1, 0]]], dtype=torch.bool)
    greedy = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    assert decode_walk(hits, greedy) == (8, 3)


def test_decode_walk_without_hits_is_one_token_per_step():
    g = torch.tensor([[1, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert decode_walk(torch.zeros(3, 2, 4, dtype=torch.bool), g) == (5, 5)


def test_decode_walk_with_every_hit_takes_full_chains():
    """Every draft hits: each step takes D + 1 tokens, the last one cut by the answer's end
    (a 10-pair answer with D = 4: steps at 0 and 5 accept 4, the step at 10 does not exist)."""
    hits = torch.ones(4, 1, 10, dtype=torch.bool)
    assert decode_walk(hits, torch.ones(1, 10, dtype=torch.bool)) == (10, 2)
