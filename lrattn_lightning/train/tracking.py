"""MLflow for training runs: which store, opening it safely, and a logger that never stops training.

    resolve_tracking_uri  --tracking_uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db; a bad scheme or a
                          dead server is an error before any work (or a fallback to the local store);
                          default_tracking_uri: that default, what a printed command without the flag reaches
    open_store            creates a new sqlite store and the experiment under a file lock, so two fits
                          starting together on a new store both succeed
    TrackingLogger        MLFlowLogger whose MLflow calls are bounded and guarded: when the store fails
                          (server gone, disk full) training goes on with one warning, and the process
                          still ends in bounded time. A resumed fit drops metrics at steps the run
                          already holds, so no step appears twice.
    end_orphaned_runs     a fresh start of a run folder ends the RUNNING runs a killed fit of it left

HTTP calls are bounded through MLflow's own settings (`HTTP_LIMITS`, unless the user set them): a dead
server costs one call of at most ~1 min (timeout x attempts + backoff). From then on the logger holds
what it is given in memory (metrics, params, tags, small JSON/text artifacts; at most `HOLD_VALUES`
values, the oldest go first) and checks at a logging call, at most once per `$LRATTN_TRACKING_RETRY_S`
seconds (30) and with a 2 s health probe for a server, whether the store is back; then it writes what it
held and logs on. The `lrattn.tracking_gap` tag says which steps the gap spanned and what could not be
recovered (figures, files); `lrattn.last_step` is the last step the fit logged, so `lrattn compare` can
tell a run whose last validation is not at its end. A fit's run is FINISHED only once its final validation is
logged (`final_validation_pending`): a fit stopped before it is KILLED, one whose loss turned non-finite is
FAILED with `lrattn.diverged` saying where.
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
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lrattn_lightning.core.errors import InputError, first_line
from lrattn_lightning.train.checkpoint.lock import FileLock, launched_as_rank_zero

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
# Tags this module writes on a training run.
GAP_TAG, LAST_STEP_TAG, RUN_DIR_TAG = "lrattn.tracking_gap", "lrattn.last_step", "lrattn.run_dir"
DIVERGED_TAG = "lrattn.diverged"
RETRY_ENV = "LRATTN_TRACKING_RETRY_S"
HOLD_VALUES = 100_000  # metric values (plus one per other call) held during a gap: ~30 MB at most
# Held during a gap and replayed in order when the store is back; other calls (figures, files whose
# temp copy is gone by then) are counted as not recovered; reads answer None.
_REPLAYABLE = frozenset({"log_batch", "log_metric", "log_param", "set_tag", "log_dict", "log_text"})
_READS = ("get_", "search_", "list_")
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
    _retry_seconds()  # a bad $LRATTN_TRACKING_RETRY_S fails here, before the store or the run folder exist
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


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise the creation of a sqlite store (MLflow creates its tables racily: 'table already exists')."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
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


def end_orphaned_runs(uri: str, experiment_id: str, run_dir: Path, keep: str | None) -> list[str]:
    """A fresh start of `run_dir`, whose lock this process now holds: a RUNNING run tagged with this folder
    (on this host) has no live fit (a live one would hold the lock and this start would have been refused);
    it was SIGKILLed, ran out of memory or lost power before it could end its run. Mark it KILLED with a tag
    saying why, so the folder does not show two RUNNING runs of one name. `keep`: the run being resumed."""
    from mlflow.tracking import MlflowClient

    mine = run_dir_tag(run_dir)
    try:
        client = MlflowClient(uri)
        runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
        orphans = [r for r in runs if r.data.tags.get(RUN_DIR_TAG) == mine and r.info.run_id != keep]
        for run in orphans:
            client.set_tag(run.info.run_id, "lrattn.killed_reason",
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


def _chain(err: BaseException | None) -> list[BaseException]:
    """An error and its causes, outermost first (sqlalchemy's wrapped DB-API error included)."""
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__ or getattr(err, "orig", None)
    return seen


def _disk_full(errors: list[BaseException]) -> OSError | bool:
    """The OSError (or True) when any cause is a full disk: ENOSPC, sqlite's 'database or disk is full'."""
    for e in errors:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
    return any("disk is full" in str(e) or "No space left" in str(e) for e in errors)


def _call_fault(err: BaseException) -> bool:
    return getattr(err, "error_code", None) in _CALL_FAULTS


@contextlib.contextmanager
def _quiet_store() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before, strict=True):
            lg.disabled = was


