"""Corpus preparation and the litdata DataModule.

    source --documents--> deterministic split by key hash --tokenize + EOS--> litdata shards
    out_dir/
      meta.json            tokenizer spec, vocab size, token/byte counts per split, source, format version
      train/, val/         litdata chunks (index.json + chunk-*.bin), one flat token stream per split
      tasks/cloze.jsonl    multiple-choice continuation items from held-out documents (lm-eval)
      tasks/perplexity.jsonl  held-out documents for loglikelihood_rolling (lm-eval)
      tokenizer.json       for bpe / hf tokenizers (tokenizer.tiktoken for tiktoken)

Training reads fixed windows of seq_len + 1 tokens (inputs x[:-1], targets x[1:]); windows never
cross a chunk boundary (litdata's TokensLoader). Bits per byte = loss_nats / ln 2 / bytes_per_token.
Sources (`iter_documents`): the built-in corpora `stdlib-docs` (default; the Python reference docs
and standard-library docstrings of the running interpreter), `jargon` and `bible-kjv` (Debian
packages), a .txt file, a folder of .txt/.jsonl files, or `hf:<dataset>`. The project commits no
corpus text. Nothing here runs at import time.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from lrattn_lightning.model.config import SizeConfig
from lrattn_lightning.data.tokenizer import encode_document, load_tokenizer, parse_tokenizer_name, train_bpe

FORMAT_VERSION = 1
SPLITS = ("train", "val")
PREPARE_HINT = "run `lrattn prepare` (lrattn_lightning.data.datamodule.prepare) to create it"
REPREPARE_HINT = "prepare it again with `lrattn prepare --overwrite` (prepare(..., overwrite=True))"


# --------------------------------------------------------------------------------------------------
# documents and corpora


@dataclass(frozen=True)
class Document:
    """A unit of text. `key` decides the split: documents that share a key land on the same side."""

    text: str
    key: str


BUILTIN_SOURCES = ("stdlib-docs", "jargon", "bible-kjv")
MIN_FRAGMENT_CHARS = 60  # docstrings and paragraphs shorter than this are dropped
DOCUMENT_TARGET_CHARS = 4000  # plain text is cut into documents of about this many characters
JARGON_DIR = Path("/usr/share/doc/jargon-text")  # Debian jargon-text
# Stdlib sources are parsed with `ast`, never imported, so import-time side effects (antigravity,
# this, turtle, tkinter) cannot happen. Test suites and generated codec tables are not prose.
_STDLIB_SKIP = frozenset({"test", "encodings", "lib2to3", "__phello__"})
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_INNER_SPACE = re.compile(r"(?<=\S)[ \t]{2,}")
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Dedent, strip line ends, collapse inner runs of spaces and runs of blank lines."""
    lines = (_INNER_SPACE.sub(" ", line.rstrip()) for line in inspect.cleandoc(text).splitlines())
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def key_hash(key: str) -> float:
    """A stable uniform number in [0, 1) for a document key."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") / 2**64


def split_of(key: str, val_fraction: float) -> str:
    """'val' for about `val_fraction` of keys, else 'train'; the same on every machine and run."""
    return "val" if key_hash(key) < val_fraction else "train"


def iter_documents(source: str, max_documents: int | None = None, max_bytes: int | None = None) -> Iterator[Document]:
    """Cleaned, deduplicated documents of `source`, stopping after `max_documents` or `max_bytes`.

    source: stdlib-docs | jargon | bible-kjv | a .txt file (paragraph groups, keyed by position) |
    a folder of .txt/.jsonl files (keyed by file: a file stays on one side of the split; jsonl rows
    need a `text` field) | hf:<dataset>[:<config>] (needs network or a local Hugging Face cache).
    """
    seen: set[bytes] = set()
    count = total = 0
    for doc in _source_documents(source):
        text = clean_text(doc.text)
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        if len(text) < MIN_FRAGMENT_CHARS or digest in seen:
            continue
        seen.add(digest)
        yield Document(text, doc.key)
        count, total = count + 1, total + len(text.encode("utf-8"))
        if (max_documents is not None and count >= max_documents) or (max_bytes is not None and total >= max_bytes):
            return


def _source_documents(source: str) -> Iterator[Document]:
    if source == "stdlib-docs":
        return _stdlib_documents()
    if source == "jargon":
        return _jargon_documents()
    if source == "bible-kjv":
        return _bible_documents()
    if source.startswith("hf:"):
        return _hf_documents(source[3:])
    path = Path(source)
    if path.is_file():
        return (Document(t, f"{path.name}:{i}") for i, t in enumerate(_group_paragraphs(_read_text(path))))
    if path.is_dir():
        return _folder_documents(path)
    raise ValueError(
        f"unknown source '{source}': not a built-in corpus {list(BUILTIN_SOURCES)}, nor an existing .txt file or "
        "folder; for a Hugging Face dataset use hf:<name>"
    )


def _stdlib_documents() -> Iterator[Document]:
    """The Python reference docs (pydoc topics), then each stdlib module's docstrings in source order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield Document(topics[name], f"pydoc:{name}")
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    for name in sorted(sys.stdlib_module_names):
        if name in _STDLIB_SKIP:
            continue
        for path in _module_files(root, name):
            text = _docstrings_of(path, seen)
            if text:
                yield Document(text, f"stdlib:{path.relative_to(root).with_suffix('').as_posix()}")


