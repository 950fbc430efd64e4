"""The one flag style of every `lrattn` subcommand.

Options are declared and shown with underscores, as LightningCLI spells its flags (`--max_new_tokens`,
`--tracking_uri`); the hyphenated spelling (`--max-new-tokens`) is accepted as an alias.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def underscore_flags(argv: Sequence[str]) -> list[str]:
    """--max-new-tokens[=v] -> --max_new_tokens[=v]; everything else unchanged."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + eq + value
        out.append(arg)
    return out


class Parser(argparse.ArgumentParser):
    """argparse with the one flag style: declared `--a-b` becomes `--a_b`, and `--a-b` on the command line
    is read as `--a_b`."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        # (dict.fromkeys: `--a_b` and `--a-b` both declared are one flag, listed once in --help)
        names = tuple(dict.fromkeys("--" + n[2:].replace("-", "_") if n.startswith("--") else n for n in names))
        return super().add_argument(*names, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args(underscore_flags(args), namespace)
