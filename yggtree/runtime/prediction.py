"""What the objective predicted of a step (:class:`Prediction`), and the predicted speed-up of a
run of steps over plain decoding (:func:`predicted_speedup`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prediction", "predicted_speedup"]


@dataclass(frozen=True)
class Prediction:
    """What the objective expected of one step (the engine's view of a step is a StepRecord).

    ``aal``, ``step_ms`` and ``plain_ms`` come from the offline model alone (profile +
    calibration); the ``*_online`` fields are the same quantities after the policy's
    :class:`~yggtree.runtime.feedback.Feedback` correction from the steps already run (equal to the offline ones without
    feedback). Both are made before the step runs."""

    committed: int  # committed length before the step
    draft_depth: int  # D chosen (0: a plain step)
    verify_width: int  # W_v chosen (1 for a plain step)
    aal: float  # expected tokens emitted (bonus included; 1 for a plain step)
    step_ms: float  # predicted wall time of the step
    plain_ms: float  # predicted wall time of one plain step at this context
    aal_online: float | None = None
    step_ms_online: float | None = None
    plain_ms_online: float | None = None
    verify_ms: float | None = None  # predicted time of the step's verify call (T_v(W_v) at ctx)

    def terms(self, online: bool = False) -> tuple[float, float, float]:
        """(aal, step_ms, plain_ms), offline or feedback-corrected."""
        if not online or self.aal_online is None:
            return self.aal, self.step_ms, self.plain_ms
        return self.aal_online, self.step_ms_online, self.plain_ms_online

    @property
    def speedup(self) -> float:
        return self.aal * self.plain_ms / self.step_ms


def predicted_speedup(preds: list[Prediction], online: bool = False) -> float:
    """Predicted speed-up of a run of steps over plain decoding: the plain time of the tokens
    expected to be emitted over the predicted time of the steps (``online``: with the feedback
    correction each prediction had when it was made)."""
    terms = [p.terms(online) for p in preds]
    t = sum(s for _, s, _ in terms)
    return sum(a * pl for a, _, pl in terms) / t if t > 0 else float("nan")
