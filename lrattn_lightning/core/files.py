"""Files the package reads: YAML (strictly: a duplicated key is an error) and what ships inside the wheel; and how
it writes files without following a link planted where one of them goes.

Every file `lrattn` creates or replaces (locks, temporaries, checkpoints, exports, prepared shards and metadata,
reports) goes through the writers at the end of this module: a new file is opened O_CREAT|O_EXCL|O_NOFOLLOW (never
an existing file, never a link's target; a hard link planted there is not written either), a replaced one is such
a new temporary beside it renamed over it, and a path that is a symbolic link or not a regular file is refused in
one line (`LinkError`) naming it and the fix. Where the folders below a trusted one are made by the platform too
(an MLflow run's local artifact folders: train/artifacts.py), `open_folder` walks them part by part, each opened
O_NOFOLLOW relative to the one above, and `replacing_in` writes the file inside the folder it opened. On a shared project folder, whoever can write into a run folder can
plant `.lock -> ~victim/precious`; a plain open() would truncate precious.

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

Where PyYAML has libyaml (`yaml.__with_libyaml__`), a document is read by its C parser and composer instead, ~3x
faster (a lab's sweep file of 10,000 listed runs: 5 s in Python). libyaml's composer recurses in C without a bound,
so its events are first scanned (`_prescan`, a flat loop): a collection past MAX_YAML_DEPTH is never composed, and a
document without aliases or long scalars needs no `measure` (it is a tree no deeper than the scan saw). The C path
only ever accepts: a document it refuses for any reason (the limits, a duplicated key, invalid YAML) is read again
by the Python loader above, which refuses it in its own words, so every error reads as it always did.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import sys
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import IO, Any

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
        _no_duplicate_keys(self, node)
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


# ---- the C path: libyaml's parser and composer, guarded by a scan of its events --------------------------------
class _Refused(Exception):
    """The C path does not take this document; the Python loader reads it (and says why, if it refuses it)."""


_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def _prescan(text: str) -> bool:
    """libyaml's events of `text`, in one flat loop: _Refused past MAX_YAML_DEPTH (before its composer, which
    recurses in C, sees the document); else whether the composed graph needs `measure`: it holds an alias (which
    may expand or recurse) or a scalar long enough to be an integer past Python's digits. Without either it is a
    tree, as deep as counted here and of the document's own nodes."""
    parser = yaml.CSafeLoader(text)
    digits = sys.get_int_max_str_digits() or sys.maxsize
    depth, needs_measure = 0, False
    try:
        while (event := parser.get_event()) is not None:
            kind = type(event)
            if kind in _OPEN:
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise _Refused("too deep")
            elif kind in _CLOSE:
                depth -= 1
            elif kind is yaml.AliasEvent or (kind is yaml.ScalarEvent and len(event.value) > digits):
                needs_measure = True
    finally:
        parser.dispose()
    return needs_measure


def _no_duplicate_keys(loader: yaml.BaseLoader, node: yaml.MappingNode) -> None:
    """DuplicateKeyError for a key given twice in `node` (a `<<` merge is not a key; an unhashable key is
    PyYAML's to report)."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges are not duplicates
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise DuplicateKeyError(key, seen[key], line)
        except TypeError:  # unhashable keys: PyYAML reports those itself
            continue
        seen[key] = line


if yaml.__with_libyaml__:

    class _FastStrictLoader(yaml.CSafeLoader):
        """_StrictLoader's checks on libyaml's composed nodes (the depth is _prescan's; `measure` is the caller's).
        A scalar's tag is resolved once per distinct (value, style): a sweep file repeats its names thousands of
        times, and the SafeLoader's resolver has no path resolvers, so the tag depends on nothing else."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._tags: dict[tuple[str, Any], str] = {}

        def resolve(self, kind: type, value: Any, implicit: Any) -> str:
            if kind is not yaml.ScalarNode:
                return super().resolve(kind, value, implicit)
            tag = self._tags.get((value, implicit))
            if tag is None:
                tag = self._tags[value, implicit] = super().resolve(kind, value, implicit)
            return tag

        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            _no_duplicate_keys(self, node)
            return super().construct_mapping(node, deep)


