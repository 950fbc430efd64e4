"""Bad input is one line `lrattn: error: ...` (exit 2) before any work, and nothing is written (items 9 and 10 of
the resilience issue; in process, through `main(argv)`); resumes that would silently change a run are refused in
one line, edits that do not change it are not. The real-process half is ../e2e/test_resilience.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers.paths import REPO_ROOT
from helpers.runs import REGISTRY, RUN, STRETCHABLE, ckpt_dir, fit_args, step_of, tmpfs

from lrattn_lightning.cli import main


# ---- items 9 and 10: one line, exit 2, before any work -----------------------------------------------
def _broken_inputs(folder: Path, data: Path) -> dict[str, Path]:
    (folder / "folder.yaml").mkdir()
    (folder / "latin1.yaml").write_bytes("sizes: {}  # caf\xe9\n".encode("latin-1"))
    (folder / "empty.ckpt").write_bytes(b"")
    (folder / "random.ckpt").write_bytes(np.random.default_rng(0).bytes(4096))
    big_ids = folder / "big-ids"
    shutil.copytree(data, big_ids)
    chunk = json.loads((big_ids / "train/index.json").read_text())["chunks"][0]
    body = np.memmap(big_ids / "train" / chunk["filename"], dtype=np.uint16, mode="r+", offset=(chunk["chunk_size"] + 2) * 4)
    body[100] = 700  # an id the tiny model (vocab 512) has no embedding for
    body.flush()
    meta = json.loads((big_ids / "meta.json").read_text())
    del meta["splits"]["train"]["max_token_id"]  # a folder prepared before the ids were recorded: scanned
    (big_ids / "meta.json").write_text(json.dumps(meta))
    return {"big-ids": big_ids}


def _drop(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2:]


BAD_INPUTS = {
    # name: (arguments after replacing DATA, expected words in the one line)
    "registry is a folder": (lambda d: fit_args(d, "--registry", "folder.yaml"), ["registry file folder.yaml is a directory"]),
    "registry not UTF-8": (lambda d: fit_args(d, "--registry", "latin1.yaml"), ["registry file latin1.yaml is not UTF-8"]),
    "max_steps -5": (lambda d: fit_args(d, steps=-5), ["--trainer.max_steps -5"]),
    "checkpoint_every -1": (lambda d: fit_args(d, every=-1), ["--checkpoint_every -1"]),
    "seq_len 0": (lambda d: fit_args(d, "--data.seq_len", "0"), ["--data.seq_len 0", ">= 1"]),
    "empty ckpt to fit": (lambda d: fit_args(d, "--ckpt_path", "empty.ckpt"), ["checkpoint empty.ckpt is empty"]),
    "random ckpt to validate": (
        lambda d: ["validate", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir",
                   str(d), "--ckpt_path", "random.ckpt"], ["checkpoint random.ckpt cannot be read"]),
    "htp:// tracking URI": (lambda d: fit_args(d, "--tracking_uri", "htp://localhost:5000"), ["unknown scheme 'htp'"]),
    "prepare into an existing folder": (lambda d: ["prepare", "--out", str(d)], ["already exists", "--overwrite"]),
    "token id beyond the vocabulary": (lambda d: fit_args(Path("big-ids")), ["holds token id 700", "vocab_size 512"]),
    "fit without --size": (lambda d: _drop(fit_args(d), "--size"), ["fit needs --size"]),
    "fit without --ablation": (lambda d: _drop(fit_args(d), "--ablation"), ["fit needs --ablation"]),
    "negative learning rate": (lambda d: fit_args(d, "--model.lr", "-1"), ["--model.lr -1", "a number >= 0"]),
    "negative warmup": (lambda d: fit_args(d, "--model.warmup_steps", "-5"), ["--model.warmup_steps -5", ">= 0"]),
    "no accumulation": (lambda d: fit_args(d, "--trainer.accumulate_grad_batches", "0"),
                        ["--trainer.accumulate_grad_batches 0", ">= 1"]),
    "validation every 0 steps": (lambda d: fit_args(d, "--trainer.val_check_interval", "0"),
                                 ["--trainer.val_check_interval 0"]),
    "a batch larger than the split": (lambda d: fit_args(d, "--data.batch_size", "100000"),
                                      ["windows of seq_len + 1", "one batch needs --data.batch_size 100000 windows"]),
    "validate without a checkpoint": (
        lambda d: ["validate", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir",
                   str(d)], ["validate needs --ckpt_path", "random weights"]),
}


def test_fast_asked_for_the_gated_dynamic_query_is_one_line_before_any_work(data, tmp_path, monkeypatch, capsys):
    """`--model.impl fast` with per-token queries names the backend that serves them, before a run folder exists (it
    was swapped for `compiled` without a word); the default (auto) takes `compiled` there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "dyn.yaml").write_text("include: builtin\nablations:\n  dynquery-tiny:\n    extends: "
                                       "p-lr-block-n8-r32-dynquery\n    doc: the dynamic query at tiny\n    attnres: {blocks: 4}\n")
    assert main([*fit_args(data, "--model.impl", "fast", ablation="dynquery-tiny"), "--registry", "dyn.yaml"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lrattn:")]
    assert len(lines) == 1 and "impl 'fast' does not serve query 'gated_dynamic'" in lines[0], lines
    assert "'compiled'" in lines[0] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, data, tmp_path, monkeypatch, capsys):
    inputs = tmp_path / "INPUTS"
    inputs.mkdir()
    _broken_inputs(inputs, data)
    monkeypatch.chdir(inputs)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    make, needles = BAD_INPUTS[case]
    assert main(make(data)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lrattn:")]
    assert len(lines) == 1 and lines[0].startswith("lrattn: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (inputs / "runs").exists() and not (inputs / "mlflow.db").exists()


@pytest.mark.usefixtures("mlflow_store")
def test_truncated_checkpoint_is_one_line(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(fit_args(data, steps=2)) == 0
    whole = (ckpt_dir(tmp_path) / "last.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(whole[: len(whole) // 2])
    capsys.readouterr()
    for sub in ("fit", "validate"):
        args = fit_args(data, "--ckpt_path", "cut.ckpt", "--run_name", "other") if sub == "fit" else [
            "validate", "--registry", REGISTRY, "--data.data_dir", str(data), "--ckpt_path", "cut.ckpt"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "lrattn: error: checkpoint cut.ckpt cannot be read" in err and "Traceback" not in err
    assert not (tmp_path / "runs/lrattn/other").exists()


def test_read_only_store_is_one_line(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert main(fit_args(data, "--tracking_uri", f"sqlite:///{ro}/mlflow.db")) == 2
        err = capsys.readouterr().err
        assert f"lrattn: error: MLflow store sqlite:///{ro}/mlflow.db: cannot write in {ro} (Read-only file system)" in err
        assert main(fit_args(data, "--runs_dir", str(ro / "runs"))) == 2
        assert f"run folder {ro}/runs/lrattn/{RUN} cannot be created or written" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_non_utf8_corpus_is_prepared_with_a_warning_that_counts(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    paragraph = "A paragraph of plain words that is long enough to be kept as a document here. "
    # 60 distinct paragraphs (about 14 kB), one document each: a user's documents split by their content
    text = "\n\n".join(f"{i}: {paragraph * 3}" for i in range(60)).encode()
    corpus.write_bytes(text + "\n\ncafé \ufffd ".encode() + b"caf\xe9 \xff\xfe " + paragraph.encode() * 2)
    args = ["--out", str(tmp_path / "out"), "--val-fraction", "0.3", "--document_separator", "\n\n"]
    assert main(["prepare", "--source", str(corpus), *args]) == 0
    err = capsys.readouterr().err  # \xe9 (a lead byte before a space), \xff, \xfe; the real U+FFFD is not counted
    assert f"warning: {corpus}: 3 undecodable byte sequence(s)" in err


@pytest.mark.usefixtures("mlflow_store")
def test_doc_and_control_edits_do_not_block_resume_and_limit_val_batches_1_warns(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    registry = yaml.safe_load((REPO_ROOT / "registry.yaml").read_text())
    (tmp_path / "registry.yaml").write_text(yaml.safe_dump(registry, sort_keys=False))
    args = ["--registry", "registry.yaml", "--trainer.limit_val_batches", "1", *STRETCHABLE]
    assert main(fit_args(data, *args, ablation="s-lr-grid-n4-r16", steps=2)) == 0
    assert "--trainer.limit_val_batches 1 means ONE batch" in capsys.readouterr().err
    grid = registry["grids"]["s-lr-rank-blocks"]  # s-lr-grid-n4-r16 is one of its points
    grid["doc"] = "a new description"
    grid["control"] = "baseline"
    (tmp_path / "registry.yaml").write_text(yaml.safe_dump(registry, sort_keys=False))
    assert main(fit_args(data, *args, "--ckpt_path", "last", ablation="s-lr-grid-n4-r16", steps=3)) == 0
    ckpt = torch.load(ckpt_dir(tmp_path, run="tiny-s-lr-grid-n4-r16-seed0") / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3
    assert ckpt["hyper_parameters"]["model_config"]["ablation"]["control"] == "baseline"
    grid["block_summary"] = "mean"  # an architecture field: refused
    (tmp_path / "registry.yaml").write_text(yaml.safe_dump(registry, sort_keys=False))
    capsys.readouterr()
    assert main(fit_args(data, *args, "--ckpt_path", "last", ablation="s-lr-grid-n4-r16", steps=4)) == 2
    assert "different architecture" in capsys.readouterr().err


def test_last_of_a_folder_from_before_one_last_ckpt_is_the_newest(tmp_path):
    """Folders written by earlier versions hold a stale last.ckpt beside last-vN.ckpt; `last` means the newest."""
    from lrattn_lightning.train.checkpoint.save import newest_last

    for name, step in (("last.ckpt", 30), ("last-v1.ckpt", 30), ("last-v2.ckpt", 100), ("step000010.ckpt", 10)):
        torch.save({"global_step": step}, tmp_path / name)
    assert newest_last(tmp_path) == tmp_path / "last-v2.ckpt"
    torch.save({"global_step": 147}, tmp_path / "last.ckpt")
    assert newest_last(tmp_path) == tmp_path / "last.ckpt"
    assert newest_last(tmp_path / "none") is None


@pytest.mark.usefixtures("mlflow_store")
def test_resuming_with_a_changed_learning_rate_is_refused_not_ignored(data, tmp_path, monkeypatch, capsys):
    """The optimizer state carries its learning rates and weight decays: a resume that passes other values
    would silently train with the checkpoint's. One line names the flag; resuming with the same values works."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(fit_args(data, *STRETCHABLE, steps=2)) == 0
    capsys.readouterr()
    assert main(fit_args(data, *STRETCHABLE, "--ckpt_path", "last", "--model.lr", "1e-3", steps=4)) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[lrattn] schedule")]
    assert len(err) == 1 and "--model.lr" in err[0] and "0.0003" in err[0] and "0.001" in err[0], err
    assert step_of(ckpt_dir(tmp_path) / "last.ckpt") == 2  # nothing trained, nothing overwritten
    assert main(fit_args(data, *STRETCHABLE, "--ckpt_path", "last", steps=4)) == 0
    assert step_of(ckpt_dir(tmp_path) / "last.ckpt") == 4


@pytest.mark.parametrize("value", ["abc", "0", "-5MB", "-1", "0KB", "5 parsecs", "MB"])
def test_prepare_chunk_bytes_that_is_no_size_is_one_line(value, tmp_path, monkeypatch, capsys):
    """Issue 53: abc and 0 gave litdata's traceback (so did a plain 400000), -5MB was accepted."""
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "--max_documents", "5", "--out", "out", f"--chunk_bytes={value}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and "Traceback" not in err, err
    assert err.startswith(f"lrattn: error: --chunk_bytes {value}: ") and "e.g. 400000" in err, err
    assert list(tmp_path.iterdir()) == []


def test_prepare_chunk_bytes_in_plain_bytes_or_with_a_unit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chunks = {}
    for value in ("40000", "40KB", "8MB"):
        assert main(["prepare", "--max_documents", "20", "--out", value, "--chunk_bytes", value]) == 0
        chunks[value] = json.loads((tmp_path / value / "train/index.json").read_text())["chunks"]
    assert chunks["40000"] == chunks["40KB"] and len(chunks["40000"]) > len(chunks["8MB"]) == 1, chunks


@pytest.mark.parametrize("vocab, needle", [
    (1000, "sizes with room for 1000 ids: small, d768, "),
    (200_000, "no size of the registry has room for 200000 ids (the most: 100277, size 'd768'): add one with "
              "vocab_size >= 200000 (extends: d768); or prepare")])
def test_a_data_vocabulary_too_large_for_the_size_names_the_sizes_that_fit(vocab, needle, data, tmp_path, monkeypatch,
                                                                           capsys):
    """Issue 52 item 5: the error said only 'choose a size with vocab_size >= N'."""
    shutil.copytree(data, tmp_path / "big-vocab")
    meta = json.loads((tmp_path / "big-vocab/meta.json").read_text())
    meta["vocab_size"] = vocab  # what a tokenizer of that many ids records (no id in the shards is looked at first)
    (tmp_path / "big-vocab/meta.json").write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    assert main(fit_args(Path("big-vocab"))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lrattn: error: data vocab_size {vocab} ") and len(err.strip().splitlines()) == 1, err
    assert "of size 'tiny'" in err and needle in err, err
    assert not (tmp_path / "runs").exists()
