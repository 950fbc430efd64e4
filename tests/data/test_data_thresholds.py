"""Documents at and around every size threshold of the readers come out of the shards byte for byte (issue 52).

A reader cuts, buffers, sniffs or checks its input at sizes of its own (SIZES, read from the modules that hold
them): a partly read line taken for a whole one (issue 52: a first JSONL line between HEAD_BYTES and
CHECK_LINE_BYTES was refused as "Extra data"), a character or escape cut by a block, a document dropped or
doubled where a batch ends, would change the text. So for every format, three documents of T-1, T and T+1 (plus
an offset) in one measure of T (bytes of the stream, bytes of the text, characters) stand first, in the middle
or last (consecutive in the first and last layouts, between short ones in the middle), each with a unit (a 2-,
3- or 4-byte character, a JSON escape, a surrogate pair) across the boundary T from the document's start or
the next multiple of T in the stream; `prepare` (byte tokenizer) writes them, and the shards, read back, hold
exactly those texts. Hypothesis draws the rest; every threshold is an explicit example for every format at its
real size. The sizes too large to cross here (ARROW_BATCH_BYTES, RUNNING_RATIO_BYTES, PART_BYTES) and the
counts are crossed with every threshold shrunk (`test_every_document_byte_for_byte_at_shrunk_thresholds`).
"""

from __future__ import annotations

import _compression
import bz2
import csv
import gzip
import io
import json
import lzma
import re
import sys
from pathlib import Path

import pytest
from helpers.prepare import split_documents
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lrattn_lightning.data as data_package
from lrattn_lightning.data import arrow, delimited, documents, formats, jsonlines, pieces, pipeline, split
from lrattn_lightning.data.prepare import prepare

# (module, name, measure): a size the readers cut, buffer, sniff or check at; its value is read from the module
# when a test runs. The measure: "stream" (bytes of the file's content, a JSONL line's framing included), "text"
# (UTF-8 bytes of a document's text), "chars" (characters of it).
SIZES = [
    (documents, "HEAD_BYTES", "stream"),  # the sniff: magic bytes, text or not, the first lines checked
    (formats, "CHECK_LINE_BYTES", "stream"),  # of a first JSONL line longer than the head, what check parses
    (jsonlines, "LONG_LINE", "stream"),  # a longer JSONL line is parsed as it streams, read this much at a time
    (formats, "BLOCK_BYTES", "stream"),  # read size of text files
    (delimited, "CSV_BLOCK_BYTES", "stream"),  # what pyarrow's CSV reader parses at a time (a longer row grows it)
    (formats, "RATIO_BYTES", "stream"),  # decompressed bytes sampled for the ratio
    (formats, "RATIO_PIECE", "stream"),  # compressed bytes fed at a time for it
    (io, "DEFAULT_BUFFER_SIZE", "stream"),  # the buffer of open() and of the zstd stream's BufferedReader
    (_compression, "BUFFER_SIZE", "stream"),  # gzip's, bz2's and lzma's read size
    (documents, "LONG_CHARS", "chars"),  # a longer document is spooled
    (documents, "BLOCK_CHARS", "chars"),  # a spooled document is read back in blocks of this size
    (arrow, "BLOCK_BYTES", "text"),  # a long Parquet/Arrow value is decoded this many bytes at a time
    (split, "BLOCK_BYTES", "chars"),  # a block of documents split together
    (pipeline, "BATCH_BYTES", "chars"),  # what a worker gets at once
    (pipeline, "ITEM_TOKENS", "text"),  # a litdata item (byte tokenizer: a token a byte)
    (pieces, "PIECE_CHARS", "chars"),  # a long document's pieces
    (pieces, "WINDOW", "chars"),  # the tokenizer's check around a cut
]
# too large to cross at their real size in a unit test: crossed in the shrunk test, with the counts
LARGE = [(arrow, "ARROW_BATCH_BYTES", "text"), (formats, "RUNNING_RATIO_BYTES", "stream"),
         (pipeline, "PART_BYTES", "chars")]
