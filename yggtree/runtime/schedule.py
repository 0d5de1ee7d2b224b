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

    overlap     sequential + fork (after prune) and join (before commit): the next step's head
                and draft run on the drafter's own worker, concurrently with the target's
                verify, from the most likely accepted path; used only if that path is what
                acceptance returns (runtime/overlap.py)

``--stages NAME`` picks one by name (or a comma-separated order of stage names, for ablations);
``auto`` takes the plan's recorded ``stages`` field. A thread split may follow the name:
``NAME@T`` (T intra-op threads while decoding) and ``overlap@T+D`` (T for the target, D for the
drafter's worker; ``overlap`` alone: one for the worker, the rest of the usable cores for the
target). A name that does not exist, an order that breaks a dependency, or threads above the
cores this process may use (its affinity mask) are refused with one line.
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
    "fork": ("prune",),  # the worker drafts from the verified tree's likeliest path
    "join": ("fork", "accept"),  # the guess is checked against the acceptance
    "commit": ("accept",),
}
# stage -> stages that, when in the plan, must run before it (their products change what it does)
AFTER: dict[str, tuple[str, ...]] = {"verify": ("prune", "fork"), "commit": ("ahead", "join")}
# stages that cannot share a plan (both use the drafter between verify and commit)
EXCLUSIVE = (("ahead", "fork"),)
# the wall-time bucket each stage is reported under (stats ``stage_ms``, StepRecord.stage_ms)
BUCKET = {"choose": "policy", "refine": "policy", "size": "policy", "merge": "lookup"}
BUCKETS = ("head", "draft", "prune", "verify", "accept", "commit", "policy", "resync", "lookup", "ahead",
           "fork", "join")

SEQUENTIAL = ("lookup", "choose", "resync", "head", "refine", "draft", "merge", "size", "prune",
              "verify", "accept", "commit")
PLANS: dict[str, tuple[str, ...]] = {
    "plain": ("verify", "accept", "commit"),
    "sequential": SEQUENTIAL,
    "ahead": SEQUENTIAL[:-1] + ("ahead", "commit"),
    "overlap": SEQUENTIAL[:-3] + ("fork", "verify", "accept", "join", "commit"),
}


@dataclass(frozen=True)
class ExecutionPlan:
    """A checked stage order and its thread budget."""

    name: str
    stages: tuple[str, ...]
    threads: int = 0  # intra-op threads while decoding (0: leave the process setting)
    draft_threads: int = 0  # the drafter's worker's threads (overlap plans; 0: no worker)

    @property
    def ahead(self) -> bool:
        return "ahead" in self.stages

    @property
    def overlap(self) -> bool:
        return "fork" in self.stages

    @property
    def label(self) -> str:
        """The plan with its thread split, as ``--stages`` takes it (``overlap@1+1``)."""
        if self.overlap:
            return f"{self.name}@{self.threads}+{self.draft_threads}"
        return f"{self.name}@{self.threads}" if self.threads else self.name


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
    for a, b in EXCLUSIVE:
        if a in at and b in at:
            raise YggError(f"stages {a!r} and {b!r} cannot share a plan (plan {','.join(stages)})")
    for s in ("verify", "accept", "commit"):
        if s not in at:
            raise YggError(f"stage plan {','.join(stages)} has no {s!r} stage")
    if speculative and "prune" not in at:
        raise YggError(f"stage plan {','.join(stages)} never drafts: a speculative engine needs "
                       "lookup..prune")
    if not speculative and len(stages) > 3:
        raise YggError(f"stage plan {','.join(stages)} drafts, but the engine has no tree to draft")


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
    """The execution plan ``name`` stands for: ``auto`` (the plan's recorded choice), a named
    plan, or a comma-separated stage order, each optionally with a thread split (``@T``,
    ``@T+D``, which overrides ``threads``); a plain engine always runs ``plain``."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise YggError(f"threads must be an integer >= 0, got {threads!r}")
    if name == "auto":
        name = recorded
    name, t, draft_t = split_name(name)
    threads = threads if t is None else t
    if name in PLANS:
        stages = PLANS[name]
    elif "," in name:
        stages = tuple(s.strip() for s in name.split(","))
    else:
        raise YggError(f"unknown stage plan {name!r} (choose from auto, {', '.join(n for n in PLANS if n != 'plain')}, "
                       "or a comma-separated stage order)")
    cores = usable_cores()
    overlap = speculative and "fork" in stages
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
    if not speculative:
        return ExecutionPlan("plain", PLANS["plain"], threads)
    check_order(stages, speculative)
    return ExecutionPlan(name, stages, threads, draft_t)


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
