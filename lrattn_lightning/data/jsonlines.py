"""JSONL lines: one JSON object a line, its text in a string field. A line of at most LONG_LINE bytes is parsed
whole by json.loads; a longer one is parsed as it streams (`long_line_text`), so that a line of any length
costs a constant amount of memory: the field's string goes to a TextBuilder (spooled past LONG_CHARS) in
pieces, every other value is checked and skipped.

The streaming parser accepts what json.loads accepts (RFC 8259, plus NaN, Infinity and -Infinity; the last
of a key given twice counts) and gives the same text: a piece of a string's escaped content is cut only
between whole escapes (`\\n`, `\\u00e9`, a surrogate pair `\\ud83d\\ude00` together) and decoded by json.loads
itself. Nesting deeper than MAX_DEPTH, and a key or number longer than MAX_TOKEN bytes, are refused.
The refusals of both paths are the same lines (`not_json`, `not_object`, `no_field`, `not_string`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.documents import TextBuilder, TextStats, Utf8Decoder

LONG_LINE = 1 << 20  # bytes: a longer line is parsed as it streams
MAX_DEPTH = 200  # nesting of objects and arrays in a line
MAX_TOKEN = 1 << 20  # bytes of a key, a number or a literal
_TAIL = 12  # the longest escape (a surrogate pair): a block's last bytes wait for the next block
_WS = re.compile(rb"[ \t\r\n]*")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = ((b"null", "NoneType"), (b"true", "bool"), (b"false", "bool"), (b"NaN", "float"),
             (b"Infinity", "float"), (b"-Infinity", "float"))
# whole units of a string's content: plain bytes, a two-character escape, a surrogate pair, a lone high surrogate
# (only where what follows shows it is not a pair: never at the end of a block), any other \uXXXX
_UNITS = re.compile(
    rb'(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]'
    rb"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    rb"|\\u[dD][89abAB][0-9a-fA-F]{2}(?=[^\\]|\\[^u]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]|[dD][0-9abAB]))"
    rb"|\\u(?![dD][89abAB])[0-9a-fA-F]{4})*+")
SHAPE = "each line of a JSONL file is one JSON object with a string field '{field}'"


def not_json(where: str, field: str, message: str, column: int) -> InputError:
    return InputError(f"{where}: not JSON ({message} at column {column}); {SHAPE.format(field=field)}")


def not_object(where: str, field: str, kind: str) -> InputError:
    return InputError(f"{where}: a JSON {kind}, not an object; {SHAPE.format(field=field)}")


def no_field(where: str, field: str, keys: list[str]) -> InputError:
    shown = ", ".join(keys[:12]) or "none"
    return InputError(f"{where}: no field '{field}' (fields: {shown}); pass --text_field NAME")


def not_string(where: str, field: str, kind: str) -> InputError:
    return InputError(f"{where}: field '{field}' holds a JSON {kind}, not a string; pass --text_field NAME of a "
                      "text field")


def too_deep(where: str) -> InputError:
    return InputError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels; a JSONL line holds a document's text, "
                      "not deep structure: flatten the line")


def line_text(line: str, where: str, field: str) -> str:
    """The text of a line of at most LONG_LINE bytes (decoded), parsed whole."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise not_json(where, field, err.msg, err.colno) from err
    except RecursionError as err:
        raise too_deep(where) from err
    if not isinstance(row, dict):
        raise not_object(where, field, type(row).__name__)
    if field not in row:
        raise no_field(where, field, list(row))
    if not isinstance(row[field], str):
        raise not_string(where, field, type(row[field]).__name__)
    return row[field]


