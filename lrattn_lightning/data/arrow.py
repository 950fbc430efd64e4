"""Parquet files and Arrow tables (a saved Hugging Face dataset): their text column in bounded batches.

    check_parquet(path, field)           the schema has the string column (one line otherwise); its text bytes
    parquet_documents(path, field, ...)  Documents, row group by row group, in batches of about ARROW_BATCH_BYTES
    arrow_documents(column, ...)         the Documents of one Arrow string column, through the text policy

A batch holds about ARROW_BATCH_BYTES of text (its row count follows the column's average value size); pages are
read as they are needed, not a whole row group. Parquet keeps a value whole, so pyarrow holds the largest value
of a batch once (its bytes; never a copy as text: a value longer than LONG_CHARS is decoded in blocks from
Arrow's buffer into a spooled document).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.documents import LONG_CHARS, Document, Spool, TextBuilder, TextStats, Utf8Decoder
from lrattn_lightning.data.staging import check_stop

ARROW_BATCH_BYTES = 32 << 20  # text of a Parquet or Arrow batch (its row count follows the column's average size)
BLOCK_BYTES = 1 << 20  # a long value is decoded this many bytes at a time


def check_parquet(path: Path, field: str) -> int:
    """InputError unless `path` is a readable Parquet file with a string column `field`; its uncompressed bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise InputError(f"{path}: not a readable Parquet file ({err}); copy it again") from err
    schema = pf.schema_arrow
    if field not in schema.names:
        raise InputError(f"{path}: no column '{field}' (columns: {', '.join(schema.names)}); pass --text_field NAME")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise InputError(f"{path}: column '{field}' holds {kind}, not text; pass --text_field NAME of a string column")
    return _text_bytes(pf, field)


def parquet_documents(path: Path, field: str, spool: Spool | None,
                      read: Callable[[float], None]) -> Iterator[Document]:
    """The documents of a Parquet file's column `field`; `read(fraction of the rows)` after each batch."""
    import pyarrow.parquet as pq

    stats = TextStats(path)
    pf = pq.ParquetFile(path, buffer_size=BLOCK_BYTES)  # pages as they are needed, not a whole row group
    leaf, rows, total = _leaf(pf, field), 0, max(pf.metadata.num_rows, 1)
    for group in range(pf.metadata.num_row_groups):
        meta = pf.metadata.row_group(group)
        size = meta.column(leaf).total_uncompressed_size
        batch = max(1, min(1024, meta.num_rows * ARROW_BATCH_BYTES // max(size, 1)))
        for part in pf.iter_batches(batch_size=batch, row_groups=[group], columns=[field], use_threads=False):
            check_stop()
            yield from arrow_documents(part.column(0), rows, stats, spool, path, field)
            rows += part.num_rows
            read(rows / total)
    stats.finish()
    read(1.0)


def _leaf(pf: Any, field: str) -> int:
    """The Parquet column (leaf) of a top-level field."""
    schema = pf.metadata.schema
    return next(i for i in range(pf.metadata.num_columns) if schema.column(i).path == field)


def _text_bytes(pf: Any, field: str) -> int:
    """The uncompressed size of a Parquet file's text column (about its text's bytes)."""
    leaf = _leaf(pf, field)
    return sum(pf.metadata.row_group(g).column(leaf).total_uncompressed_size for g in range(pf.metadata.num_row_groups))


def arrow_documents(column: Any, first_row: int, stats: TextStats, spool: Spool | None, path: Path | str,
                    field: str) -> Iterator[Document]:
    """The documents of an Arrow string column (a Parquet or Arrow batch), rows numbered from `first_row`, through
    the text policy of `stats`: a valid column becomes Python strings at once; undecodable bytes are decoded row by
    row; a value longer than LONG_CHARS bytes is decoded in blocks straight from Arrow's buffer."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = Path(path).name
    if column.null_count:
        first = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
        raise InputError(f"{path}: row {first_row + first} has no text (null in column '{field}'); drop such rows, or "
                         "pass --text_field NAME")
    lengths = pc.binary_length(column).to_numpy(zero_copy_only=False)
    stats.bytes += int(lengths.sum())
    if not len(lengths) or lengths.max() <= LONG_CHARS:
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError:
            texts = None
        if texts is not None:
            for i, text in enumerate(texts):
                yield Document(text, None, f"{name}#{first_row + i}")
            return
    stats.bytes -= int(lengths.sum())  # counted again as each value is decoded
    raw = column.cast(pa.large_binary())
    for i, length in enumerate(lengths.tolist()):
        where, origin = f"in row {first_row + i}", f"{name}#{first_row + i}"
        if length <= LONG_CHARS:
            yield Document(stats.decode(raw[i].as_py(), where), None, origin)
            continue
        view, decoder, text = memoryview(raw[i].as_buffer()), Utf8Decoder(stats), TextBuilder(spool)
        for start in range(0, length, BLOCK_BYTES):
            check_stop()
            text.add(decoder.feed(bytes(view[start : start + BLOCK_BYTES]), where))
        text.add(decoder.feed(b"", where, final=True))
        yield text.document(None, origin)
