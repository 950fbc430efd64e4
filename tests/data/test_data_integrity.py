"""Shards damaged after `lrattn prepare`, while meta.json still says they are fine (issue 19, item 4).

Real shards from a real `lrattn prepare` subprocess, really corrupted on disk (bytes overwritten, a chunk
truncated, token ids beyond the vocabulary written in), then a real `lrattn fit` from a scratch folder: one
line `lrattn: error: data/<split>/<file>: ...` naming the file, exit 2, no run and no MLflow store started.
Before prepare recorded a sha256 per shard file, the ids were trusted from meta.json and the first step (or
the sanity validation) died in a 122-line IndexError. Also `lrattn prepare --out` under a regular file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import in_process
from helpers.paths import REPO_ROOT
from helpers.tracking import seed_store

from lrattn_lightning.data import shards
from lrattn_lightning.data.shards import read_meta, validate_data_dir
from lrattn_lightning.model.registry import load_registry

REPO = REPO_ROOT
REGISTRY = str(REPO / "registry.yaml")


def lrattn(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`lrattn ARGS` in this process from `cwd` (helpers/cli.py)."""
    return in_process(args, cwd)


def fit(cwd: Path, steps: int = 2) -> subprocess.CompletedProcess:
    return lrattn(["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir", "data",
                   "--data.batch_size", "2", "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "2",
                   "--trainer.val_check_interval", str(steps), "--trainer.enable_progress_bar", "false",
                   "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu",
                   "--trainer.devices", "1", "--model.warmup_steps", "1"], cwd)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("prepared")
    done = lrattn(["prepare", "--source", "stdlib-docs", "--tokenizer", "byte", "--max_documents", "60",
                   "--val_fraction", "0.1", "--out", "data"], where)
    assert done.returncode == 0, done.stderr
    return where / "data"


