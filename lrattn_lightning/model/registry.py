"""Strict loader for `registry.yaml`: names -> frozen configs.

The file has three sections:
  sizes:      name -> SizeConfig fields (+ optional `extends`)
  ablations:  name -> AblationConfig fields (+ optional `extends`); `doc` and `control` required
  grids:      name -> {extends, name: "template-{rank}-{blocks}", doc, axes: {field: [values]}, ...}
              each grid point becomes a named ablation, exactly as if written out by hand.
and optionally
  include: builtin   the registry shipped with lrattn comes first: this file adds its own entries (which may
                     extend or name as control the shipped ones, never redefine one); the hash covers both

Every error is a ValueError that names the entry and the field and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lrattn_lightning.errors import InputError
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig, config_error
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
        """The validated pair; raises ValueError naming the field if the two do not fit."""
        return ModelConfig(self.size(size), self.ablation(ablation))

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]


def closest_names(name: str, known: list[str], n: int = 3) -> list[str]:
    close = difflib.get_close_matches(name, known, n=n, cutoff=0.4)
    return close or sorted(known, key=lambda k: -difflib.SequenceMatcher(None, name, k).ratio())[:n]


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


def read_yaml_text(path: Path, what: str) -> str:
    """The text of a YAML file; a folder, an unreadable or a non-UTF-8 file is a ValueError naming it."""
    if path.is_dir():
        raise InputError(f"{what} file {path} is a directory; pass the path of a YAML file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{what} file {path} is not UTF-8 text (byte {err.start}: {err.reason}); "
                         "save it as UTF-8") from err
    except OSError as err:
        raise InputError(f"{what} file {path} cannot be read ({err.strerror or err})") from err


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges are not duplicates
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
            except TypeError:  # unhashable keys: PyYAML reports those itself
                continue
            seen[key] = line
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"duplicate key '{key}' on line {again} (first on line {first}); keep one of them")


def load_yaml_strict(text: str, path: str | Path) -> Any:
    """Parse YAML like yaml.safe_load, but duplicate keys are an error; errors are one line naming the file."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except DuplicateKeyError as err:
        raise InputError(f"{path}: {err}") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise InputError(f"{path}: not valid YAML{where}: {problem}") from err


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

    sizes = {name: _build(SizeConfig, "sizes", name, _resolve_extends(sizes_raw, "sizes", name)) for name in sizes_raw}
    ablations = {}
    for name in ablations_raw:
        fields = _resolve_extends(ablations_raw, "ablations", name)
        for required in ("doc", "control"):
            if required not in fields:
                raise config_error(f"ablations.{name}", required, f"every ablation must state its '{required}' (control may be null)")
        if "tags" in fields:
            tags = fields["tags"] or []
            if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
                raise config_error(f"ablations.{name}", "tags", f"must be a list of strings, got {tags!r}")
            fields["tags"] = tuple(tags)
        ablations[name] = _build(AblationConfig, "ablations", name, fields)
    for name, abl in ablations.items():
        if abl.control is not None and abl.control not in ablations:
            hint = ", ".join(closest_names(abl.control, list(ablations)))
            raise config_error(f"ablations.{name}", "control", f"unknown ablation '{abl.control}'; closest: {hint}")
    for abl in ablations.values():  # the user's registry names these classes: they may be imported (trust.py)
        if abl.router is not None:
            trust(abl.router, f"ablations.{abl.name}.router")
    return Registry(sizes=sizes, ablations=ablations, path=path, sha256=sha256)


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise config_error(key, key, "must be a mapping of name -> fields")
    for name, entry in value.items():
        if not isinstance(entry, dict):
            raise config_error(f"{key}.{name}", name, "must be a mapping of fields")
    return value


def _resolve_extends(table: dict[str, dict], section: str, name: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fields of `name` with its `extends` chain applied (child fields win)."""
    if name in chain:
        cycle = " -> ".join((*chain, name))
        raise config_error(f"{section}.{chain[0]}", "extends", f"cycle: {cycle}")
    entry = dict(table[name])
    parent = entry.pop("extends", None)
    if parent is None:
        return entry
    if not isinstance(parent, str):
        raise config_error(f"{section}.{name}", "extends", f"must name one entry, got {parent!r}")
    if parent not in table:
        hint = ", ".join(closest_names(str(parent), list(table)))
        raise config_error(f"{section}.{name}", "extends", f"unknown entry '{parent}'; closest: {hint}")
    merged = _resolve_extends(table, section, parent, (*chain, name))
    # A child does not inherit what describes the parent alone.
    for own in ("doc",):
        merged.pop(own, None)
    merged.update(entry)
    return merged


def _build(cls: type, section: str, name: str, fields: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)} - {"name", "options"}
    if cls is AblationConfig:  # the routing kind's own options, written as fields
        fields = _with_kind_options(f"{section}.{name}", fields)
    for key in fields:
        if key not in known and not (key == "options" and cls is AblationConfig):
            hint = ", ".join(closest_names(key, sorted(known | set(fields.get("options") or {}))))
            raise config_error(f"{section}.{name}", key, f"unknown field; closest: {hint}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name != "name" and f.name not in fields
               and f.default is dataclasses.MISSING]
    if missing:
        raise config_error(f"{section}.{name}", missing[0], "required field is missing")
    return cls(name=name, **fields).validate()


def _with_kind_options(where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Fields with the routing kind's options moved into `options` (every option, its default where not given)."""
    from lrattn_lightning.model.routing.kinds import kind_of

    if "options" in fields:
        raise config_error(where, "options", "write a routing kind's options as plain fields (e.g. `dilation: 2`)")
    kind = kind_of(fields.get("routing", "residual"), where)
    if not kind.options:
        return fields
    out = {k: v for k, v in fields.items() if k not in kind.options}
    out["options"] = {option: fields.get(option, default) for option, default in kind.options.items()}
    return out


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
