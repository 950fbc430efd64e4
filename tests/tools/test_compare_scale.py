"""`lrattn compare` at a lab's scale (issue 53): the MLflow requests it makes per run are bounded (no get_run per
run, histories in bulk queries, an artifact not asked of every run of an entry that logs none), a slow phase prints
a progress line, and a row of many seeds says how many rather than listing them. A real sqlite MLflow store of 48
runs (2 sizes x 2 entries x 12 seeds); the timings are benchmarks/compare-scale's, not a test's."""

from __future__ import annotations

import collections

import pytest
import sqlalchemy
from helpers.tracking import seed_store, sqlite_experiment
from mlflow.entities import Metric, Param
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
from mlflow.tracking import MlflowClient

from lrattn_lightning.tools.compare import runs as runs_module
from lrattn_lightning.tools.compare.compare import write_report

SIZES, ENTRIES, SEEDS = ("tiny", "small"), ("baseline", "s-lr-block-n8-r64"), 12
STORE_CALLS = ("get_run", "get_metric_history", "get_metric_history_bulk", "search_runs", "get_experiment_by_name")


@pytest.fixture(scope="module")
def study(tmp_path_factory, store_template):
    root = tmp_path_factory.mktemp("compare-scale")
    seed_store(root, store_template)
    uri, client, exp = sqlite_experiment(root, "lab")
    for size in SIZES:
        for i, entry in enumerate(ENTRIES):
            for seed in range(SEEDS):
                tags = {"seed": str(seed), "control": "none" if entry == "baseline" else "baseline",
                        "lrattn.last_step": "20", "mlflow.runName": f"{size}-{entry}-s{seed}"}
                rid = client.create_run(exp, tags=tags).info.run_id
                params = {"size": size, "ablation": entry, "params": str(1000 * (1 + i)), "train_max_steps": "20",
                          "added_flops_pct": str(0.5 * i)}
                loss = 3.0 - 0.1 * i - 0.2 * SIZES.index(size) + 0.001 * seed
                metrics = [Metric(key, value, 0, step) for step in range(5, 21, 5) for key, value in
                           (("train/loss", loss + 1 - step / 20), ("train/device/items_per_sec", 1000.0 + step))]
                metrics.append(Metric("val/loss", loss, 0, 20))
                client.log_batch(rid, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
                if entry != "baseline":  # what RoutingArtifacts logs for a kind that records
                    client.log_dict(rid, {"step": 20, "sites_by_sources": [[0.5, 0.5], [0.25, 0.75]]},
                                    "routing/weights.json")
                client.set_terminated(rid, "FINISHED")
    return {"uri": uri, "root": root}


def _counted(client, monkeypatch) -> collections.Counter:
    """Count the tracking store's calls (the requests a server would get) and artifact file reads, through the
    real store and repository."""
    calls = collections.Counter()
    store = client._tracking_client.store
    for name in STORE_CALLS:
        real = getattr(store, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, wrapper)
    real_download = LocalArtifactRepository.download_artifacts

    def download(self, *args, **kwargs):
        calls["artifact"] += 1
        return real_download(self, *args, **kwargs)

    monkeypatch.setattr(LocalArtifactRepository, "download_artifacts", download)

    def statement(*args, **kwargs):
        calls["sql"] += 1

    sqlalchemy.event.listen(store.engine, "before_cursor_execute", statement)
    return calls


@pytest.fixture(scope="module")
def report(study, tmp_path_factory):
    """One compare of the study, its store calls and artifact reads counted, its progress lines forced (threshold 0,
    chunks of 20 runs), its stderr kept."""
    import io
    import sys

    out = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as monkeypatch:
        client = MlflowClient(study["uri"])
        calls = _counted(client, monkeypatch)
        monkeypatch.setattr(runs_module, "PROGRESS_AFTER", 0.0, raising=False)
        monkeypatch.setattr(runs_module, "PROGRESS_EVERY", 0.0, raising=False)
        monkeypatch.setattr(runs_module, "CHUNK", 20, raising=False)
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        rows, files = write_report(client, "lab", out)
    return {"rows": rows, "files": files, "calls": calls, "err": err.getvalue(), "out": out}


def test_requests_per_run_are_bounded(report):
    rows, files, calls = report["rows"], report["files"], report["calls"]
    runs = len(SIZES) * len(ENTRIES) * SEEDS
    assert sum(len(row.runs) for row in rows) == runs
    assert calls["get_run"] == 0, calls  # was 3 a run: two artifact downloads and the ladder's params
    assert calls["get_metric_history"] == 0, calls  # was 3 a run
    assert calls["get_metric_history_bulk"] == 0, calls  # one SQL query a chunk of 20 runs instead
    # routing/weights.json of each run that has one; of the baseline's and of gates.json a few tries per entry
    tries = 3 * len(SIZES) * (len(ENTRIES) + 1)
    assert calls["artifact"] <= runs // 2 + tries < 2 * runs, calls
    assert calls["search_runs"] == 0 and calls["get_experiment_by_name"] <= 2, calls  # sqlite: four plain queries
    assert calls["sql"] <= 60, calls  # SQLAlchemy's statements: 19 here, was 3,388 (70 a run)
    # what was read is what the runs hold: tokens/s (the median of the history), the curves, the heatmaps
    assert {round(row.tokens_per_s) for row in rows} == {1012}
    assert all(list(run.curves["val/loss"]) == [(20, run.val_loss)] for row in rows for run in row.runs)
    assert all(len(run.curves["train/loss"]) == 4 for row in rows for run in row.runs)
    assert "routing_heatmaps.png" in {f.name for f in files}


@pytest.mark.usefixtures("mlflow_store")
def test_the_sqlite_search_is_mlflows_search(tmp_path):
    """sqlite_search (four plain queries and MLflow's in-memory filter) returns what MlflowClient.search_runs does,
    in its order, for the filters compare asks and others: run info, tags (the description left out) in order,
    params, latest metrics (a NaN one too); deleted runs and other experiments' runs not; a filter on datasets and a
    store that is not sqlite go through MLflow (None)."""
    import math

    uri, client, exp = sqlite_experiment(tmp_path, "same")
    other = client.create_experiment("other")
    rids = []
    for i in range(6):
        rid = client.create_run(other if i == 5 else exp, tags={"sweep": "s" if i % 2 else "t", "seed": str(i),
                                                               "mlflow.note.content": "long text"},
                                run_name=None if i == 3 else f"run-{i}", start_time=1000 + i // 2).info.run_id
        client.log_batch(rid, metrics=[Metric("val/loss", math.nan if i == 1 else 3.0 - i, 5, 2)],
                         params=[Param("size", "tiny"), Param("ablation", f"a{i % 3}")])
        client.set_terminated(rid, "FINISHED" if i != 2 else "FAILED")
        rids.append(rid)
    client.delete_run(rids[4])
    reader = MlflowClient(uri)
    for query in ("", "attributes.status = 'FINISHED'", "tags.sweep = 's'", "params.ablation = 'a0' and "
                  "metrics.`val/loss` < 10", "attributes.run_name LIKE 'run-%'"):
        want = reader.search_runs([exp], query, max_results=1000)
        got = runs_module.sqlite_search(reader, exp, query)
        assert [r.info.run_id for r in got] == [r.info.run_id for r in want] and got, query
        for a, b in zip(got, want, strict=True):
            b.data.tags.pop("mlflow.note.content")
            assert a.info.to_proto() == b.info.to_proto()
            assert list(a.data.tags.items()) == list(b.data.tags.items()) and a.data.params == b.data.params
            assert [m.to_proto() for m in a.data._metric_objs] == [m.to_proto() for m in b.data._metric_objs]
    assert runs_module.sqlite_search(reader, exp, "datasets.name = 'x'") is None
    assert runs_module.sqlite_search(object(), exp, "") is None


def test_a_slow_phase_prints_a_progress_line(report):
    runs = len(SIZES) * len(ENTRIES) * SEEDS
    for done in (20, 40, runs):
        assert f"[lrattn compare] read histories of {done}/{runs} runs" in report["err"], report["err"]
    assert f"[lrattn compare] searched {runs} runs (" in report["err"], report["err"]  # its pages: one here


def test_a_phase_quicker_than_the_threshold_prints_none(study, report, capsys):
    records = [row.runs[0] for row in report["rows"]]
    runs_module.read_histories(MlflowClient(study["uri"]), records)  # PROGRESS_AFTER: 5 s
    assert "read histories" not in capsys.readouterr().err


def test_many_seeds_are_counted_not_listed(report):
    table = (report["out"] / "table.md").read_text().split("## Pairwise")[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and "baseline" in line.split("|")[2]]
    assert len(rows) == len(SIZES) and all(f"| {SEEDS} seeds (0-{SEEDS - 1}) |" in line for line in rows), table
    assert ",".join(map(str, range(SEEDS))) not in table
    csv = (report["out"] / "table.csv").read_text()
    assert ";".join(map(str, range(SEEDS))) in csv  # the CSV keeps every seed


def test_the_summary_runs_description_of_many_rows_is_not_cut_mid_line(study):
    """600 rows' Δ lines are more than MLflow keeps of a tag (8,000 characters): the description keeps the rows
    that fit, whole, says how many more the report holds, and ends with where the report is."""
    from lrattn_lightning.tools.compare.summary_run import compared, description

    numbers = {f"delta/ladder-m/s-lr-block-n8-r64+lr{i}": 0.1 for i in range(600)}
    text = description(compared("lab", [], "baseline"), numbers)
    client = MlflowClient(study["uri"])
    rid = client.create_run(client.create_experiment("lab-reports-test")).info.run_id
    client.set_tag(rid, "mlflow.note.content", text)
    stored = client.get_run(rid).data.tags["mlflow.note.content"]
    assert stored == text  # MLflow kept all of it
    lines = stored.splitlines()
    deltas = [line for line in lines if line.startswith("- Δ ")]
    assert 100 < len(deltas) < 600 and all(line.endswith(": +0.1000") for line in deltas)
    assert f"- ... {600 - len(deltas)} more rows: see the report artifact `compare/report.md`" in lines
    assert lines[-1].startswith("The full report (table, p-values, figures)")


# ---- what is kept of a history, and what the curves figure makes of it ---------------------------------------
def test_a_long_curve_is_thinned_to_its_first_last_and_each_buckets_extremes():
    """A run that logged 20,000 points keeps at most CURVE_POINTS + 2 of them: its first and last, and in each
    bucket of steps its first, lowest and highest point (a spike stays in the figure); two seeds logged alike keep
    the same steps (their mean is still taken step by step); a short curve is kept whole."""
    import numpy as np

    steps = np.arange(1, 20_001) * 5
    values = 3.0 + np.sin(steps / 997.0)
    values[7_321], values[12_000] = 9.0, -1.0  # a spike up and one down
    values[15_000] = np.nan
    kept_steps, kept = runs_module.thin(steps, values)
    assert len(kept_steps) <= runs_module.CURVE_POINTS + 2 and len(kept_steps) > runs_module.CURVE_POINTS // 2
    assert kept_steps[0] == steps[0] and kept_steps[-1] == steps[-1] and np.all(np.diff(kept_steps) > 0)
    assert {steps[7_321], steps[12_000]} <= set(kept_steps.tolist())
    assert np.nanmax(kept) == 9.0 and np.nanmin(kept) == -1.0
    assert np.array_equal(kept, values[np.searchsorted(steps, kept_steps)], equal_nan=True)  # values, not averages
    other_steps, _ = runs_module.thin(steps, 3.0 + np.cos(steps / 991.0))
    firsts = set(kept_steps.tolist()) & set(other_steps.tolist())  # each bucket's first step at least
    assert len(firsts) >= len(kept_steps) // 3
    short_steps, short = runs_module.thin(steps[:100], values[:100])
    assert np.array_equal(short_steps, steps[:100]) and np.array_equal(short, values[:100])


@pytest.mark.usefixtures("mlflow_store")
def test_histories_keep_a_resumed_runs_later_value_of_a_step_and_the_median_of_every_speed(tmp_path):
    """Points of one (run, key, step) logged twice (a resumed run): the later timestamp wins; tokens/s is the
    median of every point logged, duplicates included; a run with no history has none."""
    from lrattn_lightning.tools.compare.table import RunRecord

    uri, client, exp = sqlite_experiment(tmp_path, "resumed")
    rids = [client.create_run(exp).info.run_id for _ in range(2)]
    points = [("train/loss", 5.0, 1, 10), ("train/loss", 4.0, 2, 20), ("train/loss", 3.5, 9, 20),
              ("train/loss", 3.9, 5, 20), ("val/loss", 3.0, 3, 20), ("val/loss", 2.9, 8, 20),
              ("train/device/items_per_sec", 100.0, 1, 10), ("train/device/items_per_sec", 300.0, 2, 20),
              ("train/device/items_per_sec", 200.0, 9, 20), ("train/device/items_per_sec", 400.0, 9, 30)]
    client.log_batch(rids[0], metrics=[Metric(k, v, t, s) for k, v, t, s in points])
    records = [RunRecord(rid, rid, "tiny", "baseline", None, 0, 0, 2.9, 1, 0.0, {}) for rid in rids]
    runs_module.read_histories(MlflowClient(uri), records)
    first, empty = records
    assert list(first.curves["train/loss"]) == [(10, 5.0), (20, 3.5)] and list(first.curves["val/loss"]) == [(20, 2.9)]
    assert first.tokens_per_s == 250.0 and first.last_val_step == 20 and first.final_step == 21
    assert empty.tokens_per_s is None and empty.last_val_step is None and not empty.curves["train/loss"]


def test_the_curves_figures_seed_mean_is_taken_over_the_steps_every_seed_logged():
    """_seed_mean (numpy over the row's points) equals the mean, min and max over seeds written out per step, at
    the steps every seed logged only; a row one of whose runs has no curve draws nothing."""
    import statistics

    from lrattn_lightning.tools.compare.figures import _seed_mean
    from lrattn_lightning.tools.compare.runs import Curve
    from lrattn_lightning.tools.compare.table import Row, RunRecord

    def run(pairs):
        record = RunRecord("r", "r", "tiny", "baseline", None, 0, 0, 1.0, 1, 0.0, {})
        record.curves = {"train/loss": Curve(pairs)}
        return record

    seeds = [[(10, 3.0), (20, 2.5), (30, 2.0)], [(10, 3.2), (20, 2.1), (30, 2.2), (40, 1.0)], [(10, 2.9), (30, 2.4)]]
    steps, mean, low, high = _seed_mean(Row("tiny", "baseline", None, [run(p) for p in seeds]), "train/loss")
    assert steps == [10, 30]
    assert mean == pytest.approx([statistics.fmean([3.0, 3.2, 2.9]), statistics.fmean([2.0, 2.2, 2.4])], rel=1e-15)
    assert low == [2.9, 2.0] and high == [3.2, 2.4]
    assert _seed_mean(Row("tiny", "baseline", None, [run(seeds[0]), run([])]), "train/loss") == ([], [], [], [])
