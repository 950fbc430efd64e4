"""A long document in pieces that the tokenizer reads as it reads the whole.

A document longer than LONG_CHARS (data/documents.py) is tokenised in pieces of at most PIECE_CHARS characters,
so a worker never holds more, whatever the document's size. A cut must not change the tokens: the byte
tokenizer is cut anywhere; any other is cut where its own ids prove the cut harmless, checked at every cut:

    ids(text[p - WINDOW : p]) + ids(text[p : p + WINDOW]) == ids(text[p - WINDOW : p + WINDOW])

Candidates are tried from the end of a piece backwards: before a space between two non-spaces first (where a
GPT-2 or cl100k-style pre-tokenizer always splits, so the first candidate holds), then at any whitespace
boundary, then around punctuation; at most TRIES of them. A tokenizer that changes tokens at every such place
(one that adds a prefix to every text it is given, say) cannot read a long document in pieces: such a
document is refused in one line, which names `--max_document_bytes` (skip documents above a size) as the way on.

BPE training (before the tokenizer exists) cuts before the last space between two non-spaces, the boundary
its byte-level pre-tokenizer splits at anyway.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.documents import Document

PIECE_CHARS = 1 << 20
WINDOW = 512
TRIES = 32
_PATTERNS = (re.compile(r"(?<=\S) (?=\S)"), re.compile(r"(?<=\S)(?=\s)|(?<=\s)(?=\S)"),
             re.compile(r"(?<=[^\w\s])|(?=[^\w\s])"))
_REGIONS = (1 << 12, 1 << 16, PIECE_CHARS)  # searched from the end of a piece, nearest first


class Cutter:
    """Where a long document's pieces end, for one tokenizer (None: BPE training; `exact`: cut anywhere)."""

    def __init__(self, tokenizer: Any | None, exact: bool = False, name: str = "") -> None:
        self.tokenizer, self.exact, self.name = tokenizer, exact, name

    @classmethod
    def of(cls, tokenizer: Any) -> Cutter:
        spec = tokenizer.spec()
        return cls(tokenizer, exact=spec["kind"] == "byte", name=spec.get("file") or spec["kind"])

    def pieces(self, doc: Document) -> Iterator[str]:
        """The document's text in pieces of at most PIECE_CHARS characters (one piece when it is short)."""
        if doc.spool is None:
            yield doc.text
            return
        if self.exact:  # any cut is harmless: the blocks as they are read
            yield from doc.blocks()
            return
        buf = ""
        for block in doc.blocks():
            buf += block
            while len(buf) > PIECE_CHARS + WINDOW:
                cut = self.cut(buf, doc)
                yield buf[:cut]
                buf = buf[cut:]
        if buf:
            yield buf

    def cut(self, text: str, doc: Document) -> int:
        """A cut in text[PIECE_CHARS // 2 : PIECE_CHARS] (the text goes on at least WINDOW characters after it)."""
        for pattern in _PATTERNS if self.tokenizer is not None else _PATTERNS[:2]:
            for tried, at in enumerate(_candidates(pattern, text, PIECE_CHARS // 2, PIECE_CHARS)):
                if self.tokenizer is None or self._harmless(text, at):
                    return at
                if tried + 1 >= TRIES:
                    break
        if self.tokenizer is None:
            return PIECE_CHARS  # no whitespace in half a piece: anywhere (training only counts words)
        raise InputError(f"{doc.origin or 'a document'}: {doc.length:,} characters, and no place in "
                         f"{PIECE_CHARS // 2:,} of them where tokenizer {self.name} reads the text cut as it reads it "
                         f"whole (tried {TRIES} per kind of boundary), so it cannot be tokenised in pieces; pass "
                         "--max_document_bytes N to skip documents longer than N bytes, or use a tokenizer that splits "
                         "at spaces (byte, bpe, tiktoken)")

    def _harmless(self, text: str, at: int) -> bool:
        left, right = text[max(at - WINDOW, 0) : at], text[at : at + WINDOW]
        encode = self.tokenizer.encode
        return list(encode(left)) + list(encode(right)) == list(encode(left + right))


def _candidates(pattern: re.Pattern, text: str, low: int, high: int) -> Iterator[int]:
    """The places `pattern` matches in text[low:high], nearest `high` first (searched in growing regions)."""
    end = high
    for region in _REGIONS:
        start = max(low, high - region)
        yield from reversed([match.start() for match in pattern.finditer(text, start, end)])
        if start == low:
            return
        end = start
