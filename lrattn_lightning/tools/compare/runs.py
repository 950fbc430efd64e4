"""Reading runs back from MLflow at a lab's scale (issue 53: 3,000 runs within 30 s, 20,000 within 3 minutes).

    search_all      every run of an experiment matching a filter, across result pages
    RunReader       the client compare reads through: one search serves the finished runs and the runs left out,
                    `get_run` of a run it has searched is the searched run (no request), an artifact is read from
                    the run's artifact location directly (MLflow's own `download_artifacts` asks the store for the
                    whole run first), and an artifact three runs of an entry lacked (and none had) is not asked of
                    its other runs (a kind that logs none)
    read_histories  the metric histories compare needs (tokens/s, train/loss, val/loss): on a sqlite or SQL store
                    one query per chunk of CHUNK runs, on a server a bounded pool of requests; each run's curve
                    is kept as two arrays (16 bytes a point)

A phase that runs longer than PROGRESS_AFTER seconds prints `[lrattn compare] read histories of 1500/3000 runs` on
stderr (again every PROGRESS_EVERY seconds and at its end).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from lrattn_lightning.train.schema import Metric, Tag

PROGRESS_AFTER, PROGRESS_EVERY = 5.0, 5.0  # seconds
CHUNK = 500  # runs per bulk history query: the memory of one chunk's metric objects is what is held at once
THREADS = 8  # concurrent requests to a tracking server
MISSES = 3  # runs of an entry without an artifact (and none with it) before its other runs are not asked
HISTORY_KEYS = (Metric.TOKENS_PER_SEC, Metric.TRAIN_LOSS, Metric.VAL_LOSS)


FINISHED = "attributes.status = 'FINISHED'"


def search_all(client: Any, experiment_id: str, query: str) -> list[Any]:
    """Every run of the experiment matching `query` (an MLflow filter string), all pages of 1000."""
    if isinstance(client, RunReader):
        return client.search_all(experiment_id, query)
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


class Progress:
    """`[lrattn compare] WHAT DONE/TOTAL runs` on stderr once the phase has taken PROGRESS_AFTER seconds."""

    def __init__(self, what: str, total: int):
        self.what, self.total = what, total
        self.start = self.last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.start < PROGRESS_AFTER or (now - self.last < PROGRESS_EVERY and done < self.total):
            return
        self.last = now
        print(f"[lrattn compare] {self.what} {done}/{self.total} runs ({now - self.start:.0f} s)", file=sys.stderr,
              flush=True)


class RunReader:
    """An MlflowClient that remembers the runs it searched (see module doc); anything else goes to the client."""

    def __init__(self, client: Any):
        self.client = client
        self.runs: dict[str, Any] = {}
        self.misses: dict[tuple[str, str, str], int] = {}  # (size, ablation, path) -> runs without it; -1: seen
        self.searched: dict[tuple[str, str], list[Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def search_all(self, experiment_id: str, query: str) -> list[Any]:
        """search_all's runs, each query asked once; the finished runs of a query (compare's own) are those of the
        query without the status (which compare asks next, for the runs it leaves out): one search, not two."""
        if query.startswith(FINISHED):
            rest = query.removeprefix(FINISHED).removeprefix(" and ")
            return [run for run in self.search_all(experiment_id, rest) if run.info.status == "FINISHED"]
        key = (experiment_id, query)
        if key not in self.searched:
            self.searched[key] = search_all(self.client, experiment_id, query)
            for run in self.searched[key]:
                run.data.tags.pop(Tag.NOTE, None)  # the run's description: kilobytes a run, never read here
                self.runs[run.info.run_id] = run
        return self.searched[key]

    def search_runs(self, *args: Any, **kwargs: Any) -> Any:
        page = self.client.search_runs(*args, **kwargs)
        for run in page:
            run.data.tags.pop(Tag.NOTE, None)  # the run's description: kilobytes a run that compare never reads
            self.runs[run.info.run_id] = run
        return page

    def get_run(self, run_id: str) -> Any:
        run = self.runs.get(run_id)
        return run if run is not None else self.client.get_run(run_id)

    def download_artifacts(self, run_id: str, path: str, dst_path: str | None = None) -> str:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        run = self.runs.get(run_id)
        if run is None or not run.info.artifact_uri:
            return self.client.download_artifacts(run_id, path, dst_path)
        params = run.data.params
        entry = (params.get("size", ""), params.get("ablation", ""), path)  # runs of one entry log the same files
        if self.misses.get(entry, 0) >= MISSES:
            raise FileNotFoundError(f"{path}: {MISSES} runs of {entry[1]} at {entry[0]} have none")
        repo = get_artifact_repository(run.info.artifact_uri, tracking_uri=self.client.tracking_uri)
        try:
            local = repo.download_artifacts(path, dst_path)
        except Exception:
            if self.misses.get(entry, 0) >= 0:
                self.misses[entry] = self.misses.get(entry, 0) + 1
            raise
        self.misses[entry] = -1
        return local


class Curve(Sequence):
    """A metric's (step, value) pairs, in step order, as two arrays."""

    __slots__ = ("steps", "values")

    def __init__(self, pairs: Sequence[tuple[int, float]] = ()):
        self.steps = array("q", (int(s) for s, _ in pairs))
        self.values = array("d", (float(v) for _, v in pairs))

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(zip(self.steps[i], self.values[i], strict=True))
        return self.steps[i], self.values[i]

    def __iter__(self) -> Any:
        return zip(self.steps, self.values, strict=True)

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return f"Curve({list(self)!r})"


