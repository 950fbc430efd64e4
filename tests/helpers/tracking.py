"""MLflow for tests: a real `mlflow server` on a free loopback port, an experiment in a new sqlite store, and an
empty store made once by MLflow and copied where a test's commands would otherwise create one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# the tracking server without MLflow 3's background job runners (huey consumers for GenAI jobs: four more
# processes, each importing MLflow, that tracking never uses) and with one web worker: what the tests need of it
SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real `mlflow server` on a free loopback port (its own process group), up and healthy: (process, uri).
    Stopped (TERM, then KILL) on exit, also when the test has killed it already."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination",
         str(tmp_path / "art")],
        cwd=tmp_path, env=SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline, "mlflow server did not come up"
                assert server.poll() is None, "mlflow server exited"
                time.sleep(0.5)
        yield server, uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=20)


def sqlite_experiment(folder: Path, name: str):
    """A new sqlite MLflow store in `folder` and an experiment `name` whose artifacts lie beside it (not ./mlruns):
    (tracking URI, client, experiment id)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client, client.create_experiment(name, artifact_location=(folder / "artifacts").as_uri())


def empty_store(folder: Path) -> Path:
    """folder/mlflow.db, a new sqlite store as MLflow creates it (its tables, the Default experiment) and nothing
    else: the template seed_store copies. Made from `folder` (the Default experiment's artifacts would lie in
    folder/mlruns), never the checkout."""
    from mlflow.tracking import MlflowClient

    db = folder / "mlflow.db"
    with contextlib.chdir(folder):
        MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


def seed_store(folder: Path, template: Path, name: str = "mlflow.db") -> Path:
    """A copy of the empty store `template` (empty_store's) as folder/NAME, by default the default store of a
    command run from `folder`: the command finds an existing store, as a user's second run does, instead of spending
    1-3 s on MLflow creating its tables (alembic migrations). Only for tests whose point is not the store's creation."""
    db = folder / name
    shutil.copyfile(template, db)
    return db
