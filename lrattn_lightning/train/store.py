"""The MLflow store of a run, without Lightning (`lrattn compare`, sweep and eval import it; train/tracking.py's logger
builds on it).

    resolve_tracking_uri  --tracking_uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db; a bad scheme or a
                          dead server is an error before any work (or a fallback to the local store);
                          default_tracking_uri: that default, what a printed command without the flag reaches
    open_store            creates a new sqlite store and the experiment under a file lock, so two fits
                          starting together on a new store both succeed
    end_orphaned_runs     a fresh start of a run folder ends the RUNNING runs a killed fit of it left

What the logger (train/tracking.py) shares: quiet_store (MLflow's per-call tracebacks off), call_fault (a call's
own fault, not the store's), error_chain and disk_full (what a failure was), retry_seconds, store_error, and the
calls it holds through an outage (REPLAYABLE) or answers None to (READS). Tag names: train/schema.py.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.train.checkpoint.lock import FileLock
from lrattn_lightning.train.schema import Tag

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
# Tags this module and the logger (train/tracking.py) write on a training run (train/schema.py Tag).
GAP_TAG, LAST_STEP_TAG, RUN_DIR_TAG = Tag.TRACKING_GAP, Tag.LAST_STEP, Tag.RUN_DIR
DIVERGED_TAG = Tag.DIVERGED
RETRY_ENV = "LRATTN_TRACKING_RETRY_S"
HOLD_VALUES = 100_000  # metric values (plus one per other call) held during a gap: ~30 MB at most
# Held during a gap and replayed in order when the store is back; other calls (figures, files whose
# temp copy is gone by then) are counted as not recovered; reads answer None.
REPLAYABLE = frozenset({"log_batch", "log_metric", "log_param", "set_tag", "log_dict", "log_text"})
READS = ("get_", "search_", "list_")
# Errors that are the call's own fault, not the store's: retrying them cannot help.
_CALL_FAULTS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS",
                          "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE"})
# MLflow logs a traceback per failing sqlite call and urllib3 a line per retry: a full disk gave 31,083
# lines. Our one warning carries the cause instead.
_NOISY_LOGGERS = ("mlflow.store.db.utils", "urllib3.connectionpool", "mlflow.utils.rest_utils")
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
    retry_seconds()  # a bad $LRATTN_TRACKING_RETRY_S fails here, before the store or the run folder exist
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


def default_tracking_uri() -> str:
    """The store a command given no --tracking_uri takes: $MLFLOW_TRACKING_URI, else ./mlflow.db (absolute)."""
    return absolute_sqlite(_USER_TRACKING_URI or LOCAL_TRACKING_URI)


def uri_source(flag: str | None) -> str:
    """Where resolve_tracking_uri(flag) took the store from, in words."""
    return "--tracking_uri" if flag else "$MLFLOW_TRACKING_URI" if _USER_TRACKING_URI else "the default local store"


def absolute_sqlite(uri: str) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db (MLflow caches stores by URI, not by cwd)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a local sqlite store (sqlite:///FILE), as written; None for other stores."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix):]) if uri.startswith(prefix) else None


def artifact_location(uri: str) -> str | None:
    """Local stores keep artifacts in ./mlartifacts beside the database; servers decide themselves."""
    db = sqlite_file(uri)
    return None if db is None else (db.resolve().parent / "mlartifacts").as_uri()


def store_lock_path(db: Path) -> Path:
    """The lock file beside a sqlite store `db` (held while the store is created)."""
    return db.parent / f".{db.name}.lock"


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise the creation of a sqlite store (MLflow creates its tables racily: 'table already exists')."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
    try:
        lock = FileLock(store_lock_path(db), "the MLflow store's lock file").acquire(blocking=True)
    except OSError as err:
        raise TrackingError(f"MLflow store {uri}: cannot write in {db.parent} ({err.strerror or err}); "
                            "make it writable or pass --tracking_uri") from err
    try:
        yield
    finally:
        lock.release()


def store_error(uri: str, err: BaseException) -> TrackingError:
    cause = " ".join(str(err).split())[:600] or type(err).__name__
    return TrackingError(f"MLflow store {uri} cannot be used: {cause} -- fix the store (writable? not full?) "
                         "or pass another --tracking_uri")


def open_store(uri: str, experiment: str) -> str:
    """Create the store if new and the experiment if missing (race-free); returns the experiment id."""
    from mlflow.exceptions import MlflowException

    from lrattn_lightning.train.artifacts import LinkSafeClient

    with store_lock(uri):
        try:
            client = LinkSafeClient(uri)
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
            raise store_error(uri, err) from err
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(f"MLflow experiment '{experiment}' in {uri} is deleted; restore it "
                            f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or pick another --experiment")
    return exp.experiment_id


def run_in_store(uri: str, run_id: str) -> bool:
    """Whether the store holds an active run `run_id` (a checkpoint may come from another store)."""
    from mlflow.exceptions import MlflowException

    from lrattn_lightning.train.artifacts import LinkSafeClient

    try:
        return LinkSafeClient(uri).get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:
        return False


def server_alive(uri: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
            response.read()
        return True
    except (OSError, ValueError):
        return False


def end_orphaned_runs(uri: str, experiment_id: str, run_dir: Path, keep: str | None) -> list[str]:
    """A fresh start of `run_dir`, whose lock this process now holds: a RUNNING run tagged with this folder
    (on this host) has no live fit (a live one would hold the lock and this start would have been refused);
    it was SIGKILLed, ran out of memory or lost power before it could end its run. Mark it KILLED with a tag
    saying why, so the folder does not show two RUNNING runs of one name. `keep`: the run being resumed."""
    from lrattn_lightning.train.artifacts import LinkSafeClient

    mine = run_dir_tag(run_dir)
    try:
        client = LinkSafeClient(uri)
        runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
        orphans = [r for r in runs if r.data.tags.get(RUN_DIR_TAG) == mine and r.info.run_id != keep]
        for run in orphans:
            client.set_tag(run.info.run_id, Tag.KILLED_REASON,
                           f"its fit died without ending it (SIGKILL, out of memory, power loss); found RUNNING by "
                           f"the next start of {mine} (pid {os.getpid()}) on {time.strftime('%Y-%m-%d %H:%M:%S')}")
            client.set_terminated(run.info.run_id, "KILLED")
    except Exception:  # housekeeping only: a store that fails here fails with one line when the run opens
        return []
    for run in orphans:
        print(f"[lrattn] MLflow run {run.info.run_id} ('{run.info.run_name}') was left RUNNING by a fit of "
              f"{run_dir} that was killed before it could end it; marked KILLED", file=sys.stderr)
    return [r.info.run_id for r in orphans]


def run_dir_tag(run_dir: Path) -> str:
    return f"{socket.gethostname()}:{Path(run_dir).resolve()}"


def error_chain(err: BaseException | None) -> list[BaseException]:
    """An error and its causes, outermost first (sqlalchemy's wrapped DB-API error included)."""
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__ or getattr(err, "orig", None)
    return seen


def disk_full(errors: list[BaseException]) -> OSError | bool:
    """The OSError (or True) when any cause is a full disk: ENOSPC, sqlite's 'database or disk is full'."""
    for e in errors:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
    return any("disk is full" in str(e) or "No space left" in str(e) for e in errors)


def call_fault(err: BaseException) -> bool:
    return getattr(err, "error_code", None) in _CALL_FAULTS


@contextlib.contextmanager
def quiet_store() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before, strict=True):
            lg.disabled = was


def retry_seconds() -> float:
    value = os.environ.get(RETRY_ENV, "30")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise TrackingError(f"${RETRY_ENV}={value!r}: give the seconds between checks whether a failed MLflow store "
                            "is back (a number >= 0; default 30)")
    return seconds
