"""MLflow artifacts in a local store are written without following a link (train/artifacts.py; issue 53, item 1).

A real sqlite store made as `lrattn fit` makes it (open_store: artifacts in ./mlartifacts beside the database) and
the client every command logs through (LinkSafeClient). Each artifact path the platform logs (train/schema.py
Artifact, bench.json) is logged as its call site logs it, once normally (read back whole, and the same bytes,
listing and sizes as MLflow's own client gives), and once with a link planted at the file, at each folder of its
path, at the run's artifact folder and at the run's folder: the victim keeps its bytes, the error is one line
naming the link.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
from helpers.paths import PRECIOUS
from helpers.tracking import seed_store
from mlflow.tracking import MlflowClient

from lrattn_lightning.core.files import PACKAGE_ROOT, LinkError
from lrattn_lightning.train.artifacts import LinkSafeClient
from lrattn_lightning.train.schema import Artifact
from lrattn_lightning.train.store import open_store


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.imshow([[0.1, 0.9], [0.5, 0.5]])
    return fig


def log(client: MlflowClient, run_id: str, path: str, tmp_path: Path) -> None:
    """Log the artifact `path` as the platform's call site for it does."""
    if path.endswith(".png"):  # callbacks/routing.py
        import matplotlib.pyplot as plt

        fig = _figure()
        client.log_figure(run_id, fig, path)
        plt.close(fig)
    elif path.endswith(".json") and not path.startswith(Artifact.EVAL_RESULTS):  # routing.py, bench.py
        client.log_dict(run_id, {"step": 7, "sites": [[0.25, 0.75]], "name": "ü"}, path)
    elif path.startswith(Artifact.COMPARE):  # tools/compare/summary_run.py: a report file under its own name
        source = tmp_path / "report-files" / Path(path).name
        source.parent.mkdir(exist_ok=True)
        source.write_text("| method | loss |\n|---|---|\n| baseline | 3.14 |\n")
        client.log_artifact(run_id, str(source), Artifact.COMPARE.removesuffix("/"))
    else:  # cli/lightning.py's config, eval/evaluate.py's results
        client.log_text(run_id, "model:\n  lr: 0.001\nname: é\n", path)


ARTIFACTS = [Artifact.CONFIG, Artifact.ROUTING_HEATMAP, Artifact.ROUTING_WEIGHTS, Artifact.ROUTING_SITES,
             Artifact.GATES, Artifact.GATES_JSON, f"{Artifact.EVAL_RESULTS}step000002-20261207-000000-abcd1234.json",
             f"{Artifact.COMPARE}table.md", "bench.json"]


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory, store_template) -> str:
    """A local store as fit opens it (one for the module, copied from the empty one MLflow built once)."""
    uri = f"sqlite:///{seed_store(tmp_path_factory.mktemp('store'), store_template)}"
    open_store(uri, "exp")
    return uri


@pytest.fixture
def store(store_uri):
    """(LinkSafeClient, a new run's id, the run's artifact folder) in the module's local store."""
    client = LinkSafeClient(store_uri)
    run_id = client.create_run(open_store(store_uri, "exp")).info.run_id
    root = client.local_artifact_folder(run_id)
    assert root == Path(store_uri.removeprefix("sqlite:///")).parent / "mlartifacts" / run_id / "artifacts"
    return client, run_id, root


def test_every_artifact_is_logged_as_mlflow_logs_it(store, tmp_path):
    """The normal path: each artifact read back whole, and byte for byte, listing and sizes what MLflow's own
    client writes for the same call."""
    client, run_id, root = store
    plain = MlflowClient(client.tracking_uri)
    other = plain.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    for path in ARTIFACTS:
        log(client, run_id, path, tmp_path)
        log(plain, other, path, tmp_path)
    for path in ARTIFACTS:
        ours = Path(client.download_artifacts(run_id, path, str(tmp_path / "down-ours")))
        theirs = Path(plain.download_artifacts(other, path, str(tmp_path / "down-theirs")))
        assert ours.read_bytes() == theirs.read_bytes() and ours.stat().st_size > 0, path
        assert (root / path).stat().st_mode == Path(plain.get_run(other).info.artifact_uri.removeprefix("file://"),
                                                    path).stat().st_mode, path
    assert json.loads((root / Artifact.ROUTING_WEIGHTS).read_text()) == {"step": 7, "sites": [[0.25, 0.75]],
                                                                          "name": "ü"}
    assert (root / Artifact.CONFIG).read_text() == "model:\n  lr: 0.001\nname: é\n"

    def listing(c, rid, folder=None):
        return sorted((a.path, a.is_dir, a.file_size) for a in c.list_artifacts(rid, folder))

    for folder in (None, "routing", "eval", "compare"):
        assert listing(client, run_id, folder) == listing(plain, other, folder), folder
    assert not [p for p in root.rglob("*") if p.name.startswith(".")]  # no temporary left behind
    log(client, run_id, Artifact.CONFIG, tmp_path)  # logged again: replaced, as MLflow replaces it
    assert (root / Artifact.CONFIG).read_text() == "model:\n  lr: 0.001\nname: é\n"


