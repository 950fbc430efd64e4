"""Strict loader for `registry.yaml`: names -> frozen configs.

The file has three sections:
  sizes:      name -> SizeConfig fields (+ optional `extends`)
  ablations:  name -> AblationConfig fields (+ optional `extends`); `doc` and `control` required; the routing
              kind's options nested under its name (`laurel: {rank: 8}`) or, the older form, flat (`laurel_rank: 8`);
              `extends` merges them option by option
  grids:      name -> {extends, name: "template-{rank}-{blocks}", doc, axes: {field: [values]}, ...}
              each grid point becomes a named ablation, exactly as if written out by hand.
and optionally
  include: builtin   the registry shipped with lrattn comes first: this file adds its own entries (which may
                     extend or name as control the shipped ones, never redefine one); the hash covers both

Every error is a ValueError that names the entry and the field and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError, config_error
from lrattn_lightning.core.files import load_yaml_strict, read_yaml_text
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.model.accounting import check_budget
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig
from lrattn_lightning.model.routing.kinds import ablation_from_entry, ablation_from_fields, entry_of
from lrattn_lightning.model.routing.trust import trust

DEFAULT_PATH = Path("registry.yaml")
PACKAGED_PATH = Path(__file__).resolve().parents[1] / "registry.yaml"  # shipped in the package (in a checkout: a link to ./registry.yaml)
_SECTIONS = ("sizes", "ablations", "grids")
INCLUDE = "include"  # the one value: "builtin", the registry shipped with the package


class UnknownNameError(InputError, KeyError):
    """An unknown size/ablation name; the message lists the closest known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class Registry:
    sizes: dict[str, SizeConfig]
    ablations: dict[str, AblationConfig]
    path: str
    sha256: str

    def size(self, name: str) -> SizeConfig:
        return _lookup(self.sizes, name, "size")

    def ablation(self, name: str) -> AblationConfig:
        return _lookup(self.ablations, name, "ablation")

    def model(self, size: str, ablation: str) -> ModelConfig:
        """The validated pair; raises ValueError naming the field if the two do not fit or exceed the budget."""
        cfg = ModelConfig(self.size(size), self.ablation(ablation))
        check_budget(cfg, f"ablations.{ablation} at size {size}")
        return cfg

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]


def _lookup(table: dict[str, Any], name: str, kind: str) -> Any:
    if name in table:
        return table[name]
    hint = ", ".join(closest_names(name, list(table)))
    raise UnknownNameError(f"unknown {kind} '{name}'; closest: {hint} (all {kind}s: `lrattn list`)")


def load_registry(path: str | Path | None = None) -> Registry:
    """Load and validate a registry. `path=None` reads ./registry.yaml, else the one shipped with the repo."""
    if path is None:
        path = DEFAULT_PATH if DEFAULT_PATH.exists() else PACKAGED_PATH
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"registry file {path} not found; pass the path of a registry.yaml")
    text = read_yaml_text(path, "registry")
    raw = load_yaml_strict(text, path) or {}
    if isinstance(raw, dict) and INCLUDE in raw:
        raw, text = _with_builtin(raw, path, text)
    return parse_registry(raw, path=str(path), sha256=hashlib.sha256(text.encode()).hexdigest())


def _with_builtin(raw: dict[str, Any], path: Path, text: str) -> tuple[dict[str, Any], str]:
    """`include: builtin`: the shipped registry's sections, then this file's entries (a name given twice is an
    error naming the entry: extend the shipped one under a new name instead). Returns the merged sections and
    the text the registry's hash covers (both files)."""
    where = str(path)
    if raw[INCLUDE] != "builtin":
        raise config_error(where, INCLUDE, f"only 'builtin' (the registry shipped with lrattn) can be included, got "
                           f"{raw[INCLUDE]!r}")
    if path.resolve() == PACKAGED_PATH.resolve():
        raise config_error(where, INCLUDE, "the shipped registry cannot include itself")
    builtin_text = read_yaml_text(PACKAGED_PATH, "registry")
    builtin = load_yaml_strict(builtin_text, PACKAGED_PATH) or {}
    merged: dict[str, Any] = {}
    for section in _SECTIONS:
        mine = _section(raw, section)
        theirs = _section(builtin, section)
        for name in mine:
            if name in theirs:
                raise config_error(f"{section}.{name}", name, f"already in the builtin registry ({where} includes it); "
                                   f"choose another name (`extends: {name}` to build on it)")
        if mine or theirs:
            merged[section] = {**theirs, **mine}
    for key in raw:
        if key not in (*_SECTIONS, INCLUDE):
            raise config_error(where, key, f"unknown section; expected one of {[*_SECTIONS, INCLUDE]}")
    return merged, builtin_text + "\n" + text


