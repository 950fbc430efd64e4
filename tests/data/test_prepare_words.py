"""What `prepare` says counts the right noun: "1 document", "2 documents", read back from its own lines."""

from __future__ import annotations

import json
import re

import pytest

from lrattn_lightning.core.words import count, plural
from lrattn_lightning.data.prepare import prepare


@pytest.mark.parametrize(("n", "said"), [(0, "0 documents"), (1, "1 document"), (2, "2 documents"),
                                         (1234, "1,234 documents")])
def test_count_says_one_as_singular_and_groups_thousands(n, said):
    assert count(n, "document") == said
    assert plural(2, "bus", "buses") == "buses" and plural(1, "bus", "buses") == "bus"


@pytest.mark.parametrize("train_docs", [1, 2])
def test_prepare_counts_one_document_in_the_singular(tmp_path, capsys, train_docs):
    """A split of one document is "1 document" (it said "1 documents"); of two, "2 documents"."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({"text": f"train document {i}"}) + "\n" for i in range(train_docs)))
    val.write_text(json.dumps({"text": "the one held-out document"}) + "\n")
    prepare(source=str(train), val_source=str(val), out_dir=tmp_path / "out", tokenizer="byte", cloze_items=0,
            perplexity_documents=0, progress=False)
    said = capsys.readouterr()
    lines = (said.out + said.err).splitlines()
    val_line = next(line for line in lines if re.search(r"\bval: ", line))
    train_line = next(line for line in lines if re.search(r"\btrain: ", line))
    assert "val: 1 document, " in val_line, val_line
    assert f"train: {count(train_docs, 'document')}, " in train_line, train_line
    assert not any(re.search(r"\b1 (documents|tokens|bytes|parts)\b", line) for line in lines), lines