COUNTS = {"BATCH_DOCUMENTS": 2, "BLOCK_DOCUMENTS": 3}  # documents, not sizes: every layout crosses them shrunk
NOT_READER_SIZES = {  # int constants of lrattn_lightning.data that no reader cuts a user's text at
    "MAX_DEPTH": "JSON nesting, a refusal", "MAX_TOKEN": "keys and numbers, not text; a refusal",
    "_TAIL": "the longest JSON escape, the parser's unit, not a size", "TRIES": "cut candidates (not the byte tokenizer)",
    "TASK_TEXT_BYTES": "the eval tasks' sample of the corpus", "FORMAT_VERSION": "the layout's version",
    "MIN_FRAGMENT_CHARS": "the built-in corpora's cleaning", "DOCUMENT_TARGET_CHARS": "the built-in corpora's cleaning",
    "CLOZE_CONTEXT_WORDS": "eval tasks", "CLOZE_CONTINUATION_WORDS": "eval tasks", "CLOZE_PER_DOCUMENT": "eval tasks",
    "CLOZE_CHOICES": "eval tasks", "PERPLEXITY_MAX_CHARS": "eval tasks",
    "BYTES_PER_ENTRY": "a tokenizer.json's size limit", "SLACK_BYTES": "a tokenizer.json's size limit",
    "GROWTH": "the factor a CSV block grows by, not a size (the grown blocks are crossed with CSV_BLOCK_BYTES)"}
# shrunk: distinct small values (a name held by several modules gets the same one; BLOCK_BYTES one per module)
SMALL = {"HEAD_BYTES": 64, "CHECK_LINE_BYTES": 100, "LONG_LINE": 80, "RATIO_BYTES": 90, "RATIO_PIECE": 7,
         "RUNNING_RATIO_BYTES": 120, "LONG_CHARS": 72, "BLOCK_CHARS": 48, "BATCH_BYTES": 200, "ITEM_TOKENS": 50,
         "PIECE_CHARS": 128, "WINDOW": 16, "CSV_BLOCK_BYTES": 40, "_REGIONS": (32, 64, 128), "ARROW_BATCH_BYTES": 110, "PART_BYTES": 1000,
         **COUNTS}
SMALL_BLOCK_BYTES = {formats: 56, arrow: 30, split: 150}

FORMATS = ["jsonl", "jsonl.gz", "jsonl.zst", "jsonl.bz2", "jsonl.xz", "txt files", "txt with a separator", "parquet",
           "save_to_disk", "hf:DIR", "csv", "tsv.gz"]
SEPARATOR = "\n<|doc|>\n"
# a unit across a boundary: multi-byte UTF-8, characters JSON escapes (\n \" \\ \u0001), surrogate pairs (JSON with
# ensure_ascii), a line separator JSON leaves raw, CR LF
UNITS = ["é", "€", "😀", "😀😀", "\n", '"', "\\", "\x01", "\u2028", "\r\n", "é😀\"€"]
FILLERS = ["a", "é", "€", "😀", "x\n"]  # never only whitespace: a blank document is skipped
LAYOUTS = {"first": "TTTss", "middle": "sTsTsTs", "last": "ssTTT"}  # T: a target document, s: a short one


def data_modules() -> list:
    return [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith(data_package.__name__ + ".")]


def value_of(module, name: str) -> int:
    return getattr(module, name)


# ------------------------------------------------------------------------------ the corpus and its files

def encoded(text: str, fmt: str, ascii_json: bool) -> bytes:
    """A document's text as its file holds it (a JSONL string without its quotes)."""
    if fmt.startswith("jsonl"):
        return json.dumps(text, ensure_ascii=ascii_json)[1:-1].encode()
    return text.encode()


def measure(text: str, how: str, fmt: str, ascii_json: bool) -> int:
    if how == "chars":
        return len(text)
    return len(encoded(text, fmt, ascii_json) if how == "stream" else text.encode())


def fill(n: int, filler: str, how: str, fmt: str, ascii_json: bool) -> str:
    """Text of exactly `n` in the measure: fillers, then ASCII."""
    n = max(n, 0)
    q, r = divmod(n, measure(filler, how, fmt, ascii_json))
    return filler * q + "a" * r


def framing(fmt: str, how: str, last: bool, newline: bool) -> tuple[int, int]:
    """The bytes before and after a document's text in the stream (JSONL: `{"text": "` and `"}\\n`)."""
    if how != "stream" or not fmt.startswith("jsonl"):
        return 0, 0
    return len('{"text": "'), len('"}') + (1 if newline or not last else 0)


