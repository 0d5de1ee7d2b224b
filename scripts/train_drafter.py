"""Retrain the shipped default drafter from scratch (a thin wrapper over ``yggtree distill``).

    python scripts/train_drafter.py [--out DIR] [extra distill options...]

runs ``yggtree distill`` with the options recorded in the shipped head's manifest.json
(yggtree/assets/drafters/smollm2-135m-eagle: its ``command``, without its ``--out``), then the
extra options given here, which override them. Output is deterministic given the seed and the
thread count; the teacher data are cached under ~/.cache/yggtree/distill.
"""

from __future__ import annotations

import json
import shlex
import sys

from yggtree.offline.distill import main
from yggtree.runtime.artifacts import DEFAULT_DRAFTER_DIR


def shipped_options() -> list[str]:
    """The shipped head's ``yggtree distill`` options, ``--out`` dropped."""
    argv = shlex.split(json.loads((DEFAULT_DRAFTER_DIR / "manifest.json").read_text())["command"])
    assert argv[:2] == ["yggtree", "distill"], argv[:2]
    out = []
    args = iter(argv[2:])
    for a in args:
        if a == "--out":
            next(args)
        elif not a.startswith("--out="):
            out.append(a)
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv = ["--out", "drafter-retrained", *argv]
    sys.exit(main(shipped_options() + argv))
