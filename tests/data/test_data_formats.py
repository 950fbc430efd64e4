"""A researcher's own corpus (issue 29): every format it comes in gives the same dataset, and a file that is
not what its name says is refused in one line before anything is written.

The same documents (prose with unicode, blank lines and long lines, from the bundled stdlib docs) are written as
a folder of .txt files, JSONL (plain, .gz, .zst, .bz2, .xz), text split by a separator, Parquet (several row
groups), CSV and TSV (as Python's csv module writes them, plain, .gz, .zst; issue 52), a mixed folder, a Hugging Face dataset saved with `save_to_disk` and a local folder read through
`datasets.load_dataset` (`hf:DIR`): every one prepares to byte-identical shards. Refusals go through `lrattn`'s
own entry point (`cli.main`, in this process: one line on stderr, exit 2) and leave the output's folder as it was.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import json
import lzma
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.prepare import prepare_in, split_documents

from lrattn_lightning.data.corpora import iter_documents
from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.data.shards import read_meta

SEPARATOR = "\n<|doc|>\n"


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """240 documents of 200-1600 characters, each a little different (a counter line), none holding SEPARATOR."""
    texts = [d.text for d in iter_documents("stdlib-docs", max_documents=120)]
    docs = []
    for i in range(240):
        body = texts[i % len(texts)]
        start = (i * 37) % max(len(body) - 200, 1)
        docs.append(f"Document {i} — naïve café, 日本語.\n\n{body[start : start + 200 + (i * 53) % 1400]}")
    return docs


def write_all_formats(docs: list[str], root: Path) -> dict[str, list[str]]:
    """The documents in every format; {name: --source arguments}."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir()
    lines = "".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(docs)).encode()
    (root / "txt").mkdir()
    for i, text in enumerate(docs):
        (root / "txt" / f"doc-{i:04d}.txt").write_text(text, encoding="utf-8")
    (root / "docs.jsonl").write_bytes(lines)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (root / "docs.jsonl.bz2").write_bytes(bz2.compress(lines))
    (root / "docs.jsonl.xz").write_bytes(lzma.compress(lines))
    (root / "docs.txt.gz").write_bytes(gzip.compress(SEPARATOR.join(docs).encode()))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, root / "docs.parquet", row_group_size=50)
    (root / "mixed").mkdir()  # sorted by name: a.jsonl.zst (the first 100), b.parquet (the rest)
    (root / "mixed" / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines.splitlines(True)[:100])))
    pq.write_table(table.slice(100), root / "mixed" / "b.parquet", row_group_size=64)
    (root / "mixed" / "README.md").write_text("not corpus\n")  # left out, with a line
    (root / "hfdir").mkdir()
    pq.write_table(table, root / "hfdir" / "train.parquet")
    for name, dialect in (("docs.csv", "excel"), ("docs.tsv", "excel-tab")):
        table_text = delimited(docs, dialect)
        (root / name).write_bytes(table_text)
        (root / f"{name}.gz").write_bytes(gzip.compress(table_text))
        (root / f"{name}.zst").write_bytes(zstandard.ZstdCompressor().compress(table_text))
    import datasets

    datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))}).save_to_disk(str(root / "saved"))
    return {
        "txt folder": [str(root / "txt")],
        "jsonl": [str(root / "docs.jsonl")],
        "jsonl.gz": [str(root / "docs.jsonl.gz")],
        "jsonl.zst": [str(root / "docs.jsonl.zst")],
        "jsonl.bz2": [str(root / "docs.jsonl.bz2")],
        "jsonl.xz": [str(root / "docs.jsonl.xz")],
        "txt.gz with --document_separator": [str(root / "docs.txt.gz")],
        "parquet": [str(root / "docs.parquet")],
        "a folder mixing jsonl.zst and parquet": [str(root / "mixed")],
        "a glob": [str(root / "mixed" / "*.*[tl]")],  # a.jsonl.zst and b.parquet
        **{f"docs.{kind}{z}": [str(root / f"docs.{kind}{z}")] for kind in ("csv", "tsv") for z in ("", ".gz", ".zst")},
        "saved HF dataset": [str(root / "saved")],
        "hf:DIR (datasets.load_dataset)": [f"hf:{root / 'hfdir'}"],
    }


