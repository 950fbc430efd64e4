"""What `--source` (and `--val_source`) name, as one stream of documents: a built-in corpus, or a user's files
and Hugging Face datasets.

    Corpus(specs, options).check()       every input is what its name says, before anything is written
    Corpus.documents(spool)              Documents in order (built-in: cleaned; a user's: as they are, empty ones
                                         skipped and counted; a long one spooled: data/documents.py)
    Corpus.fingerprint() / .records()    what a resumed prepare compares; what meta.json records (size, sha256)

Specs, in order: a built-in corpus name (alone), a file, a folder (its files of known kinds, recursively,
sorted, hidden ones left out), a glob, `hf:NAME` (a dataset of the hub or its local cache, or a local folder of
data files, streamed by `datasets.load_dataset`) or a folder written by `save_to_disk`. A saved DatasetDict is read
at `--hf_split` (train); its own validation split (VALIDATION_SPLITS, the first it has; never `test`) is the
validation corpus of `--source` (`Corpus.saved_validation`), and what `--val_source` reads of it.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.arrow import ARROW_BATCH_BYTES, arrow_documents
from lrattn_lightning.data.corpora import BUILTIN_SOURCES, iter_documents
from lrattn_lightning.data.documents import LONG_CHARS, Document, Spool, TextBuilder, TextStats
from lrattn_lightning.data.formats import SUPPORTED, FileInput, ReadOptions, hidden, kind_of
from lrattn_lightning.data.shards import sha256_files
from lrattn_lightning.data.staging import check_stop

VALIDATION_SPLITS = ("validation", "valid", "val")  # a saved DatasetDict's validation split, the first it has

class HFInput:
    """A Hugging Face dataset: `hf:NAME` (streamed by `datasets.load_dataset`, from its cache or the hub; a local
    folder of data files too; rows as `datasets` gives them) or a folder written by `save_to_disk` (memory-mapped
    Arrow, read in batches of about ARROW_BATCH_BYTES of text through the text policy of Parquet files)."""

    def __init__(self, name: str, options: ReadOptions, saved: bool, split: str | None = None) -> None:
        self.name, self.options, self.saved = name, options, saved
        self.split = split or options.hf_split  # of a saved DatasetDict, or of hf:NAME
        self.size, self.consumed = 0, 0
        self._dataset: Any = None

    def describe(self) -> str:
        return "saved Hugging Face dataset" if self.saved else "Hugging Face dataset"

    def saved_split(self, names: tuple[str, ...]) -> str | None:
        """The first of `names` that this saved DatasetDict holds other than the split it reads, or None."""
        splits = saved_splits(Path(self.name)) if self.saved else None
        return next((s for s in names if s in (splits or []) and s != self.split), None)

    def expected(self) -> int:
        return self.size

    def _load(self) -> Any:
        if self._dataset is not None:
            return self._dataset
        o = self.options
        try:
            import datasets

            if self.saved:
                ds = datasets.load_from_disk(self.name)
                if isinstance(ds, datasets.DatasetDict):
                    if self.split not in ds:
                        raise InputError(f"{self.name}: no split '{self.split}' (splits: {', '.join(ds)}); pass "
                                         "--hf_split NAME")
                    ds = ds[self.split]
                self.size = sum(os.path.getsize(f["filename"]) for f in ds.cache_files)
            else:
                # datasets' own notes ("Using the latest cached version...") would be a second line beside an error
                verbosity = datasets.logging.get_verbosity()
                datasets.logging.set_verbosity_error()
                try:
                    ds = datasets.load_dataset(self.name, o.hf_config, split=self.split, streaming=True)
                finally:
                    datasets.logging.set_verbosity(verbosity)
        except InputError:
            raise
        except Exception as err:  # missing dataset, no network, no cache, a bad config or split: one line
            offline = " (HF_DATASETS_OFFLINE=1 reads only the local cache)" if os.environ.get(
                "HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1" else ""
            raise InputError(f"could not load Hugging Face dataset '{self.name}' (config {o.hf_config}, split "
                             f"'{self.split}': {type(err).__name__}: {' '.join(str(err).split())[:300]}){offline}; it "
                             "needs network access or the dataset in the local Hugging Face cache") from err
        names = ds.column_names or (list(ds.features) if ds.features else None)
        if names is not None and o.text_field not in names:
            raise InputError(f"Hugging Face dataset '{self.name}': no column '{o.text_field}' (columns: "
                             f"{', '.join(names)}); pass --text_field NAME")
        self._dataset = ds
        return ds

    def check(self) -> None:
        ds = self._load()
        if not self.saved:
            for _ in self._rows(ds.take(1), None):
                break

    def _rows(self, rows: Any, spool: Spool | None = None) -> Iterator[Document]:
        field = self.options.text_field
        for i, row in enumerate(rows):
            text = row.get(field)
            if not isinstance(text, str):
                raise InputError(f"Hugging Face dataset '{self.name}': row {i} has {type(text).__name__} in "
                                 f"'{field}', not text; pass --text_field NAME of a text column")
            if len(text) > LONG_CHARS and spool is not None:  # (`check` reads a row only to see its type)
                built = TextBuilder(spool)
                built.add(text)
                yield built.document(None, f"{self.name}#{i}")
            else:
                yield Document(text, None, f"{self.name}#{i}")

    def documents(self, spool: Spool | None = None) -> Iterator[Document]:
        ds = self._load()
        if not self.saved:
            yield from self._rows(ds, spool)
            return
        field, stats = self.options.text_field, TextStats(self.name)
        table = ds.select_columns([field])
        total = max(len(table), 1)
        batch = max(1, min(1024, total * ARROW_BATCH_BYTES // max(self.size, 1)))
        done = 0
        for part in table.with_format("arrow").iter(batch_size=batch):
            check_stop()
            for column in part.column(field).chunks:
                yield from arrow_documents(column, done, stats, spool, self.name, field)
                done += len(column)
            self.consumed = self.size * done // total
        stats.finish()

    def inputs(self) -> list[Path]:
        """Files to record in meta.json: a saved dataset's Arrow files, a local folder's files, none for the hub."""
        if self.saved:
            return sorted(Path(f["filename"]) for f in self._load().cache_files)
        local = Path(self.name)
        return sorted(p for p in local.rglob("*") if p.is_file() and not hidden(p, local)) if local.is_dir() else []


def saved_splits(path: Path) -> list[str] | None:
    """The splits of a folder written by `DatasetDict.save_to_disk` (its dataset_dict.json), None for another."""
    try:
        return [str(s) for s in json.loads((path / "dataset_dict.json").read_text())["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def resolve(specs: list[str], options: ReadOptions, validation: bool = False) -> list[FileInput | HFInput]:
    """The inputs of `--source` (or `--val_source`: `validation`, a saved DatasetDict read at its validation split
    when it has one) in order: each spec a file, a folder (its files of known kinds, recursively, sorted; hidden ones
    left out), a glob, `hf:NAME` or a saved dataset folder."""
    items: list[FileInput | HFInput] = []
    seen: set[Path] = set()

    def saved(name: str) -> HFInput:
        item = HFInput(name, options, saved=True)
        if validation and (split := item.saved_split(VALIDATION_SPLITS)):
            item.split = split
        return item

    for spec in specs:
        if spec.startswith("hf:"):
            name = spec[3:]
            items.append(saved(name) if saved_dataset(Path(name)) else HFInput(name, options, saved=False))
            continue
        path = Path(spec)
        if saved_dataset(path):
            items.append(saved(spec))
            continue
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not hidden(p, path))
            where = f"folder {path}"
        elif path.is_file():
            files, where = [path], None
        elif glob.has_magic(spec):
            files, where = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()), f"glob {spec}"
            if not files:
                raise InputError(f"--source {spec}: no file matches the pattern")
        else:
            raise InputError(f"unknown source '{spec}': not a built-in corpus {list(BUILTIN_SOURCES)}, nor an existing "
                             "file, folder or glob; for a Hugging Face dataset use hf:NAME")
        known = [(p, kind_of(p)) for p in files]
        unknown = [p for p, k in known if k is None]
        if where is None and unknown:
            raise InputError(f"{path}: unknown format (by its name); {SUPPORTED}: rename it, or convert it")
        if unknown:
            names = ", ".join(p.name for p in unknown[:3]) + (", ..." if len(unknown) > 3 else "")
            print(f"[lrattn prepare] {where}: left out {len(unknown)} file(s) of other kinds ({names})",
                  file=sys.stderr, flush=True)
        if where is not None and len(unknown) == len(files):
            raise InputError(f"--source {spec}: the {where} holds no corpus files ({SUPPORTED})")
        for p, k in known:
            if k is not None and p.resolve() not in seen:
                seen.add(p.resolve())
                items.append(FileInput(p, k[0], k[1], options))
    return items


class Corpus:
    """The documents of one `--source` list (or `--val_source`), read in order."""

    def __init__(self, specs: str | list[str], options: ReadOptions, validation: bool = False,
                 items: list[FileInput | HFInput] | None = None) -> None:
        self.specs = [specs] if isinstance(specs, str) else list(specs)
        if not self.specs:
            raise InputError("--source names nothing; give a built-in corpus, files, folders, globs or hf:NAME")
        builtin = [s for s in self.specs if s in BUILTIN_SOURCES]
        if builtin and len(self.specs) > 1:
            raise InputError(f"--source {' '.join(self.specs)}: the built-in corpus {builtin[0]} stands alone; "
                             "prepare it, or your files, in one run")
        self.builtin = builtin[0] if builtin else None
        self.items = items if items is not None else [] if self.builtin else resolve(self.specs, options, validation)
        self.options = options
        self.saved_split = False  # the validation split saved with --source's DatasetDicts (saved_validation)
        self.empty = 0  # documents skipped because they are empty or only whitespace

    def __str__(self) -> str:
        return " ".join(self.specs)

    def saved_validation(self) -> Corpus | None:
        """The validation splits saved with this corpus's DatasetDicts (VALIDATION_SPLITS, the first each has; never
        `test`), as the validation corpus, or None when none has one: a dataset's own split is its validation set."""
        items = [HFInput(i.name, self.options, saved=True, split=split) for i in self.items
                 if isinstance(i, HFInput) and (split := i.saved_split(VALIDATION_SPLITS))]
        if not items:
            return None
        corpus = Corpus([f"{i.name}[{i.split}]" for i in items], self.options, items=items)
        corpus.saved_split = True
        return corpus

    def check(self) -> None:
        for item in self.items:
            item.check()

    def expected(self) -> int | None:
        """Bytes of input to read, decompressed (the progress bar's 100 %, estimated from the compression ratio
        seen so far), None when unknown (a built-in or streamed dataset)."""
        if self.builtin or any(isinstance(i, HFInput) and not i.saved for i in self.items):
            return None
        return sum(i.expected() for i in self.items)

    @property
    def consumed(self) -> int:
        return sum(i.consumed for i in self.items)

    def documents(self, spool: Spool | None = None) -> Iterator[Document]:
        """Every document; `empty` counts the skipped ones of this pass (BPE training reads the corpus twice)."""
        self.empty = 0
        if self.builtin:
            yield from iter_documents(self.builtin)
            return
        for item in self.items:
            for doc in item.documents(spool):
                if doc.is_blank():
                    self.empty += 1
                    doc.release()
                else:
                    yield doc

    def fingerprint(self) -> list[Any]:
        """What decides the documents: each input's path, size and modification time (a resume needs them equal)."""
        if self.builtin:
            return [self.builtin, sys.version]
        out: list[Any] = []
        for item in self.items:
            if isinstance(item, HFInput) and not item.inputs():
                out.append([item.name, self.options.hf_config, item.split])
            for path in item.inputs():
                st = path.stat()
                out.append([str(path), st.st_size, st.st_mtime_ns])
        return out

    def records(self) -> list[dict[str, Any]]:
        """meta.json's `inputs`: every input file with its size and sha256 (a hub dataset by name)."""
        out: list[dict[str, Any]] = []
        for item in self.items:
            paths = item.inputs()
            if isinstance(item, HFInput) and not paths:
                out.append({"hf_dataset": item.name, "config": self.options.hf_config, "split": item.split})
            for path, digest in zip(paths, sha256_files(paths), strict=True):
                out.append({"file": str(path), "format": item.describe(), "bytes": path.stat().st_size, "sha256": digest,
                            **({"split": item.split} if isinstance(item, HFInput) and saved_splits(Path(item.name))
                               else {})})
        return out


def limited(docs: Iterator[Document], max_documents: int | None, max_bytes: int | None) -> Iterator[Document]:
    """The first documents of a stream: stop after `max_documents`, or once `max_bytes` of UTF-8 are reached."""
    if max_documents is None and max_bytes is None:
        yield from docs
        return
    count = total = 0
    for doc in docs:
        yield doc
        count, total = count + 1, total + doc.nbytes
        if (max_documents is not None and count >= max_documents) or (max_bytes is not None and total >= max_bytes):
            return
