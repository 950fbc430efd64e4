"""Which documents are held out: a seeded hash, deterministic on every machine and for any file layout.

    u(key) = blake2b(key, 8 bytes, salt = seed) / 2**64  in [0, 1)

Built-in corpora carry keys (a topic, an entry, a chapter): a key is held out when u(key) < val_fraction, so
related pieces stay on one side; when no key falls there (a tiny prefix), the lowest key does. Seed 0 is the
unsalted hash (blake2b's salt is zeros by default), the split these corpora always had.

A user's documents are split one by one, by their content (the same document lands on the same side whatever
file, format or order it comes in): the stream is cut into blocks (at most BLOCK_DOCUMENTS documents or
BLOCK_BYTES characters), and after each block exactly round(n * val_fraction) of the n documents so far are
held out, the lowest u(text) of the block. So --val_fraction holds within one document for any corpus, a block
is all that is held in memory, and at least one document is held out once there are two.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.documents import Document

BLOCK_DOCUMENTS = 1000
BLOCK_BYTES = 1 << 20
SPLITS = ("train", "val")


def key_hash(key: str, seed: int = 0) -> float:
    """A stable uniform number in [0, 1) for a key (a document's key, or its text)."""
    return _uniform([key], seed)


def text_hash(doc: Document, seed: int = 0) -> float:
    """key_hash of a document's text, a spooled one's read in blocks (the same number as for the text whole)."""
    return _uniform(doc.blocks(), seed)


def _uniform(texts: Iterable[str], seed: int) -> float:
    """blake2b (8 bytes, salted by `seed`) of the texts' UTF-8, one after the other, as a number in [0, 1)."""
    digest = hashlib.blake2b(digest_size=8, salt=seed.to_bytes(16, "little"))
    for text in texts:
        digest.update(text.encode("utf-8"))
    return int.from_bytes(digest.digest(), "big") / 2**64


def split_of(key: str, val_fraction: float, seed: int = 0) -> str:
    """'val' for about `val_fraction` of keys, else 'train'; the same on every machine and run."""
    return "val" if key_hash(key, seed) < val_fraction else "train"


def check_seed(seed: int) -> int:
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise InputError(f"--split_seed {seed!r}: a whole number in [0, 2**64)")
    return seed


def sided(docs: Iterable[Document], val_fraction: float, seed: int) -> Iterator[tuple[Document, str]]:
    """(document, 'train' | 'val') in stream order: by key when documents have one, else by content in blocks."""
    it = iter(docs)
    first = next(it, None)
    if first is None:
        return
    if first.key is not None:
        yield from _by_key([first, *it], val_fraction, seed)
        return
    block: list[Document] = [first]
    size, done, held = first.length, 0, 0
    for doc in it:
        if len(block) >= BLOCK_DOCUMENTS or size >= BLOCK_BYTES:
            sides = _block_sides(block, done, held, val_fraction, seed, final=False)
            yield from zip(block, sides, strict=True)
            done, held, block, size = done + len(block), held + sides.count("val"), [], 0
        block.append(doc)
        size += doc.length
    yield from zip(block, _block_sides(block, done, held, val_fraction, seed, final=True), strict=True)


def _block_sides(block: list[Document], done: int, held: int, val_fraction: float, seed: int, final: bool) -> list[str]:
    want = math.floor((done + len(block)) * val_fraction + 0.5) - held
    if final and held + want == 0 and done + len(block) >= 2:
        want = 1  # a tiny corpus still gets a validation document
    want = max(0, min(want, len(block)))
    order = sorted(range(len(block)), key=lambda i: (text_hash(block[i], seed), i))
    held_out = set(order[:want])
    return ["val" if i in held_out else "train" for i in range(len(block))]


def _by_key(docs: list[Document], val_fraction: float, seed: int) -> Iterator[tuple[Document, str]]:
    sides = [split_of(d.key, val_fraction, seed) for d in docs]
    if "val" not in sides:
        lowest = min(docs, key=lambda d: key_hash(d.key, seed)).key
        sides = ["val" if d.key == lowest else "train" for d in docs]
    yield from zip(docs, sides, strict=True)


def fixed(docs: Iterable[Document], side: str) -> Iterator[tuple[Document, str]]:
    """Every document on one side (`--val_source`: the source is all train, the validation source all val)."""
    return ((doc, side) for doc in docs)