def _module_files(root: Path, name: str) -> list[Path]:
    if (root / f"{name}.py").is_file():
        return [root / f"{name}.py"]
    if not (root / name).is_dir():
        return []  # built into the interpreter or a C extension: no source to parse
    return sorted(
        p for p in (root / name).rglob("*.py")
        if not _STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts) and not p.name.startswith("test_")
    )


def _docstrings_of(path: Path, seen: set[str]) -> str:
    """Module, class and function docstrings of one file, cleaned, unseen and not tiny, blank-line joined."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ""
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, _DOC_NODES)), key=lambda n: getattr(n, "lineno", 0))
    parts = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_FRAGMENT_CHARS and doc not in seen:
            seen.add(doc)
            parts.append(clean_text(doc))
    return "\n\n".join(parts)


def _jargon_documents() -> Iterator[Document]:
    """The Jargon File (Debian jargon-text): one document per lexicon entry, prose before it by paragraphs."""
    folder = JARGON_DIR
    path = next((p for p in (folder / "jargon.txt.gz", folder / "jargon.txt") if p.is_file()), None)
    if path is None:
        raise ValueError(f"source 'jargon' needs the Debian package jargon-text ({folder} not found): apt-get install jargon-text")
    text = _read_text(path)
    pieces = re.split(r"(?m)^(?=[ \t]*:[^:\n]+:)", text)  # an entry starts with a line like '   :cruft: n.'
    for i, piece in enumerate(_group_paragraphs(pieces[0])):
        yield Document(piece, f"jargon:front:{i}")
    for piece in pieces[1:]:
        headword = piece.strip().split(":")[1]
        yield Document(piece, f"jargon:{headword}")


def _bible_documents() -> Iterator[Document]:
    """The King James Bible (Debian bible-kjv-text, read through bible-kjv's `bible`): one document per chapter."""
    exe = shutil.which("bible")
    if exe is None:
        raise ValueError(
            "source 'bible-kjv' needs the Debian packages bible-kjv-text (the text) and bible-kjv (the `bible` "
            "program that decompresses it): apt-get install bible-kjv"
        )
    try:
        out = subprocess.run(
            [exe, "-l100000", "Gen1:1-Rev22:21"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
            check=True, timeout=300,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise ValueError(f"source 'bible-kjv': `bible` failed ({err}); reinstall with apt-get install --reinstall bible-kjv") from err
    title, verses = None, []
    for line in [*out.splitlines(), "END"]:
        if line and not line[0].isspace():  # a chapter heading such as 'Genesis 1'
            if title and verses:
                yield Document(title + "\n\n" + "\n".join(verses), f"kjv:{title}")
            title, verses = line.strip(), []
        elif line.strip():
            verses.append(line.strip().split(" ", 1)[-1])  # drop the verse number


def _folder_documents(folder: Path) -> Iterator[Document]:
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise ValueError(f"source folder {folder} has no .txt or .jsonl files")
    for path in files:
        rel = path.relative_to(folder).as_posix()
        if path.suffix == ".txt":
            yield from (Document(t, rel) for t in _group_paragraphs(_read_text(path)))
            continue
        undecodable = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line, bad = _decode_utf8(raw)
                undecodable += bad
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    text = row["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field 'text' ({err!r})") from err
                yield Document(str(text), rel)
        if undecodable:
            _warn_undecodable(path, undecodable)


def _hf_documents(name: str) -> Iterator[Document]:
    """Rows of a Hugging Face dataset's train split (field `text`); `name` may be 'path:config'."""
    path, _, config = name.partition(":")
    try:
        import datasets

        rows = datasets.load_dataset(path, config or None, split="train", streaming=True)
        for i, row in enumerate(rows):
            if "text" not in row:
                raise ValueError(f"hf:{name}: rows have no 'text' field (fields: {sorted(row)})")
            yield Document(str(row["text"]), f"hf:{name}:{i}")
    except ValueError:
        raise
    except Exception as err:  # network, missing dataset, missing package: one clear message
        raise ValueError(f"could not load Hugging Face dataset '{name}' ({type(err).__name__}: {err}); "
                         "it needs network access or a local Hugging Face cache") from err


def _read_text(path: Path) -> str:
    """A text file as UTF-8; undecodable bytes become U+FFFD, with one warning that counts them."""
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            raw = f.read()
    else:
        raw = path.read_bytes()
    text, bad = _decode_utf8(raw)
    if bad:
        _warn_undecodable(path, bad)
    return text


_REPLACEMENT = "\ufffd"


def _decode_utf8(raw: bytes) -> tuple[str, int]:
    """(text, number of undecodable byte sequences replaced by U+FFFD)."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode("utf-8"))


def _warn_undecodable(path: Path, count: int) -> None:
    print(f"[lrattn prepare] warning: {path} is not valid UTF-8: {count} undecodable byte sequence(s) were replaced "
          "by U+FFFD; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) if that is not intended",
          file=sys.stderr, flush=True)


def _group_paragraphs(text: str, target: int = DOCUMENT_TARGET_CHARS) -> Iterator[str]:
    """Blank-line separated paragraphs (tiny ones dropped), joined into pieces of about `target` chars."""
    piece: list[str] = []
    size = 0
    for para in re.split(r"\n[ \t]*\n", text):
        para = para.strip("\n")
        if len(para.strip()) < MIN_FRAGMENT_CHARS:
            continue
        piece.append(para)
        size += len(para)
        if size >= target:
            yield "\n\n".join(piece)
            piece, size = [], 0
    if piece:
        yield "\n\n".join(piece)


# --------------------------------------------------------------------------------------------------
# prepare


def prepare(
    source: str = "stdlib-docs",
    out_dir: str | Path = "data/stdlib-docs-byte",
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    num_workers: int = 1,
    chunk_bytes: int | str = "8MB",
    overwrite: bool = False,
    max_documents: int | None = None,
    max_bytes: int | None = None,
    seed: int = 1234,
    cloze_items: int = 500,
    perplexity_documents: int = 200,
) -> dict[str, Any]:
    """Tokenise `source` into litdata shards under `out_dir`; returns the written meta.json as a dict.

    Atomic: everything is built in a hidden sibling folder that is renamed to `out_dir` at the end,
    so a failure leaves nothing behind. An existing `out_dir` is an error unless `overwrite=True`.
    `max_documents` / `max_bytes` take a prefix of the source (tests, quick runs). `num_workers`
    tokenizer processes (forked on Linux) write the shards; `chunk_bytes` is litdata's chunk size.
    """
    out = Path(out_dir)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    parse_tokenizer_name(tokenizer)  # fail fast on a bad name
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        docs = list(iter_documents(source, max_documents=max_documents, max_bytes=max_bytes))
        print(f"[lrattn prepare] read {len(docs):,} documents ({sum(len(d.text) for d in docs):,} characters) "
              f"from {source}", file=sys.stderr, flush=True)
        splits = _split_documents(docs, val_fraction, source)
        tok = _make_tokenizer(tokenizer, [d.text for d in splits["train"]], staging)
        dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
        counts = {}
        for split in SPLITS:
            texts = [d.text for d in splits[split]]
            _write_shards(texts, staging / split, tok.spec(), staging, dtype, num_workers, chunk_bytes)
            counts[split] = _split_counts(texts, staging / split)
            counts[split]["max_token_id"] = max_token_id(staging / split, check_shards(staging, split), dtype)
            print(f"[lrattn prepare] {split}: {len(texts):,} documents, {counts[split].get('tokens', 0):,} tokens "
                  "written", file=sys.stderr, flush=True)
        tasks = write_task_files(splits["val"], staging / "tasks", seed, cloze_items, perplexity_documents)
        meta = {
            "format_version": FORMAT_VERSION,
            "source": source,
            "tokenizer": tok.spec(),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": np.dtype(dtype).name,
            "val_fraction": val_fraction,
            "limits": {"max_documents": max_documents, "max_bytes": max_bytes},
            "splits": counts,
            "tasks": tasks,
            # stdlib-docs is the running interpreter's documentation: it changes with the Python version.
            "created_with": {"python": platform.python_version(), "litdata": _litdata_version()},
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        staging.chmod(0o777 & ~_current_umask())  # mkdtemp made it private
        _publish(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return meta


def _split_documents(docs: list[Document], val_fraction: float, source: str) -> dict[str, list[Document]]:
    """Train/val by key hash. If no key falls in val, the lowest-hash key goes there (tiny corpora)."""
    if not docs:
        raise ValueError(f"source '{source}' yielded no documents")
    out: dict[str, list[Document]] = {"train": [], "val": []}
    for doc in docs:
        out[split_of(doc.key, val_fraction)].append(doc)
    if not out["val"]:
        lowest = min(docs, key=lambda d: key_hash(d.key))
        out["val"] = [d for d in docs if d.key == lowest.key]
        out["train"] = [d for d in docs if d.key != lowest.key]
    if not out["train"]:
        raise ValueError(f"source '{source}': too few documents ({len(docs)}) for a train/val split")
    return out


def _make_tokenizer(name: str, train_texts: list[str], staging: Path) -> Any:
    kind, arg = parse_tokenizer_name(name)
    if kind == "byte":
        return load_tokenizer({"kind": "byte"})
    if kind == "bpe":
        return train_bpe(train_texts, int(arg), staging / "tokenizer.json")
    src = Path(arg)
    if not src.is_file():
        raise ValueError(f"tokenizer '{name}': file {src} not found")
    dst = staging / ("tokenizer.json" if kind == "hf" else "tokenizer.tiktoken")
    shutil.copyfile(src, dst)  # the prepared folder carries its own tokenizer
    return load_tokenizer({"kind": kind, "file": dst.name}, base_dir=staging)


def _write_shards(
    texts: list[str], out: Path, spec: dict, base_dir: Path, dtype: Any, num_workers: int, chunk_bytes: int | str
) -> None:
    from litdata import TokensLoader, optimize

    # The worker fn lives in tokenizer.py so spawned workers need not import lightning (seconds).
    fn = functools.partial(
        encode_document, texts=tuple(texts), spec_json=json.dumps(spec), base_dir=str(base_dir), dtype=np.dtype(dtype).name
    )
    with _optimizer_scratch(base_dir / ".litdata-scratch"):
        # Inputs are indices, not texts: litdata inspects string inputs for file paths.
        optimize(
            fn=fn,
            inputs=list(range(len(texts))),
            output_dir=str(out),
            chunk_bytes=chunk_bytes,
            item_loader=TokensLoader(),
            num_workers=num_workers,
            reorder_files=False,
            verbose=False,
            # litdata defaults to spawn: seconds of re-imports per call, and a hang when the caller's
            # script lacks an `if __name__ == "__main__":` guard. Fork is what torch's DataLoader uses on Linux.
            start_method="fork" if sys.platform.startswith("linux") else "spawn",
        )


@contextmanager
def _optimizer_scratch(path: Path) -> Iterator[None]:
    """Undo what `litdata.optimize` does to the process: its scratch caches (default: the system temp
    dir) go inside the staging folder, and the multiprocessing start method it forces is restored."""
    keys = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    saved = {k: os.environ.get(k) for k in keys}
    start_method = multiprocessing.get_start_method(allow_none=True)
    for k in keys:
        os.environ[k] = str(path / k.lower())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        multiprocessing.set_start_method(start_method, force=True)
        shutil.rmtree(path, ignore_errors=True)


def _split_counts(texts: list[str], shard_dir: Path) -> dict[str, Any]:
    tokens = sum(c["dim"] for c in json.loads((shard_dir / "index.json").read_text())["chunks"])
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"documents": len(texts), "tokens": tokens, "bytes": n_bytes, "bytes_per_token": n_bytes / max(tokens, 1)}


def _litdata_version() -> str:
    import litdata

    return litdata.__version__


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging folder to `out` (replacing an old one only if `overwrite`)."""
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} appeared while preparing; not replacing it")
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)


# --------------------------------------------------------------------------------------------------
# lm-eval task data (the task YAMLs live elsewhere)

CLOZE_CONTEXT_WORDS = 48
CLOZE_CONTINUATION_WORDS = 12
CLOZE_PER_DOCUMENT = 16
CLOZE_CHOICES = 4
PERPLEXITY_MAX_CHARS = 4000


def write_task_files(
    docs: list[Document], out: Path, seed: int, cloze_items: int, perplexity_documents: int
) -> dict[str, Any]:
    """Write tasks/cloze.jsonl and tasks/perplexity.jsonl from held-out documents; deterministic in `seed`."""
    out.mkdir(parents=True, exist_ok=True)
    cloze = build_cloze_items(docs, cloze_items, seed)
    ppl = build_perplexity_documents(docs, perplexity_documents)
    for name, rows in (("cloze", cloze), ("perplexity", ppl)):
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {
        "cloze": {"file": "tasks/cloze.jsonl", "items": len(cloze), "choices": CLOZE_CHOICES, "target_delimiter": " "},
        "perplexity": {"file": "tasks/perplexity.jsonl", "items": len(ppl)},
        "seed": seed,
    }


def build_cloze_items(docs: list[Document], n_items: int, seed: int) -> list[dict[str, Any]]:
    """Items {id, context, choices, gold, source}: choose the true next words of a passage among 4.

    Passages are disjoint word windows of held-out documents; distractors are the continuations of
    other passages. Context and choices are joined by one space (lm-eval's target_delimiter).
    """
    span = CLOZE_CONTEXT_WORDS + CLOZE_CONTINUATION_WORDS
    passages = []  # (context, continuation, key)
    for doc in docs:
        words = doc.text.split()
        for start in range(0, len(words) - span + 1, span)[:CLOZE_PER_DOCUMENT]:
            ctx = " ".join(words[start : start + CLOZE_CONTEXT_WORDS])
            cont = " ".join(words[start + CLOZE_CONTEXT_WORDS : start + span])
            passages.append((ctx, cont, doc.key))
    rng = random.Random(seed)
    rng.shuffle(passages)
    continuations = sorted({c for _, c, _ in passages})
    items = []
    for ctx, cont, key in passages[:n_items]:
        others = [c for c in continuations if c != cont]
        if len(others) < CLOZE_CHOICES - 1:
            break
        choices = [cont, *rng.sample(others, CLOZE_CHOICES - 1)]
        rng.shuffle(choices)
        items.append({"id": len(items), "context": ctx, "choices": choices, "gold": choices.index(cont), "source": key})
    return items


def build_perplexity_documents(docs: list[Document], n_docs: int) -> list[dict[str, Any]]:
    """Rows {id, text, source}: held-out documents, cut at a word boundary after PERPLEXITY_MAX_CHARS."""
    rows = []
    for doc in docs[:n_docs]:
        text = doc.text
        if len(text) > PERPLEXITY_MAX_CHARS:
            cut = text.rfind(" ", 0, PERPLEXITY_MAX_CHARS)
            text = text[: cut if cut > 0 else PERPLEXITY_MAX_CHARS]
        rows.append({"id": len(rows), "text": text, "source": doc.key})
    return rows


# --------------------------------------------------------------------------------------------------
# reading and validating a prepared folder


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """Parsed meta.json; ValueError (saying what to run) if the folder or file is missing or corrupt."""
    root = Path(data_dir)
    if not root.is_dir() or not any(root.iterdir()):
        raise ValueError(f"data dir {root} is missing or empty; {PREPARE_HINT}")
    path = root / "meta.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing, so {root} is not a prepared data dir; {REPREPARE_HINT}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is corrupt ({err}); {REPREPARE_HINT}") from err
    missing = [k for k in ("format_version", "tokenizer", "vocab_size", "splits") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{path} is corrupt: missing {missing}; {REPREPARE_HINT}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {meta['format_version']}, this code reads {FORMAT_VERSION}; {REPREPARE_HINT}"
        )
    return meta


