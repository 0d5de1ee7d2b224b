"""``yggtree --help`` and each command's ``--help``: a user's text (descriptions drawn from module
docstrings are shown without their reStructuredText quotes), the main command named first."""

from __future__ import annotations

import argparse

from yggtree.cli import build_parser


def test_every_help_text_reads_as_plain_text():
    parser = build_parser()
    top = parser.format_help()
    assert "yggtree run --prompt" in top and "``" not in top
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"run", "serve", "compile", "profile", "tune"}
    for name, command in sub.choices.items():
        assert "``" not in command.format_help(), name


def test_every_flag_the_readme_shows_exists():
    """Each ``yggtree CMD ... --flag`` line of the README's shell blocks, and each flag of its ``run``
    table, names a flag the command has (the README drifts from the parser otherwise)."""
    import re
    from pathlib import Path

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            for cmd, rest in re.findall(r"\byggtree ([a-z-]+)((?:\s+(?!&&|\||#)\S+)*)", line.split("#")[0]):
                shown += [(cmd, f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)]
    table = text[text.index("`yggtree run --help` lists every flag"):]
    table = table[: table.index("\n\n", table.index("| flags |"))]
    shown += [("run", f) for f in re.findall(r"`(--[a-z][a-z0-9-]*)", table)]
    assert len(shown) > 40
    missing = sorted({(c, f) for c, f in shown if c in flags and f not in flags[c]})
    assert missing == [], missing
