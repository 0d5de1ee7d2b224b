"""This machine's own compiled plan: built once, in the background, then loaded in a second.

A plain ``yggtree run`` (nothing asked but the embedded default) on a machine with no tuned plan
answers at once with plain decoding that needs no compilation, and starts, in a detached process
that runs only on CPU time nothing else wants (the idle scheduling class), the build of the
machine plan:

1. the default plan (at the verify and draft widths a CPU's objective takes) in the fastest lossless format the CPU runs (``machine_weights``: the GGUF's
   own 4-bit weights as w4a8 where the kernel library runs, over a float16 KV cache as llama.cpp
   runs a GGUF: ``machine_kv_cache``; else float32), with the shipped acceptance calibration of the
   embedded pair;
2. its AOTInductor packages (:func:`yggtree.offline.compile.compile_plan`, which builds the
   kernel library and measures the product kernel first): the target's whole steps, its prefill
   blocks and the drafter's calls, one package per core at once, the longest first;
3. a quick latency profile timed on those packages (the padding they were compiled with);
4. the plan naming that profile, refreshed in its compiled copy, and last, written in one rename,
   ``ready.json`` pointing at it;
5. whether its latency objective decodes faster than its plain steps here,
   and with how many lookup nodes a step (``measure/speculation_choice.py``: 0, 4 and 8, each
   timed on held-out prompts), kept by profile in ``speculation.json``: runs take the fastest
   count (``--lookup N`` keeps N), and where no objective beat plain steps they decode the plan
   plainly (``--speculate`` keeps the objective); a plan whose verdict is missing or of another
   ``VERSION`` has it measured by the next build.
6. the memory allocator runs restart on (``measure/allocator_choice.py``: the system's against
   each one installed, jemalloc or tcmalloc, timed on the ready plan once per machine and set of
   libraries: child processes decoding it), after the verdict: runs need not wait for it;
7. last, the batched graphs ``yggtree serve`` decodes ``SERVE_BATCH`` requests at once with
   (runtime/batch_packages.py, built where missing), so that a server's first start loads them.

Every measurement waits for a quiet machine (``QUIET_WAITS``); one that could not (the product
kernel's choice, a profile or the verdict timed while other processes kept the cores busy) is
used, and the next run starts a build that measures it again (at most ``REMEASURES`` times: its
packages stay where the kernel choice does not change).

Every later run loads the compiled copy (no tracing) and decodes with the latency objective on
the machine's own curves (plain steps wherever no tree pays), its online feedback starting from
what the earlier runs on the same profile learnt (``feedback.json``: the offline model's
optimism is paid once per machine, not in every short run). A build that is interrupted or
killed leaves no ``ready.json``: the next run starts it again (the compile pipeline writes its
manifest last and checks it, so nothing half-written is loaded). A build that stops on an error
records it (``failed.json``, with :func:`code_key`): the same code would stop on it again, so runs
say so in one line and do not start it until the code, torch or the compilers on the PATH change.
A plan whose kernel library is not built for the running code (its C++ sources changed; the packages,
which call its ops, stay valid) is not ready either: the build compiles the library and times the
plan on it again, and no run compiles it before its first token.
The build holds an exclusive lock on ``build.lock`` while it runs (released by the kernel when the
process dies), so two runs never build at once. Its output goes to ``build.log`` in the machine
plan's directory, its last step to ``status.json`` and, once complete, how long it took to
``took.json``: a run that finds it building says where it is and about how long is left
(:meth:`MachinePlan.progress`).

A ``yggtree run`` that decodes while the build runs pauses it (SIGSTOP to every process of the
build's session, SIGCONT when the run ends: :meth:`MachinePlan.paused`): even in the idle class, a build
beside a multi-threaded decode stalls the decode's parallel loops, whose threads wait on each
other at every product (the run's decoding at several times its speed alone). A run killed
outright leaves the build stopped until the next run ends.

``YGGTREE_MACHINE_BUILD=0`` turns the background build off (the run then takes the quick start
of ``yggtree.quickstart``, which compiles in the foreground); the test suite sets it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import YggError
from .files import data_root, write_text_atomic

BUILD_ENV = "YGGTREE_MACHINE_BUILD"  # "0": no background build
READY = "ready.json"
LOCK = "build.lock"
LOG = "build.log"
FEEDBACK = "feedback.json"  # what the objective's feedback learnt in earlier runs, by profile
SPECULATION = "speculation.json"  # whether the objective decoded faster than plain steps here, by profile
PID = "build.pid"  # the running build's process id (and its session's: it starts one of its own)
STATUS = "status.json"  # the running build's last step and when it started (MachinePlan.progress)
TOOK = "took.json"  # how long the last complete build here took: the next one's estimate
NOT_BUILT = "not built yet"  # MachinePlan.ready_plan's reason before the first build
FAILED = "failed.json"  # the error a build stopped on, with the code it ran: not retried until that changes
REMEASURED = "remeasured.json"  # how many later builds measured a plan timed while busy again
CALIBRATION = "calibration.json"  # the plan's copy of the acceptance calibration the package ships
REMEASURES = 3  # at most this many: a machine that is never quiet keeps what it measured
MACHINE_VERIFY_WIDTHS = (4, 8)  # W_v the machine plan compiles
MACHINE_DRAFT_WIDTHS = (1, 2)  # W_d


def enabled() -> bool:
    return os.environ.get(BUILD_ENV, "1") != "0"


def machine_kv_cache(weights: str | None) -> str | None:
    """The KV cache dtype of a machine plan in ``weights`` (None: float32, the float model's own).
    A quantized plan keeps keys and values in float16, as llama.cpp runs a GGUF (its weights'
    blocks, 8-bit activations, a float16 cache): half the bytes a step's attention reads, and the
    greedy text no further from float32's than the format's own (docs/results.md section 11). A
    float32 plan keeps float32's cache: its output is the float model's, exactly."""
    return None if weights is None else "float16"


def machine_drafter_weights(weights: str | None, flags: set[str] | None = None) -> str | None:
    """The drafter's weight format in a machine plan whose target runs ``weights``: a float32
    plan's drafter in ``w4a8`` where the kernel library runs here (its calls read a sixth of the
    bytes and stay cached across a step's calls; what is emitted is the float target's), else the
    target's own (None)."""
    return "w4a8" if weights is None and machine_weights(flags) == "w4a8" else None


