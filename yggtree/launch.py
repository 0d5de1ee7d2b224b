"""The ``yggtree`` command's entry point: the allocator first (``runtime/allocator.py``: a process
restarts itself on the allocator measured fastest on this machine before anything heavy loads),
for ``run`` the weights' memory faulting in beside torch's import (``runtime/reserve.py``), then
the command line (``yggtree.cli``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .errors import YggError
    from .runtime.allocator import ensure

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ensure([sys.executable, "-m", "yggtree.launch", *args])
    except YggError as e:
        sys.stderr.write(f"yggtree: error: {e}\n")
        return 1
    if args[:1] != ["run"]:
        from .cli import main as cli_main

        return cli_main(args)
    from .runtime.reserve import Reserve, run_hint

    reserve = Reserve.open(run_hint())
    try:
        from .cli import main as cli_main

        return cli_main(args, reserve)
    finally:
        reserve.close()  # not taken (an early error): its fault stopped before the exit unmaps it


if __name__ == "__main__":
    raise SystemExit(main())
