"""A prepared folder: its layout, and the checks that it is whole and fits a model before training.

    out_dir/
      meta.json            tokenizer spec, vocab size, token/byte counts per split, source, format version
      train/, val/         litdata chunks (index.json + chunk-*.bin), one flat token stream per split
      tasks/*.jsonl        the offline eval tasks' data (data/task_files.py)
      tokenizer.json       for bpe / hf tokenizers (tokenizer.tiktoken for tiktoken)

Every problem is a ValueError that says what to run. Bits per byte = loss_nats / ln 2 / bytes_per_token,
with meta.json's bytes_per_token of the split (`bits_per_byte`, the one place it is computed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.errors import InputError
from lrattn_lightning.model.config import SizeConfig

FORMAT_VERSION = 1
SPLITS = ("train", "val")
PREPARE_HINT = "run `lrattn prepare` (lrattn_lightning.data.prepare.prepare) to create it"
REPREPARE_HINT = "prepare it again with `lrattn prepare --overwrite` (prepare(..., overwrite=True))"


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """Parsed meta.json; ValueError (saying what to run) if the folder or file is missing or corrupt."""
    root = Path(data_dir)
    if not root.is_dir() or not any(root.iterdir()):
        raise InputError(f"data dir {root} is missing or empty; {PREPARE_HINT}")
    path = root / "meta.json"
    if not path.is_file():
        raise InputError(f"{path} is missing, so {root} is not a prepared data dir; {REPREPARE_HINT}")
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


def check_shards(data_dir: str | Path, split: str) -> list[dict[str, Any]]:
    """The chunk records of `split`; ValueError if index.json or a chunk file is missing or the wrong size."""
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
        raise InputError(
            f"data vocab_size {meta['vocab_size']} ({meta['tokenizer'].get('kind')} tokenizer in {data_dir}) exceeds "
            f"model vocab_size {size.vocab_size} of size '{size.name}'; choose a size with vocab_size >= "
            f"{meta['vocab_size']} or prepare the data with a smaller tokenizer (byte, or bpe:{size.vocab_size})"
        )
    if seq_len > size.seq_len:
        raise InputError(f"seq_len {seq_len} exceeds the {size.seq_len} positions of size '{size.name}'; use seq_len <= {size.seq_len}")
    for split in ("val", "train"):
        chunks = check_shards(data_dir, split)
        # An id the embedding does not have crashes the first step (a device-side assert on GPUs).
        # prepare records each split's largest id; folders prepared before that are scanned.
        top = meta["splits"].get(split, {}).get("max_token_id")
        if top is None:
            top = max_token_id(Path(data_dir) / split, chunks, meta.get("dtype", "uint16"))
        if top >= size.vocab_size:
            raise InputError(
                f"the {split} split of {data_dir} holds token id {top}, beyond the vocab_size {size.vocab_size} of size "
                f"'{size.name}' (ids must be < {size.vocab_size}); prepare the data with a tokenizer that fits the "
                "model or choose a size with a larger vocab_size"
            )
        if count_windows(chunks, seq_len + 1) == 0:
            tokens = sum(c["dim"] for c in chunks)
            raise InputError(
                f"the {split} split of {data_dir} has {tokens} tokens in {len(chunks)} chunk(s), fewer than one "
                f"window of seq_len + 1 = {seq_len + 1}; use a shorter seq_len, a larger val_fraction or more data"
            )
    return meta


def bits_per_byte(loss_nats_per_token: Any, bytes_per_token: float) -> Any:
    """Cross-entropy in nats per token -> bits per UTF-8 byte of text (a float, or a tensor for a tensor).

    `bytes_per_token` is the split's, from meta.json (`TokenDataModule.bytes_per_token`). Every
    bpb the project reports (val/bpb in training, eval/val/bpb in `lrattn eval`) comes from here.
    """
    return loss_nats_per_token / math.log(2) / bytes_per_token
