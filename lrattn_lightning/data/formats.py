"""A researcher's own corpus: files in the formats corpora come in, checked by their content, read as a stream.

    kind_of(path) -> (kind, compression)   by the file name
    FileInput.check()                      before anything is written: the content is what the name says
    FileInput.documents()                  Documents, streamed (memory bounded by a record, a row batch or a block)

Formats, by the file name: `.parquet` (the column `--text_field`, row group by row group, with pyarrow),
`.jsonl`/`.ndjson` (one JSON object a line, its field `--text_field`), `.txt` (one document a file, or pieces
between `--document_separator`); `.jsonl` and `.txt` also compressed as `.gz`, `.zst`, `.bz2`, `.xz`. A Hugging
Face dataset by name (`hf:NAME`, through `datasets`, from its cache or the hub) or saved with `save_to_disk`.

Data is never guessed: a file whose magic bytes say Parquet, gzip, zstd, bz2, xz, zip or Arrow under a name
that says otherwise, text holding NUL bytes or mostly undecodable bytes, a line that is not a JSON object, a
missing or non-string field: one InputError naming the file, the line or row, and the fix. Undecodable bytes
that are rare in real text become U+FFFD with one warning saying how many, which fraction and where.
Documents are read as they are (no cleaning); only documents that are empty or all whitespace are skipped.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.corpora import Document

KINDS = {".txt": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_SUFFIX_OF = {"gzip": ".gz", "zstd": ".zst", "bz2": ".bz2", "xz": ".xz"}
HEAD_BYTES = 1 << 16  # what `check` reads of each file (decompressed) before anything is written
BLOCK_BYTES = 1 << 20  # read size of text files split by a separator
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark some editors put first: not part of the text
BAD_FRACTION = 0.01  # undecodable byte sequences per byte above which a file is not UTF-8 text, but refused
SUPPORTED = ".parquet, .jsonl/.ndjson or .txt (the last two also as .gz, .zst, .bz2, .xz)"


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    separator: str | None = None  # plain text: None = one document per file
    hf_config: str | None = None
    hf_split: str = "train"


def magic_of(head: bytes) -> str | None:
    """The container a file's first bytes announce, or None for anything else (text, among others)."""
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    if head.startswith(b"BZh") and head[3:4].isdigit() and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "bz2"  # 'BZh', the block size, then a block's (or the end of stream's) magic number
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith(b"7z\xbc\xaf\x27\x1c"):
        return "7z"
    if head.startswith(b"ARROW1"):
        return "arrow"
    return None


def _rename_hint(path: Path, found: str, kind: str) -> str:
    stem = path.name
    for suffix in COMPRESSIONS:
        stem = stem.removesuffix(suffix)
    if found == "parquet":
        return f"it is a Parquet file (magic bytes PAR1): name it {Path(stem).stem}.parquet"
    if found in _SUFFIX_OF:
        return f"it is {found}-compressed (its magic bytes say so): name it {stem}{_SUFFIX_OF[found]}"
    return f"it is a {found} file, not {kind}: unpack it, or leave it out of --source"


class TextStats:
    """Undecodable UTF-8 sequences of one file: how many, in how many bytes, and where the first was."""

    def __init__(self, path: Path) -> None:
        self.path, self.bad, self.bytes, self.first = path, 0, 0, ""

    def decode(self, raw: bytes, where: str) -> str:
        """`raw` as UTF-8; an undecodable sequence becomes U+FFFD and is counted (its place kept if first)."""
        self.bytes += len(raw)
        if b"\x00" in raw:
            raise InputError(f"{self.path}: binary content (a NUL byte {where}), not text: leave the file out of "
                             "--source, or convert it to UTF-8 text")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if not self.bad:
                self.first = f"{where}, byte {err.start} of it" if where else f"byte {err.start}"
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


def _decompress_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError)


