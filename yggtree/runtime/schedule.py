"""Execution plans: which of a decode step's optional stages run, on which threads, and the one
stage timer.

The step is :func:`yggtree.runtime.stages.speculate_step`, read top to bottom. Plans::

    plain       the root alone: verify, accept, commit      (an engine without drafter or lookup)
    sequential  the step as written, the drafter's head a call at the start of each step and its
                catch-up inside the commit
    ahead       sequential + the ahead-of-time tail and head draft: right after acceptance the
                drafter processes every verified node (and a head row under each) in one
                static-shape call; the commit keeps the accepted leaf's row, so the next head
                is picked up, not called
    overlap     sequential + fork (after prune) and join (before commit): the next step's head
                and draft run on the drafter's own worker, concurrently with the target's
                verify, from the most likely accepted path; used only if that path is what
                acceptance returns (runtime/overlap.py)

``--stages NAME`` picks one by name; ``auto`` takes the plan's recorded ``stages`` field. A thread
split may follow the name: ``NAME@T`` (T intra-op threads while decoding) and ``overlap@T+D`` (T
for the target, D for the drafter's worker; ``overlap`` alone: one for the worker, the rest of the
usable cores for the target). A name that does not exist or threads above the cores this process
may use (its affinity mask) are refused with one line.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import YggError

PLANS = ("sequential", "ahead", "overlap")  # the plans a speculative engine may run
# the stage timer's names, the keys of stats ``stage_ms`` and StepRecord.stage_ms (policy: the
# step policy's choices, lookup: proposing and merging lookup candidates)
STAGES = ("head", "draft", "prune", "verify", "accept", "commit", "policy", "resync", "lookup", "ahead",
          "fork", "join")


@dataclass(frozen=True)
class ExecutionPlan:
    """A plan's name and its thread budget."""

    name: str  # plain | one of PLANS
    threads: int = 0  # intra-op threads while decoding (0: leave the process setting)
    draft_threads: int = 0  # the drafter's worker's threads (overlap plans; 0: no worker)

    @property
    def ahead(self) -> bool:
        return self.name == "ahead"

    @property
    def overlap(self) -> bool:
        return self.name == "overlap"

    @property
    def label(self) -> str:
        """The plan with its thread split, as ``--stages`` takes it (``overlap@1+1``)."""
        if self.overlap:
            return f"{self.name}@{self.threads}+{self.draft_threads}"
        return f"{self.name}@{self.threads}" if self.threads else self.name


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


def split_name(name: str) -> tuple[str, int | None, int | None]:
    """``NAME``, ``NAME@T`` or ``NAME@T+D`` -> (NAME, T, D) (None where not given)."""
    if "@" not in name:
        return name, None, None
    base, _, split = name.partition("@")
    parts = split.split("+")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise YggError(f"thread split {split!r} of stage plan {name!r}: use NAME@T or NAME@T+D "
                       "(T target threads, D drafter threads)")
    return base, int(parts[0]), int(parts[1]) if len(parts) == 2 else None


def resolve_plan(name: str, speculative: bool, recorded: str = "sequential",
                 threads: int = 0) -> ExecutionPlan:
    """The execution plan ``name`` stands for: ``auto`` (the plan's recorded choice) or a named
    plan, optionally with a thread split (``@T``, ``@T+D``, which overrides ``threads``); a plain
    engine always runs ``plain``."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise YggError(f"threads must be an integer >= 0, got {threads!r}")
    if name == "auto":
        name = recorded
    name, t, draft_t = split_name(name)
    threads = threads if t is None else t
    if name not in PLANS:
        raise YggError(f"unknown stage plan {name!r} (choose from auto, {', '.join(PLANS)})")
    cores = usable_cores()
    overlap = speculative and name == "overlap"
    if draft_t is not None and speculative and not overlap:
        raise YggError(f"stage plan {name!r} has no drafter worker: a thread split T+D needs an "
                       "overlap plan")
    if overlap:
        draft_t = 1 if draft_t is None else draft_t
        threads = threads or max(cores - draft_t, 1)
        if draft_t < 1 or threads < 1:
            raise YggError(f"overlap@{threads}+{draft_t}: the target and the drafter need >= 1 thread each")
    draft_t = draft_t if overlap else 0
    if threads + draft_t > cores:
        split = f"{threads}+{draft_t}" if overlap else f"{threads}"
        raise YggError(f"threads {split} exceeds this machine's {cores} usable cores")
    return ExecutionPlan(name if speculative else "plain", threads, draft_t)


class StageTimer:
    """The one stage timer: wall time of every stage run, per step and per request, by name
    (:data:`STAGES`). ``with timer(name):`` times the block under ``name`` (one block at a time)."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(STAGES, 0.0)  # seconds over the request
        self.step = dict.fromkeys(STAGES, 0.0)  # seconds in the step under way
        self._name, self._t = "", 0.0

    def new_step(self) -> None:
        self.step = dict.fromkeys(STAGES, 0.0)

    def __call__(self, name: str) -> StageTimer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self._t
        self.step[self._name] += dt
        self.total[self._name] += dt

    def step_ms(self) -> dict:
        return {k: v * 1e3 for k, v in self.step.items()}