def parse_registry(raw: dict[str, Any], *, path: str = "<dict>", sha256: str = "") -> Registry:
    if not isinstance(raw, dict):
        raise InputError(f"{path}: the top level must be a mapping with sections {list(_SECTIONS)}")
    for key in raw:
        if key not in _SECTIONS:
            hint = f" (`{INCLUDE}: builtin` is read by load_registry from a file)" if key == INCLUDE else ""
            raise config_error(path, key, f"unknown section; expected one of {[*_SECTIONS, INCLUDE]}{hint}")
    sizes_raw = _section(raw, "sizes")
    ablations_raw = dict(_section(raw, "ablations"))
    for grid_name, grid in _section(raw, "grids").items():
        for name, entry in _expand_grid(grid_name, grid).items():
            if name in ablations_raw:
                raise config_error(f"grids.{grid_name}", "name", f"grid point '{name}' collides with an existing ablation")
            ablations_raw[name] = entry

    sizes = {name: _build(SizeConfig, f"sizes.{name}", name, _size_fields(sizes_raw, name)) for name in sizes_raw}
    ablations = {name: ablation_from_entry(name, entry_of(_lineage(ablations_raw, "ablations", name)),
                                           f"ablations.{name}") for name in ablations_raw}
    for name, abl in ablations.items():
        if abl.control is not None and abl.control not in ablations:
            hint = ", ".join(closest_names(abl.control, list(ablations)))
            raise config_error(f"ablations.{name}", "control", f"unknown ablation '{abl.control}'; closest: {hint}")
    for abl in ablations.values():  # the user's registry names these classes: they may be imported (trust.py)
        for path in abl.kind.code_paths(abl.options):
            trust(path, f"ablations.{abl.name}")
    return Registry(sizes=sizes, ablations=ablations, path=path, sha256=sha256)


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise config_error(key, key, "must be a mapping of name -> fields")
    for name, entry in value.items():
        if not isinstance(entry, dict):
            raise config_error(f"{key}.{name}", name, "must be a mapping of fields")
    return value


def _lineage(table: dict[str, dict], section: str, name: str, chain: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """`name` and the entries it `extends`, the farthest first: [(name, fields without `extends`), ...]."""
    if name in chain:
        cycle = " -> ".join((*chain, name))
        raise config_error(f"{section}.{chain[0]}", "extends", f"cycle: {cycle}")
    entry = dict(table[name])
    parent = entry.pop("extends", None)
    if parent is None:
        return [(name, entry)]
    if not isinstance(parent, str):
        raise config_error(f"{section}.{name}", "extends", f"must name one entry, got {parent!r}")
    if parent not in table:
        hint = ", ".join(closest_names(str(parent), list(table)))
        raise config_error(f"{section}.{name}", "extends", f"unknown entry '{parent}'; closest: {hint}")
    return [*_lineage(table, section, parent, (*chain, name)), (name, entry)]


def _size_fields(table: dict[str, dict], name: str) -> dict[str, Any]:
    """Fields of size `name` with its `extends` chain applied (child fields win; the doc is each entry's own)."""
    merged: dict[str, Any] = {}
    for _, fields in _lineage(table, "sizes", name):
        merged.pop("doc", None)
        merged.update(fields)
    return merged


def _build(cls: type, where: str, name: str, fields: dict[str, Any]) -> Any:
    """A size entry (`where` names it in errors): unknown fields list the closest, a missing one is named."""
    known = {f.name for f in dataclasses.fields(cls)} - {"name"}
    for key in fields:
        if key not in known:
            hint = ", ".join(closest_names(key, sorted(known)))
            raise config_error(where, key, f"unknown field; closest: {hint}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name != "name" and f.name not in fields
               and f.default is dataclasses.MISSING]
    if missing:
        raise config_error(where, missing[0], "required field is missing")
    built = cls(name=name, **fields).validate()
    check_budget(built, where)  # before any model of this size is built
    return built


def model_config_from_dict(data: Any, where: str = "model_config") -> ModelConfig:
    """A stored ModelConfig.to_dict() (a checkpoint's, an exported config.json's), read as strictly as a registry
    entry (also the format before typed options: every kind's fields, a nested `options`); an unknown, missing or
    mistyped field is one line naming `where`, the part and the field."""
    if not isinstance(data, dict) or not all(isinstance(data.get(p), dict) for p in ("size", "ablation")):
        raise InputError(f"{where}: must hold the mappings 'size' and 'ablation', got {type(data).__name__}")
    size, ablation = dict(data["size"]), dict(data["ablation"])
    try:
        name = size.pop("name", None)
        if not isinstance(name, str):
            raise config_error(f"{where}.size", "name", f"must be a name, got {name!r}")
        size_cfg = _build(SizeConfig, f"{where}.size", name, size)
        name = ablation.pop("name", None)
        if not isinstance(name, str):
            raise config_error(f"{where}.ablation", "name", f"must be a name, got {name!r}")
        cfg = ModelConfig(size_cfg, ablation_from_fields(name, ablation, f"{where}.ablation", stored=True))
        check_budget(cfg, where)
        return cfg
    except InputError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a value of the wrong type
        raise InputError(f"{where}: not a valid model config ({type(err).__name__}: {err})") from None


def _expand_grid(grid_name: str, grid: dict[str, Any]) -> dict[str, dict[str, Any]]:
    where = f"grids.{grid_name}"
    grid = dict(grid)
    template = grid.pop("name", None)
    axes = grid.pop("axes", None)
    if not isinstance(template, str):
        raise config_error(where, "name", "a grid needs a name template such as 's-lr-grid-n{blocks}-r{rank}'")
    if not isinstance(axes, dict) or not axes or not all(isinstance(v, list) and v for v in axes.values()):
        raise config_error(where, "axes", "a grid needs axes: {field: [value, ...], ...}")
    for axis in axes:
        if "{" + axis + "}" not in template:
            raise config_error(where, "name", f"the template must contain '{{{axis}}}' so grid names are unique")
    out = {}
    for combo in itertools.product(*axes.values()):
        point = dict(zip(axes, combo, strict=True))
        try:
            name = template.format(**point)
        except (KeyError, IndexError, ValueError) as err:
            raise config_error(where, "name", f"template {template!r} names a placeholder that is not an axis "
                               f"({err}); use only {sorted('{' + a + '}' for a in axes)}") from err
        out[name] = {**grid, **point, "tags": [*grid.get("tags", []), f"grid:{grid_name}"]}
    return out
