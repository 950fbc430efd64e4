"""`lrattn demo` keeps to what concerns the user: no note about its own corpus's fit to the size."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.prepare import prepared_corpus

from lrattn_lightning.cli.demo import own_corpus
from lrattn_lightning.train.summary import RunEnd, fit_summary


def test_the_unused_rows_note_is_the_users_on_their_data_and_not_on_the_demos(tmp_path_factory, tmp_path):
    """A byte corpus on a 512-id size leaves 255 rows untrained: fit says so; the demo, on its own corpus, does not
    (it printed "3839 embedding rows never trained" about its own set-up). A user's corpus given to the demo is
    theirs: the note stays."""
    data = prepared_corpus(tmp_path_factory, 4)
    end = RunEnd(step=2, metrics={})
    said = {notes: fit_summary(end, run_name="r", experiment="e", checkpoint=tmp_path / "none.ckpt",
                               data_dir=str(data), size_name="tiny", vocab_size=512, data_notes=notes)
            for notes in (True, False)}
    assert any("255 embedding and output rows were never trained" in line for line in said[True]), said[True]
    assert not any("never trained" in line for line in said[False]), said[False]
    assert own_corpus(str(data))
    meta = json.loads((data / "meta.json").read_text())
    users = tmp_path / "users"
    users.mkdir()
    (users / "meta.json").write_text(json.dumps({**meta, "source": str(Path("/data/my.jsonl"))}))
    assert not own_corpus(str(users)) and not own_corpus(str(tmp_path / "missing"))
