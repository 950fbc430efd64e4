"""A document, however long: its text in memory up to LONG_CHARS characters, else spooled to a file.

    Document(text, key, origin)        a document held in memory (at most LONG_CHARS characters)
    Document(spool=PATH, ...)          a longer one: its UTF-8 text in PATH (the staging folder's .prepare/spool)
    doc.blocks()                       its text in blocks of at most BLOCK_CHARS characters (one, in memory)
    TextBuilder(spool)                 a reader feeds a document's text in pieces; .document() keeps it in memory
                                       or has spooled it, so no reader ever holds a whole long document
    Utf8Decoder(stats)                 bytes -> text in pieces: a character cut by a block boundary waits for
                                       the next block, so pieces decode exactly as the whole would
    TextStats                          the one text policy: undecodable bytes become U+FFFD and are counted; above
                                       BAD_FRACTION of a file (or a NUL byte) it is not text: one line naming it

Memory: a reader holds at most one block of its input and one LONG_CHARS document; whatever a document's size,
the rest of it waits on disk until the pipeline reads it back in pieces (data/pipeline.py).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import open_new

LONG_CHARS = 1 << 20  # a document longer than this (characters) is spooled to disk, and tokenised in pieces
BLOCK_CHARS = 1 << 20  # what a spooled document is read back in
HEAD_BYTES = 1 << 16  # the start of a file that decides whether it is text at all
BAD_FRACTION = 0.01  # undecodable byte sequences per byte above which a file is not UTF-8 text, but refused
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Document:
    """A unit of text. `key` decides the split: documents that share a key land on the same side; a document
    without one (a user's corpus) is split by its content (`data/split.py`). `origin` says where it came from
    (a file and line, for the eval tasks' `source`). A document longer than LONG_CHARS has `text` "" and its
    text in `spool` (UTF-8), `chars` characters long."""

    text: str
    key: str | None = None
    origin: str = ""
    spool: Path | None = None
    chars: int = -1

    @property
    def source(self) -> str:
        return self.key if self.key is not None else self.origin

    @property
    def length(self) -> int:
        """Characters of text."""
        return len(self.text) if self.spool is None else self.chars

    @property
    def nbytes(self) -> int:
        """Bytes of UTF-8 text."""
        return len(self.text.encode("utf-8")) if self.spool is None else self.spool.stat().st_size

    def is_blank(self) -> bool:
        """Empty, or nothing but whitespace (such documents are skipped and counted)."""
        return not any(block.strip() for block in self.blocks())

    def blocks(self) -> Iterator[str]:
        """The text in blocks of at most BLOCK_CHARS characters, in order."""
        if self.spool is None:
            yield self.text
            return
        with open(self.spool, encoding="utf-8", newline="") as f:
            while block := f.read(BLOCK_CHARS):
                yield block

    def release(self) -> None:
        """The spooled text is not needed any more (the document is written or skipped)."""
        if self.spool is not None:
            self.spool.unlink(missing_ok=True)


class Spool:
    """Where long documents wait: one file each in `folder`, numbered."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._numbers = itertools.count()

    def path(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / f"{next(self._numbers)}.txt"


class TextBuilder:
    """One document's text as a reader finds it, in pieces: kept in memory while it is at most LONG_CHARS
    characters, written to a spool file from then on."""

    def __init__(self, spool: Spool | None) -> None:
        self.spool, self.pieces, self.chars = spool, [], 0
        self.file, self.path = None, None

    def add(self, text: str) -> None:
        if not text:
            return
        self.chars += len(text)
        if self.file is None and self.chars <= LONG_CHARS:
            self.pieces.append(text)
            return
        if self.file is None:
            if self.spool is None:
                raise RuntimeError("a document longer than LONG_CHARS needs a spool folder")
            self.path = self.spool.path()
            self.file = os.fdopen(open_new(self.path, "spool file", stale=True), "w", encoding="utf-8", newline="")
            self.file.writelines(self.pieces)
            self.pieces = []
        self.file.write(text)

    def document(self, key: str | None = None, origin: str = "") -> Document:
        if self.file is None:
            return Document("".join(self.pieces), key, origin)
        self.file.close()
        return Document("", key, origin, spool=self.path, chars=self.chars)

    def discard(self) -> None:
        """The text so far is not a document (a JSON field given twice: the last one counts)."""
        if self.file is not None:
            self.file.close()
            self.path.unlink(missing_ok=True)
        self.pieces, self.chars, self.file, self.path = [], 0, None, None


class TextStats:
    """Undecodable UTF-8 sequences of one file: how many, in how many bytes, and where the first was."""

    def __init__(self, path: Path | str) -> None:
        self.path, self.bad, self.bytes, self.first = path, 0, 0, ""

    def decode(self, raw: bytes, where: str, offset: int = 0) -> str:
        """`raw` as UTF-8; an undecodable sequence becomes U+FFFD and is counted (its place kept if first: `where`
        and the byte in `raw`, or without `where`, the byte in the file, `raw` starting at `offset`)."""
        self.bytes += len(raw)
        if b"\x00" in raw:
            raise InputError(f"{self.path}: binary content (a NUL byte {where}), not text: leave the file out of "
                             "--source, or convert it to UTF-8 text")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if not self.bad:
                self.first = f"{where}, byte {err.start} of it" if where else f"byte {offset + err.start}"
        parts, start = [], 0
        while True:
            try:
                parts.append(raw[start:].decode("utf-8"))
                break
            except UnicodeDecodeError as err:
                parts.append(raw[start : start + err.start].decode("utf-8"))
                parts.append("\ufffd")
                self.bad += 1
                start += err.end
        self.check()
        return "".join(parts)

    def surrogates(self, text: str, where: str) -> str:
        """A JSON string may escape half a surrogate pair (`\\ud800`), which no UTF-8 text holds: U+FFFD, counted."""
        found = len(_SURROGATE.findall(text))
        if not found:
            return text
        if not self.bad:
            self.first = f"{where} (an escaped lone surrogate)"
        self.bad += found
        self.check()
        return _SURROGATE.sub("\ufffd", text)

    def check(self, final: bool = False) -> None:
        if self.bad > max(16, BAD_FRACTION * self.bytes) and (final or self.bytes >= HEAD_BYTES // 4):
            raise InputError(f"{self.path}: not UTF-8 text: {self.bad:,} undecodable byte sequences in the first "
                             f"{self.bytes:,} bytes (first at {self.first}); convert it to UTF-8 (e.g. iconv -f "
                             "latin1 -t utf-8), or leave it out of --source")

    def finish(self) -> None:
        self.check(final=True)
        if self.bad:
            print(f"[lrattn prepare] warning: {self.path}: {self.bad:,} undecodable byte sequence(s) in "
                  f"{self.bytes:,} bytes ({self.bad / self.bytes:.4%}), first at {self.first}, were replaced by "
                  "U+FFFD; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) if that is not intended",
                  file=sys.stderr, flush=True)


def utf8_cut(raw: bytes) -> int:
    """The length of `raw` without a trailing UTF-8 sequence that the next bytes may complete (0-3 bytes)."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte < 0x80:
            return len(raw)
        if byte >= 0xC0:  # a lead byte: complete when its sequence fits in what follows it
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(raw) if back >= need else len(raw) - back
    return len(raw)


class Utf8Decoder:
    """Bytes in blocks -> text, through a file's TextStats: a character cut by a block boundary is decoded
    with the next block, so the pieces are what decoding the whole would give."""

    def __init__(self, stats: TextStats) -> None:
        self.stats, self.carry = stats, b""

    def feed(self, raw: bytes, where: str, final: bool = False, offset: int = 0) -> str:
        """`raw` decoded, but for a character it may cut short (the next call decodes it); `offset`: where `raw`
        starts in the file (for a first undecodable byte without `where`)."""
        offset -= len(self.carry)
        raw = self.carry + raw if self.carry else raw
        cut = len(raw) if final else utf8_cut(raw)
        self.carry = raw[cut:]
        return self.stats.decode(raw[:cut], where, offset) if cut else ""
