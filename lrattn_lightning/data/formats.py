"""A researcher's own corpus: files in the formats corpora come in, checked by their content, read as a stream.

    kind_of(path) -> (kind, compression)   by the file name
    FileInput.check()                      before anything is written: the content is what the name says
    FileInput.documents(spool)             Documents, streamed in blocks of at most 1 MiB whatever a document's
                                           or a file's size (a longer document waits in `spool`: data/documents.py)

Formats, by the file name: `.parquet` (the column `--text_field`, row group by row group, with pyarrow),
`.jsonl`/`.ndjson` (one JSON object a line, its field `--text_field`), `.txt` (one document a file, or pieces
between `--document_separator`), `.csv`/`.tsv` (the column `--text_field` under a header row, streamed by pyarrow:
data/delimited.py); all but `.parquet` also compressed as `.gz`, `.zst`, `.bz2`, `.xz`. A Hugging Face dataset
by name (`hf:NAME`, through `datasets`, from its cache or the hub) or saved with `save_to_disk`.

Data is never guessed: a file whose magic bytes say Parquet, gzip, zstd, bz2, xz, zip or Arrow under a name
that says otherwise, text holding NUL bytes or mostly undecodable bytes, a line that is not a JSON object, a
missing or non-string field: one InputError naming the file, the line or row, and the fix. One text policy for
every format (TextStats): undecodable bytes that are rare in real text become U+FFFD with one warning saying how
many, which fraction and where; more, and the file is refused in one line naming it and the first place.
Documents are read as they are (no cleaning); only documents that are empty or all whitespace are skipped.

Memory does not grow with a document or a file: text files are read in BLOCK_BYTES blocks, a JSONL line longer
than LONG_LINE is parsed as it streams (data/jsonlines.py), Parquet in batches (data/arrow.py), CSV and TSV in
blocks (data/delimited.py).
`consumed` counts the decompressed bytes read; `expected()` estimates their total from the compression ratio
seen so far (the progress bar's ETA, and the free-space check before anything is written).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.arrow import check_parquet, parquet_documents
from lrattn_lightning.data.delimited import check_csv, csv_documents
from lrattn_lightning.data.documents import HEAD_BYTES, Document, Spool, TextBuilder, TextStats, Utf8Decoder
from lrattn_lightning.data.jsonlines import LONG_LINE, line_text, long_line_text, rest_of_line
from lrattn_lightning.data.staging import check_stop

KINDS = {".txt": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"}
DELIMITERS = {"csv": ",", "tsv": "\t"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_SUFFIX_OF = {"gzip": ".gz", "zstd": ".zst", "bz2": ".bz2", "xz": ".xz"}
BLOCK_BYTES = 1 << 20  # read size of text files
RATIO_BYTES = 1 << 20  # decompressed bytes `check` makes to estimate a compressed file's ratio
RATIO_PIECE = 1 << 12  # compressed bytes fed at a time for it
RUNNING_RATIO_BYTES = 4 << 20  # compressed bytes read after which their own ratio replaces the sampled one
CHECK_LINE_BYTES = 1 << 19  # of a first JSONL line longer than the head, what `check` parses before any work
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark some editors put first: not part of the text
SUPPORTED = ".parquet, .jsonl/.ndjson, .csv, .tsv or .txt (all but .parquet also as .gz, .zst, .bz2, .xz)"


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


def _decompress_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError)


class FileInput:
    """One file of a corpus: its kind (text, jsonl, parquet) and compression come from its name, and
    `check` makes sure the content agrees. `consumed` (decompressed bytes read) and `expected()` drive the
    progress bar and the free-space check."""

    def __init__(self, path: Path, kind: str, compression: str | None, options: ReadOptions) -> None:
        self.path, self.kind, self.compression, self.options = path, kind, compression, options
        self.size = path.stat().st_size
        self.consumed = 0
        self.ratio = 1.0  # decompressed bytes per byte of the file, as far as they have been seen
        self._raw: Any = None  # the open file while it is read (its position refines the ratio)

    def describe(self) -> str:
        return f"{self.kind}{'.' + self.compression if self.compression else ''}"

    def expected(self) -> int:
        """The decompressed size: exact for plain files, estimated from the ratio seen so far for the others."""
        if not self.compression:
            return self.size
        raw = self._raw
        if raw is not None and not raw.closed and raw.tell() >= RUNNING_RATIO_BYTES:  # past a decompressor's read-ahead
            self.ratio = self.consumed / raw.tell()
        return max(self.consumed, int(self.size * self.ratio))

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
        """InputError unless the content is what the name says: magic bytes, text, and the first record. Reads at
        most HEAD_BYTES + CHECK_LINE_BYTES of the content (and decompresses RATIO_BYTES of it apart, for the
        ratio), whatever the file's size."""
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
                whole = not stream.peek(1)
                long_first = self.kind == "jsonl" and b"\n" not in content and not whole
                if long_first:
                    check_long_first_line(self.path, self.options.text_field, content.removeprefix(BOM), stream)
        except _decompress_errors() as err:
            raise self._broken(err) from err
        if self.compression:
            self.ratio = sample_ratio(self.path, self.compression)
        content = content.removeprefix(BOM)
        inner = magic_of(content[:16])
        if inner is not None and self.compression:
            raise InputError(f"{self.path}: the {self.compression} data holds a {inner} file, not {self.kind}: "
                             f"{'name the inner file .parquet' if inner == 'parquet' else 'unpack it'}")
        stats = TextStats(self.path)
        stats.decode(content[:HEAD_BYTES], "in the first bytes")
        stats.check(final=True)
        if self.kind == "jsonl" and not long_first:  # every whole line of the head
            lines = content.split(b"\n")
            for lineno, line in enumerate(lines if whole else lines[:-1], 1):
                if line.strip():
                    line_text(line.decode("utf-8", errors="replace"), f"{self.path}:{lineno}", self.options.text_field)
        if self.kind in DELIMITERS:  # the header and the column's first rows
            check_csv(self.path, self._open, self.options.text_field, DELIMITERS[self.kind])

    def _check_parquet(self) -> None:
        self.ratio = check_parquet(self.path, self.options.text_field) / max(self.size, 1)

    def documents(self, spool: Spool | None = None) -> Iterator[Document]:
        if self.kind == "parquet":
            yield from self._parquet_documents(spool)
            return
        if self.kind in DELIMITERS:
            yield from self._csv_documents(spool)
            return
        raw, stream = self._open()
        self._raw, stats, self.consumed = raw, TextStats(self.path), 0  # (BPE training reads the corpus twice)
        try:
            with raw, stream:
                if self.kind == "jsonl":
                    yield from self._jsonl(stream, stats, spool)
                elif self.options.separator is None:
                    yield from self._whole(stream, stats, spool)
                else:
                    yield from self._separated(stream, stats, spool)
        except _decompress_errors() as err:
            raise self._broken(err) from err
        stats.finish()
        self.ratio = self.consumed / max(self.size, 1)

    def _read(self, stream: Any, first: bool) -> bytes:
        """The next block (a signal stops the work here: a block takes milliseconds)."""
        check_stop()
        block = stream.read(BLOCK_BYTES)
        self.consumed += len(block)
        return block.removeprefix(BOM) if first else block

    def _jsonl(self, stream: Any, stats: TextStats, spool: Spool | None) -> Iterator[Document]:
        field, lineno = self.options.text_field, 0
        while line := stream.readline(LONG_LINE):
            lineno += 1
            self.consumed += len(line)
            # a whole line (the last may have no newline): judged on what readline gave, before a BOM is taken off
            whole = line.endswith(b"\n") or len(line) < LONG_LINE
            line = line.removeprefix(BOM) if lineno == 1 else line
            where = f"{self.path}:{lineno}"
            if whole:
                if line.strip():
                    text = line_text(stats.decode(line, f"on line {lineno}"), where, field)
                    if b"\\ud" in line or b"\\uD" in line:
                        text = stats.surrogates(text, f"on line {lineno}")
                    yield Document(text, None, f"{self.path.name}:{lineno}")
                continue
            built = self._long_line(stream, line, lineno, stats, spool)
            if built is not None:
                yield built.document(None, f"{self.path.name}:{lineno}")

    def _long_line(self, stream: Any, first: bytes, lineno: int, stats: TextStats,
                   spool: Spool | None) -> TextBuilder | None:
        """A line longer than LONG_LINE, parsed as it streams (data/jsonlines.py), read LONG_LINE at a time."""
        rest = rest_of_line(stream)

        def more() -> bytes:
            check_stop()
            block = rest(LONG_LINE)
            self.consumed += len(block)
            return block

        return long_line_text(first, more, self.path, lineno, self.options.text_field, stats, lambda: TextBuilder(spool))

    def _whole(self, stream: Any, stats: TextStats, spool: Spool | None) -> Iterator[Document]:
        """One document: the whole file."""
        decoder, text = Utf8Decoder(stats), TextBuilder(spool)
        first = True
        while block := self._read(stream, first):
            text.add(decoder.feed(block, "", offset=self.consumed - len(block)))
            first = False
        text.add(decoder.feed(b"", "", final=True, offset=self.consumed))
        yield text.document(None, self.path.name)

    def _separated(self, stream: Any, stats: TextStats, spool: Spool | None) -> Iterator[Document]:
        """The pieces between separators: the bytes are split (a UTF-8 separator never matches inside another
        character); a block's last len(separator) - 1 bytes wait for the next, where a separator may go on."""
        sep = self.options.separator.encode("utf-8")
        piece, buf, first = 0, b"", True
        decoder, text = Utf8Decoder(stats), TextBuilder(spool)
        while True:
            block = self._read(stream, first)
            first, buf, start = False, buf + block, 0
            while (found := buf.find(sep, start)) >= 0:
                text.add(decoder.feed(buf[start:found], f"in document {piece}", final=True))
                yield text.document(None, f"{self.path.name}#{piece}")
                decoder, text, piece, start = Utf8Decoder(stats), TextBuilder(spool), piece + 1, found + len(sep)
            if not block:
                text.add(decoder.feed(buf[start:], f"in document {piece}", final=True))
                yield text.document(None, f"{self.path.name}#{piece}")
                return
            cut = max(start, len(buf) - len(sep) + 1)
            text.add(decoder.feed(buf[start:cut], f"in document {piece}"))
            buf = buf[cut:]

    def _parquet_documents(self, spool: Spool | None) -> Iterator[Document]:
        def read(fraction: float) -> None:
            self.consumed = int(self.size * self.ratio * fraction)

        yield from parquet_documents(self.path, self.options.text_field, spool, read)

    def _csv_documents(self, spool: Spool | None) -> Iterator[Document]:
        self.consumed = 0

        def read(stream: Any) -> None:
            self.consumed = max(self.consumed, stream.tell())  # (a file read again for a long row starts over)

        try:
            yield from csv_documents(self.path, self._open, self.options.text_field, DELIMITERS[self.kind], spool, read)
        except _decompress_errors() as err:
            raise self._broken(err) from err
        self.ratio = self.consumed / max(self.size, 1)

    def inputs(self) -> list[Path]:
        return [self.path]


