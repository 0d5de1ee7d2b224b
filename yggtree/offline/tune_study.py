"""The optuna study behind ``yggtree tune``: storage, identity, trial budget, recovery, pruning.

- Storage: any SQLAlchemy URL optuna's RDB storage accepts (an SQLite file by default; PostgreSQL
  or MySQL so several machines tune one study). A URL that cannot be opened is one YggError line.
- Identity: a study records what it tunes (target, drafter, dtype, backend, device, threads, the
  search space) in its user attributes; a tune of anything else on that study is refused (its
  trials' speeds would not be comparable).
- Budget: ``--trials N`` counts every trial of the study except those a killed process left
  behind (re-run under another number). Local workers take trials under a file lock (count, then ``study.ask()``), so N
  trials are started, none twice.
- Recovery: a trial still RUNNING whose process is gone (same host: its pid is dead; another
  host: no sign of life for ``stale_s``) is marked FAIL and its parameters are enqueued
  again: the next trial to start re-runs it under a new number, so
  trial numbers only grow and no completed trial runs again.
- Pruning (:class:`LeaderPruner`): step 0 is the predicted tokens/s; only the ``measure_top``
  best predictions so far go on to be compiled and measured; at steps >= 1 (measured after
  1, 2, 4, ... held-out prompts) a trial below the median of the completed trials at the same
  step stops.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import YggError

IDENTITY_ATTR = "yggtree_identity"
BASE_ATTR = "yggtree_base_enqueued"  # set once the base plan's trial is enqueued


def redacted(url: str) -> str:
    """``url`` without its password (for messages and reports)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as given
        return url


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def open_storage(url: str):
    """An optuna RDB storage for ``url``; YggError (one line) when it cannot be opened."""
    import optuna
    from sqlalchemy.engine import make_url

    try:
        backend = make_url(url).get_backend_name()
    except Exception:  # noqa: BLE001 - sqlalchemy raises several types for a bad URL
        raise YggError(f"--storage {url!r} is not a database URL (e.g. sqlite:///study.db, "
                       "postgresql://user@host/db)") from None
    if backend == "sqlite":
        kwargs = {"connect_args": {"timeout": 60}}  # concurrent local workers wait for the lock
        db = make_url(url).database
        if db and db != ":memory:" and not Path(db).parent.is_dir():
            raise YggError(f"cannot open study storage {redacted(url)}: directory "
                           f"{Path(db).parent} does not exist")
    elif backend in ("postgresql", "mysql"):
        kwargs = {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
    else:
        kwargs = {}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except ImportError:  # optuna re-raises the driver's ModuleNotFoundError as ImportError
        raise YggError(f"cannot open study storage {redacted(url)}: its database driver is not "
                       f"installed (for PostgreSQL: pip install 'psycopg[binary]')") from None
    except Exception as e:  # noqa: BLE001 - sqlalchemy/driver errors of every kind: one line
        first = " ".join(str(e).split("\n")[0].split())[:300]
        raise YggError(f"cannot open study storage {redacted(url)}: {type(e).__name__}: {first}") from None


def open_study(url: str, name: str, identity: dict, sampler=None, pruner=None, create: bool = True):
    """The study ``name`` in the storage at ``url`` (created when missing and ``create``), its
    identity checked against ``identity`` (set when the study has none yet)."""
    with trial_lock(url, name):  # local workers starting together create its tables and mark it once
        return _open_study(open_storage(url), name, identity, sampler, pruner, create)


def _open_study(storage, name: str, identity: dict, sampler, pruner, create: bool):
    import optuna

    try:
        if create:
            study = optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                        load_if_exists=True, sampler=sampler, pruner=pruner)
        else:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:
        raise YggError(f"no study {name!r} in the storage") from None
    except ValueError as e:  # a multi-objective or minimising study of the same name
        raise YggError(f"study {name!r} cannot be used: {e}") from None
    have = study.user_attrs.get(IDENTITY_ATTR)
    if have is None:
        if study.direction != optuna.study.StudyDirection.MAXIMIZE:
            raise YggError(f"study {name!r} minimises; it is not a yggtree tune study")
        if study.trials:
            raise YggError(f"study {name!r} already has trials that are not yggtree tune trials; "
                           "use another --study")
        study.set_user_attr(IDENTITY_ATTR, identity)
        return study
    if have.get("format") != identity.get("format"):
        raise YggError(f"study {name!r} was made by another version of yggtree tune (study format "
                       f"{have.get('format')}, this tune writes {identity.get('format')}: its parameters are "
                       "encoded otherwise); use another --study")
    if have.get("device_identity") != identity.get("device_identity"):  # runtime/device.py names the difference
        from ..runtime.device import device_difference

        (kind, _, name), (was_kind, _, was_name) = (str(d.get("device", "")).partition(" ") for d in (identity, have))
        was = {"device": was_kind, "device_name": was_name, "device_identity": have.get("device_identity")}
        now = {"kind": kind, "name": name, "identity": identity.get("device_identity")}
        raise YggError(f"study {name!r} timed its trials on another device ({device_difference(was, now)}); use "
                       "another --study")
    if have != identity:
        key = next((k for k in sorted(set(have) | set(identity)) if have.get(k) != identity.get(k)), "?")
        raise YggError(f"study {name!r} tunes another setup (differs in {key}: study "
                       f"{_short(have.get(key))} vs this tune {_short(identity.get(key))}); use "
                       "another --study")
    return study


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


