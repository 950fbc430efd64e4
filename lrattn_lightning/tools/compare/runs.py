"""Reading runs back from MLflow at a lab's scale (issue 53: 3,000 runs within 30 s, 20,000 within 3 minutes).

    search_all      every run of an experiment matching a filter, across result pages
    sqlite_search   the same from a sqlite store in four plain queries (MLflow's search builds an ORM object a tag,
                    param and metric), filtered by MLflow's own in-memory filter
    RunReader       the client compare reads through: one search (on sqlite: sqlite_search) serves the finished
                    runs and the runs left out, `get_run` of a run it has searched is the searched run (no request),
                    an artifact is read from the run's artifact location directly (MLflow's own
                    `download_artifacts` asks the store for the whole run first; a local one is read in place, not
                    copied), and an artifact three runs of an entry lacked (and none had) is not asked of its other
                    runs (a kind that logs none)
    read_histories  the metric histories compare needs (tokens/s, train/loss, val/loss): on a sqlite or SQL store
                    one query per chunk of CHUNK runs (on sqlite its rows read by numpy as they come), on a server a
                    bounded pool of requests; each run's curve is kept as two arrays (16 bytes a point)

A phase that runs longer than PROGRESS_AFTER seconds prints `[lrattn compare] read histories of 1500/3000 runs` (the
search: `searched 5000 runs`) on stderr (again every PROGRESS_EVERY seconds and at its end).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from lrattn_lightning.train.schema import Metric, Tag

PROGRESS_AFTER, PROGRESS_EVERY = 5.0, 5.0  # seconds
CHUNK = 500  # runs per bulk history query: the memory of one chunk's metric objects is what is held at once
THREADS = 8  # concurrent requests to a tracking server
MISSES = 3  # runs of an entry without an artifact (and none with it) before its other runs are not asked
HISTORY_KEYS = (Metric.TOKENS_PER_SEC, Metric.TRAIN_LOSS, Metric.VAL_LOSS)
RUN_INDEX = "index_metrics_run_uuid_key_step"  # MLflow's index of the metrics table on (run_uuid, key, step)
POINT = np.dtype([("run", np.int64), ("key", np.int64), ("step", np.int64), ("timestamp", np.int64),
                  ("value", np.float64), ("nan", np.int64)])  # a history point as _sql_histories reads it on sqlite
CURVE_POINTS = 600  # points of a run's curve kept for the figures (thin): 10 KB a run, however long it logged


FINISHED = "attributes.status = 'FINISHED'"


def search_all(client: Any, experiment_id: str, query: str) -> list[Any]:
    """Every run of the experiment matching `query` (an MLflow filter string), all pages of 1000."""
    if isinstance(client, RunReader):
        return client.search_all(experiment_id, query)
    runs, token = [], None
    progress = Progress("searched", None)
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        progress(len(runs), finished=not token)
        if not token:
            return runs


class Progress:
    """`[lrattn compare] WHAT DONE/TOTAL runs` on stderr once the phase has taken PROGRESS_AFTER seconds."""

    def __init__(self, what: str, total: int | None):
        self.what, self.total = what, total  # total None: not known ahead (a search's pages)
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, *, finished: bool | None = None) -> None:
        now = time.monotonic()
        finished = done >= (self.total or 0) if finished is None else finished
        if now - self.start < PROGRESS_AFTER or (now - self.last < PROGRESS_EVERY and not finished):
            return
        self.last = now
        of = "" if self.total is None else f"/{self.total}"
        print(f"[lrattn compare] {self.what} {done}{of} runs ({now - self.start:.0f} s)", file=sys.stderr, flush=True)


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
            found = sqlite_search(self.client, experiment_id, query)
            self.searched[key] = search_all(self.client, experiment_id, query) if found is None else found
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
        from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

        run = self.runs.get(run_id)
        if run is None or not run.info.artifact_uri:
            return self.client.download_artifacts(run_id, path, dst_path)
        params = run.data.params
        entry = (params.get("size", ""), params.get("ablation", ""), path)  # runs of one entry log the same files
        if self.misses.get(entry, 0) >= MISSES:
            raise FileNotFoundError(f"{path}: {MISSES} runs of {entry[1]} at {entry[0]} have none")
        repo = get_artifact_repository(run.info.artifact_uri, tracking_uri=self.client.tracking_uri)
        try:
            if isinstance(repo, LocalArtifactRepository):  # on this disk: the file itself, not a copy made by a
                local = repo.download_artifacts(path)  # pool of threads started for each file
                if not os.path.isfile(local):
                    raise FileNotFoundError(f"{path}: not among run {run_id}'s artifacts")
            else:
                local = repo.download_artifacts(path, dst_path)
        except Exception:
            if self.misses.get(entry, 0) >= 0:
                self.misses[entry] = self.misses.get(entry, 0) + 1
            raise
        self.misses[entry] = -1
        return local


RUN_COLUMNS = "run_uuid, name, experiment_id, user_id, status, start_time, end_time, lifecycle_stage, artifact_uri"
CHILD_COLUMNS = {"tags": "key, value", "params": "key, value", "latest_metrics": "key, value, timestamp, step, is_nan"}


def sqlite_search(client: Any, experiment_id: str, query: str) -> list[Any] | None:
    """search_all's runs (its order: newest first, then by id; active runs only) read from a sqlite store with four
    plain queries (the runs, then their tags, params and latest metrics) and filtered by MLflow's own in-memory
    filter (SearchUtils.filter, what its file store searches with). MLflow's search builds an ORM object a tag,
    param and metric: 4.6 of compare's 31 CPU-s at 3,000 runs, 37 at 20,000. None (search through MLflow) on any
    other store or for a filter on datasets (a run's inputs are not read here). The run's description (the note
    tag: kilobytes a run, never read here) is left out unless the filter names it."""
    from mlflow.entities import Metric as Point
    from mlflow.entities import Param as Setting
    from mlflow.entities import Run, RunData, RunInfo, RunTag
    from mlflow.utils.search_utils import SearchUtils

    store = _store(client)
    if type(store).__name__ != "SqlAlchemyStore" or store.engine.dialect.name != "sqlite" \
            or not str(experiment_id).isdigit():
        return None
    if any(clause.get("type") == "dataset" for clause in SearchUtils.parse_search_filter(query)):
        return None
    progress, active = Progress("searched", None), "r.experiment_id = ? AND r.lifecycle_stage = 'active'"
    note = "" if Tag.NOTE in query else f" AND c.key != '{Tag.NOTE}'"
    with store.engine.connect() as conn:
        cursor = conn.connection.dbapi_connection.cursor()
        infos = cursor.execute(f"SELECT {RUN_COLUMNS} FROM runs AS r WHERE {active} ORDER BY start_time DESC, run_uuid",
                               (int(experiment_id),)).fetchall()
        children = {}
        for table, columns in CHILD_COLUMNS.items():  # a run's own in the order they were written, as the ORM reads
            listed = ", ".join(f"c.{c}" for c in columns.split(", "))
            children[table] = {row[0]: [] for row in infos}
            for rid, *rest in cursor.execute(
                    f"SELECT c.run_uuid, {listed} FROM {table} AS c JOIN runs AS r ON r.run_uuid = c.run_uuid "
                    f"WHERE {active}{note if table == 'tags' else ''} ORDER BY c.rowid", (int(experiment_id),)):
                children[table][rid].append(rest)
    runs = []
    for rid, name, exp, user, status, start, end, stage, artifact_uri in infos:
        tags = [RunTag(k, v) for k, v in children["tags"][rid]]
        name = name or next((t.value for t in tags if t.key == "mlflow.runName"), name)
        data = RunData(metrics=[Point(k, math.nan if is_nan else v, t, s) for k, v, t, s, is_nan in
                                children["latest_metrics"][rid]],
                       params=[Setting(k, v) for k, v in children["params"][rid]], tags=tags)
        runs.append(Run(RunInfo(run_id=rid, experiment_id=str(exp), user_id=user, status=status, start_time=start,
                                end_time=end, lifecycle_stage=stage, artifact_uri=artifact_uri, run_name=name), data))
    runs = SearchUtils.filter(runs, query)
    progress(len(runs), finished=True)
    return runs


class Curve(Sequence):
    """A metric's (step, value) pairs, in step order, as two arrays."""

    __slots__ = ("steps", "values")

    def __init__(self, pairs: Sequence[tuple[int, float]] = ()):
        self.steps = array("q", (int(s) for s, _ in pairs))
        self.values = array("d", (float(v) for _, v in pairs))

    @classmethod
    def of(cls, steps: np.ndarray, values: np.ndarray) -> Curve:
        curve = cls()
        curve.steps.frombytes(np.ascontiguousarray(steps, dtype=np.int64).tobytes())
        curve.values.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
        return curve

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


def thin(steps: np.ndarray, values: np.ndarray, limit: int = CURVE_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most `limit` + 2 of a curve's points (steps ascending): all of them when they fit; else the first and the
    last, and in each of limit // 3 buckets of steps (a power of two wide, counted from step 0: seeds logged alike
    keep the same steps, so their mean is still taken step by step) its first point, its lowest and its highest."""
    if len(steps) <= limit:
        return steps, values
    width = 1 << max(0, math.ceil(math.log2((int(steps[-1]) + 1) / max(1, limit // 3))))
    bucket = steps // width
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    keep = np.zeros(len(steps), dtype=bool)
    keep[[0, -1]] = True
    keep[starts] = True
    ends = np.r_[starts[1:], len(steps)] - 1
    nan = np.isnan(values)
    keep[np.lexsort((np.where(nan, np.inf, values), bucket))[starts]] = True  # each bucket's lowest
    keep[np.lexsort((np.where(nan, -np.inf, values), bucket))[ends]] = True  # and highest
    return steps[keep], values[keep]


class _Columns(NamedTuple):
    """A chunk's history points: the run (an index into the chunk's run ids), the key (into HISTORY_KEYS), step,
    timestamp, value."""

    run: np.ndarray
    key: np.ndarray
    step: np.ndarray
    timestamp: np.ndarray
    value: np.ndarray

    @classmethod
    def of(cls, run_ids: list[str], points: Any) -> _Columns:
        """From (run id, key, step, timestamp, value, is_nan) tuples."""
        points = list(points)
        if not points:
            return cls(*(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.int64, np.int64, float)))
        runs, keys, steps, stamps, values, nans = zip(*points, strict=True)
        run_index, key_index = {rid: i for i, rid in enumerate(run_ids)}, {k: i for i, k in enumerate(HISTORY_KEYS)}
        value = np.array([math.nan if v is None else v for v in values], dtype=float)
        value[np.array(nans, dtype=bool)] = math.nan
        return cls(np.fromiter(map(run_index.__getitem__, runs), np.int64, len(runs)),
                   np.fromiter(map(key_index.__getitem__, keys), np.int64, len(keys)),
                   np.array(steps, dtype=np.int64), np.array(stamps, dtype=np.int64), value)


def _store(client: Any) -> Any:
    return getattr(getattr(client, "_tracking_client", None), "store", None)


def _sql_histories(store: Any, run_ids: list[str]) -> _Columns:
    """One query for every key of the chunk's runs, read as plain rows (MLflow's own get_metric_history_bulk builds
    an ORM object per point: 3 minutes of 4 for 3,000 runs' 660,000 points on a loaded 2-core machine). On sqlite
    it reads through the (run, key, step) index: its planner otherwise picks the key index and scans every run's
    points for each chunk (quadratic in the runs: 1.5 s a chunk at 20,000 runs, 0.25 s through the run index)."""
    from mlflow.store.tracking.dbmodels.models import SqlMetric
    from sqlalchemy import inspect, select

    m = SqlMetric
    if not run_ids:
        return _Columns.of(run_ids, [])
    with store.engine.connect() as conn:
        if conn.dialect.name != "sqlite":
            query = select(m.run_uuid, m.key, m.step, m.timestamp, m.value, m.is_nan).where(
                m.key.in_(HISTORY_KEYS), m.run_uuid.in_(run_ids))
            return _Columns.of(run_ids, conn.execute(query).all())
        indexes = {index["name"] for index in inspect(conn).get_indexes(m.__tablename__)}
        hint = f" INDEXED BY {RUN_INDEX}" if RUN_INDEX in indexes else ""
        cursor = conn.connection.dbapi_connection.cursor()
        # the run and the key come back as their indexes (run_ids, HISTORY_KEYS), so numpy reads the rows as they come
        keys, ids = ", ".join("?" * len(HISTORY_KEYS)), ", ".join("(?, ?)" for _ in run_ids)
        cursor.execute(f"WITH ids(i, id) AS (VALUES {ids}) SELECT ids.i, CASE m.key "
                       f"{' '.join(f'WHEN ? THEN {i}' for i in range(len(HISTORY_KEYS)))} END, m.step, "
                       "IFNULL(m.timestamp, 0), IFNULL(m.value, 0.0), m.is_nan OR m.value IS NULL "
                       f"FROM ids JOIN {m.__tablename__} AS m{hint} ON m.run_uuid = ids.id WHERE m.key IN ({keys})",
                       (*(x for pair in enumerate(run_ids) for x in pair), *HISTORY_KEYS, *HISTORY_KEYS))
        rows = np.fromiter(cursor, dtype=POINT)
        value = rows["value"].copy()
        value[rows["nan"].astype(bool)] = math.nan
        return _Columns(*(np.ascontiguousarray(rows[f]) for f in ("run", "key", "step", "timestamp")), value)


def _histories(client: Any, run_ids: list[str]) -> _Columns:
    """The HISTORY_KEYS points of the chunk's runs, in any order."""
    store = _store(client)
    if type(store).__name__ == "SqlAlchemyStore" and hasattr(store, "ManagedSessionMaker"):  # sqlite, any SQL
        return _sql_histories(store, run_ids)
    if callable(getattr(store, "get_metric_history_bulk", None)):
        return _Columns.of(run_ids, ((m.run_id, key, m.step, m.timestamp, m.value, False) for key in HISTORY_KEYS
                                     for m in store.get_metric_history_bulk(run_ids, key, max_results=None)))
    with ThreadPoolExecutor(THREADS) as pool:  # a tracking server: one request a run and key, THREADS at a time
        jobs = {(rid, key): pool.submit(client.get_metric_history, rid, key) for rid in run_ids for key in HISTORY_KEYS}
        return _Columns.of(run_ids, ((rid, key, m.step, m.timestamp, m.value, False) for (rid, key), job in jobs.items()
                                     for m in job.result()))


