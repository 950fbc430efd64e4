"""What every `lrattn` subcommand shares: the one-line error, one flag style, the files shipped in the package.

Options are declared and shown with underscores, as LightningCLI spells its flags (`--max_new_tokens`,
`--tracking_uri`); the hyphenated spelling (`--max-new-tokens`) is accepted as an alias.
"""

from __future__ import annotations

import argparse
import re
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


NAME_MAX = 100  # characters: a name is one folder among longer paths (file systems allow 255 bytes)
_NAME_RULES = {  # (first character, the others, in words); lower: sweep variant labels, which join the
    # registry's lower-case names in a run's name
    False: ("[A-Za-z0-9]", "[A-Za-z0-9._-]", "letters, digits, '-', '_' and '.'"),
    True: ("[a-z0-9]", "[a-z0-9.-]", "lower-case letters, digits, '-' and '.'"),
}


def check_name(value: Any, what: str, lower: bool = False) -> str:
    """`value` if it is one safe path component (run, experiment and sweep names, variant labels), else a
    UsageError naming `what`. Such names become folders under --runs_dir: a separator, `..`, an absolute
    path or a control character would put files elsewhere, and "" would silently mean a default."""
    first, rest, chars = _NAME_RULES[lower]
    rule = f"a name is one folder: {chars}, starting with a letter or digit, at most {NAME_MAX} characters"
    if not isinstance(value, str) or not value:
        raise UsageError(f"{what} is empty; {rule}")
    shown = repr(value if len(value) <= 60 else value[:60] + "...")  # repr: a newline stays on the line
    if len(value) > NAME_MAX:
        raise UsageError(f"{what} {shown} is too long ({len(value)} characters, at most {NAME_MAX}); give a shorter name")
    if "/" in value or "\\" in value or value in (".", ".."):
        raise UsageError(f"{what} {shown} is a path, not a name; {rule}")
    if not re.fullmatch(first, value[0]):
        raise UsageError(f"{what} {shown} starts with {value[0]!r}; {rule}")
    bad = next((c for c in value if not re.fullmatch(rest, c)), None)
    if bad is not None:
        raise UsageError(f"{what} {shown} holds {bad!r}; {rule}")
    return value


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