@contextlib.contextmanager
def trial_lock(url: str, study: str):
    """An exclusive lock shared by this host's workers of one study (a file in the temporary
    directory keyed by storage and study)."""
    import fcntl

    key = hashlib.sha256(f"{url}\0{study}".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"yggtree-tune-{key}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner() -> dict:
    """Who runs a trial: host, pid and the pid's start time (a reused pid is not this one)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": process_start(pid)}


def owner_alive(attrs: dict, stale_s: float, now: float | None = None) -> bool:
    """Whether the process recorded in a trial's user attributes may still run it."""
    own = attrs.get("owner")
    if not isinstance(own, dict):
        return True  # not ours to judge
    if own.get("host") == socket.gethostname():
        return process_start(int(own.get("pid", -1))) == own.get("pid_start")
    seen = attrs.get("alive_at", 0.0)
    return (now if now is not None else time.time()) - float(seen) < stale_s


def recover(study, stale_s: float) -> list[int]:
    """Fail every RUNNING trial whose process is gone and enqueue its parameters again (the new
    trial's user attribute ``retry_of`` names the old number); returns the recovered numbers.
    Call under :func:`trial_lock`."""
    from optuna.trial import TrialState

    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if owner_alive(t.user_attrs, stale_s):
            continue
        try:
            study.tell(t.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):
            continue  # another worker recovered it first
        retry(study, t.number, t.params)
        out.append(t.number)
    return out


def retry(study, number: int, params: dict) -> None:
    """Enqueue ``params`` again as the re-run of the failed trial ``number``."""
    study.enqueue_trial(params, user_attrs={"retry_of": number}, skip_if_exists=False)


def enqueue_base(study, url: str, params: dict) -> bool:
    """Enqueue the base plan's parameters once per study (user attribute ``base`` on the trial);
    False when it was enqueued before. The study attribute :data:`BASE_ATTR`, checked under
    :func:`trial_lock`, guards this host's workers and reruns; optuna's ``skip_if_exists``
    guards the rest (a study whose trials already drew the plan). Processes on other hosts
    starting at the same instant may still both enqueue it (the second run is a duplicate plan,
    not a lost trial)."""
    with trial_lock(url, study.study_name):
        if BASE_ATTR in study.user_attrs:
            return False
        study.enqueue_trial(params, user_attrs={"base": True}, skip_if_exists=True)
        study.set_user_attr(BASE_ATTR, params)
        return True


def counted(study) -> tuple[int, int]:
    """(trials counting toward the budget, of which waiting): every trial but those that were
    re-run (killed trials: another trial names them in ``retry_of``)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    rerun = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    live = [t for t in trials if t.number not in rerun]
    return len(live), sum(t.state == TrialState.WAITING for t in live)


def next_trial(study, url: str, budget: int, stale_s: float, deadline: float | None = None):
    """The next trial for this worker (``study.ask()``), or None when the budget is spent (or
    ``deadline``, a ``time.time()``, has passed and nothing is waiting). Dead workers' trials
    are recovered first."""
    with trial_lock(url, study.study_name):
        recover(study, stale_s)
        n, waiting = counted(study)
        late = deadline is not None and time.time() >= deadline
        if not waiting and (n >= budget or late):
            return None
        trial = study.ask()
        trial.set_user_attr("owner", owner())
        trial.set_user_attr("alive_at", time.time())
        return trial


# ----------------------------------------------------------------------------- pruning


def should_measure(predicted: float, earlier: list[float], top: int) -> bool:
    """A candidate is measured when its predicted value ranks among the ``top`` best of itself
    and every earlier prediction."""
    return sum(v > predicted for v in earlier) < top


def should_stop(value: float, completed_at_step: list[float], min_completed: int = 1) -> bool:
    """A measured candidate stops when it is below the median of the completed trials at the
    same step, once at least ``min_completed`` of them reached it (fewer: it goes on). A median of
    one or two few-prompt measurements is no yardstick: a real tune whose base plan completed first
    pruned every later trial against that one number at its first prompt."""
    if len(completed_at_step) < max(min_completed, 1):
        return False
    xs = sorted(completed_at_step)
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return value < median


def make_pruner(measure_top: int):
    """An optuna pruner applying :func:`should_measure` at step 0 and :func:`should_stop` after
    (against the median of at least ``measure_top`` completed trials: like optuna's MedianPruner's
    start-up trials, nothing is stopped before that many finished)."""
    import optuna
    from optuna.trial import TrialState

    class LeaderPruner(optuna.pruners.BasePruner):
        def prune(self, study, trial) -> bool:
            step = trial.last_step
            if step is None:
                return False
            value = trial.intermediate_values[step]
            others = [t for t in study.get_trials(deepcopy=False) if t.number != trial.number]
            if step == 0:
                earlier = [t.intermediate_values[0] for t in others
                           if 0 in t.intermediate_values and t.number < trial.number]
                return not should_measure(value, earlier, measure_top)
            done = [t.intermediate_values[step] for t in others
                    if t.state == TrialState.COMPLETE and step in t.intermediate_values]
            return should_stop(value, done, measure_top)

    return LeaderPruner()