def _library_built() -> bool:
    """Whether the kernel library of this code is built here (runtime/kernels.py); False where it
    cannot be (its instruction set refused)."""
    from .runtime import kernels

    try:
        return kernels.library_built()
    except YggError:
        return False


def machine_weights(flags: set[str] | None = None) -> str | None:
    """The fastest lossless weight format for the embedded GGUF on this CPU: ``w4a8`` (its own
    4-bit blocks, on the kernel library) where the library runs, else None (float32)."""
    from .runtime import kernels

    have = kernels.cpu_flags() if flags is None else flags
    return "w4a8" if not [f for f in kernels.LIBRARY_FLAGS if f not in have] else None


@dataclass(frozen=True)
class Unsettled:
    """A measurement of a ready machine plan to be taken again (:meth:`MachinePlan.unsettled`)."""

    line: str  # what and why, one line
    kernel: bool = False  # the product-kernel choice: forgotten first (the same choice keeps every package)


@dataclass(frozen=True)
class Verdict:
    """What the build measured of a ready plan's speculation here (measure/speculation_choice.py)."""

    speculate: bool  # its objective decoded faster than its plain steps
    ratio: float  # the fastest objective's speed over plain steps
    lookup: int  # lookup nodes a step of that objective
    sampling_ratio: float  # that objective's speed over plain steps on sampled requests
    speculate_sampling: bool  # faster there too: runs that sample speculate

    def for_requests(self, sampled: bool) -> tuple[bool, float]:
        """(whether runs speculate, the measured speed over plain steps) for greedy or sampled runs."""
        return (self.speculate_sampling, self.sampling_ratio) if sampled else (self.speculate, self.ratio)