class FileInput:
    """One file of a corpus: its kind (text, jsonl, parquet) and compression come from its name, and
    `check` makes sure the content agrees. `consumed` (bytes of the file read) drives the progress bar."""

    def __init__(self, path: Path, kind: str, compression: str | None, options: ReadOptions) -> None:
        self.path, self.kind, self.compression, self.options = path, kind, compression, options
        self.size = path.stat().st_size
        self.consumed = 0

    def describe(self) -> str:
        return f"{self.kind}{'.' + self.compression if self.compression else ''}"

    # ---- reading ------------------------------------------------------------------------------------
    def _open(self) -> tuple[Any, Any]:
        """(the raw file, a binary stream of its decompressed content)."""
        raw = open(self.path, "rb")  # noqa: SIM115  (closed by the caller, with the stream)
        if self.compression == "gzip":
            return raw, gzip.GzipFile(fileobj=raw)
        if self.compression == "bz2":
            return raw, bz2.BZ2File(raw)
        if self.compression == "xz":
            return raw, lzma.LZMAFile(raw)
        if self.compression == "zstd":
            import zstandard

            return raw, io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        return raw, raw

    def _broken(self, err: BaseException) -> InputError:
        what = f"{self.compression} data" if self.compression else "the file"
        return InputError(f"{self.path}: cannot read {what} ({type(err).__name__}: {err}); the file is truncated or "
                          "corrupt: copy it again")

    def check(self) -> None:
        """InputError unless the content is what the name says: magic bytes, text, and the first record."""
        with open(self.path, "rb") as f:
            head = f.read(16)
            f.seek(max(self.size - 4, 0))
            tail = f.read(4)
        found = magic_of(head)
        if self.kind == "parquet":
            if found == "parquet" and tail != b"PAR1":
                raise InputError(f"{self.path}: a Parquet file cut short (no PAR1 magic bytes at its end); copy it again")
            if found != "parquet":
                what = f"a {found} file" if found else "no Parquet magic bytes (PAR1)"
                raise InputError(f"{self.path}: not a Parquet file ({what}); name it for what it is ({SUPPORTED})")
            self._check_parquet()
            return
        if found != self.compression:
            if found is None:
                raise InputError(f"{self.path}: named {self.compression}, but its magic bytes are not {self.compression}'s: "
                                 f"drop the {self.path.suffix} suffix if it is plain {self.kind}")
            raise InputError(f"{self.path}: {_rename_hint(self.path, found, self.kind)}")
        raw, stream = self._open()
        try:
            with raw, stream:
                content = stream.read(HEAD_BYTES)
                while self.kind == "jsonl" and b"\n" not in content and (more := stream.read(HEAD_BYTES)):
                    content += more  # a first record longer than the head
                whole = not stream.read(1)
        except _decompress_errors() as err:
            raise self._broken(err) from err
        content = content.removeprefix(BOM)
        inner = magic_of(content[:16])
        if inner is not None and self.compression:
            raise InputError(f"{self.path}: the {self.compression} data holds a {inner} file, not {self.kind}: "
                             f"{'name the inner file .parquet' if inner == 'parquet' else 'unpack it'}")
        stats = TextStats(self.path)
        stats.decode(content[:HEAD_BYTES], "in the first bytes")
        stats.check(final=True)
        if self.kind == "jsonl":  # every whole line of the head
            lines = content.split(b"\n")
            for lineno, line in enumerate(lines if whole else lines[:-1], 1):
                if line.strip():
                    _json_text(line.decode("utf-8", errors="replace"), self.path, lineno, self.options.text_field)

    def _check_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.ParquetFile(self.path).schema_arrow
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"{self.path}: not a readable Parquet file ({err}); copy it again") from err
        field = self.options.text_field
        if field not in schema.names:
            raise InputError(f"{self.path}: no column '{field}' (columns: {', '.join(schema.names)}); pass "
                             "--text_field NAME")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise InputError(f"{self.path}: column '{field}' holds {kind}, not text; pass --text_field NAME of a "
                             "string column")

    def documents(self) -> Iterator[Document]:
        if self.kind == "parquet":
            yield from self._parquet_documents()
            return
        raw, stream = self._open()
        stats = TextStats(self.path)
        try:
            with raw, stream:
                if self.kind == "jsonl":
                    for lineno, line in enumerate(stream, 1):
                        self.consumed = raw.tell()
                        line = line.removeprefix(BOM) if lineno == 1 else line
                        if line.strip():
                            text = _json_text(stats.decode(line, f"on line {lineno}"), self.path, lineno,
                                              self.options.text_field)
                            yield Document(text, None, f"{self.path.name}:{lineno}")
                elif self.options.separator is None:
                    text = stats.decode(stream.read().removeprefix(BOM), "")
                    self.consumed = raw.tell()
                    yield Document(text, None, self.path.name)
                else:
                    yield from self._separated(raw, stream, stats)
        except _decompress_errors() as err:
            raise self._broken(err) from err
        stats.finish()
        self.consumed = self.size

    def _separated(self, raw: Any, stream: Any, stats: TextStats) -> Iterator[Document]:
        # split the bytes: a UTF-8 separator never matches inside another character
        sep, buf, piece = self.options.separator.encode("utf-8"), b"", 0
        while True:
            block = stream.read(BLOCK_BYTES)
            block = block.removeprefix(BOM) if piece == 0 and not buf else block
            self.consumed = raw.tell()
            pieces = (buf + block).split(sep)
            buf = pieces.pop() if block else b""  # the last piece may go on in the next block
            for chunk in pieces:
                yield Document(stats.decode(chunk, f"in document {piece}"), None, f"{self.path.name}#{piece}")
                piece += 1
            if not block:
                return

    def _parquet_documents(self) -> Iterator[Document]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        rows, total = 0, max(pf.metadata.num_rows, 1)
        for batch in pf.iter_batches(batch_size=1024, columns=[self.options.text_field]):
            column = batch.column(0)
            if column.null_count:
                first = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
                raise InputError(f"{self.path}: row {rows + first} has no text (null in column "
                                 f"'{self.options.text_field}'); drop such rows, or pass --text_field NAME")
            for i, text in enumerate(column.to_pylist()):
                yield Document(text, None, f"{self.path.name}#{rows + i}")
            rows += len(column)
            self.consumed = self.size * rows // total
        self.consumed = self.size

    def inputs(self) -> list[Path]:
        return [self.path]


def _json_text(line: str, path: Path, lineno: int, field: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}:{lineno}: not JSON ({err.msg} at column {err.colno}); each line of a JSONL file "
                         f"is one JSON object with a string field '{field}'") from err
    if not isinstance(row, dict):
        raise InputError(f"{path}:{lineno}: a JSON {type(row).__name__}, not an object; each line of a JSONL file "
                         f"is one JSON object with a string field '{field}'")
    if field not in row:
        shown = ", ".join(list(row)[:12]) or "none"
        raise InputError(f"{path}:{lineno}: no field '{field}' (fields: {shown}); pass --text_field NAME")
    text = row[field]
    if not isinstance(text, str):
        raise InputError(f"{path}:{lineno}: field '{field}' holds a JSON {type(text).__name__}, not a string; pass "
                         "--text_field NAME of a text field")
    return text


def hidden(path: Path, root: Path) -> bool:
    """A file under a hidden folder, or hidden itself (`.git`, `.cache`, editor files)."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def kind_of(path: Path) -> tuple[str, str | None] | None:
    """(kind, compression) by the file name, or None for a name this reader does not know."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = KINDS.get(suffixes[-1]) if suffixes else None
    if kind is None or (kind == "parquet" and compression):
        return None
    return kind, compression
