"""Per-step tree choices: the hook through which a policy steers the decode loop.

Every policy subclasses :class:`StepPolicy` (one interface; the engine refuses anything else).
Each speculation step the engine asks it (stages.speculate_step: its "policy" stages)::

    policy.see_catch_up(behind, remaining)                the drafter's lag, the tokens left
    policy.catch_up_by_heads(behind, committed)           (a lag to catch up) head calls or chunks
    policy.see_lookup(prop, committed)                    this step's lookup candidates
    choice = policy.choose_draft(h_root, committed)       before drafting: D and W_d
    choice = policy.after_head(h_root, head_logp, choice, committed)
                                  after the drafter's head (head_logp [k]: its top-k log-probs
                                  at the root): D >= 1 and W_d again (default: unchanged)
    w_v    = policy.choose_verify(tree, choice, committed)  after drafting: W_v

and reports the finished step to ``on_step(StepRecord)`` and to ``policy.observe(StepRecord)``
(a policy correcting its model from measured steps; default: nothing); ``start_request`` marks
where one request's text begins. The engine's caches and graphs are sized for its envelope
(D_max, the compiled W_d and W_v), so any choice from the compiled sets fits; a width outside
them is a YggError.

``draft_depth = 0`` is a plain decoding step: no drafter call, the target verifies the root
alone (W_v = 1, ``choose_verify`` is not asked unless lookup candidates make a tree). The
drafter then falls behind; the engine re-absorbs the committed sequence into it
(``Drafter.prefill``) before the next drafted step, a cost reported as the ``resync`` stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tree import Tree

__all__ = ["StepChoice", "StepRecord", "StepPolicy", "FixedPolicy"]


@dataclass(frozen=True)
class StepChoice:
    draft_depth: int  # D: drafter calls this step (1..D_max; 0 = plain step, no drafting)
    draft_width: int  # W_d: one of the compiled draft widths (ignored when D = 0)


@dataclass(frozen=True)
class StepRecord:
    """One speculation step, reported to ``on_step`` callbacks."""

    h_root: torch.Tensor  # [H] float32: target final hidden state (final-norm output) at the
    #                       position whose logits produced the root token (last prompt token after
    #                       prefill, else the last accepted node of the previous verify)
    committed: int  # committed length before this step
    choice: StepChoice
    verify_width: int  # W_v used
    n_accepted: int  # drafted tokens accepted this step (bonus excluded)
    stage_ms: dict  # per-stage wall times of this step
    tree: Tree | None = None  # the drafted tree (N = 1 + D * W_d slots); None for a plain step
    kept: torch.Tensor | None = None  # [W_v] int64 tree nodes verified (padding = 0)
    kept_valid: torch.Tensor | None = None  # [W_v] bool, False for padding
    target_argmax: torch.Tensor | None = None  # [W_v] int64 target's greedy next token per kept node


class StepPolicy:
    """The one interface every step policy implements: subclass it and override
    ``choose_draft`` and ``choose_verify``; the other hooks default to doing nothing."""

    def choose_draft(self, h_root: torch.Tensor, committed: int) -> StepChoice:
        raise NotImplementedError

    def choose_verify(self, tree: Tree, choice: StepChoice, committed: int) -> int:  # W_v
        raise NotImplementedError

    def after_head(self, h_root: torch.Tensor, head_logp: torch.Tensor, choice: StepChoice,
                   committed: int) -> StepChoice:
        """(D >= 1, W_d) once the drafter's head ran (head_logp [k]: its top-k log-probs at the
        root); by default the choice stands."""
        return choice

    def see_catch_up(self, behind: int, remaining: int) -> None:
        """Before ``choose_draft``: the drafter lacks the last ``behind`` committed tokens (plain
        steps, or a request whose drafter prefill was deferred; 0: it is in step), which the next
        drafted step first absorbs (the ``resync`` stage), and the request may emit at most
        ``remaining`` more tokens."""

    def catch_up_by_heads(self, behind: int, committed: int) -> bool:
        """Whether the drafter's catch-up of ``behind`` tokens below ``committed`` (more than its
        head call holds) runs in head calls (Drafter.absorb) rather than in prefill chunks; by
        default the chunks."""
        return False

    def see_lookup(self, prop, committed: int) -> None:
        """This step's lookup candidates (a :class:`~yggtree.runtime.lookup.Proposal`), before
        ``choose_draft``."""

    def takes_lookup_only(self) -> bool:
        """Whether a step ``choose_draft`` made plain (D = 0) is worth building a lookup-only tree
        for (its candidates hung from the root, ``choose_verify`` then picking W_v); by default
        always."""
        return True

    def lookup_logq(self, p: float) -> float:
        """A lookup edge's acceptance ``p`` on the drafter's log-probability scale (by default
        the drafter's probability is taken as its acceptance)."""
        return math.log(max(p, 1e-9))

    def observe(self, rec: StepRecord) -> None:
        """A finished step (a policy learning from measured steps)."""

    def start_request(self) -> None:
        """A new request begins (its text is not the previous one's continuation)."""


@dataclass(frozen=True)
class FixedPolicy(StepPolicy):
    """The same (D, W_d, W_v) every step: the engine's behaviour without a policy."""

    choice: StepChoice
    verify_width: int

    @classmethod
    def of(cls, tree_params) -> "FixedPolicy":
        """From a :class:`~yggtree.runtime.engine.TreeParams`."""
        tp = tree_params
        return cls(StepChoice(tp.draft_depth, tp.draft_width), tp.verify_width)

    def choose_draft(self, h_root: torch.Tensor, committed: int) -> StepChoice:
        return self.choice

    def choose_verify(self, tree: Tree, choice: StepChoice, committed: int) -> int:
        return self.verify_width
