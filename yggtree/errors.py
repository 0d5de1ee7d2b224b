"""The one error type users see."""


class YggError(Exception):
    """An error the user can fix; the CLI prints its message as one line and exits non-zero."""


def run_reporting(name: str, fn, args, code: int = 1) -> int:
    """Run a command's ``fn(args)``; a YggError becomes one stderr line and exit ``code``."""
    import sys

    try:
        return fn(args)
    except YggError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return code