def scratch_copy(prepared: Path, tmp_path: Path) -> Path:
    """A scratch folder holding a copy of the prepared folder as ./data."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    shutil.copytree(prepared, scratch / "data")
    return scratch


def chunk_body(data: Path, split: str) -> tuple[Path, np.memmap]:
    """The first chunk of `split` and a writable view of its tokens (after litdata's uint32 header)."""
    chunk = json.loads((data / split / "index.json").read_text())["chunks"][0]
    path = data / split / chunk["filename"]
    return path, np.memmap(path, dtype=np.uint16, mode="r+", offset=(chunk["chunk_size"] + 2) * 4)


# ---- the corruptions: each returns the file the one line must name ----------------------------------
def overwrite_half_with_random_bytes(data: Path) -> str:
    path, _ = chunk_body(data, "val")  # the sanity validation would read it first
    raw = bytearray(path.read_bytes())
    raw[: len(raw) // 2] = np.random.default_rng(0).bytes(len(raw) // 2)  # the header too
    path.write_bytes(bytes(raw))
    return "data/val/chunk-0-0.bin"


def write_ids_beyond_the_vocabulary(data: Path) -> str:
    path, body = chunk_body(data, "train")
    body[[10, 500, 1000]] = [700, 257, 65535]  # the tiny model has 512 embeddings, the byte tokenizer 257 ids
    body.flush()
    return "data/train/chunk-0-0.bin"


def truncate(data: Path) -> str:
    path, _ = chunk_body(data, "train")
    path.write_bytes(path.read_bytes()[:-1000])
    return "data/train/chunk-0-0.bin"


def truncate_and_rewrite_index(data: Path) -> str:
    """The chunk cut and index.json edited to agree with it: only meta.json's record still knows."""
    truncate(data)
    index = json.loads((data / "train/index.json").read_text())
    index["chunks"][0]["chunk_bytes"] -= 1000
    (data / "train/index.json").write_text(json.dumps(index))
    return "data/train/chunk-0-0.bin"


CORRUPTIONS = {
    "half a val chunk overwritten with random bytes": (overwrite_half_with_random_bytes, "contents changed since prepare"),
    "token ids beyond the vocabulary, meta.json unchanged": (write_ids_beyond_the_vocabulary, "contents changed"),
    "a truncated chunk": (truncate, "bytes"),
    "a truncated chunk, index.json rewritten to match": (truncate_and_rewrite_index, "but prepare wrote"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_shards_are_one_line_naming_the_file(case, prepared, tmp_path):
    scratch = scratch_copy(prepared, tmp_path)
    meta_before = (scratch / "data/meta.json").read_bytes()
    corrupt, needle = CORRUPTIONS[case]
    name = corrupt(scratch / "data")
    done = fit(scratch)
    lines = [line for line in done.stderr.splitlines() if line.startswith("lrattn:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("lrattn: error: ") and name in lines[0] and needle in lines[0], lines[0]
    assert "lrattn prepare" in lines[0]  # the fix
    assert sorted(p.name for p in scratch.iterdir()) == ["data"]  # no runs/, no mlflow.db: nothing started
    assert (scratch / "data/meta.json").read_bytes() == meta_before


def test_prepare_records_each_shard_files_sha256(prepared):
    """meta.json's records are the files' real sizes and sha256 (hashed here independently)."""
    for split in ("train", "val"):
        files = read_meta(prepared)["checksums"][split]
        chunks = json.loads((prepared / split / "index.json").read_text())["chunks"]
        assert list(files) == ["index.json", *(c["filename"] for c in chunks)]
        for name, record in files.items():
            raw = (prepared / split / name).read_bytes()
            assert record == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def test_clean_data_trains_and_still_verifies_after_training(prepared, tmp_path, store_template):
    scratch = scratch_copy(prepared, tmp_path)
    seed_store(scratch, store_template)
    done = fit(scratch)
    assert done.returncode == 0, done.stderr[-3000:]
    shards._VERIFIED.clear()  # hash again: training must not have touched what prepare recorded
    validate_data_dir(scratch / "data", load_registry(REGISTRY).size("tiny"))


def _as_prepared_before_checksums(data: Path) -> None:
    meta = json.loads((data / "meta.json").read_text())
    del meta["checksums"]  # max_token_id stays: recorded, and now stale
    (data / "meta.json").write_text(json.dumps(meta, indent=2))


def test_folder_prepared_before_checksums_still_works_and_is_scanned(prepared, tmp_path):
    size = load_registry(REGISTRY).size("tiny")
    scratch = scratch_copy(prepared, tmp_path)
    _as_prepared_before_checksums(scratch / "data")
    assert validate_data_dir(scratch / "data", size)["vocab_size"] == 257  # a clean old folder passes
    write_ids_beyond_the_vocabulary(scratch / "data")
    done = fit(scratch)
    lines = [line for line in done.stderr.splitlines() if line.startswith("lrattn:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("lrattn: error: data/train/chunk-0-0.bin: holds token id 65535"), lines[0]
    assert sorted(p.name for p in scratch.iterdir()) == ["data"]


def _rewrite_with_checksums(data: Path, token_id: int) -> None:
    """A shard rewritten with new ids and meta.json's checksums recomputed to match (max_token_id left as it was)."""
    _, body = chunk_body(data, "train")
    body[[10, 500]] = token_id
    body.flush()
    meta = json.loads((data / "meta.json").read_text())
    meta["checksums"]["train"] = shards.shard_files(data / "train")
    (data / "meta.json").write_text(json.dumps(meta, indent=2))


@pytest.mark.parametrize("token_id, needle", [
    (300, "beyond the 257 ids of its byte tokenizer (meta.json vocab_size; size 'tiny' has 512 rows"),
    (700, "beyond the 257 ids of its byte tokenizer (meta.json vocab_size) and the vocab_size 512 of size 'tiny'")])
def test_ids_past_the_datas_vocabulary_in_shards_rewritten_with_their_checksums_are_one_line(
        token_id, needle, prepared, tmp_path):
    """Issue 53: ids between the data's vocabulary and the model's (300: byte data, a 512-row model) trained
    silently; shards rewritten with recomputed checksums had their stale max_token_id trusted, and ids past the
    model's vocabulary crashed the first step in a 130-line IndexError. The recorded id holds only for the chunks
    prepare scanned (`max_token_id_of`): these are scanned, and checked against the data's own vocabulary."""
    scratch = scratch_copy(prepared, tmp_path)
    _rewrite_with_checksums(scratch / "data", token_id)
    done = fit(scratch)
    lines = [line for line in done.stderr.splitlines() if line.startswith("lrattn:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"lrattn: error: data/train/chunk-0-0.bin: holds token id {token_id}, "), lines[0]
    assert needle in lines[0] and "lrattn prepare --overwrite" in lines[0], lines[0]
    assert sorted(p.name for p in scratch.iterdir()) == ["data"]  # no run, no MLflow store


def test_a_prepared_folders_recorded_ids_stand_in_for_the_scan_only_for_its_own_chunks(prepared, tmp_path, monkeypatch):
    size = load_registry(REGISTRY).size("tiny")
    scanned = []
    monkeypatch.setattr(shards, "chunk_max_ids", lambda *a: scanned.append(a[0]) or {"chunk-0-0.bin": 256})
    validate_data_dir(prepared, size)
    assert scanned == []  # as prepared: the recorded ids, bound to the checksums verified next
    scratch = scratch_copy(prepared, tmp_path)
    _rewrite_with_checksums(scratch / "data", 65)
    validate_data_dir(scratch / "data", size)
    assert scanned == [scratch / "data/train"]  # rewritten since: scanned (its val split still as prepared)


@pytest.mark.parametrize("out, overwrite", [("file.txt/sub", False), ("file.txt/a/b", False), ("file.txt", True),
                                            (".", True)])
def test_prepare_out_under_a_file_or_not_replaceable_is_one_line(out, overwrite, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "file.txt").write_text("kept\n")
    done = lrattn(["prepare", "--max_documents", "5", "--out", out, *(["--overwrite"] if overwrite else [])], scratch)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and f"--out {out}" in done.stderr
    assert "choose another --out" in done.stderr
    assert [p.name for p in scratch.iterdir()] == ["file.txt"] and (scratch / "file.txt").read_text() == "kept\n"


def test_prepare_overwrite_refuses_a_folder_it_did_not_write(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("kept\n")
    done = lrattn(["prepare", "--max_documents", "5", "--out", "notes", "--overwrite"], tmp_path)
    assert done.returncode == 2 and "thesis.tex" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"] and (mine / "thesis.tex").read_text() == "kept\n"
