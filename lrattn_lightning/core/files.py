"""Files the package reads: YAML (strictly: a duplicated key is an error) and what ships inside the wheel."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lrattn_lightning.core.errors import InputError

# the folder holding the package (in a checkout: the repository; PYTHONPATH for child processes, `git` for provenance)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def packaged(relative: str) -> Path | None:
    """A recipe or sweep file shipped in the package (`experiments/...`), or None."""
    parts = Path(relative).parts
    if not parts or parts[0] != "experiments":
        return None
    path = Path(str(resources.files("lrattn_lightning").joinpath(*parts)))
    return path if path.is_file() else None


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
