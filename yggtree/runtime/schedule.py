"""Execution plans: which stages a decode step runs, in which order, and the one stage timer.

The stage dependency graph (:data:`NEEDS`) says which stages' products each stage reads; a plan
is an order of stages that respects it. Named plans::

    plain       verify, accept, commit                      (no drafter, no lookup)
    sequential  every stage in dependency order, the drafter's head a call at the start of
                each step and its catch-up inside the commit
    ahead       sequential + the ahead-of-time tail and head draft: right after acceptance the
                drafter processes every verified node (and a head row under each) in one
                static-shape call; the commit keeps the accepted leaf's row, so the next head
                is picked up, not called

``--stages NAME`` picks one by name (or a comma-separated order of stage names, for ablations);
``auto`` takes the plan's recorded ``stages`` field. A name that does not exist, an order that
breaks a dependency, or a thread count above the machine's cores is refused with one line.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import YggError

# stage -> the stages whose products it reads (each must be in the plan, earlier)
NEEDS: dict[str, tuple[str, ...]] = {
    "lookup": (),
    "choose": ("lookup",),
    "resync": ("choose",),
    "head": ("choose", "resync"),
    "refine": ("head",),
    "draft": ("refine",),
    "merge": ("draft",),
    "size": ("merge",),
    "prune": ("size",),
    "verify": (),  # the root alone without prune (a plain step)
    "accept": ("verify",),
    "ahead": ("accept",),
    "commit": ("accept",),
}
# stage -> stages that, when in the plan, must run before it (their products change what it does)
AFTER: dict[str, tuple[str, ...]] = {"verify": ("prune",), "commit": ("ahead",)}
# the wall-time bucket each stage is reported under (stats ``stage_ms``, StepRecord.stage_ms)
BUCKET = {"choose": "policy", "refine": "policy", "size": "policy", "merge": "lookup"}
BUCKETS = ("head", "draft", "prune", "verify", "accept", "commit", "policy", "resync", "lookup", "ahead")

SEQUENTIAL = ("lookup", "choose", "resync", "head", "refine", "draft", "merge", "size", "prune",
              "verify", "accept", "commit")
PLANS: dict[str, tuple[str, ...]] = {
    "plain": ("verify", "accept", "commit"),
    "sequential": SEQUENTIAL,
    "ahead": SEQUENTIAL[:-1] + ("ahead", "commit"),
}


@dataclass(frozen=True)
class ExecutionPlan:
    """A checked stage order and its thread budget."""

    name: str
    stages: tuple[str, ...]
    threads: int = 0  # intra-op threads while decoding (0: leave the process setting)

    @property
    def ahead(self) -> bool:
        return "ahead" in self.stages


def check_order(stages: tuple[str, ...], speculative: bool) -> None:
    """YggError (one line) unless ``stages`` respects the dependency graph and the engine."""
    unknown = [s for s in stages if s not in NEEDS]
    if unknown:
        raise YggError(f"unknown stage {unknown[0]!r} (stages: {', '.join(NEEDS)})")
    if len(set(stages)) != len(stages):
        raise YggError(f"stage plan {','.join(stages)} runs a stage twice")
    at = {s: i for i, s in enumerate(stages)}
    for s, i in at.items():
        for need in NEEDS[s]:
            if need not in at or at[need] > i:
                raise YggError(f"stage {s!r} needs {need!r} before it (plan {','.join(stages)})")
        for before in AFTER.get(s, ()):
            if before in at and at[before] > i:
                raise YggError(f"stage {s!r} must run after {before!r} (plan {','.join(stages)})")
    for s in ("verify", "accept", "commit"):
        if s not in at:
            raise YggError(f"stage plan {','.join(stages)} has no {s!r} stage")
    if speculative and "prune" not in at:
        raise YggError(f"stage plan {','.join(stages)} never drafts: a speculative engine needs "
                       "lookup..prune")
    if not speculative and len(stages) > 3:
        raise YggError(f"stage plan {','.join(stages)} drafts, but the engine has no tree to draft")


def resolve_plan(name: str, speculative: bool, recorded: str = "sequential",
                 threads: int = 0) -> ExecutionPlan:
    """The execution plan ``name`` stands for: ``auto`` (the plan's recorded choice), a named
    plan, or a comma-separated stage order; a plain engine always runs ``plain``."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise YggError(f"threads must be an integer >= 0, got {threads!r}")
    cores = os.cpu_count() or 1
    if threads > cores:
        raise YggError(f"threads {threads} exceeds this machine's {cores} cores")
    if name == "auto":
        name = recorded
    if not speculative:
        return ExecutionPlan("plain", PLANS["plain"], threads)
    if name in PLANS:
        stages = PLANS[name]
    elif "," in name:
        stages = tuple(s.strip() for s in name.split(","))
    else:
        raise YggError(f"unknown stage plan {name!r} (choose from auto, {', '.join(n for n in PLANS if n != 'plain')}, "
                       "or a comma-separated stage order)")
    check_order(stages, speculative)
    return ExecutionPlan(name, stages, threads)


class StageTimer:
    """The one stage timer: wall time of every stage run, per step and per request, by bucket."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(BUCKETS, 0.0)  # seconds over the request
        self.step = dict.fromkeys(BUCKETS, 0.0)  # seconds in the step under way

    def new_step(self) -> None:
        self.step = dict.fromkeys(BUCKETS, 0.0)

    def run(self, name: str, fn, *args) -> None:
        t = time.perf_counter()
        fn(*args)
        dt = time.perf_counter() - t
        b = BUCKET.get(name, name)
        self.step[b] += dt
        self.total[b] += dt

    def step_ms(self) -> dict:
        return {k: v * 1e3 for k, v in self.step.items()}