def delimited(docs: list[str], dialect: str, header: tuple[str, str] = ("id", "text")) -> bytes:
    """The documents as a CSV or TSV file with a header, an id column first (quoted where a value needs it)."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf, dialect=dialect)
    writer.writerow(header)
    writer.writerows([i, text] for i, text in enumerate(docs))
    return buf.getvalue().encode()


def shard_digest(out: Path) -> dict:
    meta = read_meta(out)
    chunks = {s: {n: r["sha256"] for n, r in meta["checksums"][s].items() if n != "index.json"} for s in ("train", "val")}
    counts = {s: {k: meta["splits"][s][k] for k in ("documents", "tokens", "bytes")} for s in ("train", "val")}
    return {"chunks": chunks, "counts": counts}


@pytest.fixture(scope="module")
def corpus(documents, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats") / "corpus"
    return root, write_all_formats(documents, root)


@pytest.fixture(scope="module")
def reference(documents, corpus):
    root, sources = corpus
    out = root.parent / "reference"
    prepare(sources["jsonl"], out, tokenizer="byte", chunk_bytes="64KB", cloze_items=20, perplexity_documents=20)
    return out


@pytest.mark.parametrize("name", ["txt folder", "jsonl.gz", "jsonl.zst", "jsonl.bz2", "jsonl.xz",
                                  "txt.gz with --document_separator", "parquet", "a folder mixing jsonl.zst and parquet",
                                  "a glob", "saved HF dataset", "hf:DIR (datasets.load_dataset)",
                                  *[f"docs.{k}{z}" for k in ("csv", "tsv") for z in ("", ".gz", ".zst")]])
def test_every_format_gives_the_same_shards(name, corpus, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _, sources = corpus
    out = tmp_path / "out"
    prepare(sources[name], out, tokenizer="byte", chunk_bytes="64KB", cloze_items=20, perplexity_documents=20,
            document_separator=SEPARATOR if "separator" in name else None)
    assert shard_digest(out) == shard_digest(reference)
    assert (out / "tasks" / "cloze.jsonl").read_bytes() == (reference / "tasks" / "cloze.jsonl").read_bytes()


def test_shards_hold_exactly_the_documents(documents, reference):
    """Read back independently: each chunk's tokens (after litdata's header) are the UTF-8 bytes of the documents
    of its split in order, each followed by EOS, and every document is in exactly one split."""
    meta = read_meta(reference)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(documents)
    seen = []
    for split in ("train", "val"):
        seen += split_documents(reference, split)
    assert sorted(seen) == sorted(documents)


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Some editors start UTF-8 files with EF BB BF: not part of the first document, and not a JSON error."""
    from lrattn_lightning.data.formats import ReadOptions
    from lrattn_lightning.data.sources import Corpus

    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + _lines(2))
    (tmp_path / "b.txt").write_bytes("\ufeffcaf\u00e9 text".encode())
    corpus = Corpus([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")], ReadOptions())
    corpus.check()
    assert [d.text for d in corpus.documents()] == ["document number 0 with some words",
                                                    "document number 1 with some words", "caf\u00e9 text"]


def test_meta_records_every_input_file_with_size_and_sha256(corpus, tmp_path):
    root, sources = corpus
    meta = prepare(sources["a folder mixing jsonl.zst and parquet"], tmp_path / "out", cloze_items=0,
                   perplexity_documents=0)
    records = meta["inputs"]["train"]
    assert [Path(r["file"]).name for r in records] == ["a.jsonl.zst", "b.parquet"]
    for record in records:
        raw = Path(record["file"]).read_bytes()
        assert record["bytes"] == len(raw) and record["sha256"] == hashlib.sha256(raw).hexdigest()
    assert records[0]["format"] == "jsonl.zstd" and records[1]["format"] == "parquet"
    assert meta["read"]["text_field"] == "text" and meta["split"] == {"by": "document", "seed": 0}


# ---------------------------------------------------------------------------------------------- refusals


run = prepare_in  # (conftest)


def _lines(n: int, field: str = "text") -> bytes:
    return "".join(json.dumps({field: f"document number {i} with some words"}) + "\n" for i in range(n)).encode()


def _parquet_bytes(tmp_path: Path, **columns) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), tmp_path / "x.parquet")
    return (tmp_path / "x.parquet").read_bytes()


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