# Where libyaml and PyYAML's Python scanner read the same text differently (found by tests/cli/test_hostile_yaml.py's
# fuzzing): tabs, carriage returns, a byte-order mark or a Unicode line break, a control character, a tag (libyaml
# reads a lone `!` as '' where PyYAML reads null), a comment right after a block scalar's indicator (`|#`: refused
# by PyYAML only), a `?` where a flow collection may be (PyYAML ends a plain scalar there, libyaml does not). A
# document holding any of them goes to the Python loader, as it always did.
_NOT_FOR_C = re.compile(r"[^\n\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd]"
                        r"|(?:^|[\s\[\]{},])!|[|>][-+0-9]*#")


def _compose_fast(text: str) -> tuple[Any, yaml.Node | None]:
    """(the C loader, its composed document or None if empty), within the limits; _Refused or any error else."""
    if _NOT_FOR_C.search(text) or ("?" in text and ("[" in text or "{" in text)):
        raise _Refused("libyaml and PyYAML may read this text differently")
    needs_measure = _prescan(text)
    loader = _FastStrictLoader(text)
    node = loader.get_single_node()
    if node is not None and needs_measure:
        measure(node)
    return loader, node


def _load_fast(text: str) -> Any:
    """load_yaml_strict by libyaml; raises (anything) where the document is not plainly within the limits."""
    loader, node = _compose_fast(text)
    try:
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml_strict(text: str, path: str | Path) -> Any:
    """Parse YAML like yaml.safe_load, but duplicate keys and documents past the limits (MAX_YAML_DEPTH,
    MAX_ALIAS_NODES, a recursive alias) are errors; errors are one line naming the file. libyaml reads it where
    PyYAML has it; whatever it refuses is read again by the Python loader, which says why (the module's docstring)."""
    if yaml.__with_libyaml__:
        try:
            return _load_fast(text)
        except Exception:  # noqa: S110 (refused: the reference loader below reads it and words any error)
            pass
    return _load_python(text, path)


def _load_python(text: str, path: str | Path) -> Any:
    """load_yaml_strict by PyYAML's Python loader (_StrictLoader): the reference, and the words of every error."""
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
    building it; anything else (invalid YAML, duplicate keys) is left to the caller's own parser. libyaml checks it
    where PyYAML has it; the Python loader looks again at what it does not pass."""
    if yaml.__with_libyaml__:
        try:
            loader, _ = _compose_fast(text)
            loader.dispose()
            return
        except Exception:  # noqa: S110 (not plainly within the limits: the Python loader below decides)
            pass
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


# ---- writing: never through a link ----------------------------------------------------------------------------
class LinkError(InputError):
    """A path `lrattn` would write is a symbolic link or not a regular file: refused, never followed."""


_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def _refusal(path: Path | str, what: str, mode: int) -> LinkError:
    if stat.S_ISLNK(mode):
        try:
            to = f" to {os.readlink(path)}"
        except OSError:
            to = ""
        return LinkError(f"{what} {path} is a symbolic link{to}; lrattn writes no file through a link: "
                         "remove the link and run again")
    kind = _KINDS.get(stat.S_IFMT(mode), "a regular file" if stat.S_ISREG(mode) else "not a regular file")
    return LinkError(f"{what} {path} is {kind}, not what lrattn writes there: remove or move it and run again")


def refuse_link(path: Path | str, what: str = "file", folder: bool = False) -> None:
    """LinkError (one line) if `path` exists and is a symbolic link or anything but a regular file (`folder`: a
    folder)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
        raise _refusal(path, what, mode)


