"""Errors about what `lrattn` was given, and how any error is shown in one line.

`InputError` is bad input (a flag, a file, a registry entry, a checkpoint): `lrattn` prints it as one line, exit 2,
before any work. `UsageError` is bad command-line input; `CheckpointError` a checkpoint that cannot be written, read or
trusted. `one_line` and `first_line` are the one way to put an exception's text on a line.
"""

from __future__ import annotations

import math
from typing import Any


class InputError(ValueError):
    """Bad input (a flag, a file, a registry entry, a config value): `lrattn` prints it as one line, exit 2.

    Every error the project raises about what it was given derives from this class, so `lrattn` can tell
    them from a failure inside the work (a plain ValueError from torch mid-training keeps its traceback).
    """


class UsageError(InputError):
    """Bad command-line input, reported as one line before any work starts."""


class CheckpointError(InputError):
    """A checkpoint that cannot be written, read or used; the message names the file, the cause and the fix."""


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) if str(err).strip() else type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{text} ({err.filename})"
    return text


def first_line(err: BaseException, limit: int = 300, skip: tuple[str, ...] = (), typed: bool = False) -> str:
    """The first non-empty line of an exception's text (lines holding any of `skip` left out), at most `limit`
    characters; `typed`: prefixed with the exception's type. Its type alone when there is no text."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not any(s in line for s in skip)]
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0][:limit]}" if typed else lines[0][:limit]


def config_error(entry: str, field: str, message: str) -> InputError:
    """The one error format for bad configuration: the entry, the field, what is wrong and the fix."""
    return InputError(f"{entry}: field '{field}': {message}")


def finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