REFUSALS = {  # name: (file name, content(tmp_path), what the one line must say)
    "Parquet named .jsonl": ("docs.jsonl", lambda t: _parquet_bytes(t, text=["a b c"] * 3),
                             "docs.jsonl: it is a Parquet file (magic bytes PAR1): name it docs.parquet"),
    "zstd named .jsonl": ("docs.jsonl", lambda t: _zstd(_lines(5)), "docs.jsonl: it is zstd-compressed (its magic bytes "
                          "say so): name it docs.jsonl.zst"),
    "gzip named .jsonl.zst": ("docs.jsonl.zst", lambda t: gzip.compress(_lines(5)), "name it docs.jsonl.gz"),
    "plain text named .jsonl.gz": ("docs.jsonl.gz", lambda t: _lines(5), "named gzip, but its magic bytes are not gzip's: "
                                   "drop the .gz suffix"),
    "bz2 named .txt": ("notes.txt", lambda t: bz2.compress(b"hello world " * 50), "name it notes.txt.bz2"),
    "xz named .txt": ("notes.txt", lambda t: lzma.compress(b"hello world " * 50), "name it notes.txt.xz"),
    "zip named .txt": ("notes.txt", lambda t: b"PK\x03\x04" + bytes(200), "it is a zip file, not text"),
    "binary named .txt": ("blob.txt", lambda t: np.random.default_rng(0).bytes(5000),
                          "blob.txt: binary content (a NUL byte in the first bytes), not text"),
    "mostly undecodable text": ("latin.txt", lambda t: ("caf\xe9 na\xefve \xe0 l'\xe9t\xe9 " * 400).encode("latin-1"),
                                "latin.txt: not UTF-8 text: "),
    "a line that is not JSON": ("docs.jsonl", lambda t: _lines(2) + b"{broken\n" + _lines(2),
                                "docs.jsonl:3: not JSON (Expecting property name enclosed in double quotes at column 2)"),
    "a missing field": ("docs.jsonl", lambda t: _lines(3, field="body"), "docs.jsonl:1: no field 'text' (fields: body); "
                        "pass --text_field NAME"),
    "a field that is not text": ("docs.jsonl", lambda t: b'{"text": 42}\n', "docs.jsonl:1: field 'text' holds a JSON int"),
    "a JSON array line": ("docs.jsonl", lambda t: b'["a", "b"]\n', "docs.jsonl:1: a JSON list, not an object"),
    "Parquet without the column": ("docs.parquet", lambda t: _parquet_bytes(t, body=["x"] * 3),
                                   "docs.parquet: no column 'text' (columns: body); pass --text_field NAME"),
    "Parquet with a number column": ("docs.parquet", lambda t: _parquet_bytes(t, text=[1, 2, 3]),
                                     "docs.parquet: column 'text' holds int64, not text"),
    "a truncated Parquet file": ("docs.parquet", lambda t: _parquet_bytes(t, text=["x"] * 3)[:-10],
                                 "docs.parquet: a Parquet file cut short (no PAR1 magic bytes at its end); copy it again"),
    "JSONL named .parquet": ("docs.parquet", lambda t: _lines(3), "docs.parquet: not a Parquet file (no Parquet magic "
                             "bytes (PAR1))"),
    "a truncated gzip file": ("docs.jsonl.gz", lambda t: gzip.compress(_lines(200))[:-30],
                              "docs.jsonl.gz: cannot read gzip data (EOFError"),
    "an unknown format": ("docs.xml", lambda t: b"<text>hello</text>\n", "docs.xml: unknown format (by its name)"),
    "CSV without the column": ("docs.csv", lambda t: b"id,txt,body\n1,a b,c d\n", "docs.csv: no column 'text' in the "
                               "header (columns, closest first: txt, id, body); pass --text_field NAME"),
    "a TSV column of numbers": ("docs.tsv", lambda t: b"text\tbody\n1\tx\n2\ty\n", "docs.tsv: column 'text' holds int64 "
                                "in its first rows, not text"),
    "a CSV row with a value too many": ("docs.csv", lambda t: b"id,text\n1,a b\n2,c, d\n", "docs.csv: row 3 (the header "
                                        "is row 1) has 3 value(s), the header 2: '2,c, d'"),
    "an empty CSV file": ("docs.csv", lambda t: b"", "docs.csv: empty, not even a header row"),
    "gzip named .csv": ("docs.csv", lambda t: gzip.compress(b"text\nhello\n"), "name it docs.csv.gz"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_file_that_is_not_what_its_name_says_is_one_line(case, tmp_path, capsys):
    name, content, needle = REFUSALS[case]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(content(tmp_path))
    before = sorted(p.name for p in tmp_path.iterdir())
    code, lines = run(["--source", f"in/{name}", "--out", "data/out"], tmp_path, capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lrattn: error: "), lines
    assert needle in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no data/, no staging folder


def test_a_bad_line_deep_in_a_file_leaves_nothing(tmp_path, capsys):
    """Found while streaming (after the checks of the first bytes): one line, and what was written is removed."""
    (tmp_path / "docs.jsonl").write_bytes(_lines(3000) + b"not json\n")
    code, lines = run(["--source", "docs.jsonl", "--out", "data/out"], tmp_path, capsys)
    assert code == 2 and len(lines) == 2 and lines[0] == "[lrattn prepare] reading docs.jsonl", lines
    assert "docs.jsonl:3001: not JSON" in lines[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "docs.jsonl"] and not any((tmp_path / "data").iterdir())


def test_rare_undecodable_bytes_are_a_warning_saying_how_many_and_where(tmp_path, capsys):
    text = "".join(f"line {i} of honest UTF-8 prose, naïve café.\n" for i in range(400)).encode()
    (tmp_path / "notes.txt").write_bytes(text[:5000] + b"\xff\xfe" + text[5000:])
    (tmp_path / "other.txt").write_bytes(text)
    code, lines = run(["--source", "notes.txt", "other.txt", "--out", "data/out", "--val_fraction", "0.5"],
                      tmp_path, capsys)
    warnings = [line for line in lines if "warning" in line]
    assert code == 0 and len(warnings) == 1, lines
    size = len(text) + 2
    assert f"notes.txt: 2 undecodable byte sequence(s) in {size:,} bytes ({2 / size:.4%}), first at byte 5000" in warnings[0]
    assert "iconv" in warnings[0]


# ---------------------------------------------------------------------------------------------- the split


def _val_texts(out: Path) -> list[str]:
    return split_documents(out, "val")


def test_the_split_is_by_document_whatever_the_file_layout(documents, tmp_path):
    """One file or ten: the same documents held out, exactly round(n * val_fraction) of them (by file, one file
    held 357 documents of which none could be held out, and ten files held out 14 %)."""
    layouts = {"one": [documents], "ten": [documents[i::10] for i in range(10)]}
    held = {}
    for name, files in layouts.items():
        folder = tmp_path / name
        folder.mkdir()
        for i, part in enumerate(files):
            (folder / f"part-{i:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        meta = prepare(str(folder), tmp_path / f"out-{name}", val_fraction=0.05, cloze_items=0, perplexity_documents=0)
        assert meta["splits"]["val"]["documents"] == round(len(documents) * 0.05) == 12
        held[name] = sorted(_val_texts(tmp_path / f"out-{name}"))
    assert held["one"] == held["ten"]
    other = prepare(str(tmp_path / "one"), tmp_path / "seeded", split_seed=7, cloze_items=0, perplexity_documents=0)
    assert other["splits"]["val"]["documents"] == 12 and sorted(_val_texts(tmp_path / "seeded")) != held["one"]


@pytest.mark.parametrize("n, fraction, held", [(2500, 0.05, 125), (2500, 0.003, 8), (2500, 0.0001, 1), (3, 0.05, 1)])
def test_the_split_holds_out_round_n_times_the_fraction(n, fraction, held):
    """Across blocks of 1000 documents the count stays exact (the rounding is of the running total); a tiny
    corpus still gets one validation document; the choice depends on the seed, not on the block's order."""
    from lrattn_lightning.data.documents import Document
    from lrattn_lightning.data.split import key_hash, sided

    docs = [Document(f"document {i}") for i in range(n)]
    sides = [side for _, side in sided(docs, fraction, 0)]
    assert sides.count("val") == held
    if n < 1000:  # one block: the lowest hashes are held out, in any order
        lowest = sorted(range(n), key=lambda i: key_hash(docs[i].text, 0))[:held]
        assert {i for i, s in enumerate(sides) if s == "val"} == set(lowest)
        assert sorted(d.text for d, s in sided(docs[::-1], fraction, 0) if s == "val") == sorted(docs[i].text for i in lowest)


def test_val_source_is_the_whole_validation_split(documents, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents[:200]))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents[200:]))
    meta = prepare(str(tmp_path / "train.jsonl"), tmp_path / "out", val_source=str(tmp_path / "val.jsonl"),
                   cloze_items=0, perplexity_documents=0)
    assert meta["splits"]["train"]["documents"] == 200 and meta["splits"]["val"]["documents"] == 40
    assert _val_texts(tmp_path / "out") == documents[200:] and meta["split"]["by"] == "val_source"
    assert [Path(r["file"]).name for r in meta["inputs"]["val"]] == ["val.jsonl"]
    with pytest.raises(ValueError, match="--val_fraction and --val_source exclude each other"):
        prepare(str(tmp_path / "train.jsonl"), tmp_path / "x", val_source=str(tmp_path / "val.jsonl"), val_fraction=0.1)


# ---------------------------------------------------------------------------------------------- progress


def test_progress_shows_documents_tokens_per_second_and_eta(corpus, tmp_path, capsys, monkeypatch):
    """A bar on a terminal (tqdm: bytes read of the total, elapsed<remaining, documents and tokens/s); in a batch
    job's log, a line every LOG_SECONDS with the same and the ETA."""
    from lrattn_lightning.data.pipeline import Progress

    _, sources = corpus
    prepare(sources["jsonl"], tmp_path / "bar", progress=True, cloze_items=0, perplexity_documents=0)
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "[lrattn prepare]: 100%|" in bar and " docs, " in bar and " tok/s" in bar, bar
    assert "240 docs" in bar and "<00:00" in bar  # elapsed<remaining (tqdm's ETA)
    monkeypatch.setattr(Progress, "LOG_SECONDS", 0.0)
    prepare(sources["jsonl"], tmp_path / "log", progress=False, cloze_items=0, perplexity_documents=0)
    lines = [line for line in capsys.readouterr().err.splitlines() if "ETA" in line]
    size = Path(sources["jsonl"][0]).stat().st_size
    assert lines and lines[-1].startswith(f"[lrattn prepare] 100% of {size / 1e6:,.1f} MB read, 240 documents, "), lines
    assert "tokens/s, ETA 00:00:00" in lines[-1]


def hub_download_cache(docs: list[str], cache: Path, repo: str, config: str) -> None:
    """The documents in `datasets`' cache as `load_dataset(repo, config)` leaves a hub dataset there
    (CACHE/NAMESPACE___NAME/CONFIG/0.0.0/HASH/NAME-train.arrow and dataset_info.json): written by datasets' own
    Parquet builder, then moved to the names a hub download gives (no network here to make a real download)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache.mkdir(parents=True)
    source = cache.parent / "hub-source.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), source, row_group_size=50)
    namespace, name = repo.split("/")
    builder = Parquet(cache_dir=str(cache), dataset_name=name, config_name=config, data_files={"train": str(source)},
                      hash="0f1e2d3c4b5a6978")
    builder.download_and_prepare()
    built = Path(builder.cache_dir)  # CACHE/NAME/CONFIG-<data files hash>/0.0.0/HASH
    target = cache / f"{namespace}___{name}" / config / "0.0.0" / built.name
    target.parent.mkdir(parents=True)
    built.rename(target)
    assert (target / f"{name}-train.arrow").is_file() and (target / "dataset_info.json").is_file()


def test_hf_name_from_the_local_datasets_cache_offline(documents, reference, tmp_path):
    """`lrattn prepare --source hf:NAME --hf_config C` with HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 reads a
    hub dataset downloaded before (datasets' cache under HF_HOME) to the same shards as the JSONL; a name or
    config not in the cache is one line saying it needs the network or the cache."""
    import subprocess
    import sys

    home = tmp_path / "hf-home"
    hub_download_cache(documents, home / "datasets", "lrattn-test/stdlib-docs", "sample")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("HF_DATASETS_CACHE", None)

    def prepare_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lrattn_lightning.cli", "prepare", "--tokenizer", "byte",
                               "--chunk_bytes", "64KB", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    out = tmp_path / "out"
    done = prepare_cli("--source", "hf:lrattn-test/stdlib-docs", "--hf_config", "sample", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert shard_digest(out) == shard_digest(reference)
    assert read_meta(out)["inputs"]["train"][0] == {"hf_dataset": "lrattn-test/stdlib-docs", "config": "sample",
                                           "split": "train"}, read_meta(out)["inputs"]
    refused = prepare_cli("--source", "hf:lrattn-test/stdlib-doc", "--out", str(tmp_path / "never"))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert "lrattn-test/stdlib-doc" in lines[0] and "HF_DATASETS_OFFLINE=1" in lines[0] and "cache" in lines[0]
    assert not (tmp_path / "never").exists()
    refused = prepare_cli("--source", "hf:lrattn-test/stdlib-docs", "--hf_config", "smaple", "--out", str(tmp_path / "never"))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "config smaple" in lines[0] and "sample" in lines[0], lines
    assert not (tmp_path / "never").exists()