def open_new(path: Path | str, what: str = "file", perm: int = 0o666, stale: bool = False) -> int:
    """A descriptor on a file created here (O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW, `perm` less the umask). A link or
    non-regular file at `path` is a LinkError; an existing regular file is FileExistsError, or with `stale` (this
    process's own leftover name) unlinked first: unlinking a planted file, or a hard link, harms nobody's data."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW
    try:
        return os.open(path, flags, perm)
    except FileExistsError:
        refuse_link(path, what)
        if not stale:
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        return os.open(path, flags, perm)
    except FileExistsError:
        refuse_link(path, what)
        raise


def open_own(path: Path | str, what: str = "file", perm: int = 0o644) -> int:
    """A read-write descriptor on `path`, created if missing, never through a link (O_NOFOLLOW): for a file that is
    kept and reused (a lock). A link, a non-regular file or a file with other hard links is a LinkError, refused
    before a byte is written."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NO_FOLLOW, perm)
    except OSError:
        refuse_link(path, what)  # ELOOP: a link; anything else is the caller's OSError
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        if stat.S_ISREG(info.st_mode):
            raise LinkError(f"{what} {path} has {info.st_nlink} hard links (another name for the same file); lrattn "
                            "writes only a file of its own: remove it and run again")
        raise _refusal(path, what, info.st_mode)
    os.set_blocking(fd, True)
    return fd


def temporary_beside(path: Path) -> Path:
    """A hidden name in `path`'s folder for the bytes of `path` before they are renamed over it."""
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


@contextlib.contextmanager
def replacing(path: Path | str, mode: str = "w", what: str = "file", perm: int = 0o666,
              temporary: Path | None = None, durable: bool = False) -> Iterator[IO[Any]]:
    """A file object ("w" text, UTF-8, or "wb") on a new temporary beside `path` (open_new), renamed over `path` when
    the block ends (`durable`: fsynced first, and the folder after) and removed if it raises. `path` must not be a
    link or a non-regular file (LinkError); the rename replaces a link itself, never its target, should one appear."""
    path = Path(path)
    refuse_link(path, what)
    tmp = temporary or temporary_beside(path)
    fd = open_new(tmp, what, perm, stale=temporary is not None)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as file:
            yield file
            file.flush()
            if durable:
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        sync_folder(path.parent)


def open_folder(base: Path | str, parts: Sequence[str], what: str = "folder") -> int:
    """A descriptor on the folder `base`/parts[0]/parts[1]/..., each part made if missing and opened relative to the
    one above with O_NOFOLLOW|O_DIRECTORY: a link, or anything but a folder, at any part is a LinkError naming it,
    never followed, and no part can become a link between its check and its use (each step opens what it
    checked). `base` is the caller's own folder, opened as it is (links above the parts are the user's setup)."""
    shown = Path(base)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            shown = shown / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=fd)
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=fd)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _refusal(shown, what, os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode) from None
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def replacing_in(folder: int, name: str, shown: Path | str, what: str = "file", perm: int = 0o666,
                 temporary: str | None = None) -> Iterator[IO[bytes]]:
    """`replacing` ("wb") of the file `name` inside an open folder (open_folder; `shown`: its path, for errors): a new
    O_EXCL|O_NOFOLLOW temporary in that folder (`temporary`: its name), renamed over `name` within it when the block
    ends. A link or a non-regular file at `name` is a LinkError; one appearing later is replaced, never followed."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise _refusal(shown, what, mode)
    tmp = temporary or f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, perm, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def sync_folder(folder: Path) -> None:
    """fsync a folder (making a rename in it durable), where the filesystem allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(path: Path | str, data: str | bytes, what: str = "file") -> None:
    """Write `path` whole (text as UTF-8) through `replacing`: never through a link, never half-written."""
    with replacing(path, "wb" if isinstance(data, bytes) else "w", what) as file:
        file.write(data)


def append_file(path: Path | str, what: str = "file") -> IO[str]:
    """A text file object appending to `path` (created if missing), opened O_NOFOLLOW: a link or a non-regular file
    there is a LinkError."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NO_FOLLOW, 0o666)
    except OSError:
        refuse_link(path, what)
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refusal(path, what, info.st_mode)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")
