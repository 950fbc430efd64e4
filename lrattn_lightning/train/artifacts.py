"""MLflow artifacts written without following a link: `LinkSafeClient`, the MlflowClient every command logs through.

MLflow's LocalArtifactRepository (an artifact store that is a folder: `file://` or a plain path, as our sqlite
stores' ./mlartifacts) makes the run's folders with os.makedirs and checks a destination by resolving it before
it writes a temporary there: a link planted as the run's artifact folder is followed (the files land in whatever
folder it names), one swapped in at a folder below between the check and the write is followed too, and
log_artifacts (a folder) copies with shutil.copy2, which follows a link at the file itself. Anyone who can write
into a shared store's run folders could make another user's run write into their folders.

`LinkSafeClient.log_artifact`/`log_artifacts` (and so MLflow's log_text, log_dict and log_figure, which write a
temporary file and hand it to log_artifact) write a local store's files here instead, through core/files.py:

    <experiment's artifact folder>/<run id>/artifacts/<folders>/<file>
     opened as it is (the user's)   each opened O_NOFOLLOW relative to the one above, made if missing
                                    (open_folder); the file a new O_EXCL|O_NOFOLLOW temporary in its folder, renamed
                                    over its name there (replacing_in)

A link (or anything but a folder, a file) at any of those parts is one LinkError line naming it, raised before a
byte is written, and nothing can be swapped for a link between a check and the write: each folder is used through
the descriptor that checked it. The bytes, mode and times are those MLflow's copy gives (copystat), at the same
artifact path, so list_artifacts and download read the same artifact. A remote artifact store (a server's
mlflow-artifacts:, s3, ...) goes through MLflow unchanged.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shutil
import stat
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repo import ARTIFACT_STREAM_CHUNK_SIZE, verify_artifact_path
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
from mlflow.tracking import MlflowClient

from lrattn_lightning.core.files import open_folder, replacing_in

# MLflow's own prefix for a local artifact being written (it refuses artifacts named so, and lists them as no one's)
STAGING_PREFIX = ".artifact.uploading."
WHAT = "MLflow artifact"


class LinkSafeClient(MlflowClient):
    """MlflowClient whose artifacts, in a local artifact store, are written without following a link (module doc)."""

    def local_artifact_folder(self, run_id: str) -> Path | None:
        """The run's artifact folder where its artifact store is local (MLflow's LocalArtifactRepository), else None."""
        repo = self._tracking_client._get_artifact_repo(run_id)  # MLflow's own choice of store, cached per run
        return Path(repo.artifact_dir) if isinstance(repo, LocalArtifactRepository) else None

    def log_artifact(self, run_id: str, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        root = self.local_artifact_folder(run_id)
        if root is None:
            return super().log_artifact(run_id, local_path, artifact_path)
        if os.path.isdir(local_path):  # as MLflow: the folder goes in under its own name
            name = os.path.basename(os.path.normpath(local_path))
            return self.log_artifacts(run_id, str(local_path), posixpath.join(artifact_path, name) if artifact_path
                                      else name)
        write_artifact(root, run_id, artifact_path, Path(local_path))
        return None

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        root = self.local_artifact_folder(run_id)
        if root is None:
            return super().log_artifacts(run_id, local_dir, artifact_path)
        for folder, dirs, files in os.walk(local_dir):
            below = posixpath.join(*(artifact_path or ".", *Path(os.path.relpath(folder, local_dir)).parts))
            for name in dirs:  # empty folders too, as MLflow copies them
                os.close(artifact_folder(root, run_id, posixpath.join(below, name)))
            for name in files:
                write_artifact(root, run_id, below, Path(folder) / name)
        return None


def _parts(artifact_path: str | None) -> list[str]:
    """The folders of an artifact path below the run's artifact folder; MLflow's own refusal of '..' and absolute
    paths."""
    verify_artifact_path(artifact_path)
    if not artifact_path:
        return []
    return [p for p in posixpath.normpath(artifact_path).split("/") if p not in ("", ".")]


def artifact_folder(root: Path, run_id: str, artifact_path: str | None) -> int:
    """A descriptor on the folder `artifact_path` of the run's local artifact folder `root`, made if missing: from
    the experiment's folder down (`<run id>/artifacts/...` where `root` is MLflow's layout), never through a link."""
    own = [run_id, "artifacts"] if root.parts[-2:] == (run_id, "artifacts") else []
    base = root.parents[1] if own else root
    base.mkdir(parents=True, exist_ok=True)
    return open_folder(base, own + _parts(artifact_path), f"{WHAT} folder")


def write_artifact(root: Path, run_id: str, artifact_path: str | None, source: Path) -> None:
    """Copy the file `source` to `artifact_path`/its name in the run's local artifact folder `root`, with its mode
    and times (as MLflow's copy), through the folders artifact_folder opened: a link anywhere is a LinkError."""
    name = source.name
    if name.startswith(STAGING_PREFIX):
        raise MlflowException.invalid_parameter_value(f"Invalid artifact file name: '{name}'. Artifact names "
                                                      f"starting with '{STAGING_PREFIX}' are reserved.")
    folder = artifact_folder(root, run_id, artifact_path)
    try:
        shown = root.joinpath(*_parts(artifact_path), name)
        with replacing_in(folder, name, shown, WHAT, temporary=STAGING_PREFIX + secrets.token_hex(8)) as file:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, file, ARTIFACT_STREAM_CHUNK_SIZE)
            file.flush()
            info = os.stat(source)
            os.fchmod(file.fileno(), stat.S_IMODE(info.st_mode))
            os.utime(file.fileno(), ns=(info.st_atime_ns, info.st_mtime_ns))
    finally:
        os.close(folder)
