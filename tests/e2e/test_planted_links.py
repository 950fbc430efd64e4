"""A link planted where `lrattn` writes a file is refused in one line and never followed (issue 53, item 1).

On a shared project folder anyone who can write into a run folder could plant `.lock -> ~victim/precious`; a plain
open() followed it and truncated the victim's file. Each path below comes from the code's own path helpers (the run
folder's lock, the store's lock, last.ckpt, previous.ckpt, the checkpoint's temporary, the staging folder of a
prepare, export's --out, a sweep's emitted script, a comparison's figure, a run's MLflow artifact); each test plants
a link there, runs the real operation and checks that the victim keeps its bytes and that the error is one line
naming the path. The writers themselves (core/files.py) are tests/core/test_files_no_follow.py; every artifact path
the platform logs (train/schema.py Artifact), with a link at each folder on its way, tests/train/test_artifact_links.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from helpers.paths import PRECIOUS
from helpers.runs import write_sweep

from lrattn_lightning.cli import main
from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import LinkError
from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.data.staging import staging_path
from lrattn_lightning.tools.compare.figures import pyplot, save_figure
from lrattn_lightning.tools.export import export_hf
from lrattn_lightning.train.checkpoint.lock import run_lock_path
from lrattn_lightning.train.checkpoint.save import LastCheckpoint, temp_path
from lrattn_lightning.train.store import store_lock_path


def fit(data: Path, *extra: str) -> list[str]:
    """The issue's command: a root fit of run `r` of experiment `exp` under ./runs."""
    return ["fit", "--size", "tiny", "--ablation", "baseline", "--data.data_dir", str(data), "--runs_dir", "runs",
            "--experiment", "exp", "--run_name", "r", "--trainer.max_steps", "2", *extra]


def the_error(capsys) -> str:
    """The one `lrattn: error:` line of the command's stderr."""
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lrattn: error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_issue_53_a_lock_link_planted_in_the_run_folder_is_refused_and_its_target_kept(data, in_tmp, victim,
                                                                                       capsys):
    lock = Path("runs/exp/r/.lock")  # the issue's path
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)
    assert main(fit(data)) == 2
    error = the_error(capsys)
    assert f"{lock} is a symbolic link to {victim}" in error and "remove the link" in error, error
    assert victim.read_text() == PRECIOUS
    assert lock.is_symlink()  # left where it was, for whoever planted it to be found
    assert not Path("mlflow.db").exists()
    assert run_lock_path(Path("runs/exp/r")) == lock


def test_a_link_planted_at_the_stores_lock_is_refused(data, in_tmp, victim, capsys):
    lock = store_lock_path(in_tmp / "mlflow.db")
    lock.symlink_to(victim)
    assert main(fit(data)) == 2
    assert f"{lock} is a symbolic link" in the_error(capsys)
    assert victim.read_text() == PRECIOUS


def checkpoint_paths(run_dir: Path) -> dict[str, Path]:
    last = LastCheckpoint(run_dir / "checkpoints", every_n_train_steps=1)
    return {"last.ckpt": last.path, "previous.ckpt": last.previous, "temporary": temp_path(last.path)}


@pytest.mark.parametrize("name", ["last.ckpt", "previous.ckpt", "temporary"])
def test_a_link_planted_at_a_checkpoint_while_the_run_trains_is_refused(data, in_tmp, victim, capsys, name):
    """Planted after the first save (before step 2), as another user could at any time: the next save refuses it."""
    path = checkpoint_paths(in_tmp / "runs/exp/r")[name]  # the temporary's name holds this process's pid
    hooks = in_tmp / "hooks.yaml"
    hooks.write_text(yaml.safe_dump({"trainer": {"callbacks": [{"class_path": "run_hooks.PlantLinkAtStep", "init_args": {
        "step": 1, "paths": [str(path)], "target": str(victim)}}]}}))
    assert main(fit(data, "--checkpoint_every", "1", "--trainer.enable_progress_bar", "false",
                    "--config", str(hooks))) == 2
    error = the_error(capsys)
    assert f"checkpoint {path} is a symbolic link to {victim}" in error, error
    assert victim.read_text() == PRECIOUS and path.is_symlink()