class Point(NamedTuple):
    step: int
    timestamp: int
    value: float


def _store(client: Any) -> Any:
    return getattr(getattr(client, "_tracking_client", None), "store", None)


def _sql_histories(store: Any, run_ids: list[str], out: dict[str, dict[str, list[Any]]]) -> None:
    """One query for every key of the chunk's runs, read as plain rows: MLflow's own get_metric_history_bulk
    builds an ORM object per point (3 minutes of 4 for 3,000 runs' 660,000 points on a loaded 2-core machine)."""
    from mlflow.store.tracking.dbmodels.models import SqlMetric
    from sqlalchemy import select

    m = SqlMetric
    query = select(m.run_uuid, m.key, m.step, m.timestamp, m.value, m.is_nan).where(
        m.key.in_(HISTORY_KEYS), m.run_uuid.in_(run_ids))
    with store.ManagedSessionMaker() as session:
        for run_id, key, step, timestamp, value, is_nan in session.execute(query):
            out[run_id][key].append(Point(step, timestamp, math.nan if is_nan else value))


def _histories(client: Any, run_ids: list[str]) -> dict[str, dict[str, list[Any]]]:
    """run id -> key -> its points (step, timestamp, value; any order), for HISTORY_KEYS."""
    out: dict[str, dict[str, list[Any]]] = {rid: {key: [] for key in HISTORY_KEYS} for rid in run_ids}
    store = _store(client)
    if type(store).__name__ == "SqlAlchemyStore" and hasattr(store, "ManagedSessionMaker"):  # sqlite, any SQL
        _sql_histories(store, run_ids, out)
        return out
    if callable(getattr(store, "get_metric_history_bulk", None)):
        for key in HISTORY_KEYS:
            for m in store.get_metric_history_bulk(run_ids, key, max_results=None):
                out[m.run_id][key].append(m)  # a Metric with its run id
        return out
    with ThreadPoolExecutor(THREADS) as pool:  # a tracking server: one request a run and key, THREADS at a time
        jobs = {(rid, key): pool.submit(client.get_metric_history, rid, key) for rid in run_ids for key in HISTORY_KEYS}
        for (rid, key), job in jobs.items():
            out[rid][key] = job.result()
    return out


def read_histories(client: Any, records: list[Any], curves: bool = True) -> None:
    """Each record's tokens/s (the median of its history), last validation step, final step where its tags and
    params do not say it (its last train/loss step + 1), and with `curves` its train and val loss curves."""
    progress = Progress("read histories of", len(records))
    for at in range(0, len(records), CHUNK):
        chunk = records[at:at + CHUNK]
        found = _histories(client, [r.run_id for r in chunk])
        for record in chunk:
            mine = found.pop(record.run_id)
            speed = [m.value for m in mine[Metric.TOKENS_PER_SEC]]
            record.tokens_per_s = statistics.median(speed) if speed else None
            history = {}
            for key in (Metric.TRAIN_LOSS, Metric.VAL_LOSS):
                values = sorted(mine[key], key=lambda m: (m.step, m.timestamp))
                history[key] = Curve(sorted({m.step: m.value for m in values}.items()))  # a resumed run's later wins
            val, train = history[Metric.VAL_LOSS], history[Metric.TRAIN_LOSS]
            record.last_val_step = val[-1][0] if val else None
            if record.final_step is None and train:  # train/loss at step s, validation after it: s + 1
                record.final_step = train[-1][0] + 1
            if curves:
                record.curves = history
        progress(at + len(chunk))
