"""A prepared folder: its layout, and the checks that it is whole and fits a model before training.

    out_dir/ (a folder, or an s3:// prefix: data/remote.py)
      meta.json            tokenizer spec, vocab size, token/byte counts per split, source, format version,
                           and `checksums`: per split, the size and sha256 of each shard file
      train/, val/         litdata chunks (index.json + chunk-*.bin), one flat token stream per split
      tasks/*.jsonl        the offline eval tasks' data (data/task_files.py)
      tokenizer.json       for bpe / hf tokenizers (tokenizer.tiktoken for tiktoken)

Every problem is a ValueError that says what to run. Bits per byte = loss_nats / ln 2 / bytes_per_token,
with meta.json's bytes_per_token of the split (`bits_per_byte`, the one place it is computed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.core.errors import InputError, UsageError
from lrattn_lightning.data import remote
from lrattn_lightning.data.staging import check_stop
from lrattn_lightning.model.config import SizeConfig

FORMAT_VERSION = 1
SPLITS = ("train", "val")
REPREPARE_HINT = "prepare it again with `lrattn prepare --overwrite` (prepare(..., overwrite=True))"


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """Parsed meta.json of a folder or an s3:// prefix; InputError (saying what to run) if it is missing or corrupt."""
    if remote.is_remote(data_dir):
        try:
            path = remote.fetch(data_dir, "meta.json")
        except FileNotFoundError as err:
            raise InputError(f"{data_dir}/meta.json does not exist, so {data_dir} is not a prepared data dir; write one "
                             f"with `lrattn prepare --out {data_dir}`") from err
        return _parse_meta(path)
    root = Path(data_dir)
    if not root.is_dir() or not any(root.iterdir()):
        raise InputError(f"data dir {root} is missing or empty; create it with `lrattn prepare --source stdlib-docs "
                         f"--tokenizer byte --out {root}` (the bundled corpus; --source FILES for your own corpus)")
    path = root / "meta.json"
    if not path.is_file():
        raise InputError(f"{path} is missing, so {root} is not a prepared data dir; {REPREPARE_HINT}")
    return _parse_meta(path)


