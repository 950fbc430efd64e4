"""Names: which known names are closest to a typo, and names that become folders (one safe path component)."""

from __future__ import annotations

import difflib
import re
from typing import Any

from lrattn_lightning.core.errors import UsageError


def closest_names(name: str, known: list[str], n: int = 3, cutoff: float = 0.4, fill: bool = True) -> list[str]:
    """Up to `n` of `known` closest to `name` (difflib ratio >= cutoff); `fill`: when none is that close, the `n`
    closest anyway (a registry's unknown entry names some), else none."""
    close = difflib.get_close_matches(name, known, n=n, cutoff=cutoff)
    if close or not fill:
        return close
    return sorted(known, key=lambda k: -difflib.SequenceMatcher(None, name, k).ratio())[:n]


def with_closest(name: str, known: list[str], n: int = 3, cutoff: float = 0.6) -> str:
    """`name (closest: a, b)`, or `name` alone when nothing is close."""
    close = closest_names(name, known, n=n, cutoff=cutoff, fill=False)
    return f"{name} (closest: {', '.join(close)})" if close else name


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
    if isinstance(value, str) and len(value) <= NAME_MAX and value not in (".", "..") and \
            re.fullmatch(first + rest + "*", value):  # (the common case in one match: a sweep checks 100,000)
        return value
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
