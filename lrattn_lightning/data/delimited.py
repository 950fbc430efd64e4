"""CSV and TSV files: the column `--text_field`, streamed by pyarrow's CSV reader a block at a time.

    check_csv(path, opener, field, delimiter)     the header has the column; the first block's rows parse, as text
    csv_documents(path, opener, field, ...)       Documents, CSV_BLOCK_BYTES of the file at a time

The first row is the header. Values are quoted as Excel and Python's `csv` module write them (`"a, ""b""\nc"`:
a quoted value may hold the delimiter, quotes and newlines), in TSV too; every value of the column is read as
text (undecodable bytes through the text policy of data/documents.py, as Parquet's). CSV has no null: an empty
cell is an empty document, skipped and counted like any. pyarrow parses whole rows only, so a row longer than a
block cannot be parsed in it: the file is then read again from its start with blocks four times larger, the rows
already given skipped (memory follows the longest row, as Parquet's holds its longest value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.data.arrow import arrow_documents
from lrattn_lightning.data.documents import Document, Spool, TextStats
from lrattn_lightning.data.staging import check_stop

CSV_BLOCK_BYTES = 1 << 20  # what pyarrow's CSV reader parses at a time (grown for a longer row)
GROWTH = 4  # a row longer than the block: the block this many times larger, and the file read again

Opener = Callable[[], tuple[Any, Any]]  # (the raw file, a binary stream of its decompressed content)


class _Straddles(Exception):
    """A row longer than the block."""


class _Reader:
    """pyarrow's streaming CSV reader over one opening of the file; its errors as one line."""

    def __init__(self, path: Path, stream: Any, field: str | None, delimiter: str, block: int, typed: bool) -> None:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        self.path, self.delimiter, self.bad = path, delimiter, []

        def invalid(row: Any) -> str:
            self.bad.append(row)
            return "error"

        columns = {} if field is None else {"include_columns": [field]}
        if typed and field is not None:
            columns["column_types"] = {field: pa.string()}
        self._reader = self._call(lambda: pcsv.open_csv(
            stream, read_options=pcsv.ReadOptions(block_size=block, use_threads=False),
            parse_options=pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True, invalid_row_handler=invalid),
            convert_options=pcsv.ConvertOptions(check_utf8=False, **columns)))
        self.schema = self._reader.schema

    def next(self) -> Any:
        """The next batch, or None at the end."""
        try:
            return self._call(self._reader.read_next_batch)
        except StopIteration:
            return None

    def _call(self, work: Callable[[], Any]) -> Any:
        import pyarrow as pa

        try:
            return work()
        except pa.ArrowInvalid as err:
            text = " ".join(str(err).split())
            if "straddl" in text:
                raise _Straddles from err
            if self.bad:
                row = self.bad[0]
                raise InputError(f"{self.path}: row {row.number} (the header is row 1) has {row.actual_columns} "
                                 f"value(s), the header {row.expected_columns}: {row.text[:60]!r}; quote values that "
                                 f"hold {self.delimiter!r} (\"a{self.delimiter}b\")") from err
            if "Empty CSV" in text:
                raise InputError(f"{self.path}: empty, not even a header row; give the first row the column names "
                                 "(e.g. text)") from err
            raise InputError(f"{self.path}: not readable as {_name(self.delimiter)} ({text[:200]}); fix the file, "
                             "or convert it to JSONL or Parquet") from err


def _name(delimiter: str) -> str:
    return "TSV" if delimiter == "\t" else "CSV"


def _open(path: Path, opener: Opener, field: str | None, delimiter: str, block: int, typed: bool,
          ) -> Iterator[tuple[Any, _Reader, int]]:
    """(stream, reader, block) for each opening of the file, the block grown while a row straddles it (the
    caller goes on to the next opening after a _Straddles of its own)."""
    while True:
        raw, stream = opener()
        with raw, stream:
            try:
                reader = _Reader(path, stream, field, delimiter, block, typed)
            except _Straddles:
                block *= GROWTH
                continue
            yield stream, reader, block
            block *= GROWTH


def check_csv(path: Path, opener: Opener, field: str, delimiter: str) -> None:
    """InputError unless the header names `field` (else: the columns, closest first) and the column's first rows
    read as text (a column pyarrow infers as numbers, dates or booleans is not a corpus)."""
    import pyarrow as pa

    for _, reader, _ in _open(path, opener, None, delimiter, CSV_BLOCK_BYTES, typed=False):
        names = reader.schema.names
        if field not in names:
            raise InputError(f"{path}: no column '{field}' in the header (columns, closest first: "
                             f"{', '.join(closest_names(field, names, n=len(names), cutoff=0.0))}); pass "
                             "--text_field NAME")
        kind = reader.schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_null(kind)):
            raise InputError(f"{path}: column '{field}' holds {kind} in its first rows, not text; pass --text_field "
                             "NAME of a text column")
        reader.next()  # the first block's rows (a row of too many values there is one line now)
        return


def csv_documents(path: Path, opener: Opener, field: str, delimiter: str, spool: Spool | None,
                  read: Callable[[Any], None]) -> Iterator[Document]:
    """The documents of the column `field`, in order; `read(stream)` after each batch (the progress bar)."""
    stats, done = TextStats(path), 0
    for stream, reader, _ in _open(path, opener, field, delimiter, CSV_BLOCK_BYTES, typed=True):
        seen = 0  # rows of this opening: the first `done` were given by an earlier one
        try:
            while (batch := reader.next()) is not None:
                check_stop()
                column = batch.column(0)
                if seen + len(column) > done:
                    column = column.slice(done - seen)
                    yield from arrow_documents(column, done, stats, spool, path, field)
                    done += len(column)
                seen += batch.num_rows
                read(stream)
        except _Straddles:
            continue
        stats.finish()
        return
