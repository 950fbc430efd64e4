"""The built-in routing kinds, listed explicitly, and the one reader of an entry's fields into an AblationConfig.

    routing: residual            residual.py           the plain residual stream
    routing: attnres             attnres/              AttnRes, P-LR / S-LR-AttnRes (backends: attnres/backends.py)
    routing: gated               gated.py              the gated residual of the blog seed (docs/method.md §7)
    routing: external            external.py           a user's router class named by import path
    routing: denseformer         denseformer.py        DenseFormer's depth-weighted averages
    routing: delta_attnres       delta_attnres.py      Delta Attention Residuals
    routing: hyper_connections   hyper_connections.py  Hyper-Connections and mHC
    routing: muddformer          muddformer.py         MUDDFormer's multiway dynamic dense connections
    routing: value_residual      value_residual.py     value residual learning (ResFormer)
    routing: laurel              laurel.py             LAuReL's learned residual per sublayer (RW, LR, both)

A new built-in kind is its module (a `RoutingKind` with its `Options` dataclass: kind.py, model/options.py) added
to KINDS, and registry entries (docs/extending.md lists the rest). A kind that leaves a member of kind.py unstated
is refused here, at import. `read_entry` reads a registry entry or a stored config (a checkpoint's, an export's)
whichever form its options take, nested under the kind's name (`laurel: {rank: 8}`) or flat (`laurel_rank: 8`,
what stored configs hold), into an Entry; `ablation_from_entry` into the kind and its typed options. A non-default
option of another kind is one line naming that kind, an unknown field or option names the closest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lrattn_lightning.core.errors import InputError, config_error
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.model.config import AblationConfig
from lrattn_lightning.model.options import KindOptions
from lrattn_lightning.model.routing import (
    delta_attnres,
    denseformer,
    external,
    gated,
    hyper_connections,
    laurel,
    muddformer,
    residual,
    value_residual,
)
from lrattn_lightning.model.routing.attnres import kind as attnres
from lrattn_lightning.model.routing.kind import RoutingKind, missing_members


def registered(*kinds: RoutingKind) -> dict[str, RoutingKind]:
    """{name: kind}, each kind checked to state every member of kind.py (a TypeError naming what it leaves out)."""
    table: dict[str, RoutingKind] = {}
    for kind in kinds:
        missing = missing_members(kind)
        if missing:
            raise TypeError(f"routing kind {type(kind).__name__} leaves {', '.join(missing)} unstated (kind.py)")
        if not (isinstance(kind.name, str) and kind.name and isinstance(kind.takes_impl, bool)
                and isinstance(kind.Options, type) and issubclass(kind.Options, KindOptions)):
            raise TypeError(f"routing kind {type(kind).__name__}: name a non-empty str, takes_impl a bool, Options a "
                            f"KindOptions dataclass")
        if kind.name in table:
            raise TypeError(f"routing kind {kind.name!r} is listed twice")
        table[kind.name] = kind
    return table


KINDS: dict[str, RoutingKind] = registered(
    residual.KIND, attnres.KIND, gated.KIND, external.KIND, denseformer.KIND, delta_attnres.KIND,
    hyper_connections.KIND, muddformer.KIND, value_residual.KIND, laurel.KIND)
ENTRY_FIELDS = ("doc", "control", "routing", "tags")  # what every entry has, whatever its kind
# How an error says that a field belongs to another kind; a kind not named here: "only routing NAME reads it".
OWNER_PHRASES = {"attnres": "only AttnRes routing (routing: attnres) reads it",
                 "gated": "only the gated residual (routing: gated) has gates",
                 "external": "only routing external names a router class"}


def owner_phrase(kind: str) -> str:
    return OWNER_PHRASES.get(kind, f"only routing {kind} reads it")


def _flat_names() -> dict[str, tuple[str, str]]:
    """Every option's flat name -> (its kind, its name there): unique, so a flat field says its kind."""
    table: dict[str, tuple[str, str]] = {}
    for kind in KINDS.values():
        for option in kind.Options.names():
            flat = kind.Options.flat(option)
            if flat in table or flat in KINDS or flat in ENTRY_FIELDS:
                raise TypeError(f"routing {kind.name}: the flat name {flat!r} of option {option!r} is taken")
            table[flat] = (kind.name, option)
    return table


FLAT = _flat_names()


def known_kinds() -> tuple[str, ...]:
    return tuple(KINDS)


def kind_of(name: Any, where: str = "ablation") -> RoutingKind:
    """The kind `routing: name` names; unknown names list the closest ones."""
    if not isinstance(name, str) or name not in KINDS:
        hint = ", ".join(closest_names(str(name), list(KINDS)))
        raise InputError(f"{where}: field 'routing': unknown routing kind {name!r}; closest: {hint} (all: "
                         f"{', '.join(KINDS)})")
    return KINDS[name]


def option_owner(field: str) -> tuple[RoutingKind, Any] | None:
    """(the kind whose options hold the flat name `field`, that option's default), or None."""
    if field not in FLAT:
        return None
    kind, option = FLAT[field]
    return KINDS[kind], next(f.default for f in dataclasses.fields(KINDS[kind].Options) if f.name == option)


