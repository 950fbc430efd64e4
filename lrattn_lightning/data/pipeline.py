"""The streaming core of `prepare`: batches of documents -> token ids in worker processes -> litdata shards,
written in parts that an interrupted prepare keeps.

    STAGING/train/, STAGING/val/   chunk-P-I.bin: part P's chunks (litdata's BinaryWriter with TokensLoader, whose
                                   rank is P), and at the end index.json: every part's chunks, in order
    STAGING/.prepare/parts/P.json  part P is complete: its documents, counts and chunk records (written last,
                                   atomically; the writer's own P.index.json is folded into it)

A part is PART_BYTES characters of documents, and ends with a document. Batches (BATCH_BYTES characters or
BATCH_DOCUMENTS texts, whichever comes first; the last batch of the input closes its part, whatever filled
it) go to `num_workers` processes (one tokenizer thread each) and come back in order, so the shards are the
same for any number of workers. A document longer than LONG_CHARS comes as pieces of at most PIECE_CHARS
(data/pieces.py), EOS after the last only. At most two batches per worker are in flight: with the chunk being
filled for each split, that is what is held in memory, however large the corpus or a document.
The byte tokenizer with `num_workers` 1 tokenises in this process (no copies between processes); any other
tokenizer in worker processes, one at least: a call into the `tokenizers` library holds its process until it
returns (a slow pre-tokenizer regex: minutes), and Python runs a signal handler only between calls, so this
process waits for answers STOP_SECONDS at a time and honours a signal (check_stop) between the waits; the
workers are then ended. A tokenizer that fails (data/tokenizer.py's TokenizerFailed) comes back as one line.

A worker's token ids come back in a file (STAGING/.prepare/batches/), and through the pool's pipe only its
name: a message shorter than PIPE_BUF is written whole or not at all, so a worker killed mid-answer (the OOM
killer, a signal to the process group, the parent ending the pool) cannot leave half a message, on which
ProcessPoolExecutor's reading thread would wait forever (it did after a SIGTERM: once in the whole suite,
once in 43 runs of the signal test in a loop).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.core.files import open_new, refuse_link, replacing, write_file
from lrattn_lightning.data.documents import Document
from lrattn_lightning.data.pieces import Cutter
from lrattn_lightning.data.shards import sha256_files
from lrattn_lightning.data.split import SPLITS
from lrattn_lightning.data.staging import BOOK, check_stop
from lrattn_lightning.data.tokenizer import encode_texts

PART_BYTES = 256 << 20  # characters of documents in a part: what a resumed prepare may have to redo
BATCH_BYTES = 1 << 20  # characters a worker gets at once
BATCH_DOCUMENTS = 256  # texts (documents, or pieces of a long one) a worker gets at once
ITEM_TOKENS = 1 << 15  # consecutive documents of one split go to litdata as one item of about this many tokens
STOP_SECONDS = 0.2  # how long this process waits for a worker's answer between looks for a signal


def new_counts() -> dict[str, int]:
    return {"documents": 0, "tokens": 0, "bytes": 0, "max_token_id": -1, "items": 0}


class WorkerDied(RuntimeError):
    """A tokenizer process died (killed by the system: out of memory?); the finished parts are kept."""


class Encoder:
    """Token ids for batches of texts, in order: in this process (one worker) or in forked worker processes."""

    def __init__(self, spec: dict[str, Any], base_dir: Path, dtype: Any, num_workers: int) -> None:
        self.kwargs = {"spec_json": json.dumps(spec), "base_dir": str(base_dir), "dtype": np.dtype(dtype).name}
        # a tokenizer other than bytes may hold a process for minutes: this one stays free to honour a signal
        self.num_workers, self.pool, self.pids = num_workers, None, []
        self.pooled = num_workers > 1 or spec.get("kind") != "byte"
        self.batches = base_dir / BOOK / "batches"  # the workers' answers (see the module's docstring)

    def __enter__(self) -> Encoder:
        # one tokenizer thread per process: the workers are the parallelism (and rayon must not run across a fork)
        self._parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if self.pooled:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            shutil.rmtree(self.batches, ignore_errors=True)  # an interrupted prepare's
            self.batches.mkdir(parents=True)
            context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            started = context.SimpleQueue()
            # a pool that notices a worker killed under it (multiprocessing.Pool would wait for its task forever)
            self.pool = ProcessPoolExecutor(self.num_workers, mp_context=context, initializer=_init_worker,
                                            initargs=(os.getpid(), self.kwargs, started))
            self.pool.submit(int).result()  # starts every worker, now: before any thread of ours (progress bar)
            self.pids = [started.get() for _ in range(self.num_workers)]
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if self.pool is not None:
            if kind is not None:  # an error or a signal: nothing more is wanted
                self.pool.shutdown(wait=False, cancel_futures=True)
                for pid in self.pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            self.pool.shutdown(wait=True)
            shutil.rmtree(self.batches, ignore_errors=True)
        if self._parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._parallelism

    def map(self, batches: Iterable[tuple[Any, list[str], list[bool]]]) -> Iterator[tuple[Any, tuple[Any, Any, Any]]]:
        """(tag, (ids, lengths, bytes)) for each (tag, texts, ends), in order (data/tokenizer.py's encode_texts)."""
        if self.pool is None:
            for tag, texts, ends in batches:
                yield tag, encode_texts(texts, ends, **self.kwargs)
            return
        from concurrent.futures.process import BrokenProcessPool

        pending: deque = deque()
        try:
            for number, (tag, texts, ends) in enumerate(batches):
                answer = str(self.batches / f"{number}.npy")
                pending.append((tag, self.pool.submit(encode_to_file, texts, ends, answer, **self.kwargs)))
                if len(pending) >= 2 * self.num_workers:
                    tag, result = pending.popleft()
                    yield tag, load_answer(_waited(result))
            while pending:
                tag, result = pending.popleft()
                yield tag, load_answer(_waited(result))
        except BrokenProcessPool as err:
            check_stop()  # the workers died of this process's signal too (sent to the group, e.g. by SLURM)
            raise WorkerDied("a tokenizer process died (killed by the system: out of memory? see `dmesg`); the "
                             "finished parts are kept: run the same command to continue from them") from err


def _waited(future: Any) -> Any:
    """A worker's answer, waited for STOP_SECONDS at a time: a signal stops the wait (Interrupted) at once."""
    from concurrent.futures import wait

    while not wait([future], timeout=STOP_SECONDS).done:
        check_stop()
    return future.result()


def encode_to_file(texts: list[str], ends: list[bool], path: str, **kwargs: str) -> str:
    """A worker's batch: encode_texts' three arrays written to `path`; returns `path` (all the pipe carries)."""
    with os.fdopen(open_new(path, "worker's answer", stale=True), "wb") as f:
        for array in encode_texts(texts, ends, **kwargs):
            np.save(f, array, allow_pickle=False)
    return path


def load_answer(path: str) -> tuple[Any, Any, Any]:
    """The arrays encode_to_file wrote; the file is removed."""
    with open(path, "rb") as f:
        ids, lengths, n_bytes = (np.load(f, allow_pickle=False) for _ in range(3))
    os.unlink(path)
    return ids, lengths, n_bytes


def _init_worker(parent: int, kwargs: dict[str, str], started: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    for signum in (signal.SIGTERM, signal.SIGHUP):  # not the parent's handlers: terminate() ends a worker at once
        signal.signal(signum, signal.SIG_DFL)
    if sys.platform.startswith("linux"):  # a killed parent (SIGKILL) takes its workers with it
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)
    encode_texts([], **kwargs)  # load the tokenizer once, before the first batch
    started.put(os.getpid())


class PartWriter:
    """The shards of one part, for each split: a litdata BinaryWriter whose rank is the part's number."""

    def __init__(self, staging: Path, part: int, chunk_bytes: int | str) -> None:
        self.staging, self.part, self.chunk_bytes = staging, part, chunk_bytes
        self.writers: dict[str, Any] = {}
        self.counts = {split: new_counts() for split in SPLITS}
        self.documents = 0

    def _writer(self, split: str) -> Any:
        if split not in self.writers:
            from litdata import TokensLoader
            from litdata.streaming.writer import BinaryWriter

            saved = os.environ.get("DATA_OPTIMIZER_GLOBAL_RANK")
            os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = str(self.part)  # chunk-PART-I.bin, PART.index.json
            refuse_link(self.staging / split, "shard folder", folder=True)  # litdata opens its files itself
            try:
                writer = BinaryWriter(str(self.staging / split), chunk_bytes=self.chunk_bytes, item_loader=TokensLoader())
                assert writer.rank == self.part
            finally:
                if saved is None:
                    os.environ.pop("DATA_OPTIMIZER_GLOBAL_RANK", None)
                else:
                    os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = saved
            self.writers[split] = writer
        return self.writers[split]

    def add(self, split: str, ids: np.ndarray, documents: int, n_bytes: int) -> None:
        """Consecutive documents of one split (their ids, EOS after each) as one litdata item."""
        counts = self.counts[split]
        self._writer(split).add_item(counts["items"], ids)
        counts["items"] += 1
        counts["documents"] += documents
        counts["tokens"] += int(ids.size)
        counts["bytes"] += n_bytes
        counts["max_token_id"] = max(counts["max_token_id"], int(ids.max()))
        self.documents += documents

    def close(self) -> dict[str, Any]:
        """Write the last chunks, then mark the part complete with its chunk records; returns the record."""
        index = {}
        for split, writer in self.writers.items():
            writer.done()
            index[split] = json.loads((self.staging / split / f"{self.part}.index.json").read_text())
        record = {"part": self.part, "documents": self.documents, "splits": self.counts, "index": index}
        write_json(self.staging / BOOK / "parts" / f"{self.part}.json", record)
        for split in index:
            (self.staging / split / f"{self.part}.index.json").unlink()
        return record


def write_json(path: Path, value: Any) -> None:
    """A whole JSON file or none: written beside, then renamed over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(value, indent=2) + "\n")


def finished_parts(staging: Path) -> list[dict[str, Any]]:
    """The records of parts 0..n-1 that are complete; every other file a part wrote is removed (the chunks of an
    unfinished part, index files: the records hold the chunk lists)."""
    done: list[dict[str, Any]] = []
    while (marker := staging / BOOK / "parts" / f"{len(done)}.json").is_file():
        done.append(json.loads(marker.read_text()))
    for split in SPLITS:
        for path in (staging / split).glob("*"):
            part = path.name.split("-")[1] if path.name.startswith("chunk-") else ""
            if not part.isdigit() or int(part) >= len(done):
                path.unlink()
    for marker in (staging / BOOK / "parts").glob("*"):
        if not marker.stem.isdigit() or int(marker.stem) >= len(done):
            marker.unlink()
    return done


def merge_index(split_dir: Path, split: str, records: list[dict[str, Any]]) -> None:
    """index.json of a split: the chunks of every part in order, as litdata's own merge of its workers' files.
    Its `updated_at` (litdata's cache key for a remote copy; a timestamp when litdata writes it) is a hash of the
    chunks' records and contents, so the same documents give the same index.json, and the same checksums."""
    chunks, config = [], None
    for record in records:
        index = record["index"].get(split)
        if index is not None:
            chunks += index["chunks"]
            config = config or index["config"]
    split_dir.mkdir(parents=True, exist_ok=True)
    digests = sha256_files([split_dir / c["filename"] for c in chunks])
    content = hashlib.sha256(json.dumps([chunks, config, digests], sort_keys=True).encode()).hexdigest()[:16]
    with replacing(split_dir / "index.json", what="shard index") as file:  # as litdata writes it (sorted keys, no indent)
        file.write(json.dumps({"chunks": chunks, "config": config, "updated_at": content}, sort_keys=True))


def write_parts(stream: Iterable[tuple[Document, str]], staging: Path, encoder: Encoder, chunk_bytes: int | str,
                done: list[dict[str, Any]], on_document: Callable[[Document, str], None],
                on_batch: Callable[[int, int], None], cutter: Cutter) -> list[dict[str, Any]]:
    """Tokenise and write every document of `stream` after those of the `done` parts (read again, not
    tokenised); a long document in the pieces `cutter` cuts. `on_document` sees every document (the eval tasks
    keep held-out ones), `on_batch(documents, tokens)` each written batch. Returns the records of all parts."""
    skip = sum(p["documents"] for p in done)
    records = list(done)

    def segments() -> Iterator[tuple[str, str, bool]]:
        """(side, text, whether it ends its document) of every document to write: a long one in pieces."""
        for index, (doc, side) in enumerate(stream):
            on_document(doc, side)
            if index >= skip:
                yield from ((side, piece, last) for piece, last in _with_last(cutter.pieces(doc)))
            doc.release()

    def batches() -> Iterator[tuple[tuple[int, list[str], list[bool], bool], list[str], list[bool]]]:
        part, texts, sides, ends, size, part_size = len(done), [], [], [], 0, 0
        for side, text, end in segments():
            texts.append(text)
            sides.append(side)
            ends.append(end)
            size, part_size = size + len(text), part_size + len(text)
            full = end and part_size >= PART_BYTES  # a part ends with a document
            if full or size >= BATCH_BYTES or len(texts) >= BATCH_DOCUMENTS:
                yield (part, sides, ends, full), texts, ends
                texts, sides, ends, size = [], [], [], 0
                if full:
                    part, part_size = part + 1, 0
        if texts:
            yield (part, sides, ends, True), texts, ends

    def closing() -> Iterator[tuple[tuple[int, list[str], list[bool], bool], list[str], list[bool]]]:
        """The batches, the last one closing its part whatever filled it (the input ends there)."""
        for (tag, texts, ends), last in _with_last(batches()):
            yield ((*tag[:3], True) if last else tag), texts, ends

    writer: PartWriter | None = None
    with warnings.catch_warnings():  # a document longer than a chunk makes that chunk longer: as intended
        warnings.filterwarnings("ignore", message="An item was larger than the target chunk size")
        for (part, sides, ends, last), (ids, lengths, n_bytes) in encoder.map(closing()):
            writer = writer if writer is not None and writer.part == part else PartWriter(staging, part, chunk_bytes)
            for side, start, end, docs, size in _items(sides, ends, lengths, n_bytes):
                writer.add(side, ids[start:end], docs, size)
            on_batch(sum(ends), int(ids.size))
            if last:
                records.append(writer.close())
                writer = None
    return records


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, whether it is the last one)."""
    it = iter(items)
    previous = next(it, _NOTHING)
    while previous is not _NOTHING:
        item = next(it, _NOTHING)
        yield previous, item is _NOTHING
        previous = item


_NOTHING = object()


def _items(sides: list[str], ends: list[bool], lengths: Any, n_bytes: Any) -> Iterator[tuple[str, int, int, int, int]]:
    """(side, start, end, documents, bytes) of the litdata items of a batch: runs of consecutive texts of one
    side, cut after ITEM_TOKENS (a chunk is cut between items only; one item per document cost litdata's
    per-item bookkeeping on every document). `documents` counts the texts that end one."""
    start = end = docs = size = 0
    side = sides[0] if sides else None
    for s, last, length, b in zip(sides, ends, lengths.tolist(), n_bytes.tolist(), strict=True):
        if end > start and (s != side or end - start >= ITEM_TOKENS):
            yield side, start, end, docs, size
            start, docs, size = end, 0, 0
        side, end, docs, size = s, end + length, docs + last, size + b
    if end > start:
        yield side, start, end, docs, size


class Progress:
    """How far `prepare` is: documents, tokens/s and the ETA, by decompressed input bytes read against their
    expected total (re-estimated as compressed files reveal their ratio), when there is one. A tqdm bar on a
    terminal; elsewhere (a batch job's log) one line every LOG_SECONDS."""

    LOG_SECONDS = 30.0

    def __init__(self, expected: Callable[[], int | None], position: Callable[[], int], enabled: bool | None = None) -> None:
        self.expected, self.position = expected, position
        self.total = expected()
        self.documents = self.tokens = 0
        self.start = self.logged = time.monotonic()
        self.bar = None
        if enabled if enabled is not None else sys.stderr.isatty():
            from tqdm import tqdm

            total = self.total
            self.bar = tqdm(total=total, unit="B" if total else "doc", unit_scale=True, unit_divisor=1024 if total else 1000,
                            desc="[lrattn prepare]", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.start, 1e-9)

    def update(self, documents: int, tokens: int) -> None:
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        if self.total:
            self.total = max(self.expected() or 0, self.position(), 1)
        if self.bar is not None:
            if self.total:
                self.bar.total = self.total
            self.bar.update((min(self.position(), self.total) if self.total else self.documents) - self.bar.n)
            self.bar.set_postfix_str(f"{self.documents:,} docs, {self.rate():,.0f} tok/s", refresh=False)
        elif time.monotonic() - self.logged >= self.LOG_SECONDS:
            self.logged = time.monotonic()
            print(f"[lrattn prepare] {self.line()}", file=sys.stderr, flush=True)

    def line(self) -> str:
        done = f"{self.documents:,} documents, {self.tokens:,} tokens, {self.rate():,.0f} tokens/s"
        if not self.total:
            return done
        fraction = min(self.position() / self.total, 1.0)
        elapsed = time.monotonic() - self.start
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        return f"{fraction:.0%} of {self.total / 1e6:,.1f} MB read, {done}, ETA {eta_text}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