def _parse_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path} is corrupt ({err}); {REPREPARE_HINT}") from err
    missing = [k for k in ("format_version", "tokenizer", "vocab_size", "splits") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise InputError(f"{path} is corrupt: missing {missing}; {REPREPARE_HINT}")
    if meta["format_version"] != FORMAT_VERSION:
        raise InputError(
            f"{path} has format_version {meta['format_version']}, this code reads {FORMAT_VERSION}; {REPREPARE_HINT}"
        )
    return meta


def check_shards(data_dir: str | Path, split: str, listing: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The chunk records of `split`; InputError if index.json or a chunk file is missing or the wrong size. For
    an s3:// prefix, the sizes are its objects' (`listing`, else listed now)."""
    if remote.is_remote(data_dir):
        return _check_remote_shards(data_dir, split, listing)
    shard_dir = Path(data_dir) / split
    index = shard_dir / "index.json"
    try:
        chunks = json.loads(index.read_text())["chunks"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise InputError(f"{index} is missing or unreadable ({err}); {REPREPARE_HINT}") from err
    for chunk in chunks:
        path = shard_dir / chunk["filename"]
        size = path.stat().st_size if path.is_file() else None
        if size != chunk["chunk_bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise InputError(
                f"shard {path} is corrupt: expected {chunk['chunk_bytes']} bytes, found {found}; {REPREPARE_HINT}"
            )
    return chunks


def _check_remote_shards(url: str, split: str, listing: dict[str, int] | None) -> list[dict[str, Any]]:
    try:
        chunks = json.loads(remote.fetch(url, f"{split}/index.json").read_text())["chunks"]
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise InputError(f"{url}/{split}/index.json is missing or unreadable ({err}); {REPREPARE_HINT}") from err
    listing = remote.sizes(url) if listing is None else listing
    for chunk in chunks:
        size = listing.get(f"{split}/{chunk['filename']}")
        if size != chunk["chunk_bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise InputError(f"shard {url}/{split}/{chunk['filename']} is corrupt: expected {chunk['chunk_bytes']} bytes, "
                             f"found {found}; {REPREPARE_HINT}")
    return chunks


def max_token_id(shard_dir: str | Path, chunks: list[dict[str, Any]], dtype: Any) -> int:
    """The largest token id in a split's chunks (-1 if empty)."""
    return max(chunk_max_ids(shard_dir, chunks, dtype).values(), default=-1)


def chunk_max_ids(shard_dir: str | Path, chunks: list[dict[str, Any]], dtype: Any) -> dict[str, int]:
    """{chunk file: its largest token id}: a litdata chunk is a uint32 header (item count, item count + 1
    offsets) followed by the tokens, which are read through a memory map."""
    tops = {}
    for chunk in chunks:
        path = Path(shard_dir) / chunk["filename"]
        header = (chunk["chunk_size"] + 2) * 4
        if path.stat().st_size > header:
            tops[chunk["filename"]] = int(np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=header).max())
    return tops


def ids_scanned_over(files: dict[str, dict[str, Any]]) -> str:
    """What a split's recorded max_token_id was computed over (meta.json `max_token_id_of`): the sha256 of its
    chunks' sha256s as `shard_files` records them (index.json left out: the ids live in the chunks)."""
    chunks = {name: record["sha256"] for name, record in sorted(files.items()) if name != "index.json"}
    return hashlib.sha256(json.dumps(chunks, sort_keys=True).encode()).hexdigest()


def shard_files(shard_dir: str | Path) -> dict[str, dict[str, Any]]:
    """What prepare records of a split for `verify_files`: {name: {"bytes", "sha256"}} of index.json and
    every chunk it lists."""
    shard_dir = Path(shard_dir)
    names = ["index.json", *(c["filename"] for c in json.loads((shard_dir / "index.json").read_text())["chunks"])]
    digests = _sha256_all([shard_dir / n for n in names])
    return {n: {"bytes": (shard_dir / n).stat().st_size, "sha256": d} for n, d in zip(names, digests, strict=True)}


def verify_files(shard_dir: str | Path, files: dict[str, dict[str, Any]]) -> None:
    """InputError naming the first file that is missing, resized or changed since prepare recorded `files`.

    Sizes first (a stat each: a truncated chunk is found at once), then every file's sha256: the whole
    split is read once, I/O bound (~1.4 GB/s a core with SHA-NI; files are hashed in parallel threads,
    and a file already verified in this process, unchanged since by size, mtime and ctime, is not re-read).
    """
    shard_dir = Path(shard_dir)
    for name, record in files.items():
        path = shard_dir / name
        size = path.stat().st_size if path.is_file() else None
        if size != record["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise InputError(f"{path}: {found}, but prepare wrote {record['bytes']} bytes (truncated or replaced "
                             f"since); {REPREPARE_HINT}")
    paths = [shard_dir / name for name in files]
    for path, digest, record in zip(paths, _sha256_all(paths), files.values(), strict=True):
        if digest != record["sha256"]:
            raise InputError(f"{path}: contents changed since prepare (sha256 {digest[:12]}..., meta.json records "
                             f"{record['sha256'][:12]}...): the file is corrupt or was rewritten; {REPREPARE_HINT}")


_VERIFIED: dict[tuple, str] = {}  # (path, size, mtime_ns, ctime_ns, inode) -> sha256, for this process


def sha256_files(paths: list[Path]) -> list[str]:
    """The sha256 of each file (hex), hashed in parallel threads."""
    return _sha256_all(paths)


def _sha256_all(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL on large updates, so threads hash several chunks at once
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(len(paths), 1))) as pool:
        return list(pool.map(_sha256, paths))


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _VERIFIED:
        digest, buffer = hashlib.sha256(), bytearray(1 << 20)
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                check_stop()  # prepare's signals stop a long hash (in this thread; the caller's map re-raises)
                digest.update(memoryview(buffer)[:n])
        _VERIFIED[key] = digest.hexdigest()
    return _VERIFIED[key]


def count_windows(chunks: list[dict[str, Any]], window: int) -> int:
    """Windows of `window` tokens litdata's TokensLoader yields (they never cross a chunk boundary)."""
    return sum(c["dim"] // window for c in chunks)


def training_window(seq_len: int | None, size: SizeConfig, flag: str | None = None) -> int:
    """The window a run trains and scores on: `seq_len` (the data module's, `--data.seq_len`), or the size's where it
    is unset; an integer from 1 to the size's positions. The one home of that rule: `lrattn fit|validate|test`
    (`flag`: its line names the flag), validate_data_dir and TokenDataModule.validate_for ask it."""
    if seq_len is None:
        return size.seq_len
    name, error = (flag, UsageError) if flag else ("seq_len", InputError)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise error(f"{name} {seq_len}: must be an integer >= 1")
    if seq_len > size.seq_len:
        raise error(f"{flag}={seq_len} exceeds seq_len={size.seq_len} of size '{size.name}'; use a shorter window or "
                    "a larger size" if flag else f"seq_len {seq_len} exceeds the {size.seq_len} positions of size "
                    f"'{size.name}'; use seq_len <= {size.seq_len}")
    return seq_len


def validate_data_dir(data_dir: str | Path, size: SizeConfig, seq_len: int | None = None,
                      sizes: Iterable[SizeConfig] = ()) -> dict[str, Any]:
    """Check a prepared folder against a model size before training; returns meta. ValueError on any problem.

    `seq_len` (the DataModule's): its training_window. `sizes` (the registry's): a vocabulary too large for `size`
    names those that fit.
    """
    meta = read_meta(data_dir)
    if meta["vocab_size"] > size.vocab_size:
        raise InputError(
            f"data vocab_size {meta['vocab_size']} ({meta['tokenizer'].get('kind')} tokenizer in {data_dir}) exceeds "
            f"model vocab_size {size.vocab_size} of size '{size.name}'; {_sizes_that_fit(meta['vocab_size'], sizes)}; "
            f"or prepare the data with a smaller tokenizer (byte, or bpe:{size.vocab_size})"
        )
    seq_len = training_window(seq_len, size)
    listing = remote.sizes(data_dir) if remote.is_remote(data_dir) else None
    for split in ("val", "train"):
        check_split(data_dir, meta, split, size, seq_len, listing)
    return meta


def _sizes_that_fit(vocab: int, sizes: Iterable[SizeConfig]) -> str:
    """`--size NAME` for each size with room for `vocab` ids (the first six), or that the registry has none."""
    sizes = list(sizes)
    fit = [s.name for s in sizes if s.vocab_size >= vocab]
    if fit:
        more = f" (or {len(fit) - 6} more)" if len(fit) > 6 else ""
        return f"sizes with room for {vocab} ids: {', '.join(fit[:6])}{more} (--size NAME)"
    if sizes:
        top = max(sizes, key=lambda s: s.vocab_size)
        return (f"no size of the registry has room for {vocab} ids (the most: {top.vocab_size}, size '{top.name}'): "
                f"add one with vocab_size >= {vocab} (extends: {top.name})")
    return f"choose a size with vocab_size >= {vocab}"


def check_split(data_dir: str | Path, meta: dict[str, Any], split: str, size: SizeConfig, seq_len: int,
                listing: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """One split whole (sizes, sha256s), its ids within the data's and the model's vocabulary, and at least one
    window of seq_len + 1: training checks both splits, `lrattn eval --val-loss` the val split before any task
    runs. Returns its chunk records."""
    if listing is None and remote.is_remote(data_dir):
        listing = remote.sizes(data_dir)
    chunks = check_shards(data_dir, split, listing)
    files = meta.get("checksums", {}).get(split)
    if listing is not None:
        verify_split(data_dir, split, meta, listing)
    _check_token_ids(data_dir, split, chunks, meta, size)
    if files and listing is None:
        verify_split(data_dir, split, meta)
    if count_windows(chunks, seq_len + 1) == 0:
        tokens = sum(c["dim"] for c in chunks)
        raise InputError(
            f"the {split} split of {data_dir} has {tokens} tokens in {len(chunks)} chunk(s), fewer than one "
            f"window of seq_len + 1 = {seq_len + 1}; use a shorter seq_len, a larger val_fraction or more data"
        )
    return chunks


def verify_split(data_dir: str | Path, split: str, meta: dict[str, Any], listing: dict[str, int] | None = None) -> None:
    """Every shard file of a split as prepare recorded it (size and sha256), in a folder or an s3:// prefix."""
    files = meta.get("checksums", {}).get(split)
    if remote.is_remote(data_dir):
        _verify_remote(str(data_dir), split, files, remote.sizes(str(data_dir)) if listing is None else listing)
    elif files:
        verify_files(Path(data_dir) / split, files)


def _verify_remote(url: str, split: str, files: dict[str, dict[str, Any]] | None, listing: dict[str, int]) -> None:
    """A prepared folder in object storage: every object's size as prepare recorded it, index.json's sha256, and
    each chunk's sha256 as S3 keeps it (a HEAD request each: the chunks are not downloaded before training).
    Objects S3 keeps no SHA-256 for (uploaded by another tool) are checked by size only, with a warning."""
    if not files:
        raise InputError(f"{url}/meta.json records no checksums (prepared by an older version); {REPREPARE_HINT}")
    for name, record in files.items():
        if listing.get(f"{split}/{name}") != record["bytes"]:
            found = listing.get(f"{split}/{name}")
            raise InputError(f"{url}/{split}/{name}: {'missing' if found is None else f'{found} bytes'}, but prepare "
                             f"wrote {record['bytes']} bytes (truncated or replaced since); {REPREPARE_HINT}")
    digest = _sha256(remote.local_dir(url) / split / "index.json")
    if digest != files["index.json"]["sha256"]:
        raise InputError(f"{url}/{split}/index.json: contents changed since prepare (sha256 {digest[:12]}...); "
                         f"{REPREPARE_HINT}")
    chunks = sorted(n for n in files if n != "index.json")
    unchecked = []
    for name, digest in remote.sha256s(url, [f"{split}/{n}" for n in chunks]).items():
        record = files[name.split("/", 1)[1]]
        if digest is None:
            unchecked.append(name)
        elif digest != record["sha256"]:
            raise InputError(f"{url}/{name}: contents changed since prepare (S3's sha256 {digest[:12]}..., meta.json "
                             f"records {record['sha256'][:12]}...): the object was rewritten; {REPREPARE_HINT}")
    if unchecked:
        print(f"[lrattn] warning: {url}: S3 keeps no SHA-256 for {len(unchecked)} of the {len(chunks)} {split} shards (e.g. "
                      f"{unchecked[0]}: uploaded by another tool?), so they are checked by size only; upload them "
                      "with `lrattn prepare --out s3://...` to have their contents checked", file=sys.stderr, flush=True)


def _check_token_ids(data_dir: str | Path, split: str, chunks: list[dict[str, Any]], meta: dict[str, Any],
                     size: SizeConfig) -> None:
    """Every id below the data's own vocabulary (meta.json vocab_size, at most the model's: checked before). An id
    past the model's crashes the first step (a device-side assert on GPUs); one between the two trains rows the
    tokenizer never writes, silently: both are one line here.

    prepare records each split's largest id and the chunk checksums it was computed over (`max_token_id_of`): it
    stands in for a scan only while those are still the split's recorded checksums (which `verify_split` then
    checks against the files). Shards rewritten since, their checksums recomputed, are scanned; so are folders
    prepared before the ids were bound to their checksums, or whose meta.json lost its max_token_id.
    """
    record, files = meta["splits"].get(split, {}), meta.get("checksums", {}).get(split)
    where, top = f"the {split} split of {data_dir}", record.get("max_token_id")
    bound = top is not None and bool(files) and record.get("max_token_id_of") == ids_scanned_over(files)
    if remote.is_remote(data_dir) and not bound:
        if "max_token_id_of" in record or top is None:  # no scan of an s3:// prefix before training: its chunks stay there
            raise InputError(f"{data_dir}/meta.json: the {split} split's max_token_id was not recorded for the shards "
                             f"its checksums name (rewritten since prepare?); {REPREPARE_HINT}")
        bound = bool(files)  # prepared before the binding: the recorded id, as S3's checksums of the chunks vouch
    if not bound:
        tops = chunk_max_ids(Path(data_dir) / split, chunks, meta.get("dtype", "uint16"))
        name, top = max(tops.items(), key=lambda item: item[1], default=("", -1))
        where = f"{Path(data_dir) / split / name}:"
    vocab, kind = int(meta["vocab_size"]), meta["tokenizer"].get("kind")
    if top >= vocab:
        model = (f") and the vocab_size {size.vocab_size} of size '{size.name}'" if top >= size.vocab_size else
                 f"; size '{size.name}' has {size.vocab_size} rows: it would train rows the tokenizer never writes)")
        raise InputError(f"{where} holds token id {top}, beyond the {vocab} ids of its {kind} tokenizer (meta.json "
                         f"vocab_size{model}: the shard is corrupt or was written by another tokenizer; {REPREPARE_HINT}")


def bits_per_byte(loss_nats_per_token: Any, bytes_per_token: float) -> Any:
    """Cross-entropy in nats per token -> bits per UTF-8 byte of text (a float, or a tensor for a tensor).

    `bytes_per_token` is the split's, from meta.json (`TokenDataModule.bytes_per_token`). Every
    bpb the project reports (val/bpb in training, eval/val/bpb in `lrattn eval`) comes from here.
    """
    return loss_nats_per_token / math.log(2) / bytes_per_token
