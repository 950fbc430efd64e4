"""Disk space for `prepare`: refused before the shards are written when the estimate does not fit, and a disk
that fills anyway (ENOSPC anywhere, a tokenizer process's included) is one line.

The estimate: the text's decompressed size (read from the files, a compressed one's ratio measured on its first
megabyte: data/formats.py), a token per BYTES_PER_TOKEN bytes of it, 2 or 4 bytes an id, less what a resumed
prepare has written already.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.split import SPLITS

if TYPE_CHECKING:
    from lrattn_lightning.data.sources import Corpus

BYTES_PER_TOKEN = {"byte": 1.0}  # text bytes a token, for the free-space estimate (others: DEFAULT_BYTES_PER_TOKEN)
DEFAULT_BYTES_PER_TOKEN = 2.0  # below what byte-level BPE reaches on prose from a few thousand merges on


class NoSpace(InputError):
    """The disk is too small for the shards: said before writing when the estimate shows it, else when it fills."""


def no_space(work: Any, where: Path) -> Any:
    """`work()`; a full disk (ENOSPC, here or in a tokenizer process) as one line. The caller removes the staging
    folder, which frees what was written."""
    try:
        return work()
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        folder = where if where.exists() else where.parent
        while not folder.exists():
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        raise NoSpace(f"no space left on the device of {where} (writing {err.filename or 'the shards'}; "
                      f"{gb(free)} free now): the unfinished folder is removed; free space on it, or choose another "
                      "--out") from err


def gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def check_space(root: Path, corpora: list[Corpus], tokenizer: str, dtype: Any, limits: tuple) -> None:
    """Refuse, before the shards are written, when the disk cannot hold them: the text's decompressed size (read
    from the files, compressed ones estimated from their first megabyte; at most --max_bytes), a token per
    BYTES_PER_TOKEN bytes of it, `dtype` bytes a token id, less what a resumed prepare has written already."""
    max_documents, max_bytes, _ = limits
    expected = [c.expected() for c in corpora]
    if None in expected or max_documents is not None:
        return  # a built-in corpus, a streamed dataset or a prefix of so many documents: no size to go by
    text = sum(expected) if max_bytes is None else min(sum(expected), max_bytes + sum(expected[1:]))
    per_token = BYTES_PER_TOKEN.get(tokenizer, DEFAULT_BYTES_PER_TOKEN)
    need = int(text / per_token * np.dtype(dtype).itemsize * 1.01) + (1 << 20)
    written = sum(p.stat().st_size for split in SPLITS for p in (root / split).glob("chunk-*"))
    free = shutil.disk_usage(root).free
    if need - written > free:
        raise NoSpace(f"the shards need about {gb(need - written)} ({gb(text)} of text, a token per {per_token:g} "
                      f"byte(s) of it, {np.dtype(dtype).itemsize} bytes an id) and {root.parent} has {gb(free)} free; "
                      "free space, choose another --out, or take a prefix with --max_documents")
