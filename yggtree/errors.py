"""The one error type users see, and the command entry points that print it as one line."""


class YggError(Exception):
    """An error the user can fix; the CLI prints its message as one line and exits non-zero."""


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """The choice the environment variable ``name`` forces: one of ``choices``, None for ``auto``
    or unset; YggError in one line naming the variable for anything else."""
    import os

    v = os.environ.get(name, "auto").strip() or "auto"
    if v == "auto":
        return None
    if v not in choices:
        raise YggError(f"{name}={v!r}: must be {', '.join(('auto', *choices[:-1]))} or {choices[-1]}")
    return v


def os_error_line(e: OSError) -> str:
    """An OSError as the words of one error line: what failed and on which path (an output path
    that is an existing file, a directory that cannot be made, a disk that is full...)."""
    what = e.strerror or str(e)
    return f"{what}: {e.filename}" if e.filename is not None else what


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush does not fail again (after a
    BrokenPipeError: stdout's reader went away)."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (tests): nothing left to flush
        pass


def run_reporting(name: str, fn, args, code: int = 1) -> int:
    """Run a command's ``fn(args)``; a YggError or an OSError becomes one stderr line and exit
    ``code``; a closed stdout (``| head``) stops quietly with status 0, like other tools."""
    import sys

    try:
        return fn(args)
    except YggError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return code
    except BrokenPipeError:
        silence_stdout()
        return 0
    except OSError as e:
        print(f"{name}: error: {os_error_line(e)}", file=sys.stderr)
        return code


def module_main(module: str, command: str, doc: str | None, add_arguments, fn, argv=None) -> int:
    """``python -m <module> ...``: the same options as ``yggtree <command>`` (``add_arguments``),
    then ``fn(args)`` through :func:`run_reporting`; ``args.argv`` holds the command's own
    arguments, as the CLI sets it (manifests record them)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run_reporting(f"yggtree {command}", fn, args)