@dataclass(frozen=True)
class MachinePlan:
    """Where this machine's plan for ``threads`` threads and ``weights`` lives, and its state."""

    root: Path  # data_root()/machine/<device>-t<threads>-<weights>
    weights: str | None
    threads: int

    @property
    def name(self) -> str:
        return f"machine-{self.weights or 'float32'}"

    @property
    def compile_root(self) -> Path:
        """The packages a completed build runs: whole-step, block and drafter-call packages."""
        return self.root / "compile"

    @property
    def shape(self) -> dict:
        """The plan fields this code builds the machine plan with (beyond the default plan's): a
        ready plan built with others is built again."""
        return {"weights": self.weights, "drafter_weights": machine_drafter_weights(self.weights),
                "kv_cache": machine_kv_cache(self.weights),
                "verify_widths": MACHINE_VERIFY_WIDTHS, "draft_widths": MACHINE_DRAFT_WIDTHS}

    def ready_plan(self) -> tuple[Path | None, str | None]:
        """(the compiled plan copy to run, None) once the build's packages and profile are done
        and its artifacts still serve this machine and code; else (None, why not)."""
        from .compiled import artifact_dir, check_artifacts
        from .plan import load_plan

        marker = self.root / READY
        if not marker.is_file():
            return None, NOT_BUILT
        try:
            path = self.root / json.loads(marker.read_text())["plan"]
            if path.parent.parent != self.compile_root:
                raise ValueError(f"{path} is not a plan of this build")
            plan = load_plan(path)
            reasons = [f"built with {k} {getattr(plan, k)}, this code builds {v}"
                       for k, v in self.shape.items() if getattr(plan, k) != v]
            reasons = reasons or check_artifacts(plan, artifact_dir(plan))
        except (YggError, OSError, ValueError, KeyError, TypeError) as e:
            return None, f"its record is unreadable ({e})"
        if not reasons and (self.weights or plan.drafter_weights) and not _library_built():
            # the kernel sources changed since the build (the packages call the ops, so they stay valid):
            # a run would compile the library before its first token; the build does, and times the plan
            # on it again
            reasons = ["the kernel library is not built for this code"]
        if reasons:
            return None, "; ".join(reasons)
        return path, None

    def building(self) -> bool:
        """Whether a build holds the lock now."""
        try:
            with open(self.root / LOCK, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def failed(self) -> str | None:
        """The error the last build stopped on, where it ran this very code (:func:`code_key`):
        the same build would stop on it again. None where none did (or other code did)."""
        try:
            record = json.loads((self.root / FAILED).read_text())
            return str(record["error"]) if record.get("code") == code_key() else None
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            return None

    def start(self) -> str:
        """Start the build in a detached process (unless one runs, or this code's build failed:
        :meth:`failed`); returns a line saying so. OSError where the directory cannot be written."""
        self.root.mkdir(parents=True, exist_ok=True)
        error = self.failed()
        if error is not None:
            return (f"this machine's plan failed to build with this code ({error}; log: {self.root / LOG}); "
                    f"it is built again once the code changes, or after `rm {self.root / FAILED}`")
        if self.building():
            where = self.progress()
            return (f"this machine's plan is being built in the background ({f'{where}; ' if where else ''}"
                    f"log: {self.root / LOG})")
        log = open(self.root / LOG, "a")
        cmd = [sys.executable, "-m", "yggtree.machine_plan", str(self.root), "--threads", str(self.threads),
               "--weights", self.weights or "float32"]
        with log:
            pid = _spawn(cmd, log)
        (self.root / PID).write_text(f"{pid}\n")
        return (f"building this machine's plan ({self.weights or 'float32'} weights, compiled, with a latency "
                f"profile) in the background, once (log: {self.root / LOG}); later runs load it")

    def progress(self, now: float | None = None) -> str | None:
        """Where the running build is, in a few words: how long it has run, its last step (the
        first clause of the log's last line) and, where a build here finished before, about how
        long is left at that build's pace; None where it recorded nothing readable."""
        try:
            status = json.loads((self.root / STATUS).read_text())
            elapsed = (time.time() if now is None else now) - float(status["started"])
            step = re.split(r": | \(", str(status["line"]), maxsplit=1)[0]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        said = f"{elapsed:.0f} s in, last: {step}"
        try:
            took = float(json.loads((self.root / TOOK).read_text())["build_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return said
        left = took - elapsed
        return f"{said}; about {left:.0f} s left, as the last build here took {took:.0f} s" if left > 0 else said


    def speculates(self, profile_sha: str) -> Verdict | None:
        """Whether runs speculate, at what measured speed over plain steps and with how many
        lookup nodes, on the plan timed by the profile of sha256 ``profile_sha``; None where
        nothing was measured for it (or another measurement was: measured again)."""
        from .measure.speculation_choice import VERSION

        try:
            record = json.loads((self.root / SPECULATION).read_text())
            if record.get("profile") != profile_sha or record.get("version") != VERSION:
                return None
            return Verdict(bool(record["speculate"]), float(record["ratio"]), int(record["lookup"]),
                           float(record["sampling_ratio"]), bool(record["speculate_sampling"]))
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            return None

    def unsettled(self, path: Path) -> Unsettled | None:
        """What of the ready plan ``path`` is to be measured again: its product-kernel choice,
        its profile or its speculation verdict timed while other processes kept the cores busy
        (the build waited as long as it could: ``QUIET_WAITS``), or a profile whose stage timings
        time other calls than the engine runs (an earlier ``STAGE_CALLS``); None where all hold,
        or once ``REMEASURES`` later builds measured them again."""
        from .measure.kernel_choice import choice_record
        from .offline.profile_grid import STAGE_CALLS
        from .offline.timing import load_warning
        from .plan import load_plan

        if self.remeasured() >= REMEASURES:
            return None
        try:
            plan = load_plan(path)
            loads = [("the product kernel", (choice_record(replace(plan, profile=None)) or {}).get("load"))]
            if plan.profile is not None:
                profile = json.loads(Path(plan.profile).read_text())
                if profile.get("stage_calls", 1) < STAGE_CALLS:
                    return Unsettled("its profile timed other stage calls than the engine runs (pruning, policy, head width)")
                loads.append(("the profile", profile.get("load")))
            verdict = json.loads((self.root / SPECULATION).read_text())
            if verdict.get("profile") == profile_sha(path):
                loads.append(("the speculation verdict", verdict.get("load")))
        except (YggError, OSError, ValueError, AttributeError):
            return None  # nothing to judge by: the staleness checks decide
        for what, load in loads:
            busy = load_warning(what, load if isinstance(load, dict) else None)
            if busy is not None:
                return Unsettled(busy.split(": its times")[0], kernel=what == "the product kernel")
        return None

    def remeasured(self) -> int:
        """How many builds measured this plan again after it was timed while busy."""
        try:
            return int(json.loads((self.root / REMEASURED).read_text())["builds"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def learnt(self, profile_sha: str) -> dict | None:
        """What earlier runs' objective feedback learnt on the plan timed by the profile of
        sha256 ``profile_sha`` (runtime/feedback.py ``Feedback.learnt``); None if nothing (or
        only for another profile: a rebuilt plan starts afresh)."""
        try:
            record = json.loads((self.root / FEEDBACK).read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(record, dict) and record.get("profile") == profile_sha
        return record.get("learnt") if ok else None

    def keep_learnt(self, profile_sha: str, learnt: dict) -> None:
        """Keep ``learnt`` for the next run (nothing where the directory cannot be written)."""
        try:
            write_text_atomic(self.root / FEEDBACK, json.dumps({"profile": profile_sha, "learnt": learnt}) + "\n")
        except OSError:
            pass

    @contextlib.contextmanager
    def paused(self):
        """The running build (if any) stopped while the block runs, continued after: every
        process of its session (the compilers its tools start in process groups of their own
        included)."""
        sid = self._build_pid()
        if sid is None:
            yield
            return
        for _ in range(2):  # twice: a process may have started one more while the first pass ran
            _signal_session(sid, signal.SIGSTOP)
        try:
            yield
        finally:
            _signal_session(sid, signal.SIGCONT)

    def _build_pid(self) -> int | None:
        """The process (group) id of this plan's build while it runs, else None."""
        try:
            pid = int((self.root / PID).read_text())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        # the id is the build's only while that process is the build of this directory
        return pid if b"yggtree.machine_plan" in cmd and str(self.root).encode() in cmd else None


def _signal_session(sid: int, sig: int) -> None:
    """Send ``sig`` to every process of the session ``sid`` (Linux's /proc; elsewhere nothing)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
            if int(fields[3]) == sid:
                os.kill(int(stat.parent.name), sig)
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile, or not ours to signal


def _spawn(cmd: list[str], log) -> int:
    """Start ``cmd`` detached (its own session: a Ctrl-C of the run does not stop it), output to
    ``log``; returns its process id (its session's and process group's id)."""
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True).pid


def machine_plan(device: dict, threads: int, weights: str | None = "auto", root: Path | None = None
                 ) -> MachinePlan:
    """The machine plan of ``device`` at ``threads`` threads in ``weights`` (None: float32; "auto":
    :func:`machine_weights`)."""
    from .runtime.device import device_slug

    weights = machine_weights() if weights == "auto" else weights
    name = f"{device_slug(device)}-t{threads}-{weights or 'float32'}"
    return MachinePlan((root or data_root()) / "machine" / name, weights, threads)


# ----------------------------------------------------------------------------- the build


def build(mp: MachinePlan, say=None) -> Path:
    """Build ``mp`` (see the module docstring) under its lock; returns the compiled plan copy.
    YggError where a step fails (the directory then holds no ready.json)."""
    if say is None:  # the log's lines (build.log) say when each step ended; status.json the last (runs quote it)
        start, started = time.perf_counter(), time.time()

        def say(line: str) -> None:
            print(f"yggtree machine plan [{time.perf_counter() - start:3.0f} s]: {line}", flush=True)
            try:
                write_text_atomic(mp.root / STATUS, json.dumps({"line": line, "started": started}) + "\n")
            except OSError:
                pass  # only a run's progress line goes without it
    mp.root.mkdir(parents=True, exist_ok=True)
    with open(mp.root / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise YggError(f"another process is building {mp.root}") from None
        try:
            say("started")
            path = _build_locked(mp, say)
        except YggError as e:  # the same code would stop on it again: runs stop starting it (MachinePlan.failed)
            write_text_atomic(mp.root / FAILED, json.dumps({"error": str(e), "code": code_key()}) + "\n")
            raise
        (mp.root / FAILED).unlink(missing_ok=True)
        return path


def code_key() -> str:
    """sha256 (16 hex digits) of what a build runs with: the package's sources (:func:`_sources_sha`),
    the torch version and the compilers and ninja on the PATH. A failed build is retried once it
    changes (new code, or a compiler installed)."""
    import shutil

    import torch

    tools = [shutil.which(t) or "" for t in ("c++", "g++", "ninja")]
    return hashlib.sha256("\0".join([_sources_sha(), torch.__version__, *tools]).encode()).hexdigest()[:16]


@functools.cache
def _sources_sha() -> str:
    """sha256 of every source file of the package (Python, the kernel library's C++) and its JSON
    assets (the acceptance calibration a build copies), read once a process."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for f in sorted(package.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h", ".json") and f.is_file():
            h.update(str(f.relative_to(package)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _build_locked(mp: MachinePlan, say) -> Path:
    from .plan import default_plan, validate_plan
    from .quickstart import shipped_calibration

    t0 = time.perf_counter()
    base = default_plan()
    shipped = shipped_calibration(base)
    if shipped is None:
        raise YggError("the package ships no acceptance calibration for the default pair")
    # the plan's own copy: a plan naming the package's file would go stale with the checkout or
    # environment that built it (the same code elsewhere shares this directory)
    calibration = mp.root / CALIBRATION
    write_text_atomic(calibration, shipped.read_text())
    # the widths a CPU's objective takes (wider trees cost more rows than they return there): half
    # the default plan's packages, so the build ends in minutes
    plan = replace(base, name=mp.name, calibration=str(calibration), profile=None, predictor=None, **mp.shape)
    plan = validate_plan(plan.to_dict())
    ready, _ = mp.ready_plan()
    if ready is not None:
        busy = mp.unsettled(ready)
        if busy is None:
            if mp.speculates(profile_sha(ready)) is None:  # built before the verdict was measured
                _measure_speculation(mp, ready, say)
            return ready
        # timed while busy: measured again (the same kernel choice keeps every package)
        n = mp.remeasured() + 1
        write_text_atomic(mp.root / REMEASURED, json.dumps({"builds": n}) + "\n")
        say(f"{busy.line}: measuring again ({n} of at most {REMEASURES})")
        if busy.kernel:
            from .measure.kernel_choice import forget_choice

            forget_choice(plan)
    else:
        (mp.root / REMEASURED).unlink(missing_ok=True)  # a build from scratch: its own count
    # 1. the packages (the target's whole steps, the prefill and drafter blocks, the drafter's
    # calls), profiled, ready
    copy = _build_plan(mp, plan, t0, say)
    # 2. whether its objective beats its plain steps here: runs decode plainly where it does not
    _measure_speculation(mp, copy, say)
    took = time.perf_counter() - t0
    try:  # the next build's estimate, nothing more: a build does not fail for it
        write_text_atomic(mp.root / TOOK, json.dumps({"build_s": round(took, 1)}) + "\n")
    except OSError:
        pass
    say(f"ready in {took:.0f} s: {copy}")
    # 3. the products' prefetch and where the kernel library's loops run in later runs, by decoding
    _measure_decoding(copy, say)
    # 4. the memory allocator later runs restart on (the system's, or one installed, measured on this plan)
    _measure_allocator(mp, copy, say)
    # 5. the batched graphs `yggtree serve` decodes its default batch with: its first start loads them
    _build_serving(copy, say)
    return copy


def _measure_decoding(copy: Path, say) -> None:
    """The settings measured by decoding on the ready plan ``copy`` (offline/compile.py
    ``record_decoding``: its products' prefetch, then where the kernel library's loops run,
    recorded in its manifest for the runs started after it), measured after the verdict, off the
    way to a ready plan: the profile and the verdict are timed at the product kernel's measured
    prefetch on OpenMP's loops, and the runs after it decode a few percent faster where decoding
    chose otherwise (docs/results.md section 10). A build stopped before it leaves those until the
    next build."""
    from .compiled import artifact_dir
    from .offline.compile import record_decoding
    from .plan import load_plan

    plan = load_plan(copy)
    record_decoding(plan, artifact_dir(plan), say)


def _measure_allocator(mp: MachinePlan, copy: Path, say) -> None:
    """This machine's allocator (measure/allocator_choice.py), timed on the ready plan ``copy``
    where no choice is cached for the allocators installed; runs started after it restart on the
    faster one. A failure is one line: runs keep the system's."""
    from .measure.allocator_choice import measure_compiled

    try:
        measure_compiled(copy, mp.compile_root, say=say)
    except (YggError, OSError) as e:
        say(f"the memory allocator was not measured ({e}): runs keep the system's")


def _build_serving(copy: Path, say) -> None:
    """The batch packages of ``yggtree serve --max-batch SERVE_BATCH`` on the ready plan ``copy``
    (offline/batch_build.py), built after the plan is ready (runs never wait for them); a
    failure is one line, and the server builds them at its first start instead."""
    from .compiled import artifact_dir
    from .offline.batch_build import batch_packages
    from .plan import load_plan
    from .runtime.build import build_plan_engine
    from .shapes import SERVE_BATCH

    try:
        plan = load_plan(copy)
        engine, _ = build_plan_engine(plan, artifact_dir(plan))
        batch_packages(engine, SERVE_BATCH, say)
    except (YggError, OSError) as e:
        say(f"the batched graphs of `yggtree serve` were not built ({e}): its first start builds them")


def _measure_speculation(mp: MachinePlan, copy: Path, say) -> None:
    """Time the ready plan ``copy``'s objective against its plain steps on held-out prompts
    (measure/speculation_choice.py), again after waits while other processes keep the cores
    busy (the quietest kept), and record the verdict under its profile's sha256 (and the size of
    its engine's weights for the next run's reserve)."""
    from .compiled import artifact_dir
    from .measure.speculation_choice import measure_speculation
    from .plan import load_plan

    from .offline.timing import quietest

    from .runtime.reserve import Reserve, run_hint

    plan = load_plan(copy)
    say("timing the latency objective against plain steps on held-out prompts")
    # its engine is the next run's: an empty reserve records the size of its weights' arena, which
    # that run then faults in while torch imports (runtime/reserve.py)
    best = quietest(lambda: measure_speculation(plan, artifact_dir(plan), mp.threads, Reserve(run_hint(), 0)),
                    QUIET_WAITS, "speculation", say)
    record = {"profile": profile_sha(copy), **best, "speculate": best["ratio"] >= 1.0,
              "speculate_sampling": best["sampling_ratio"] >= 1.0}
    write_text_atomic(mp.root / SPECULATION, json.dumps(record) + "\n")
    others = ", ".join(f"{r:.3f}x with {n}" for n, r in best.get("ratios", {}).items() if int(n) != best["lookup"])
    say(f"the latency objective decodes at {best['ratio']:.3f}x plain steps here with {best['lookup']} lookup "
        f"nodes a step{f' ({others})' if others else ''}, {best['sampling_ratio']:.3f}x on sampled requests, "
        f"{best['prompts']} held-out prompts: runs {'speculate' if record['speculate'] else 'decode plainly'}, "
        f"sampled ones {'speculate' if record['speculate_sampling'] else 'decode plainly'}")


def _build_plan(mp: MachinePlan, plan, t0: float, say) -> Path:
    """Compile ``plan`` into the compile root (every package its engine runs, a package per core
    at once, the longest first), time them for a quick latency profile, and mark the plan naming
    it ready. Returns its compiled copy."""
    import threading

    import torch

    from .compiled import artifact_dir
    from .offline.build_jobs import warm_compiler
    from .offline.compile import compile_plan
    from .measure.kernel_choice import measure_plan
    from .offline.profile import measure_profile, write_profile
    from .offline.profile_grid import ProfileGrid
    from .offline.timing import quietest
    from .plan import save_plan, validate_plan
    from .runtime.build import build_plan_engine
    from .runtime.padding import PADDING_KEY, cached_padding

    torch.set_num_threads(mp.threads)
    root = mp.compile_root
    say(f"compiling {plan.name}'s packages ({mp.weights or 'float32'} weights) into {root}")
    # the compiler's probes of this CPU beside the kernel library's build, whose last source keeps one core
    warm = threading.Thread(target=warm_compiler, daemon=True)
    warm.start()
    measure_plan(plan, say, QUIET_WAITS)  # the product kernel every package holds: timed on a quiet machine
    warm.join()
    say("compiling the packages")
    compile_plan(plan, root, replace=True, workers=0, allocator=False, decoding=False)  # a package per core
    # at once; the settings measured by decoding and the allocator are measured once the plan is ready
    # (_measure_decoding, _measure_allocator: runs need not wait for them)
    art = artifact_dir(plan, root)
    say(f"compiled at {time.perf_counter() - t0:.0f} s; timing the packages for the latency profile")
    padding = cached_padding(plan)
    engine, _ = build_plan_engine(plan, art, threads=mp.threads)
    widths = tuple(sorted({1, *plan.verify_widths}))
    grid = ProfileGrid(warmup=1, repeats=PROFILE_ROUNDS, quick=True, widths=widths, stage_forms=False)
    # times taken while other processes ran would price every later step wrongly
    profile = quietest(lambda: measure_profile(plan, "profile", mp.threads, grid, "yggtree run (this machine's plan)",
                                               engine=engine, padding=padding), QUIET_WAITS, "the profile", say)
    profile[PADDING_KEY] = profile.get(PADDING_KEY) or padding
    engine = None  # its memory, before the compile below
    write_profile(profile, mp.root, plot=False)
    final = validate_plan(plan.to_dict() | {"profile": str(mp.root / "profile.json")})
    save_plan(final, mp.root / "profile-plan.yaml")
    compile_plan(final, root, replace=True, allocator=False, decoding=False)  # the same graphs: the copy is refreshed
    copy = artifact_dir(final, root) / "plan.yaml"
    write_text_atomic(mp.root / READY, json.dumps({"plan": str(copy.relative_to(mp.root)),
                                                   "build_s": round(time.perf_counter() - t0, 1)}) + "\n")
    say(f"packages and profile ready at {time.perf_counter() - t0:.0f} s: {copy}")
    return copy


PROFILE_ROUNDS = 15  # rounds of the profile's calls (a second or two of timing): whether the objective drafts
# at all turns on one ratio, a verify step's time over a plain step's, and with 3 rounds the same plan's
# profile put it anywhere from 1.1x to 1.9x on a shared machine (15 rounds: within a few percent)
QUIET_WAITS = (5, 30, 60, 120, 240)  # a measurement timed while other processes kept cores busy is timed
# again after these waits (offline/timing.quietest), the quietest kept: a short one first, for a
# moment's work beside a short measurement (the product kernel's takes a second)


def profile_sha(plan_path: Path) -> str | None:
    """sha256 of the profile the plan at ``plan_path`` names (None: none, or unreadable)."""
    from .files import file_sha256
    from .plan import load_plan

    try:
        profile = load_plan(plan_path).profile
        return file_sha256(profile) if profile else None
    except (YggError, OSError):
        return None


def _yield_to_runs() -> None:
    """Run the build (and the compilers it starts, which inherit it) only on CPU time nothing else
    wants: the idle scheduling class where the OS has one, else the lowest priority. Runs decode
    meanwhile with every core: a build that took even a share of one would stall their parallel
    loops, whose threads wait on each other at every product.

    The build runs in a session of its own, and Linux's autogroups (on by default) share the CPU
    fairly between sessions before any policy inside one applies: an idle-class build in its own
    session still took half the cores from a run in another. So the session's group is set to
    the lowest weight too (``/proc/self/autogroup``, nice 19), where the kernel has autogroups and
    the build leads its session (as runs start it; by hand in a shell, the shell's group is left)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass
    if os.getsid(0) != os.getpid():
        return  # started by hand inside another session: its group is not the build's to lower
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroups (another OS, a kernel without them): the policy above is all
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m yggtree.machine_plan DIR --threads T --weights W``: the background build."""
    import argparse

    from .errors import run_reporting

    p = argparse.ArgumentParser(prog="python -m yggtree.machine_plan")
    p.add_argument("root")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--weights", required=True)
    args = p.parse_args(argv)
    _yield_to_runs()
    weights = None if args.weights == "float32" else args.weights
    mp = MachinePlan(Path(args.root), weights, args.threads)
    return run_reporting("yggtree machine plan", lambda _: build(mp) and 0, None)


if __name__ == "__main__":
    sys.exit(main())
