"""`lrattn prepare` as the process tests run it, and corpora built for a fit: the command with small parts (a kill
lands between parts of conftest's jsonl_corpus), waiting for a finished part, the processes still naming an output,
and a corpus of exactly four training windows."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from helpers.paths import REPO_ROOT
from lrattn_lightning.data.prepare import prepare, split_of

PART_BYTES = 80_000
# `lrattn prepare` with small parts (the only change): a kill lands between parts of a 4 MB corpus (54 parts; a
# stop finishes the 3-5 parts in flight first, so six interruptions in a row leave parts to do)
_IN_PARTS = ("import sys; from lrattn_lightning.data import pipeline; pipeline.PART_BYTES = int(sys.argv[1]); "
             "from lrattn_lightning.cli import main; sys.exit(main(['prepare', *sys.argv[2:]]))")
JSONL_ARGS = ["--source", "corpus.jsonl", "--tokenizer", "hf:tok.json", "--num_workers", "2"]  # jsonl_corpus's files


def prepare_in_parts(*args: str) -> list[str]:
    """The command `lrattn prepare ARGS` with parts of PART_BYTES."""
    return [sys.executable, "-c", _IN_PARTS, str(PART_BYTES), *args]


def prepare_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def wait_for_part(staging: Path, n: int, proc: subprocess.Popen) -> None:
    """Until part `n` of the prepare writing `staging` is finished (while `proc` runs, at most 2 minutes)."""
    deadline = time.monotonic() + 120
    while not (staging / ".prepare" / "parts" / f"{n}.json").is_file():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no part was finished"
        time.sleep(0.02)


def processes_naming(marker: str) -> list[int]:
    """The pids of the processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def gone(marker: str, timeout: float = 10) -> bool:
    """No process whose command line names `marker` is left (after up to `timeout` s for them to end)."""
    deadline = time.monotonic() + timeout
    while processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not processes_naming(marker)


def four_window_corpus(root: Path) -> Path:
    """A prepared corpus whose train split is exactly 4 windows of 33 tokens (and as much validation): 2 ranks x
    batch 2 and 1 rank x batch 4 both see the whole split at every step."""
    corpus = root / "corpus"
    corpus.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    picked = {"train": [], "val": []}
    for i in range(200):  # choose file names whose documents land in the wanted split
        side = split_of(f"doc{i:03d}.txt", 0.5)
        if len(picked[side]) < 2:
            picked[side].append(i)
    for ids in picked.values():
        for i in ids:  # 70 chars + EOS = 71 tokens; two documents = 142 tokens = 4 windows of 33
            text = " ".join(words[(i + k) % len(words)] for k in range(20))[:70].ljust(70, ".")
            (corpus / f"doc{i:03d}.txt").write_text(text)
    data = root / "data"
    prepare(source=str(corpus), out_dir=data, tokenizer="byte", val_fraction=0.5, cloze_items=0, perplexity_documents=0)
    return data


def prepared_corpus(tmp_path_factory, documents: int, cloze_items: int = 0, perplexity_documents: int = 0) -> Path:
    """`documents` of the bundled stdlib docs, byte-tokenised into a new folder (10 % held out)."""
    from lrattn_lightning.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib-byte"
    prepare(source="stdlib-docs", out_dir=out, tokenizer="byte", max_documents=documents, val_fraction=0.1,
            cloze_items=cloze_items, perplexity_documents=perplexity_documents)
    return out


def split_ids(out: Path, side: str) -> np.ndarray:
    """The token ids of one split of a `prepare` output, read from the chunk files themselves (litdata's layout:
    a header of chunk_size + 2 uint32, then the uint16 ids)."""
    index = json.loads((out / side / "index.json").read_text())
    parts = [np.fromfile(out / side / c["filename"], dtype=np.uint16)[(c["chunk_size"] + 2) * 2 :]
             for c in index["chunks"]]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def split_documents(out: Path, side: str) -> list[str]:
    """The documents of one split of a byte-tokenised `prepare` output, in order (a document is its UTF-8 bytes,
    then EOS = 256)."""
    stream = split_ids(out, side)
    assert stream.size == 0 or stream[-1] == 256, "a split ends with a document's EOS"
    documents = np.split(stream, np.flatnonzero(stream == 256) + 1)[:-1]
    return [bytes(ids[:-1].astype(np.uint8)).decode("utf-8") for ids in documents]


def read_back(out: Path) -> collections.Counter:
    """The documents in the shards of both splits of a byte-tokenised `prepare` output."""
    return collections.Counter(split_documents(out, "train") + split_documents(out, "val"))


def prepare_in(args: list[str], cwd: Path, capsys) -> tuple[int, list[str]]:
    """`lrattn prepare ARGS` in this process from folder `cwd`: (exit code, stderr's non-empty lines)."""
    from lrattn_lightning.cli import main as lrattn_main

    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = lrattn_main(["prepare", *args])
    finally:
        os.chdir(old)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]
