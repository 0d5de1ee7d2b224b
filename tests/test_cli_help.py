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