def check_shards(data_dir: str | Path, split: str) -> list[dict[str, Any]]:
    """The chunk records of `split`; ValueError if index.json or a chunk file is missing or the wrong size."""
    shard_dir = Path(data_dir) / split
    index = shard_dir / "index.json"
    try:
        chunks = json.loads(index.read_text())["chunks"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is missing or unreadable ({err}); {REPREPARE_HINT}") from err
    for chunk in chunks:
        path = shard_dir / chunk["filename"]
        size = path.stat().st_size if path.is_file() else None
        if size != chunk["chunk_bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise ValueError(
                f"shard {path} is corrupt: expected {chunk['chunk_bytes']} bytes, found {found}; {REPREPARE_HINT}"
            )
    return chunks


def max_token_id(shard_dir: str | Path, chunks: list[dict[str, Any]], dtype: Any) -> int:
    """The largest token id in a split's chunks (-1 if empty): a litdata chunk is a uint32 header
    (item count, item count + 1 offsets) followed by the tokens, which are read through a memory map."""
    top = -1
    for chunk in chunks:
        path = Path(shard_dir) / chunk["filename"]
        header = (chunk["chunk_size"] + 2) * 4
        if path.stat().st_size > header:
            tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=header)
            top = max(top, int(tokens.max()))
    return top


