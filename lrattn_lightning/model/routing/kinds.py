"""The built-in routing kinds, listed explicitly, and the one reader of an entry's fields into an AblationConfig.

    routing: residual            residual.py           the plain residual stream
    routing: attnres             attnres/              AttnRes, P-LR / S-LR-AttnRes (backends: attnres/backends.py)
    routing: gated               gated.py              the gated residual of the blog seed (SPEC §7)
    routing: external            external.py           a user's router class named by import path
    routing: denseformer         denseformer.py        DenseFormer's depth-weighted averages
    routing: delta_attnres       delta_attnres.py      Delta Attention Residuals
    routing: hyper_connections   hyper_connections.py  Hyper-Connections and mHC
    routing: muddformer          muddformer.py         MUDDFormer's multiway dynamic dense connections
    routing: value_residual      value_residual.py     value residual learning (ResFormer)
    routing: laurel              laurel.py             LAuReL's learned residual per sublayer (RW, LR, both)

A new built-in kind is its module (a `RoutingKind` with its `Options` dataclass: kind.py) added to KINDS, and
registry entries. `ablation_from_fields` reads the flat fields of a registry entry or a stored config (a
checkpoint's, an export's) into the kind and its typed options; a field of another kind is one line naming that
kind, an unknown one lists the closest names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lrattn_lightning.core.errors import InputError, config_error
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.model.config import AblationConfig, ModelConfig
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
from lrattn_lightning.model.routing.kind import RoutingKind

KINDS: dict[str, RoutingKind] = {k.name: k for k in (
    residual.KIND, attnres.KIND, gated.KIND, external.KIND, denseformer.KIND, delta_attnres.KIND,
    hyper_connections.KIND, muddformer.KIND, value_residual.KIND, laurel.KIND)}
ENTRY_FIELDS = ("doc", "control", "routing", "tags")  # what every entry has, whatever its kind


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
    """(the kind whose options hold `field`, that option's default), or None."""
    for kind in KINDS.values():
        for f in dataclasses.fields(kind.Options):
            if f.name == field:
                return kind, f.default
    return None


def ablation_from_fields(name: str, fields: dict[str, Any], where: str, stored: bool = False) -> AblationConfig:
    """An entry's fields -> a validated AblationConfig: `routing` picks the kind, its options are the fields its
    Options dataclass declares (the others' defaults where not given). `stored`: a checkpoint's or an export's
    config, which may also hold (before typed options) every kind's fields at their defaults and a nested
    `options` mapping; a registry entry writes its options as plain fields."""
    fields = dict(fields)
    kind = kind_of(fields.pop("routing", "residual"), where)
    nested = fields.pop("options", None)
    if nested is not None:
        if not stored:
            raise config_error(where, "options", "write a routing kind's options as plain fields (e.g. `dilation: 2`)")
        if not isinstance(nested, dict):
            raise config_error(where, "options", f"must be a mapping of the kind's options, got {nested!r}")
        fields.update(nested)
    for required in ("doc", "control"):
        if required not in fields:
            raise config_error(where, required, f"every ablation must state its '{required}' (control may be null)")
    doc, control, tags = fields.pop("doc"), fields.pop("control"), fields.pop("tags", None) or []
    if not isinstance(tags, list | tuple) or not all(isinstance(tag, str) for tag in tags):
        raise config_error(where, "tags", f"must be a list of strings, got {tags!r}")
    own = {f.name for f in dataclasses.fields(kind.Options)}
    values = {}
    for key, value in fields.items():
        if key in own:
            values[key] = value
            continue
        found = option_owner(key)
        if found is None:
            hint = ", ".join(closest_names(str(key), sorted(own | set(ENTRY_FIELDS))))
            raise config_error(where, key, f"unknown field; closest: {hint}")
        owner, default = found
        if value == default:  # another kind's option at its default: an `extends` reset, or an older checkpoint
            continue
        shown = "null" if default is None else repr(default)
        raise config_error(where, key, f"{owner.owner_phrase}; routing is '{kind.name}': remove it (over an "
                           f"`extends`, reset it to {shown})")
    return AblationConfig(name=name, doc=doc, control=control, kind=kind, options=kind.Options(**values),
                          tags=tuple(tags)).validate()


def training_flags() -> tuple[str, ...]:
    """Every module flag some kind reads (`--model.gate_freeze_steps` ...)."""
    return tuple(option for kind in KINDS.values() for option in kind.training_options)


def check_training_options(cfg: ModelConfig, given: dict[str, bool]) -> None:
    """Module flags (`--model.NAME`) set for a kind that does not read them: one line."""
    kind = cfg.kind
    for option, is_set in given.items():
        if is_set and option not in kind.training_options:
            owner = next((k for k in KINDS.values() if option in k.training_options), None)
            phrase = owner.owner_phrase if owner is not None else "no routing kind reads it"
            raise InputError(f"model.{option}: {phrase}; ablation '{cfg.ablation.name}' has routing "
                             f"'{cfg.ablation.routing}'")