def read_histories(client: Any, records: list[Any], curves: bool = True) -> None:
    """Each record's tokens/s (the median of its history), last validation step, final step where its tags and
    params do not say it (its last train/loss step + 1), and with `curves` its train and val loss curves (a resumed
    run's later value of a step wins; at most CURVE_POINTS + 2 points of each: thin). A chunk's points are reduced
    as arrays and let go before the next chunk is read."""
    progress = Progress("read histories of", len(records))
    speed_key, kept_keys = HISTORY_KEYS.index(Metric.TOKENS_PER_SEC), (Metric.TRAIN_LOSS, Metric.VAL_LOSS)
    for at in range(0, len(records), CHUNK):
        chunk = records[at:at + CHUNK]
        c = _histories(client, [r.run_id for r in chunk])
        order = np.lexsort((c.timestamp, c.step, c.key, c.run))  # by run, key, step, then time: the last is latest
        run, key, step, value = c.run[order], c.key[order], c.step[order], c.value[order]
        del c, order
        n = len(run)
        cuts = np.flatnonzero((run[1:] != run[:-1]) | (key[1:] != key[:-1])) + 1
        latest = np.r_[(run[1:] != run[:-1]) | (key[1:] != key[:-1]) | (step[1:] != step[:-1]), True]
        segments = {(int(run[a]), int(key[a])): (a, b) for a, b in zip(np.r_[0, cuts], np.r_[cuts, n], strict=True)
                    if a < b}
        for i, record in enumerate(chunk):
            a, b = segments.get((i, speed_key), (0, 0))
            record.tokens_per_s = statistics.median(value[a:b].tolist()) if b > a else None
            history = {}
            for name in kept_keys:
                a, b = segments.get((i, HISTORY_KEYS.index(name)), (0, 0))
                mask = latest[a:b]
                history[name] = Curve.of(*thin(step[a:b][mask], value[a:b][mask]))
            val, train = history[Metric.VAL_LOSS], history[Metric.TRAIN_LOSS]
            record.last_val_step = val.steps[-1] if val else None
            if record.final_step is None and train:  # train/loss at step s, validation after it: s + 1
                record.final_step = train.steps[-1] + 1
            if curves:
                record.curves = history
        progress(at + len(chunk))
