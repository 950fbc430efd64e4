"""The built-in corpora, and the Document every source yields.

    iter_documents(name) -> cleaned, deduplicated Documents (text, key)

Built-in corpora: `stdlib-docs` (default; the Python reference docs and standard-library docstrings of the
running interpreter, parsed with `ast`, never imported), `jargon` and `bible-kjv` (Debian packages). Their
documents carry a `key` (a topic, an entry, a chapter) that decides the train/val side, so related pieces
stay together. A user's own files are read by `data/formats.py`, as they are. The project commits no corpus
text. Nothing runs at import time.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import inspect
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.documents import Document

BUILTIN_SOURCES = ("stdlib-docs", "jargon", "bible-kjv")
MIN_FRAGMENT_CHARS = 60  # docstrings and paragraphs shorter than this are dropped
DOCUMENT_TARGET_CHARS = 4000  # plain text is cut into documents of about this many characters
JARGON_DIR = Path("/usr/share/doc/jargon-text")  # Debian jargon-text
# Stdlib sources are parsed with `ast`, never imported, so import-time side effects (antigravity,
# this, turtle, tkinter) cannot happen. Test suites and generated codec tables are not prose.
_STDLIB_SKIP = frozenset({"test", "encodings", "lib2to3", "__phello__"})
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_INNER_SPACE = re.compile(r"(?<=\S)[ \t]{2,}")
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Dedent, strip line ends, collapse inner runs of spaces and runs of blank lines."""
    lines = (_INNER_SPACE.sub(" ", line.rstrip()) for line in inspect.cleandoc(text).splitlines())
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()



def iter_documents(source: str, max_documents: int | None = None, max_bytes: int | None = None) -> Iterator[Document]:
    """Cleaned, deduplicated documents of the built-in corpus `source`, stopping after `max_documents` or
    `max_bytes`: stdlib-docs | jargon | bible-kjv."""
    seen: set[bytes] = set()
    count = total = 0
    for doc in _source_documents(source):
        text = clean_text(doc.text)
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        if len(text) < MIN_FRAGMENT_CHARS or digest in seen:
            continue
        seen.add(digest)
        yield Document(text, doc.key)
        count, total = count + 1, total + len(text.encode("utf-8"))
        if (max_documents is not None and count >= max_documents) or (max_bytes is not None and total >= max_bytes):
            return


def _source_documents(source: str) -> Iterator[Document]:
    if source == "stdlib-docs":
        return _stdlib_documents()
    if source == "jargon":
        return _jargon_documents()
    if source == "bible-kjv":
        return _bible_documents()
    raise InputError(f"unknown built-in corpus '{source}'; built-in corpora: {list(BUILTIN_SOURCES)}")


def _stdlib_documents() -> Iterator[Document]:
    """The Python reference docs (pydoc topics), then each stdlib module's docstrings in source order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield Document(topics[name], f"pydoc:{name}")
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    for name in sorted(sys.stdlib_module_names):
        if name in _STDLIB_SKIP:
            continue
        for path in _module_files(root, name):
            text = _docstrings_of(path, seen)
            if text:
                yield Document(text, f"stdlib:{path.relative_to(root).with_suffix('').as_posix()}")


def _module_files(root: Path, name: str) -> list[Path]:
    if (root / f"{name}.py").is_file():
        return [root / f"{name}.py"]
    if not (root / name).is_dir():
        return []  # built into the interpreter or a C extension: no source to parse
    return sorted(
        p for p in (root / name).rglob("*.py")
        if not _STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts) and not p.name.startswith("test_")
    )


def _docstrings_of(path: Path, seen: set[str]) -> str:
    """Module, class and function docstrings of one file, cleaned, unseen and not tiny, blank-line joined."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ""
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, _DOC_NODES)), key=lambda n: getattr(n, "lineno", 0))
    parts = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_FRAGMENT_CHARS and doc not in seen:
            seen.add(doc)
            parts.append(clean_text(doc))
    return "\n\n".join(parts)


def _jargon_documents() -> Iterator[Document]:
    """The Jargon File (Debian jargon-text): one document per lexicon entry, prose before it by paragraphs."""
    folder = JARGON_DIR
    path = next((p for p in (folder / "jargon.txt.gz", folder / "jargon.txt") if p.is_file()), None)
    if path is None:
        raise InputError(f"source 'jargon' needs the Debian package jargon-text ({folder} not found): apt-get install jargon-text")
    text = _read_text(path)
    pieces = re.split(r"(?m)^(?=[ \t]*:[^:\n]+:)", text)  # an entry starts with a line like '   :cruft: n.'
    for i, piece in enumerate(_group_paragraphs(pieces[0])):
        yield Document(piece, f"jargon:front:{i}")
    for piece in pieces[1:]:
        headword = piece.strip().split(":")[1]
        yield Document(piece, f"jargon:{headword}")


def _bible_documents() -> Iterator[Document]:
    """The King James Bible (Debian bible-kjv-text, read through bible-kjv's `bible`): one document per chapter."""
    exe = shutil.which("bible")
    if exe is None:
        raise InputError(
            "source 'bible-kjv' needs the Debian packages bible-kjv-text (the text) and bible-kjv (the `bible` "
            "program that decompresses it): apt-get install bible-kjv"
        )
    try:
        out = subprocess.run(
            [exe, "-l100000", "Gen1:1-Rev22:21"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
            check=True, timeout=300,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise InputError(f"source 'bible-kjv': `bible` failed ({err}); reinstall with apt-get install --reinstall bible-kjv") from err
    title, verses = None, []
    for line in [*out.splitlines(), "END"]:
        if line and not line[0].isspace():  # a chapter heading such as 'Genesis 1'
            if title and verses:
                yield Document(title + "\n\n" + "\n".join(verses), f"kjv:{title}")
            title, verses = line.strip(), []
        elif line.strip():
            verses.append(line.strip().split(" ", 1)[-1])  # drop the verse number


def _read_text(path: Path) -> str:
    """A Debian corpus file as UTF-8; undecodable bytes become U+FFFD, with one warning that counts them."""
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            raw = f.read()
    else:
        raw = path.read_bytes()
    text, bad = _decode_utf8(raw)
    if bad:
        _warn_undecodable(path, bad)
    return text


_REPLACEMENT = "\ufffd"


def _decode_utf8(raw: bytes) -> tuple[str, int]:
    """(text, number of undecodable byte sequences replaced by U+FFFD)."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode("utf-8"))


def _warn_undecodable(path: Path, count: int) -> None:
    print(f"[lrattn prepare] warning: {path} is not valid UTF-8: {count} undecodable byte sequence(s) were replaced "
          "by U+FFFD; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) if that is not intended",
          file=sys.stderr, flush=True)


def _group_paragraphs(text: str, target: int = DOCUMENT_TARGET_CHARS) -> Iterator[str]:
    """Blank-line separated paragraphs (tiny ones dropped), joined into pieces of about `target` chars."""
    piece: list[str] = []
    size = 0
    for para in re.split(r"\n[ \t]*\n", text):
        para = para.strip("\n")
        if len(para.strip()) < MIN_FRAGMENT_CHARS:
            continue
        piece.append(para)
        size += len(para)
        if size >= target:
            yield "\n\n".join(piece)
            piece, size = [], 0
    if piece:
        yield "\n\n".join(piece)