def corpus(fmt: str, size: int, how: str, delta: int, unit: str, cut: int, filler: str, layout: str, anchor: str,
           ascii_json: bool, bom: bool, newline: bool) -> list[str]:
    """The documents: targets of size+delta-1, size+delta, size+delta+1 (in `how`), each with `unit` across the
    boundary `size` from its start (anchor "doc") or the next multiple of `size` in the stream (anchor "stream":
    bytes of the file or line, as the readers see them), `cut` of the unit's measure before it."""
    plan, docs, start, targets = LAYOUTS[layout], [], 3 if bom and fmt in STREAMS else 0, 0
    deltas = [delta - 1, delta, delta + 1][:: -1 if layout == "last" else 1]
    unit_size = measure(unit, how, fmt, ascii_json)
    cut = min(cut, unit_size)
    for i, kind in enumerate(plan):
        last = i == len(plan) - 1
        if kind == "s":
            text = f"short {i}: naïve 日本 😀 \"q\"\n"
        else:
            before, after = framing(fmt, how, last, newline)
            total = size + deltas[targets] - before - after
            boundary = size
            if anchor == "stream" and how == "stream" and fmt in STREAMS:
                boundary = (start // size + 1) * size - start
            pre = fill(boundary - before - cut, filler, how, fmt, ascii_json)
            post = fill(total - measure(pre, how, fmt, ascii_json) - unit_size, filler, how, fmt, ascii_json)
            text, targets = pre + unit + post, targets + 1
            if not text.strip():  # a size below its framing holds no filler, and a blank document would be skipped
                text += filler
        docs.append(text)
        start += len(line_of(text, fmt, ascii_json, last, newline)) if fmt.startswith("jsonl") else len(text.encode())
        if fmt == "txt with a separator" and not last:
            start += len(SEPARATOR.encode())
        if fmt == "txt files":
            start = 0  # a file each
    return docs


STREAMS = ("jsonl", "jsonl.gz", "jsonl.zst", "jsonl.bz2", "jsonl.xz", "txt files", "txt with a separator")


def line_of(text: str, fmt: str, ascii_json: bool, last: bool, newline: bool) -> bytes:
    return b'{"text": "' + encoded(text, fmt, ascii_json) + b'"}' + (b"\n" if newline or not last else b"")


def write(docs: list[str], fmt: str, root: Path, ascii_json: bool, bom: bool, newline: bool) -> list[str]:
    """The documents as the --source of one format."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True)
    mark = b"\xef\xbb\xbf" if bom else b""
    lines = mark + b"".join(line_of(t, fmt, ascii_json, i == len(docs) - 1, newline) for i, t in enumerate(docs))
    compress = {"jsonl": bytes, "jsonl.gz": lambda b: gzip.compress(b, compresslevel=1),
                "jsonl.zst": zstandard.ZstdCompressor(level=1).compress, "jsonl.bz2": lambda b: bz2.compress(b, 1),
                "jsonl.xz": lambda b: lzma.compress(b, preset=0)}
    if fmt in compress:
        (root / f"c.{fmt}").write_bytes(compress[fmt](lines))
        return [str(root / f"c.{fmt}")]
    if fmt == "txt files":
        for i, text in enumerate(docs):
            (root / f"{i:03d}.txt").write_bytes((mark if i == 0 else b"") + text.encode())
        return [str(root)]
    if fmt == "txt with a separator":
        (root / "c.txt").write_bytes(mark + SEPARATOR.join(docs).encode())
        return [str(root / "c.txt")]
    if fmt in ("csv", "tsv.gz"):  # as Python's csv module writes them: quoted where a value needs it
        buf = io.StringIO(newline="")
        writer = csv.writer(buf, dialect="excel" if fmt == "csv" else "excel-tab")
        writer.writerow(["id", "text"])
        writer.writerows([i, text] for i, text in enumerate(docs))
        content = mark + buf.getvalue().encode()
        (root / f"c.{fmt}").write_bytes(gzip.compress(content, compresslevel=1) if fmt.endswith(".gz") else content)
        return [str(root / f"c.{fmt}")]
    table = pa.table({"text": pa.array(docs, pa.string())})
    if fmt == "parquet":
        pq.write_table(table, root / "c.parquet", row_group_size=3)
        return [str(root / "c.parquet")]
    if fmt == "hf:DIR":
        pq.write_table(table, root / "train.parquet", row_group_size=3)
        return [f"hf:{root}"]
    import datasets

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "saved"))
    return [str(root / "saved")]


def is_subsequence(part: list[str], whole: list[str]) -> bool:
    it = iter(whole)
    return all(any(doc == other for other in it) for doc in part)


def check_round_trip(tmp: Path, fmt: str, size: int, how: str, delta: int, unit: str, cut: int, filler: str,
                     layout: str, anchor: str, ascii_json: bool, bom: bool, newline: bool, chunk: str) -> None:
    docs = corpus(fmt, size, how, delta, unit, cut, filler, layout, anchor, ascii_json, bom, newline)
    source = write(docs, fmt, tmp / "in", ascii_json, bom, newline)
    prepare(source, tmp / "out", tokenizer="byte", val_fraction=0.3, chunk_bytes=chunk, cloze_items=0,
            perplexity_documents=0, progress=False, document_separator=SEPARATOR if "separator" in fmt else None)
    train, val = split_documents(tmp / "out", "train"), split_documents(tmp / "out", "val")
    assert all(d.strip() for d in docs)
    assert sorted(train + val) == sorted(docs), [(len(d), d[:40]) for d in sorted(set(train + val) ^ set(docs))]
    assert is_subsequence(train, docs) and is_subsequence(val, docs), "each split keeps the stream's order"


# ------------------------------------------------------------------------------ every threshold covered

def test_every_size_constant_of_the_readers_is_crossed_here():
    """A new size in lrattn_lightning.data (an int constant) is in SIZES, LARGE, COUNTS or NOT_READER_SIZES:
    a threshold cannot be added to a reader without this file crossing it."""
    known = {name for _, name, _ in SIZES + LARGE} | set(COUNTS) | set(NOT_READER_SIZES)
    import importlib
    import pkgutil

    found = set()
    for info in pkgutil.iter_modules(data_package.__path__):
        module = importlib.import_module(f"{data_package.__name__}.{info.name}")
        found |= {name for name, value in vars(module).items()
                  if re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name) and type(value) is int}
    assert found - known == set(), f"sizes of the readers no test crosses: {sorted(found - known)}"
    assert {"HEAD_BYTES", "LONG_LINE", "LONG_CHARS", "CHECK_LINE_BYTES", "BLOCK_BYTES"} <= found


# ------------------------------------------------------------------------------ at the real sizes

def real_examples() -> list[dict]:
    """Every format at every distinct (size, measure) of SIZES, the targets first (their boundary the file's and the
    line's), delta 0 (so T-1, T, T+1), a unit and a filler that change from one to the next."""
    distinct = sorted({(value_of(m, n), how, n) for m, n, how in SIZES}, key=lambda s: s[:2])
    seen, sizes = set(), []
    for value, how, name in distinct:
        if (value, how) not in seen:
            seen.add((value, how))
            sizes.append(name)
    out = []
    for f, fmt in enumerate(FORMATS):
        for s, name in enumerate(sizes):
            k = f + s
            out.append({"fmt": fmt, "threshold": name, "delta": 0, "unit": UNITS[k % len(UNITS)], "cut": k % 3,
                        "filler": FILLERS[k % len(FILLERS)], "layout": "first", "anchor": "doc",
                        "ascii_json": k % 2 == 0, "bom": False, "newline": True, "chunk": "1MB"})
    return out


SIZE_NAMES = {name: (module, how) for module, name, how in SIZES}


def with_examples(examples: list[dict]):
    def decorate(test):
        for ex in reversed(examples):
            test = example(**ex)(test)
        return test

    return decorate


RULES = {"fmt": st.sampled_from(FORMATS), "delta": st.integers(-14, 14), "unit": st.sampled_from(UNITS),
         "cut": st.integers(0, 12), "filler": st.sampled_from(FILLERS), "layout": st.sampled_from(list(LAYOUTS)),
         "anchor": st.sampled_from(["doc", "stream"]), "ascii_json": st.booleans(), "bom": st.booleans(),
         "newline": st.booleans(), "chunk": st.sampled_from(["64KB", "1MB", "8MB"])}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow, HealthCheck.data_too_large])
