"""A DatasetDict saved with `save_to_disk` brings its own validation split (issue 52): `prepare` reads `train` and
holds out exactly the saved `validation` split (not a fraction of `train`), says so in one line (and that an
explicit --val_fraction is not used); `--val_source` naming such a folder reads its validation split. Real folders
written by `datasets`, read back from the shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.prepare import prepare_in, split_documents

from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.data.shards import read_meta


def texts(kind: str, n: int) -> list[str]:
    return [f"{kind} document {i}: naïve café, 日本語 {'words ' * (i % 7)}" for i in range(n)]


def save(root: Path, **splits: list[str]) -> Path:
    import datasets

    folder = root / "saved"
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs})
                          for name, docs in splits.items()}).save_to_disk(str(folder))
    return folder


run = prepare_in  # (conftest)


@pytest.mark.parametrize("name", ["validation", "valid", "val"])
def test_the_saved_validation_split_is_the_validation_set(tmp_path, capsys, name):
    train, val = texts("train", 60), texts("held-out", 9)
    folder = save(tmp_path, train=train, **{name: val}, test=texts("test", 5))
    code, lines = run(["--source", str(folder), "--out", "out", "--val_fraction", "0.2"], tmp_path, capsys)
    assert code == 0, lines
    assert split_documents(tmp_path / "out", "val") == val  # exactly the saved split, in its order
    assert split_documents(tmp_path / "out", "train") == train  # all of train, none of test
    said = [line for line in lines if line.startswith("[lrattn prepare] validation:")]
    assert said == [f"[lrattn prepare] validation: the saved split {folder}[{name}], not a fraction of --source "
                    "(--val_fraction 0.2 is not used); --val_source names another"], lines
    meta = read_meta(tmp_path / "out")
    assert meta["split"]["by"] == "saved_split" and meta["val_fraction"] is None
    assert {r["split"] for r in meta["inputs"]["val"]} == {name} and {r["split"] for r in meta["inputs"]["train"]} == {"train"}


def test_without_a_validation_split_train_is_split_and_test_is_never_used(tmp_path):
    train = texts("train", 40)
    folder = save(tmp_path, train=train, test=texts("test", 5))
    meta = prepare(str(folder), tmp_path / "out", val_fraction=0.1, cloze_items=0, perplexity_documents=0,
                   progress=False)
    assert meta["split"]["by"] == "document" and meta["splits"]["val"]["documents"] == 4
    assert sorted(split_documents(tmp_path / "out", "train") + split_documents(tmp_path / "out", "val")) == sorted(train)


def test_hf_split_validation_reads_it_as_training_and_splits_it(tmp_path):
    """--hf_split validation trains on the saved validation split: it is not held out as well."""
    val = texts("held-out", 30)
    folder = save(tmp_path, train=texts("train", 10), validation=val)
    meta = prepare(str(folder), tmp_path / "out", hf_split="validation", cloze_items=0, perplexity_documents=0,
                   progress=False)
    assert meta["split"]["by"] == "document"
    assert sorted(split_documents(tmp_path / "out", "train") + split_documents(tmp_path / "out", "val")) == sorted(val)


def test_val_source_reads_a_saved_dicts_validation_split(tmp_path):
    train = texts("train", 20)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "train.txt").write_text("\n\n\n".join(train))
    other = save(tmp_path, train=texts("other train", 8), validation=texts("other held-out", 6))
    meta = prepare(str(tmp_path / "a" / "train.txt"), tmp_path / "out", val_source=str(other),
                   document_separator="\n\n\n", cloze_items=0, perplexity_documents=0, progress=False)
    assert meta["split"]["by"] == "val_source"
    assert split_documents(tmp_path / "out", "val") == texts("other held-out", 6)
    assert split_documents(tmp_path / "out", "train") == train
