"""The ``yggtree`` command's entry point: the allocator first (``runtime/allocator.py``: a process
restarts itself on the allocator measured fastest on this machine before anything heavy loads),
then the command line (``yggtree.cli``)."""

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
    from .cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