@given(threshold=st.sampled_from(list(SIZE_NAMES)), **RULES)
@with_examples(real_examples())
def test_every_document_byte_for_byte_at_every_threshold(offline, tmp_path_factory, fmt, threshold, delta, unit,
                                                        cut, filler, layout, anchor, ascii_json, bom, newline, chunk):
    module, how = SIZE_NAMES[threshold]
    check_round_trip(tmp_path_factory.mktemp("real"), fmt, value_of(module, threshold), how, delta, unit, cut,
                     filler, layout, anchor, ascii_json, bom, newline, chunk)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst"])
@pytest.mark.parametrize("threshold", ["HEAD_BYTES", "CHECK_LINE_BYTES", "LONG_LINE"])
def test_the_first_line_at_the_sniff_and_check_sizes(tmp_path, fmt, threshold):
    """Issue 52 as reported: first lines of 80 KiB (between HEAD_BYTES and CHECK_LINE_BYTES) and around each of the
    first-line sizes, also after a byte order mark, in every layout."""
    module, how = SIZE_NAMES[threshold]
    size = value_of(module, threshold)
    for n, (delta, layout, bom) in enumerate([(0, "first", False), (1, "last", True), (-1, "first", True)]):
        check_round_trip(tmp_path / str(n), fmt, size, how, delta, "😀", 1 + n, "y", layout, "stream", n == 1, bom,
                         n != 1, "8MB")
    docs = ["y" * 80 * 1024] * 4
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    root = tmp_path / "reported"
    root.mkdir()
    import zstandard

    data = {"jsonl": bytes, "jsonl.gz": gzip.compress, "jsonl.zst": zstandard.ZstdCompressor().compress}[fmt](lines)
    (root / f"t.{fmt}").write_bytes(data)
    prepare([str(root / f"t.{fmt}")], root / "o", tokenizer="byte", val_fraction=0.25, cloze_items=0,
            perplexity_documents=0, progress=False)
    assert split_documents(root / "o", "train") + split_documents(root / "o", "val") == docs


