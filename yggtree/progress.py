"""Progress reporting for long commands: a rich bar on stderr with rate and ETA, plus one plain log
line every ``every`` seconds when stderr is not a terminal (so a background run's log shows progress)."""

from __future__ import annotations

import sys
import time


def stderr_progress():
    """A rich progress bar on stderr (stdout stays free for tables and JSON lines)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )


class PlainLog:
    """``log(msg)`` writes ``[HH:MM:SS] msg`` to stderr at most once per ``every`` seconds (always with
    ``force``), and only when stderr is not a terminal (where the rich bar is live)."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.last = 0.0
        self.on = not sys.stderr.isatty()

    def __call__(self, msg: str, force: bool = False) -> None:
        now = time.perf_counter()
        if self.on and (force or now - self.last >= self.every):
            self.last = now
            sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
            sys.stderr.flush()
