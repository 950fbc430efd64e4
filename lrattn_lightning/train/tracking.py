"""MLflow for training runs: which store, opening it safely, and a logger that never stops training.

    resolve_tracking_uri  --tracking_uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db; a bad scheme or a
                          dead server is an error before any work (or a fallback to the local store)
    open_store            creates a new sqlite store and the experiment under a file lock, so two fits
                          starting together on a new store both succeed
    TrackingLogger        MLFlowLogger whose MLflow calls are bounded and guarded: when the store fails
                          (server gone, disk full) training goes on, the data is dropped with one
                          warning, and the process still ends in bounded time. A resumed fit drops
                          metrics at steps the run already holds, so no step appears twice.

HTTP calls are bounded through MLflow's own settings (`HTTP_LIMITS`, unless the user set them): a dead
server costs one call of at most ~1 min (timeout x attempts + backoff), after which the logger stops
calling it for the rest of the run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lrattn_lightning.errors import InputError
from lrattn_lightning.train.checkpointing import FileLock, launched_as_rank_zero

LOCAL_TRACKING_URI = "sqlite:///mlflow.db"
# The user's own setting, read once: mlflow.set_tracking_uri() (called by every MLFlowLogger) writes
# MLFLOW_TRACKING_URI into this process's environment, which must not steer later runs in the same process.
_USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")
# MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) keep a process alive 20+ minutes
# after a server dies. These bound one failing call to about 2 x 20 s + 1 + 2 s.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
_SCHEMES = ("", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


class TrackingError(InputError):
    """A tracking URI or store that cannot be used; one line naming the URI, the cause and the fix."""


def bound_http_retries() -> None:
    for key, value in HTTP_LIMITS.items():
        os.environ.setdefault(key, value)


def check_uri(uri: str) -> None:
    scheme = urllib.parse.urlparse(uri).scheme.split("+")[0]
    if scheme not in _SCHEMES:
        raise TrackingError(f"tracking URI {uri!r}: unknown scheme '{scheme}'; use http(s)://HOST:PORT for a server, "
                            "sqlite:///FILE.db or a folder path (fix --tracking_uri / MLFLOW_TRACKING_URI)")


def resolve_tracking_uri(flag: str | None, fallback_local: bool) -> str:
    """--tracking_uri, else $MLFLOW_TRACKING_URI, else the local sqlite store; servers are probed first."""
    uri = flag or _USER_TRACKING_URI or LOCAL_TRACKING_URI
    check_uri(uri)
    uri = absolute_sqlite(uri)
    if uri.startswith(("http://", "https://")):
        bound_http_retries()
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as response:
                response.read()
        except (OSError, ValueError) as err:
            if fallback_local:
                print(f"[lrattn] MLflow server {uri} unreachable ({err}); logging to {LOCAL_TRACKING_URI} instead",
                      file=sys.stderr)
                return absolute_sqlite(LOCAL_TRACKING_URI)
            raise TrackingError(
                f"MLflow server {uri} is unreachable ({err}). Start it, fix --tracking_uri/MLFLOW_TRACKING_URI, "
                "or pass --mlflow_fallback_local true to log to the local sqlite store."
            ) from err
    return uri


def absolute_sqlite(uri: str) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db (MLflow caches stores by URI, not by cwd)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def artifact_location(uri: str) -> str | None:
    """Local stores keep artifacts in ./mlartifacts beside the database; servers decide themselves."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):]).resolve()
        return (db.parent / "mlartifacts").as_uri()
    return None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise the creation of a sqlite store (MLflow creates its tables racily: 'table already exists')."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///"):])
    try:
        lock = FileLock(db.parent / f".{db.name}.lock").acquire(blocking=True)
    except OSError as err:
        raise TrackingError(f"MLflow store {uri}: cannot write in {db.parent} ({err.strerror or err}); "
                            "make it writable or pass --tracking_uri") from err
    try:
        yield
    finally:
        lock.release()


def _store_error(uri: str, err: BaseException) -> TrackingError:
    cause = " ".join(str(err).split())[:600] or type(err).__name__
    return TrackingError(f"MLflow store {uri} cannot be used: {cause} -- fix the store (writable? not full?) "
                         "or pass another --tracking_uri")