# ------------------------------------------------------------------------------ every threshold shrunk

@pytest.fixture
def shrunk(monkeypatch):
    """Every size of SIZES and LARGE, and the counts, small (BLOCK_BYTES one per module; imported names too)."""
    for module in data_modules():
        for name, value in SMALL.items():
            if name in vars(module):
                monkeypatch.setattr(module, name, value)
    for module, value in SMALL_BLOCK_BYTES.items():
        monkeypatch.setattr(module, "BLOCK_BYTES", value)


SHRUNK = {name: (module, how) for module, name, how in SIZES + LARGE}


def shrunk_examples() -> list[dict]:
    out = []
    for s, name in enumerate(SHRUNK):
        for d, delta in enumerate((-1, 0, 1)):
            k = s + d
            out.append({"fmt": FORMATS[k % len(FORMATS)], "threshold": name, "delta": delta, "unit": UNITS[k % len(UNITS)],
                        "cut": k % 4, "filler": FILLERS[k % len(FILLERS)], "layout": list(LAYOUTS)[k % 3],
                        "anchor": ["doc", "stream"][k % 2], "ascii_json": k % 2 == 1, "bom": k % 5 == 0,
                        "newline": k % 3 != 0, "chunk": "64KB"})
    # a size below a JSONL line's framing, its unit a newline: the document is the unit and a filler, never blank
    out.append({"fmt": "jsonl", "threshold": "RATIO_PIECE", "delta": 0, "unit": "\n", "cut": 0, "filler": "a",
                "layout": "first", "anchor": "doc", "ascii_json": False, "bom": False, "newline": False,
                "chunk": "64KB"})
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(threshold=st.sampled_from(list(SHRUNK)), **RULES)
@with_examples(shrunk_examples())
def test_every_document_byte_for_byte_at_shrunk_thresholds(offline, shrunk, tmp_path_factory, fmt, threshold, delta,
                                                           unit, cut, filler, layout, anchor, ascii_json, bom,
                                                           newline, chunk):
    module, how = SHRUNK[threshold]
    check_round_trip(tmp_path_factory.mktemp("shrunk"), fmt, value_of(module, threshold), how, delta, unit, cut, filler, layout, anchor,
                     ascii_json, bom, newline, chunk)