def _retry_seconds() -> float:
    value = os.environ.get(RETRY_ENV, "30")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise TrackingError(f"${RETRY_ENV}={value!r}: give the seconds between checks whether a failed MLflow store "
                            "is back (a number >= 0; default 30)")
    return seconds


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
    """MLFlowLogger with bounded, guarded calls, held through a store outage, and no duplicate steps on
    resume (see module doc)."""

    drops_repeated_steps = True  # a metric's value at a step it already logged is dropped (log_metrics)

    def __init__(self, *, experiment_id: str | None = None, **kwargs: Any):
        super().__init__(synchronous=True, **kwargs)  # errors surface here, not in a background queue
        self._experiment_id = experiment_id
        self._remote = self._tracking_uri.startswith(("http://", "https://"))
        self._guard: _GuardedClient | None = None
        self._logged_up_to: dict[str, int] = {}
        self._step = self._max_step = 0
        self.log_epoch = False  # Lightning's `epoch` metric (lrattn fit --log_counters true)
        self._end_status: str | None = None
        self.stopped_by: str | None = None  # "SIGTERM": the run ends as KILLED, not FAILED
        self.diverged: str | None = None  # "non-finite training loss (nan) at step 5": FAILED, tagged
        # a fit's success is not the run's end: `lrattn fit` validates the final weights after it (LRAttnCLI.after_fit)
        self.final_validation_pending = False
        # validate/test into a training run: its status stays the fit's (KILLED, RUNNING, ...), not FINISHED
        self.keep_status = False
        # an outage: the calls held for replay ([name, fn, args, kwargs, values]), the steps it spanned
        self._retry_s, self.hold_limit = _retry_seconds(), HOLD_VALUES
        self._offline, self._next_retry = False, 0.0
        self._held: deque[list] = deque()
        self._held_values = self._recovered = self._lost_values = 0
        self._lost: Counter[str] = Counter()
        self._gaps: list[list[int | None]] = []  # [first step, step it was back (None: not yet)]
        self._warned_fault = self._warned_end = False
        self._still = "is still unreachable"

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

    # ---- the guard ---------------------------------------------------------------------------
    def _guarded(self, name: str, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self._offline and (name.startswith(_READS) or not self._reconnect()):
            return self._hold(name, fn, args, kwargs)
        try:
            with _quiet_store():
                return fn(*args, **kwargs)
        except Exception as err:
            if _call_fault(err):  # this call's own fault (a bad value): dropped, the store is fine
                self._lost[name] += 1
                if not self._warned_fault:
                    self._warned_fault = True
                    print(f"[lrattn] warning: MLflow {self._tracking_uri} refused {name} at step {self._step} "
                          f"({first_line(err)}); such calls are dropped", file=sys.stderr, flush=True)
                return None
            self._went_offline(name, err)
            return self._hold(name, fn, args, kwargs)

    def _went_offline(self, name: str, err: BaseException) -> None:
        """One warning per outage; from here on calls are held, and retried at most every `_retry_s`."""
        self._offline, self._next_retry = True, time.monotonic() + self._retry_s
        self._gaps.append([self._step, None])
        errors = _chain(err)
        full, cause = _disk_full(errors), first_line(errors[-1])
        every = f"checked at most once every {self._retry_s:g} s" if self._retry_s else "checked at each logging call"
        if full and not self._remote:
            where = getattr(full, "filename", None) or self._tracking_uri.removeprefix("sqlite:///")
            what = f"MLflow store {self._tracking_uri} failed at step {self._step}: the disk holding {where} is full"
            what, until, self._still = f"{what} ({cause})", "has room again", f"finds the disk holding {where} still full"
        else:
            what, until = (f"MLflow {self._tracking_uri} failed at step {self._step} in {name} "
                           f"({type(errors[-1]).__name__}: {cause})"), "is back"
            self._still = "is still unreachable" if self._remote else f"still fails ({cause})"
        print(f"[lrattn] warning: {what}; its metrics are held in memory (up to {self.hold_limit:,} values) and "
              f"written when it {until} ({every}); training and checkpoints continue", file=sys.stderr, flush=True)

    def _hold(self, name: str, fn: Any, args: tuple, kwargs: dict) -> None:
        """Keep a call for replay (metric batches merged up to MLflow's 1000 per call); the oldest go first
        past `hold_limit` values: the last validation, the run's result, matters most."""
        if name.startswith(_READS):
            return None
        if name not in _REPLAYABLE:
            self._lost[name] += 1
            return None
        values = sum(len(kwargs.get(k) or ()) for k in ("metrics", "params", "tags")) or 1
        last = self._held[-1] if self._held else None
        if (_metrics_only(name, kwargs) and last is not None and _metrics_only(last[0], last[3])
                and last[3].get("run_id") == kwargs.get("run_id") and len(last[3]["metrics"]) + values <= 1000):
            last[3]["metrics"].extend(kwargs["metrics"])
            last[4] += values
        else:
            kwargs = {k: list(v) if isinstance(v, list | tuple) else v for k, v in kwargs.items()}
            self._held.append([name, fn, args, kwargs, values])
        self._held_values += values
        while self._held_values > self.hold_limit and len(self._held) > 1:
            dropped = self._held.popleft()
            self._held_values -= dropped[4]
            self._lost_values += dropped[4]
        return None

    def _reconnect(self, final: bool = False) -> bool:
        """Whether the store is back (then what was held is written): at most once per `_retry_s`, a server
        first with a short health probe (a dead one would cost the whole retry bound); always at the end."""
        now = time.monotonic()
        if not final and now < self._next_retry:
            return False
        self._next_retry = now + self._retry_s
        if self._remote and not server_alive(self._tracking_uri, timeout=5 if final else 2):
            return False
        since, held = self._gaps[-1][0], self._held_values
        while self._held:
            name, fn, args, kwargs, values = self._held[0]
            try:
                with _quiet_store():
                    fn(*args, **kwargs)
            except Exception as err:
                if not _call_fault(err):
                    return False  # still down (or down again): keep the rest, try again later
                self._lost[name] += 1
            self._held.popleft()
            self._held_values -= values
            self._recovered += values
        self._offline = False
        self._gaps[-1][1] = self._step
        print(f"[lrattn] MLflow {self._tracking_uri} is back at step {self._step}: wrote the {held:,} values held "
              f"since step {since}; logging goes on", file=sys.stderr, flush=True)
        return True

    def _gap_summary(self) -> str:
        spans = ", ".join(f"{a}-{b}" for a, b in self._gaps[:5]) + (" and more" if len(self._gaps) > 5 else "")
        text = (f"MLflow {'unreachable' if self._remote else 'failing'} at steps {spans}; {self._recovered:,} values held in memory were written when "
                "it was back" if self._gaps else "no outage")
        lost = [f"{n} {name} call(s)" for name, n in sorted(self._lost.items())]
        if self._lost_values:
            lost.append(f"the {self._lost_values:,} oldest held values (over the {self.hold_limit:,} held at most)")
        return text + ("; not recovered: " + ", ".join(lost) if lost else "; nothing was lost")

    # ---- logging -----------------------------------------------------------------------------
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """One value per metric and step, steps increasing: what a resumed run already holds is not logged
        again, nor a step's value twice (monitors that run per micro-batch under gradient accumulation)."""
        if not self.log_epoch:  # Lightning adds its epoch counter to every logged dict: a counter, asked for or not
            metrics = {k: v for k, v in metrics.items() if k != "epoch"}
        self._step = step if step is not None else self._step
        self._max_step = max(self._max_step, self._step)
        if step is not None:
            metrics = {k: v for k, v in metrics.items() if step > self._logged_up_to.get(k, -1)}
            if not metrics:
                return
            self._logged_up_to.update(dict.fromkeys(metrics, step))
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Called when fit ends and again after the final validation `lrattn fit` runs after it (LRAttnCLI.
        after_fit): each time, write what an outage held if the store is back, then the tags and the fit's status."""
        if not self._initialized:
            return
        if status == "success" and self.final_validation_pending:
            return  # the run ends with the final validation's (or its stop's) finalize
        if self._end_status is None:  # the first end decides: a fit's, or its final validation's
            self._end_status = "KILLED" if status == "failed" and self.stopped_by else status
        if self._offline and not self._reconnect(final=True):
            self._warn_lost_at_end()
            return
        if self.keep_status:
            return
        self.experiment.set_tag(self._run_id, LAST_STEP_TAG, str(self._max_step))
        if self.diverged:
            self.experiment.set_tag(self._run_id, DIVERGED_TAG, self.diverged)
        if self._gaps or self._lost:
            self.experiment.set_tag(self._run_id, GAP_TAG, self._gap_summary())
        super().finalize(self._end_status)
        if self._offline:  # it failed again while ending the run
            self._warn_lost_at_end()

    def _warn_lost_at_end(self) -> None:
        if self._warned_end:
            return
        self._warned_end = True
        state = "keeps its status" if self.keep_status else "stays RUNNING"
        print(f"[lrattn] warning: MLflow {self._tracking_uri} {self._still}; run {self._run_id} {state} there, without "
              f"what was logged after step {self._gaps[-1][0]} ({self._held_values:,} values held in memory are "
              "lost with this process)", file=sys.stderr, flush=True)


def _metrics_only(name: str, kwargs: dict) -> bool:
    return name == "log_batch" and bool(kwargs.get("metrics")) and not kwargs.get("params") and not kwargs.get("tags")
