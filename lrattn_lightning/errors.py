"""What every `lrattn` subcommand shares: the one-line error, one flag style, the files shipped in the package.

Options are declared and shown with underscores, as LightningCLI spells its flags (`--max_new_tokens`,
`--tracking_uri`); the hyphenated spelling (`--max-new-tokens`) is accepted as an alias.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Bad input (a flag, a file, a registry entry, a config value): `lrattn` prints it as one line, exit 2.

    Every error the project raises about what it was given derives from this class, so `lrattn` can tell
    them from a failure inside the work (a plain ValueError from torch mid-training keeps its traceback).
    """


class UsageError(InputError):
    """Bad command-line input, reported as one line before any work starts."""


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
        names = tuple("--" + n[2:].replace("-", "_") if n.startswith("--") else n for n in names)
        return super().add_argument(*names, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args(underscore_flags(args), namespace)


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) if str(err).strip() else type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{text} ({err.filename})"
    return text


def packaged(relative: str) -> Path | None:
    """A recipe or sweep file shipped in the package (`experiments/...`), or None."""
    parts = Path(relative).parts
    if not parts or parts[0] != "experiments":
        return None
    path = Path(str(resources.files("lrattn_lightning").joinpath(*parts)))
    return path if path.is_file() else None
