"""MLflow for training runs: which store, opening it safely, and a logger that never stops training.

    resolve_tracking_uri, open_store, end_orphaned_runs: the store itself (train/store.py, no Lightning)
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

import sys
import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lrattn_lightning.core.errors import first_line
from lrattn_lightning.core.files import LinkError
from lrattn_lightning.train.checkpoint.lock import launched_as_rank_zero
from lrattn_lightning.train.schema import Metric
from lrattn_lightning.train.store import (  # noqa: F401 (the store's names, also imported from here)
    DIVERGED_TAG,
    GAP_TAG,
    HOLD_VALUES,
    LAST_STEP_TAG,
    LOCAL_TRACKING_URI,
    READS,
    REPLAYABLE,
    RETRY_ENV,
    RUN_DIR_TAG,
    TrackingError,
    absolute_sqlite,
    artifact_location,
    call_fault,
    default_tracking_uri,
    disk_full,
    end_orphaned_runs,
    error_chain,
    open_store,
    quiet_store,
    resolve_tracking_uri,
    retry_seconds,
    run_dir_tag,
    run_in_store,
    server_alive,
    sqlite_file,
    store_error,
    store_lock,
    uri_source,
)


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
        from lrattn_lightning.train.artifacts import LinkSafeClient  # (imports MLflow, as the line above did)

        self._mlflow_client = LinkSafeClient(self._tracking_uri)  # artifacts never written through a link
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
        self._retry_s, self.hold_limit = retry_seconds(), HOLD_VALUES
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
            raise store_error(self._tracking_uri, err) from err

    def resume_run(self) -> None:
        """A resumed fit: remember the last step of every metric the run holds; log only later steps. The run
        trains again, so it is RUNNING again (a stop had ended it KILLED) until this fit ends it."""
        run = self.experiment.get_run(self.run_id)
        if run is not None:
            self._logged_up_to = {m.key: int(m.step) for m in run.data.to_proto().metrics}
            if run.info.status != "RUNNING":
                self.experiment.update_run(self.run_id, status="RUNNING")

    # ---- the guard ---------------------------------------------------------------------------
    def _guarded(self, name: str, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self._offline and (name.startswith(READS) or not self._reconnect()):
            return self._hold(name, fn, args, kwargs)
        try:
            with quiet_store():
                return fn(*args, **kwargs)
        except LinkError:
            raise  # a link planted where an artifact goes (train/artifacts.py): one line, not an outage
        except Exception as err:
            if call_fault(err):  # this call's own fault (a bad value): dropped, the store is fine
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
        errors = error_chain(err)
        full, cause = disk_full(errors), first_line(errors[-1])
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
        if name.startswith(READS):
            return None
        if name not in REPLAYABLE:
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
                with quiet_store():
                    fn(*args, **kwargs)
            except LinkError:
                raise
            except Exception as err:
                if not call_fault(err):
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
            metrics = {k: v for k, v in metrics.items() if k != Metric.EPOCH}
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
