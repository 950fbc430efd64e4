"""core/flags.py: one flag style; a flag declared in both spellings is one flag, and every command's --help lists
each of its flags once (`compare --help` listed `--tracking_uri TRACKING_URI, --tracking_uri TRACKING_URI`)."""

from __future__ import annotations

import re

import pytest

from lrattn_lightning.cli import COMMANDS, main
from lrattn_lightning.core.flags import Parser


def test_both_spellings_declared_are_one_flag(capsys):
    parser = Parser(prog="x")
    parser.add_argument("--tracking_uri", "--tracking-uri", default=None)
    assert parser.parse_args(["--tracking-uri", "a"]).tracking_uri == "a"
    parser.print_help()
    assert capsys.readouterr().out.count("--tracking_uri") == 2  # usage line and option line, once each


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("fit", "validate", "test")])
def test_every_commands_help_lists_each_flag_once(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    for line in text.splitlines():
        flags = re.findall(r"(?:^|, )(--[a-z][a-z0-9_-]*)", line.strip()) if line.startswith("  -") else []
        assert len(flags) == len(set(flags)), (command, line)