def planted_places(root: Path, path: str) -> list[Path]:
    """Where a link can be planted on the way to artifact `path`: the file, each folder of its path, the run's
    artifact folder and the run's folder."""
    places = [root / path]
    parent = Path(path).parent
    while parent != Path("."):
        places.append(root / parent)
        parent = parent.parent
    return [*places, root, root.parent]


@pytest.mark.parametrize("path", ARTIFACTS)
def test_a_link_planted_on_the_way_to_an_artifact_is_refused_in_one_line(store, tmp_path, victim, path):
    client, run_id, root = store
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for place in planted_places(root, path):
        shutil.rmtree(root.parent, ignore_errors=True)  # the run's folders as new, then the link planted
        place.parent.mkdir(parents=True, exist_ok=True)
        place.symlink_to(victim if place == root / path else theirs)
        with pytest.raises(LinkError) as err:
            log(client, run_id, path, tmp_path)
        message = str(err.value)
        assert f"{place} is a symbolic link to " in message and "\n" not in message, (place, message)
        assert "remove the link" in message
        assert victim.read_text() == PRECIOUS and not list(theirs.iterdir()), place
        place.unlink()


def test_the_fits_logger_and_every_client_the_package_makes_write_artifacts_without_following_links():
    """No module makes a plain MlflowClient or logs an artifact through MLflow's fluent API (mlflow.log_dict & co
    write through their own client): every artifact goes through LinkSafeClient. Read from the source itself."""
    fluent = {"log_artifact", "log_artifacts", "log_dict", "log_text", "log_figure", "log_image", "log_table"}
    found = []
    for module in (PACKAGE_ROOT / "lrattn_lightning").rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                owner = getattr(node.func, "value", None)
                if name == "MlflowClient" or (name in fluent and isinstance(owner, ast.Name) and owner.id == "mlflow"):
                    found.append(f"{module.relative_to(PACKAGE_ROOT)}:{node.lineno}")
    assert not found, found
    from lrattn_lightning.train.tracking import TrackingLogger

    logger = TrackingLogger(experiment_name="x", tracking_uri="sqlite:////nonexistent-dir/never-opened.db")
    assert isinstance(logger._mlflow_client, LinkSafeClient)


def test_a_folder_is_logged_as_mlflow_logs_it_and_a_link_inside_its_destination_is_refused(store, tmp_path, victim):
    """log_artifact of a folder (MLflow: log_artifacts under the folder's name; Lightning's checkpoint logging would
    take this path): the same files and listing as MLflow's own client; a link at one of its files is refused, where
    MLflow's copy (shutil.copy2) wrote through it."""
    client, run_id, root = store
    plain = MlflowClient(client.tracking_uri)
    other = plain.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    folder = tmp_path / "ckpts"
    (folder / "inner").mkdir(parents=True)
    (folder / "empty").mkdir()
    (folder / "a.txt").write_text("a\n")
    (folder / "inner" / "b.bin").write_bytes(bytes(range(256)))
    for c, rid in ((client, run_id), (plain, other)):
        c.log_artifact(rid, str(folder), "models")
    theirs = Path(plain.get_run(other).info.artifact_uri.removeprefix("file://"))
    ours_files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert ours_files == sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*"))
    assert "models/ckpts/empty" in ours_files
    assert (root / "models/ckpts/inner/b.bin").read_bytes() == bytes(range(256))
    (root / "models/ckpts/inner/b.bin").unlink()
    (root / "models/ckpts/inner/b.bin").symlink_to(victim)
    with pytest.raises(LinkError, match="inner/b.bin is a symbolic link"):
        client.log_artifacts(run_id, str(folder), "models/ckpts")
    assert victim.read_text() == PRECIOUS