def sample_ratio(path: Path, compression: str) -> float:
    """Decompressed bytes per byte of a compressed file over its first RATIO_BYTES of output: the file fed to a
    decompressor in small pieces, so the input it took is known within a piece (a stream reads ahead)."""
    import zlib

    import zstandard

    make = {"gzip": lambda: zlib.decompressobj(31), "bz2": bz2.BZ2Decompressor, "xz": lzma.LZMADecompressor,
            "zstd": lambda: zstandard.ZstdDecompressor().decompressobj()}[compression]
    decompressor, taken, made = make(), 0, 0
    with open(path, "rb") as f:
        while made < RATIO_BYTES and not getattr(decompressor, "eof", False) and (piece := f.read(RATIO_PIECE)):
            taken += len(piece)
            made += len(decompressor.decompress(piece))
    return made / taken if taken and made else 1.0


def check_long_first_line(path: Path, field: str, content: bytes, stream: Any) -> None:
    """A first JSONL line longer than the head: its first CHECK_LINE_BYTES parsed as they stream (a refusal there
    is one line now; the rest is checked while it is read)."""
    left, rest = CHECK_LINE_BYTES - len(content), rest_of_line(stream)

    def more() -> bytes:
        nonlocal left
        if left <= 0:
            raise _Enough
        block = rest(min(left, BLOCK_BYTES))
        left -= len(block)
        return block

    try:
        long_line_text(content, more, path, 1, field, TextStats(path), _Unkept)
    except _Enough:
        pass


class _Unkept(TextBuilder):
    """The text `check` parses in a long first line: checked, not kept (whatever CHECK_LINE_BYTES and LONG_CHARS)."""

    def __init__(self) -> None:
        super().__init__(None)

    def add(self, text: str) -> None:
        pass


class _Enough(Exception):
    """`check` has parsed enough of a long first line."""


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
