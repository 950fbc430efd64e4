"""A routing kind's options, checked from their annotations: the kind declares once what each value may be.

    flag: bool = False                          true or false (not 0 or 1)
    mode: Literal["rw", "lr"] = "rw"            one of the words; a typo names the closest
    rank: PositiveInt = 16                      an integer >= 1 (Annotated[int, Range(1)]); NonNegativeInt: >= 0
    blocks: PositiveInt | None = None           the same, or null
    alpha: Annotated[float, Range(0, 1, open_low=True, open_high=True)] | None     a finite number in (0, 1), or null
    scale: PositiveFloat | Literal["none"]      any member of a union (a word is checked against the Literal)

A wrong value is one line naming the entry and the option as the user wrote it: `ablations.x: field 'laurel.rank':
must be a positive integer, got 0`. What a single annotation cannot say (rules between options) is the kind's
`rules`; what needs the model size is the kind's `validate_model`.

Names. Inside a registry entry a kind's options nest under the kind's name (`laurel: {rank: 8}`), so they need no
prefix. A stored config (a checkpoint's, an export's, MLflow's params) keeps every option as a plain field under
its flat name, unique across kinds: the option's own name, or the one `flat_names` gives (`laurel_rank`). A registry
entry may still use the flat names (the form before nesting).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from lrattn_lightning.core.errors import InputError, config_error, finite_number
from lrattn_lightning.core.names import closest_names


@dataclass(frozen=True)
class Range:
    """Annotated metadata: a number in [low, high] (open ends: `open_low`, `open_high`; None: unbounded).
    `note` is added to the error in parentheses (what the ends mean)."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def says(self, integer: bool) -> str:
        if integer and self.high is None and self.low in (0, 1) and not self.open_low:
            text = "a positive integer" if self.low == 1 else "an integer >= 0"
        elif self.high is None and self.low == 0 and self.open_low:
            text = "a positive integer" if integer else "a positive number"
        elif self.low is None and self.high is None:
            text = "an integer" if integer else "a finite number"
        elif self.high is None:
            text = f"{'an integer' if integer else 'a number'} {'>' if self.open_low else '>='} {self.low}"
        elif self.low is None:
            text = f"{'an integer' if integer else 'a number'} {'<' if self.open_high else '<='} {self.high}"
        else:
            text = (f"{'an integer' if integer else 'a number'} in {'(' if self.open_low else '['}{self.low}, "
                    f"{self.high}{')' if self.open_high else ']'}")
        return f"{text} ({self.note})" if self.note else text


PositiveInt = Annotated[int, Range(1)]
NonNegativeInt = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, open_low=True)]
FiniteFloat = Annotated[float, Range()]


def fits(value: Any, hint: Any) -> bool:
    """Whether `value` (as read from YAML or JSON) is what the annotation `hint` allows."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin is Union or origin is types.UnionType:
        return any(fits(value, arg) for arg in args)
    if origin is Literal:
        return not isinstance(value, bool) and any(value == a and type(value) is type(a) for a in args)
    if origin is Annotated:
        base, *meta = args
        return fits(value, base) and all(m.holds(value) for m in meta if isinstance(m, Range))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return finite_number(value)
    if origin is not None:  # dict[str, Any], list[int], ...: the container's type
        return isinstance(value, origin)
    return isinstance(value, hint)


def says(hint: Any) -> str:
    """What an annotation allows, in words (`a positive integer or null`)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is None or hint is type(None):
        return "null"
    if origin is Union or origin is types.UnionType:
        words = [says(a) for a in args if a is not type(None)]
        if type(None) in args:
            words.append("null")
        return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
    if origin is Literal:
        return f"one of {list(args)}"
    if origin is Annotated:
        base, *meta = args
        ranges = [m for m in meta if isinstance(m, Range)]
        return ranges[0].says(base is int) if ranges else says(base)
    named = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", dict: "a mapping",
             list: "a list"}
    return named.get(origin or hint, getattr(hint, "__name__", str(hint)))


def complaint(value: Any, hint: Any) -> str | None:
    """None when `value` fits `hint`, else what is wrong in words (a word outside a Literal: the closest one)."""
    if fits(value, hint):
        return None
    members = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    words = [w for m in members if get_origin(m) is Literal for w in get_args(m)]
    if words and (isinstance(value, str) or len(members) == 1):
        close = closest_names(value, [str(w) for w in words], n=1, fill=False) if isinstance(value, str) else []
        return f"{value!r} is not one of {words}" + (f"; closest: {close[0]}" if close else "")
    return f"must be {says(hint)}, got {value!r}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def check_fields(record: Any, where: str, label: Any = None, skip: tuple[str, ...] = ()) -> None:
    """Every field of the dataclass `record` (but `skip`) against its annotation; the first that does not fit is
    one line naming `where` and the field (`label(field)`: its name as written)."""
    hints = _hints(type(record))
    for field in dataclasses.fields(record):
        if field.name not in skip:
            wrong = complaint(getattr(record, field.name), hints[field.name])
            if wrong is not None:
                raise config_error(where, label(field.name) if label else field.name, wrong)


class KindOptions:
    """Base of a kind's options: a frozen dataclass whose fields' annotations say what each may hold (checked by
    `validate`), `rules` the rules between them. `flat_names` maps an option to its flat name where that differs
    (`{"rank": "laurel_rank"}`); `label` is an option's name as the entry wrote it, for errors."""

    flat_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def flat(cls, option: str) -> str:
        return cls.flat_names.get(option, option)

    @classmethod
    def written(cls, values: dict[str, Any], labels: dict[str, str]) -> KindOptions:
        """The options from `values` (by option name), remembering how each was written (`labels`) for errors."""
        options = cls(**values)
        object.__setattr__(options, "_labels", {k: v for k, v in labels.items() if v != cls.flat(k)})
        return options

    def label(self, option: str) -> str:
        """The option's name as the entry wrote it (`laurel.rank`, `laurel_rank`); its flat name by default."""
        return self.__dict__.get("_labels", {}).get(option, self.flat(option))

    def name_of(self, option: str) -> str:
        """How a message names the option: `rank` where the entry nests it under the kind, else its flat name."""
        return self.label(option).rpartition(".")[2]

    def labels(self) -> dict[str, str]:
        return dict(self.__dict__.get("_labels", {}))

    def error(self, where: str, option: str, message: str) -> InputError:
        return config_error(where, self.label(option), message)

    def validate(self, where: str) -> None:
        """Each option against its annotation, then the rules between them; one line naming the option."""
        check_fields(self, where, self.label)
        self.rules(where)

    def clipped_to(self, size: Any) -> dict[str, Any]:
        """Option changes that make an entry build at a small `size` (`fit_to_size`: tests and dry runs only).
        The default, none, is the deliberate one for options that fit any size: an option that does not fit is
        still refused by the kind's validate_model, loudly, so a forgotten clip fails the every-entry tests."""
        return {}

    def rules(self, where: str) -> None:
        """Rules between the options, each already of its annotated type (none by default)."""

    def as_dict(self) -> dict[str, Any]:
        """The stored form: every option under its flat name."""
        return {self.flat(option): getattr(self, option) for option in self.names()}

    def nested(self) -> dict[str, Any]:
        """The registry form: every option under its own name (the mapping under the kind's name)."""
        return {option: getattr(self, option) for option in self.names()}