def open_store(uri: str, experiment: str) -> str:
    """Create the store if new and the experiment if missing (race-free); returns the experiment id."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with store_lock(uri):
        try:
            client = MlflowClient(uri)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                try:
                    return client.create_experiment(experiment, artifact_location=artifact_location(uri))
                except MlflowException as err:  # created by another process meanwhile (servers have no lock)
                    exp = client.get_experiment_by_name(experiment)
                    if exp is None:
                        raise err from None
        except TrackingError:
            raise
        except Exception as err:  # MlflowException, sqlalchemy and OS errors: all mean the store is unusable
            raise _store_error(uri, err) from err
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(f"MLflow experiment '{experiment}' in {uri} is deleted; restore it "
                            f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or pick another --experiment")
    return exp.experiment_id


def run_in_store(uri: str, run_id: str) -> bool:
    """Whether the store holds an active run `run_id` (a checkpoint may come from another store)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(uri).get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:
        return False


def server_alive(uri: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
            response.read()
        return True
    except (OSError, ValueError):
        return False


class _GuardedClient:
    """The MlflowClient as the logger's `experiment`: every method call goes through the logger's guard."""

    def __init__(self, client: Any, logger: TrackingLogger):
        self._client, self._logger = client, logger

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: self._logger._guarded(name, attr, args, kwargs)


class TrackingLogger(MLFlowLogger):
    """MLFlowLogger with bounded, guarded calls and no duplicate steps on resume (see module doc)."""

    def __init__(self, *, experiment_id: str | None = None, **kwargs: Any):
        super().__init__(synchronous=True, **kwargs)  # errors surface here, not in a background queue
        self._experiment_id = experiment_id
        self._remote = self._tracking_uri.startswith(("http://", "https://"))
        self._guard: _GuardedClient | None = None
        self._logged_up_to: dict[str, int] = {}
        self._offline = False
        self._dropped = 0
        self._failed_at: int | None = None
        self._step = 0
        self._finalized = False
        self.stopped_by: str | None = None  # "SIGTERM": the run ends as KILLED, not FAILED
        # validate/test into a training run: its status stays the fit's (KILLED, RUNNING, ...), not FINISHED
        self.keep_status = False

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._guard is None:
            self._guard = _GuardedClient(MLFlowLogger.experiment.fget(self), self)
        return self._guard

    def open_run(self) -> None:
        """Create (or find) the run now, so a store that cannot be written fails before training."""
        if not launched_as_rank_zero():
            return
        try:
            MLFlowLogger.experiment.fget(self)
        except Exception as err:
            raise _store_error(self._tracking_uri, err) from err

    def skip_logged_steps(self) -> None:
        """A resumed fit: remember the last step of every metric the run holds; log only later steps."""
        run = self.experiment.get_run(self.run_id)
        if run is not None:
            self._logged_up_to = {m.key: int(m.step) for m in run.data.to_proto().metrics}

    def _guarded(self, name: str, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self._offline:
            self._dropped += 1
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            self._dropped += 1
            if self._failed_at is None:
                self._failed_at = self._step
                cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
                then = ("from now on its metrics, tags and artifacts are dropped" if self._remote
                        else "failing calls are dropped")
                print(f"[lrattn] warning: MLflow {self._tracking_uri} failed at step {self._step} in {name} "
                      f"({type(err).__name__}: {cause}); {then}; training and checkpoints continue", file=sys.stderr,
                      flush=True)
            if self._remote:  # every further call to a dead server would cost the retry bound again
                self._offline = True
            return None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """One value per metric and step, steps increasing: what a resumed run already holds is not logged
        again, nor a step's value twice (monitors that run per micro-batch under gradient accumulation)."""
        self._step = step if step is not None else self._step
        if step is not None:
            metrics = {k: v for k, v in metrics.items() if step > self._logged_up_to.get(k, -1)}
            if not metrics:
                return
            self._logged_up_to.update(dict.fromkeys(metrics, step))
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._initialized or self._finalized:
            return
        self._finalized = True
        if self.keep_status:
            return
        if status == "failed" and self.stopped_by:
            status = "KILLED"
        if self._failed_at is not None:
            if self._remote and not server_alive(self._tracking_uri):
                print(f"[lrattn] warning: MLflow {self._tracking_uri} is still unreachable; run {self._run_id} stays "
                      f"RUNNING there, without what was logged after step {self._failed_at} "
                      f"({self._dropped} calls dropped)", file=sys.stderr, flush=True)
                return
            self._offline = False
            self.experiment.set_tag(self._run_id, "lrattn.tracking_gap",
                                    f"{self._dropped} logging calls dropped from step {self._failed_at} on")
        super().finalize(status)