@dataclass
class Entry:
    """An ablation's fields as written, its options sorted by kind whichever form they came in: `fields` (doc,
    control, routing, tags and any unknown key), `options` {kind: {option: value}}, `labels` {(kind, option): the
    name as written, `laurel.rank` or `laurel_rank`}."""

    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    labels: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def over(self, parent: Entry) -> Entry:
        """This entry extending `parent`: its fields and options win one by one; the parent's doc is its own."""
        options = {kind: dict(values) for kind, values in parent.options.items()}
        for kind, values in self.options.items():
            options.setdefault(kind, {}).update(values)
        return Entry({k: v for k, v in parent.fields.items() if k != "doc"} | self.fields, options,
                     parent.labels | self.labels)


def read_entry(raw: dict[str, Any], where: str, stored: bool = False) -> Entry:
    """A registry entry's or a stored config's fields -> an Entry. Options nest under their kind's name
    (`laurel: {rank: 8}`) or stand flat (`laurel_rank: 8`); `stored`: also a nested `options` mapping of flat
    names (configs stored before typed options). An unknown option under a kind is one line naming the closest."""
    entry = Entry()

    def put(kind: str, option: str, value: Any, label: str) -> None:
        if option in entry.options.get(kind, {}):
            raise config_error(where, label, f"given twice ({entry.labels[kind, option]} and {label}); keep one")
        entry.options.setdefault(kind, {})[option] = value
        entry.labels[kind, option] = label

    for key, value in raw.items():
        if key in KINDS:
            names = KINDS[key].Options.names()
            if not isinstance(value, dict):
                example = f"{key}: {{{names[0]}: ...}}" if names else f"routing {key} has no options"
                raise config_error(where, key, f"must be a mapping of routing {key}'s options ({example}), got {value!r}")
            for option, v in value.items():
                if option not in names:
                    raise config_error(where, f"{key}.{option}", _no_such_option(key, str(option), names))
                put(key, option, v, f"{key}.{option}")
        elif key in FLAT:
            put(*FLAT[key], value, key)
        elif key == "options" and stored and value is None:
            continue
        elif key == "options" and stored and isinstance(value, dict):
            for flat, v in value.items():
                if flat in FLAT:
                    put(*FLAT[flat], v, flat)
                else:
                    entry.fields[flat] = v
        elif key == "options":
            raise config_error(where, "options", "write a kind's options under its name, e.g. `denseformer: "
                               "{dilation: 2}` (registry.yaml's header)")
        else:
            entry.fields[key] = value
    return entry


def _no_such_option(kind: str, option: str, names: tuple[str, ...]) -> str:
    if not names:
        return f"routing {kind} has no options"
    return (f"routing {kind} has no option {option!r}; closest: {', '.join(closest_names(option, list(names), n=1))} "
            f"(its options: {', '.join(names)})")


def ablation_from_fields(name: str, fields: dict[str, Any], where: str, stored: bool = False) -> AblationConfig:
    """An entry's fields -> a validated AblationConfig (read_entry, then ablation_from_entry)."""
    return ablation_from_entry(name, read_entry(fields, where, stored), where)


def ablation_from_entry(name: str, entry: Entry, where: str) -> AblationConfig:
    """`routing` picks the kind, its options are those the entry gives it (the others at their defaults). Another
    kind's option is fine at its default (an `extends` reset, or a stored config from when every kind's fields were
    stored), else one line naming that kind."""
    fields = dict(entry.fields)
    kind = kind_of(fields.pop("routing", "residual"), where)
    for required in ("doc", "control"):
        if required not in fields:
            raise config_error(where, required, f"every ablation must state its '{required}' (control may be null)")
    doc, control, tags = fields.pop("doc"), fields.pop("control"), fields.pop("tags", None) or []
    if not isinstance(tags, list | tuple) or not all(isinstance(tag, str) for tag in tags):
        raise config_error(where, "tags", f"must be a list of strings, got {tags!r}")
    for key in fields:
        known = [kind.Options.flat(o) for o in kind.Options.names()] + [*ENTRY_FIELDS, kind.name]
        raise config_error(where, key, f"unknown field; closest: {', '.join(closest_names(str(key), sorted(known)))}")
    for other, values in entry.options.items():
        if other == kind.name:
            continue
        owner = KINDS[other]
        defaults = {f.name: f.default for f in dataclasses.fields(owner.Options)}
        for option, value in values.items():
            if value != defaults[option]:
                shown = "null" if defaults[option] is None else repr(defaults[option])
                raise config_error(where, entry.labels[other, option], f"{owner_phrase(other)}; routing is "
                                   f"'{kind.name}': remove it (over an `extends`, reset it to {shown})")
    own = entry.options.get(kind.name, {})
    nested = any("." in label for label in entry.labels.values())  # then errors name the unwritten options so too
    labels = {option: entry.labels.get((kind.name, option), f"{kind.name}.{option}" if nested else kind.Options.flat(option))
              for option in kind.Options.names()}
    options = kind.Options.written(own, labels)
    return AblationConfig(name=name, doc=doc, control=control, kind=kind, options=options,
                          tags=tuple(tags)).validate()


def entry_of(lineage: list[tuple[str, dict[str, Any]]], section: str = "ablations") -> Entry:
    """The Entry of an `extends` chain [(name, fields without `extends`), ...], the farthest ancestor first."""
    entry = Entry()
    for name, raw in lineage:
        entry = read_entry(raw, f"{section}.{name}").over(entry)
    return entry