def test_a_link_planted_as_a_prepares_staging_folder_is_refused_and_the_folder_it_names_kept(in_tmp):
    """The staging folder of a dead prepare is emptied before reuse: through a link that would have emptied the
    folder the link names."""
    theirs = in_tmp / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text(PRECIOUS)
    out = in_tmp / "D"
    staging_path(out).symlink_to(theirs)
    with pytest.raises(LinkError) as err:
        prepare(source="stdlib-docs", out_dir=out, tokenizer="byte", max_documents=5, val_fraction=0.2)
    assert f"{staging_path(out)} is a symbolic link to {theirs}" in str(err.value) and "\n" not in str(err.value)
    assert (theirs / "notes.txt").read_text() == PRECIOUS and not out.exists()
    staging_path(out).unlink()
    staging_path(out).mkdir()
    os.chmod(staging_path(out), 0o777)  # a folder others can write into may hold links planted in it
    with pytest.raises(InputError, match="others can write into it"):
        prepare(source="stdlib-docs", out_dir=out, tokenizer="byte", max_documents=5, val_fraction=0.2)


def test_a_link_planted_as_exports_out_is_refused(in_tmp):
    theirs = in_tmp / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text(PRECIOUS)
    (in_tmp / "hf").symlink_to(theirs)
    with pytest.raises(LinkError, match="--out .*hf is a symbolic link"):
        export_hf(in_tmp / "missing.ckpt", in_tmp / "hf", overwrite=True)
    assert [p.name for p in theirs.iterdir()] == ["config.json"]


def test_a_link_planted_at_a_sweeps_emitted_script_is_refused(data, in_tmp, victim, capsys):
    script = in_tmp / "sweep.sh"
    script.symlink_to(victim)
    assert main(["sweep", str(write_sweep(in_tmp, data)), "--emit", "commands", "--out", str(script)]) == 2
    assert f"{script} is a symbolic link" in the_error(capsys)
    assert victim.read_text() == PRECIOUS


def test_a_link_planted_at_a_comparisons_figure_is_refused(in_tmp, victim):
    (in_tmp / "curves.svg").symlink_to(victim)
    fig = pyplot().figure()
    with pytest.raises(LinkError, match="curves.svg is a symbolic link"):
        save_figure(fig, in_tmp, "curves")
    assert victim.read_text() == PRECIOUS


def test_a_link_planted_at_a_runs_mlflow_artifact_is_refused_by_the_next_fit(data, in_tmp, victim, capsys):
    """The fit's MLflow artifacts (train/schema.py Artifact, written by train/artifacts.py's client): a link planted
    at the run's config.yaml after a first fit; the resumed fit logs its config again and refuses the link."""
    from lrattn_lightning.train.artifacts import LinkSafeClient
    from lrattn_lightning.train.schema import Artifact
    from lrattn_lightning.train.store import absolute_sqlite

    assert main(fit(data, "--trainer.enable_progress_bar", "false", "--model.schedule_steps", "4")) == 0
    client = LinkSafeClient(absolute_sqlite("sqlite:///mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    config = client.local_artifact_folder(run.info.run_id) / Artifact.CONFIG
    assert config.read_text().startswith("# lightning") or "trainer:" in config.read_text()  # logged normally
    config.unlink()
    config.symlink_to(victim)
    capsys.readouterr()
    assert main(fit(data, "--trainer.enable_progress_bar", "false", "--model.schedule_steps", "4", "--ckpt_path",
                    "last", "--trainer.max_steps", "4")) == 2
    error = the_error(capsys)
    assert f"MLflow artifact {config} is a symbolic link to {victim}" in error, error
    assert victim.read_text() == PRECIOUS and config.is_symlink()