def count_windows(chunks: list[dict[str, Any]], window: int) -> int:
    """Windows of `window` tokens litdata's TokensLoader yields (they never cross a chunk boundary)."""
    return sum(c["dim"] // window for c in chunks)


def validate_data_dir(data_dir: str | Path, size: SizeConfig, seq_len: int | None = None) -> dict[str, Any]:
    """Check a prepared folder against a model size before training; returns meta. ValueError on any problem.

    `seq_len` (the DataModule's) defaults to `size.seq_len` and may not exceed it.
    """
    meta = read_meta(data_dir)
    seq_len = size.seq_len if seq_len is None else seq_len
    if meta["vocab_size"] > size.vocab_size:
        raise ValueError(
            f"data vocab_size {meta['vocab_size']} ({meta['tokenizer'].get('kind')} tokenizer in {data_dir}) exceeds "
            f"model vocab_size {size.vocab_size} of size '{size.name}'; choose a size with vocab_size >= "
            f"{meta['vocab_size']} or prepare the data with a smaller tokenizer (byte, or bpe:{size.vocab_size})"
        )
    if seq_len > size.seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the {size.seq_len} positions of size '{size.name}'; use seq_len <= {size.seq_len}")
    for split in ("val", "train"):
        chunks = check_shards(data_dir, split)
        # An id the embedding does not have crashes the first step (a device-side assert on GPUs).
        # prepare records each split's largest id; folders prepared before that are scanned.
        top = meta["splits"].get(split, {}).get("max_token_id")
        if top is None:
            top = max_token_id(Path(data_dir) / split, chunks, meta.get("dtype", "uint16"))
        if top >= size.vocab_size:
            raise ValueError(
                f"the {split} split of {data_dir} holds token id {top}, beyond the vocab_size {size.vocab_size} of size "
                f"'{size.name}' (ids must be < {size.vocab_size}); prepare the data with a tokenizer that fits the "
                "model or choose a size with a larger vocab_size"
            )
        if count_windows(chunks, seq_len + 1) == 0:
            tokens = sum(c["dim"] for c in chunks)
            raise ValueError(
                f"the {split} split of {data_dir} has {tokens} tokens in {len(chunks)} chunk(s), fewer than one "
                f"window of seq_len + 1 = {seq_len + 1}; use a shorter seq_len, a larger val_fraction or more data"
            )
    return meta


# --------------------------------------------------------------------------------------------------
# DataModule


def collate_windows(items: list[np.ndarray]) -> torch.Tensor:
    """Windows of seq_len + 1 token ids (uint16/uint32) -> LongTensor (B, seq_len + 1)."""
    return torch.from_numpy(np.stack(items).astype(np.int64))


class TokenDataModule(L.LightningDataModule):
    """Fixed token windows from a prepared folder; each batch is a LongTensor (B, seq_len + 1).

    Sharding over ranks and dataloader workers is litdata's own (it reads the torch.distributed
    world, or WORLD_SIZE / GLOBAL_RANK, when iteration starts). The train loader's position is
    `state_dict()`; a resumed run continues with the next unseen batch (see `load_state_dict`).
    """

    def __init__(
        self,
        data_dir: str = "data/stdlib-docs-byte",
        batch_size: int = 8,
        seq_len: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 42,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self._meta: dict[str, Any] | None = None
        self._train_loader: Any = None
        self._pending_state: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = read_meta(self.data_dir)
        return self._meta

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def bytes_per_token(self, split: str = "val") -> float:
        return float(self.meta["splits"][split]["bytes_per_token"])

    def tokenizer(self) -> Any:
        return load_tokenizer(self.meta["tokenizer"], base_dir=self.data_dir)

    def validate_for(self, size: SizeConfig) -> dict[str, Any]:
        """Check the data against a model size (see `validate_data_dir`); fills in seq_len if unset."""
        meta = validate_data_dir(self.data_dir, size, self.seq_len)
        if self.seq_len is None:
            self.seq_len = size.seq_len
        self._meta = meta
        return meta

    def _dataset(self, split: str) -> Any:
        from litdata import StreamingDataset, TokensLoader

        if self.seq_len is None:
            raise ValueError("TokenDataModule.seq_len is unset: pass seq_len or call validate_for(size) first")
        _ = self.meta  # a missing or corrupt folder fails here, with its fix
        check_shards(self.data_dir, split)
        return StreamingDataset(
            str(Path(self.data_dir) / split),
            item_loader=TokensLoader(block_size=self.seq_len + 1),
            shuffle=self.shuffle if split == "train" else False,
            drop_last=split == "train",  # equal train batches on every rank; keep every val window
            seed=self.seed,
        )

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        loader = StreamingDataLoader(
            self._dataset("train"), batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_windows
        )
        if self._pending_state is not None:
            loader.load_state_dict(self._pending_state)
            self._pending_state = None
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        return StreamingDataLoader(
            self._dataset("val"), batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_windows
        )

    def test_dataloader(self) -> Any:
        """`lrattn test` scores the held-out split (there is no third split)."""
        return self.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """The train loader's position (litdata's own state dict): {'train_loader': ...} or {}."""
        if self._train_loader is not None:
            return {"train_loader": self._train_loader.state_dict()}
        return {"train_loader": self._pending_state} if self._pending_state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the train loader at a saved position (applied now, or when the loader is built).

        Under a Trainer this is skipped: Lightning's fit loop already saves every stateful train
        loader in the checkpoint (loops.fit_loop.state_dict.combined_loader) and loads it into the
        new loader before iterating; loading it twice would advance litdata's worker cycle twice.
        """
        state = state_dict.get("train_loader")
        if state is None or self.trainer is not None:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._pending_state = state


def bits_per_byte(loss_nats_per_token: float, bytes_per_token: float) -> float:
    """Cross-entropy in nats per token -> bits per UTF-8 byte of text."""
    return loss_nats_per_token / math.log(2) / bytes_per_token
