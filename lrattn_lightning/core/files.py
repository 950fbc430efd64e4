"""Files the package reads: YAML (strictly: a duplicated key is an error) and what ships inside the wheel.

Every YAML `lrattn` reads (registries, recipes and `--config` files, sweep files, task files, YAML values on the
command line: cli/lightning.py hands jsonargparse `check_yaml_limits`) is first composed into PyYAML's node
graph, where an alias shares its anchor's node, and measured there before any Python object is built:

    depth          lists/mappings inside each other, counted through aliases     at most MAX_YAML_DEPTH
    alias nodes    the nodes the aliases stand for, each use counting the        at most MAX_ALIAS_NODES
                   anchor's whole subtree (what a consumer walking the result
                   would visit beyond the document's own nodes)
    recursion      an alias inside its own anchor (`&a [*a]`)                     refused
    integers       digits (Python reads at most sys.get_int_max_str_digits())     refused past that, with its line

A "billion laughs" document (nine anchors, each a list of ten aliases of the one before: 10^9 nodes from
under 1 kB) is refused in milliseconds; PyYAML would build it at once as shared lists, and the first code to
walk it (a hash, a copy, a type check) would run for minutes. A document nested 10,000 deep is refused at
level MAX_YAML_DEPTH + 1, before PyYAML's composer (4 Python frames per level here) reaches the interpreter's
recursion limit.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lrattn_lightning.core.errors import InputError

# the folder holding the package (in a checkout: the repository; PYTHONPATH for child processes, `git` for provenance)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

# The limits of every YAML document read (see the module's docstring). The repo's own files nest at most 5
# levels (registry.yaml) and use no aliases; 100 levels cost PyYAML's composer ~400 of Python's 1000 frames.
# 10^5 aliased nodes leave room for anchors and `<<: *x` merges in any hand-written config, and a walk over
# that many is instant; a document needing more can spell its values out.
MAX_YAML_DEPTH = 100
MAX_ALIAS_NODES = 100_000


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


class YamlLimitError(yaml.YAMLError):
    """A document past MAX_YAML_DEPTH or MAX_ALIAS_NODES, or a recursive alias; the text says which and the fix."""


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML silently keeps the last), and a
    document past the limits above (composed and measured before anything is constructed)."""

    _depth = 0  # nodes being composed around the current one

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self._depth >= MAX_YAML_DEPTH and self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
            line = self.peek_event().start_mark.line + 1
            raise YamlLimitError(f"nested deeper than {MAX_YAML_DEPTH} levels (line {line}); flatten the document "
                                 f"(lists and mappings may nest {MAX_YAML_DEPTH} deep)")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: yaml.Node) -> Any:
        measure(node)
        return super().construct_document(node)

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


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def measure(root: yaml.Node) -> None:
    """Refuse a composed document whose aliases expand past MAX_ALIAS_NODES or MAX_YAML_DEPTH, or recurse.

    One walk over the node graph (not the expanded tree): each node's expanded size and depth are computed
    once from its children's and kept, so 10^9 aliased nodes cost as much as the ~30 that spell them.
    """
    size: dict[int, int] = {}  # id(node) -> nodes in its expanded subtree
    depth: dict[int, int] = {}  # id(node) -> lists/mappings nested in its expanded subtree, itself included
    open_: set[int] = set()  # the nodes on the walk's current path
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    digits = sys.get_int_max_str_digits()  # 0: no limit
    while stack:
        node, finished = stack.pop()
        key, kids = id(node), _children(node)
        if digits and node.tag == "tag:yaml.org,2002:int" and len(node.value) > digits:
            raise YamlLimitError(f"the integer on line {node.start_mark.line + 1} has {len(node.value):,} digits; "
                                 f"Python reads at most {digits:,}: write a smaller number")
        if finished:
            open_.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            nested = 1 + max((depth[id(k)] for k in kids), default=0)
            depth[key] = nested if isinstance(node, yaml.CollectionNode) else 0
            if depth[key] > MAX_YAML_DEPTH:
                raise YamlLimitError(f"aliases nest the node on line {node.start_mark.line + 1} deeper than "
                                     f"{MAX_YAML_DEPTH} levels; flatten it or use fewer nested aliases")
            if size[key] - len(size) > MAX_ALIAS_NODES:
                raise YamlLimitError(f"aliases expand the node on line {node.start_mark.line + 1} past "
                                     f"{MAX_ALIAS_NODES:,} nodes (a 'billion laughs' document?); write the values "
                                     "out or use fewer aliases")
            continue
        if key in size:
            continue
        open_.add(key)
        stack.append((node, True))
        for kid in kids:
            if id(kid) in open_:
                raise YamlLimitError(f"an alias on line {kid.start_mark.line + 1} refers to a node that holds it "
                                     "(a recursive structure); replace the alias by the values it should repeat")
            if id(kid) not in size:
                stack.append((kid, False))


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"duplicate key '{key}' on line {again} (first on line {first}); keep one of them")


def load_yaml_strict(text: str, path: str | Path) -> Any:
    """Parse YAML like yaml.safe_load, but duplicate keys and documents past the limits (MAX_YAML_DEPTH,
    MAX_ALIAS_NODES, a recursive alias) are errors; errors are one line naming the file."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except (DuplicateKeyError, YamlLimitError) as err:
        raise InputError(f"{path}: {err}") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise InputError(f"{path}: not valid YAML{where}: {problem}") from err


def check_yaml_limits(text: str, where: str | Path) -> None:
    """Refuse `text` as load_yaml_strict would a document past the limits (one line naming `where`), without
    building it; anything else (invalid YAML, duplicate keys) is left to the caller's own parser."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            measure(node)
    except YamlLimitError as err:
        raise InputError(f"{where}: {err}") from None
    except yaml.YAMLError:
        return
    finally:
        loader.dispose()
