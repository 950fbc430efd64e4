"""core/names.py: a name that becomes a folder, checked by one match in the common case; the check accepts exactly
the names its rule describes (an independent predicate, over generated strings and every edge)."""

from __future__ import annotations

import string

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lrattn_lightning.core.errors import UsageError
from lrattn_lightning.core.names import NAME_MAX, check_name


def allowed(value: str, lower: bool) -> bool:
    """The rule in words: letters (lower-case for variant labels), digits and '-', '.' (and '_' unless lower),
    starting with a letter or digit, 1 to NAME_MAX characters, not '.' or '..', no separator."""
    letters = string.ascii_lowercase if lower else string.ascii_letters
    first, rest = letters + string.digits, letters + string.digits + ("-." if lower else "-._")
    return (0 < len(value) <= NAME_MAX and value not in (".", "..") and value[0] in first
            and all(c in rest for c in value))


@given(st.text(alphabet=string.ascii_letters + string.digits + "-._/\\ \n\u00e9A", max_size=NAME_MAX + 2),
       st.booleans())
@example("a" * NAME_MAX, False)
@example("a" * (NAME_MAX + 1), False)
@example("", False)
@example(".", False)
@example("..", True)
@example("a/b", False)
@example("Run_1", True)
@example("run-1.x", True)
@example("_x", False)
def test_check_name_accepts_exactly_the_rule(value, lower):
    if allowed(value, lower):
        assert check_name(value, "name", lower=lower) == value
    else:
        with pytest.raises(UsageError, match="^name "):
            check_name(value, "name", lower=lower)