class _Line:
    """The bytes of one line, fed in blocks by `more()` (b"" at its end), read from `pos`."""

    def __init__(self, first: bytes, more: Callable[[], bytes], path: Path, lineno: int, field: str) -> None:
        self.buf, self.pos, self.base, self.more, self.eof = first, 0, 0, more, False
        self.where, self.at, self.field = f"{path}:{lineno}", f"on line {lineno}", field

    def fill(self) -> bool:
        if self.eof:
            return False
        block = self.more()
        if not block:
            self.eof = True
            return False
        self.base += self.pos
        self.buf, self.pos = self.buf[self.pos :] + block, 0
        return True

    def peek(self) -> int | None:
        """The next byte after whitespace, or None at the line's end."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return None

    def error(self, message: str) -> InputError:
        return not_json(self.where, self.field, message, self.base + self.pos + 1)


class _Parser:
    def __init__(self, line: _Line, stats: TextStats, make_builder: Callable[[], TextBuilder]) -> None:
        self.line, self.stats, self.make_builder = line, stats, make_builder
        self.keys: list[str] = []
        self.found: TextBuilder | str | None = None  # the field's text, or the JSON type it held instead

    def value(self, depth: int) -> str:
        c = self.line.peek()
        if c == 0x7B:  # {
            self.object(depth + 1, top=False)
            return "dict"
        if c == 0x5B:  # [
            self.array(depth + 1)
            return "list"
        if c == 0x22:  # "
            self.string(None)
            return "str"
        return self.scalar()

    def object(self, depth: int, top: bool) -> None:
        line = self.line
        if depth > MAX_DEPTH:
            raise too_deep(line.where)
        line.pos += 1
        c = line.peek()
        if c == 0x7D:  # }
            line.pos += 1
            return
        while True:
            if c != 0x22:
                raise line.error("Expecting property name enclosed in double quotes")
            key = self.key()
            if line.peek() != 0x3A:  # :
                raise line.error("Expecting ':' delimiter")
            line.pos += 1
            if top and len(self.keys) < 12:
                self.keys.append(key)
            if top and key == line.field:
                if isinstance(self.found, TextBuilder):
                    self.found.discard()  # the last of a key given twice counts, as in json.loads
                if line.peek() == 0x22:
                    self.found = self.make_builder()
                    self.string(self.found)
                else:
                    self.found = self.value(depth)
            else:
                self.value(depth)
            c = line.peek()
            if c == 0x2C:  # ,
                line.pos += 1
                c = line.peek()
                continue
            if c == 0x7D:
                line.pos += 1
                return
            raise line.error("Expecting ',' delimiter")

    def array(self, depth: int) -> None:
        line = self.line
        if depth > MAX_DEPTH:
            raise too_deep(line.where)
        line.pos += 1
        if line.peek() == 0x5D:  # ]
            line.pos += 1
            return
        while True:
            self.value(depth)
            c = line.peek()
            if c == 0x2C:
                line.pos += 1
                continue
            if c == 0x5D:
                line.pos += 1
                return
            raise line.error("Expecting ',' delimiter")

    def key(self) -> str:
        parts: list[str] = []
        self.string(parts)
        return "".join(parts)

    def string(self, sink: TextBuilder | list[str] | None) -> None:
        """A string's content from `pos` (at its opening quote) to its closing quote: decoded into `sink` (a
        TextBuilder, or a list for a key), or checked and skipped."""
        line, decoder, where = self.line, Utf8Decoder(self.stats), self.line.at
        start = line.base + line.pos
        line.pos += 1
        taken = 0
        while True:
            end = len(line.buf) if line.eof else max(len(line.buf) - _TAIL, line.pos)
            stop = _UNITS.match(line.buf, line.pos, end).end()
            if stop > line.pos:
                text = decoder.feed(line.buf[line.pos : stop], where)
                taken += stop - line.pos
                if isinstance(sink, list) and taken > MAX_TOKEN:
                    raise line.error(f"a key longer than {MAX_TOKEN:,} bytes")
                if sink is not None and text:
                    text = self.stats.surrogates(json.loads(f'"{text}"'), where)
                    sink.append(text) if isinstance(sink, list) else sink.add(text)
            line.pos = stop
            if stop < len(line.buf) and line.buf[stop] == 0x22:
                line.pos += 1
                rest = decoder.feed(b"", where, final=True)  # an unfinished character: U+FFFD
                if sink is not None and rest:
                    sink.append(rest) if isinstance(sink, list) else sink.add(rest)
                return
            if not line.eof and stop >= len(line.buf) - 2 * _TAIL:
                line.fill()  # a unit may go on in the next block
                continue
            if stop < len(line.buf):
                byte = line.buf[stop]
                if byte == 0:
                    raise InputError(f"{self.stats.path}: binary content (a NUL byte {where}), not text: leave the "
                                     "file out of --source, or convert it to UTF-8 text")
                raise line.error("Invalid control character" if byte < 0x20 else "Invalid \\escape")
            line.pos = start - line.base
            raise line.error("Unterminated string starting")

    def scalar(self) -> str:
        line = self.line
        while not line.eof and len(line.buf) - line.pos < 64:
            line.fill()
        for literal, kind in _LITERALS:
            if line.buf.startswith(literal, line.pos):
                line.pos += len(literal)
                return kind
        match = _NUMBER.match(line.buf, line.pos)
        if match is None:
            raise line.error("Expecting value")
        while match.end() == len(line.buf) and line.fill():
            if len(line.buf) - line.pos > MAX_TOKEN:
                raise line.error(f"a number longer than {MAX_TOKEN:,} bytes")
            match = _NUMBER.match(line.buf, line.pos)
        line.pos = match.end()
        return "float" if any(c in match.group() for c in b".eE") else "int"


def rest_of_line(stream: Any) -> Callable[[int], bytes]:
    """`read(size)`: the next at most `size` bytes of the line `stream` is in (readline), then b"" once that line
    has ended (its newline read, or the stream's end): never a byte of the next line. Every `more` given to
    `long_line_text` reads through it."""
    ended = False

    def read(size: int) -> bytes:
        nonlocal ended
        if ended:
            return b""
        block = stream.readline(size)
        ended = not block or block.endswith(b"\n")
        return block

    return read


def long_line_text(first: bytes, more: Callable[[], bytes], path: Path, lineno: int, field: str, stats: TextStats,
                   make_builder: Callable[[], TextBuilder]) -> TextBuilder | None:
    """The text of `field` in the JSON object on line `lineno`, fed as `first` and then `more()` (b"" at its
    end), into a TextBuilder (None for a line of whitespace); the same refusals as `line_text`."""
    line = _Line(first, more, path, lineno, field)
    where = line.where
    parser = _Parser(line, stats, make_builder)
    c = line.peek()
    if c is None:
        return None
    if c != 0x7B:
        kind = parser.value(0)
        if line.peek() is not None:
            raise line.error("Extra data")
        raise not_object(where, field, kind)
    try:
        parser.object(1, top=True)
        if line.peek() is not None:
            raise line.error("Extra data")
    except BaseException:
        if isinstance(parser.found, TextBuilder):
            parser.found.discard()
        raise
    if parser.found is None:
        raise no_field(where, field, parser.keys)
    if isinstance(parser.found, str):
        raise not_string(where, field, parser.found)
    return parser.found
