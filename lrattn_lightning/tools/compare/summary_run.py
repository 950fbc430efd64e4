"""compare's summary run: the report logged to MLflow, in EXPERIMENT-reports, where a researcher finds it.

    reports_experiment  EXPERIMENT-reports (created, or restored if deleted), tagged with the training kind
    log_summary_run     the run: the report's files as artifacts compare/*, the headline numbers as metrics
                        (delta/SIZE/ROW: Δ mean val loss to the reference; multiplier/METHOD, multiplier_lo/,
                        multiplier_hi/: the compute multiplier over a size ladder and its interval, from
                        scaling.csv), what was compared as params, and a short description
    addresses           the lines that say where to look: the summary run's page and the study's runs table
"""

from __future__ import annotations

import csv
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattn_lightning.core.words import count, plural
from lrattn_lightning.tools.compare.runs import search_all
from lrattn_lightning.tools.compare.table import SUMMARY_TAG, Row
from lrattn_lightning.tools.compare.words import ablation_names, size_list
from lrattn_lightning.train.runs_view import ensure_view, runs_table
from lrattn_lightning.train.schema import Artifact, ExperimentTag, Metric, Param, Tag
from lrattn_lightning.train.summary import LOCAL_UI, command, run_page

REPORTS_SUFFIX, REPORT_OF_TAG = "-reports", Tag.REPORT_OF


def reports_experiment(client: Any, experiment: str) -> str:
    """The id of EXPERIMENT-reports, the summary runs' own experiment (created, or restored if deleted), tagged
    with the training kind and the saved view of its runs table."""
    from lrattn_lightning.train.store import artifact_location

    name = experiment + REPORTS_SUFFIX
    exp = client.get_experiment_by_name(name)
    if exp is None:
        exp_id = client.create_experiment(name, artifact_location(client.tracking_uri),
                                          tags={ExperimentTag.REPORT_OF: experiment})
        tags: dict[str, str] = {}
    else:
        exp_id, tags = exp.experiment_id, exp.tags
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp_id)
    ensure_view(client, exp_id, tags, columns=None)  # the kind only: its runs carry other columns
    return exp_id


def metric_key(text: str) -> str:
    """A row's label as MLflow takes it in a metric name (letters, digits, _ - . / space; `+` of a variant is _)."""
    return re.sub(r"[^\w./\- ]", "_", text)


def headline(rows: list[Row], files: list[Path]) -> dict[str, float]:
    """Δ to the reference per row, and each method's compute multiplier with its interval (scaling.csv; not the
    reference's own, 1 by definition)."""
    out = {}
    for row in rows:
        if row.delta_baseline is not None:
            recipe = "" if row.group == "A" else f" recipe {row.group}"
            out[Metric.DELTA + metric_key(f"{row.size}/{row.label or row.ablation}{recipe}")] = row.delta_baseline
    scaling = next((p for p in files if p.name == "scaling.csv"), None)
    if scaling is not None and scaling.is_file():
        with scaling.open() as f:
            for r in csv.DictReader(f):
                if r["method"] == r.get("reference"):
                    continue  # the reference's own multiplier is 1 by definition (it logged 0.9999999999999996)
                for prefix, column in ((Metric.MULTIPLIER, "multiplier"), (Metric.MULTIPLIER_LO, "low"),
                                       (Metric.MULTIPLIER_HI, "high")):
                    if r.get(column):
                        out[prefix + metric_key(r["method"])] = float(r[column])
    return out


@dataclass(frozen=True)
class Compared:
    """What a comparison compared, counted once: its params and the run's description both read it."""

    experiment: str
    reference: str
    sizes: list[str]  # in ladder order (words.size_list)
    methods: int
    seeds: list[int]  # the seed counts of the rows, ascending
    runs: int

    def params(self) -> dict[str, str]:
        return {Param.REPORT_EXPERIMENT: self.experiment, Param.REPORT_REFERENCE: self.reference,
                Param.REPORT_SIZES: ",".join(self.sizes), Param.REPORT_METHODS: str(self.methods),
                Param.REPORT_SEEDS: "/".join(map(str, self.seeds)), Param.REPORT_RUNS: str(self.runs)}


def compared(experiment: str, rows: list[Row], reference: str) -> Compared:
    return Compared(experiment, reference, size_list(rows), len(ablation_names(rows)),
                    sorted({len(row.runs) for row in rows}), sum(len(row.runs) for row in rows))


def description(what: Compared, numbers: dict[str, float]) -> str:
    """The run's Description: what was compared, the headline numbers one per line, where the report is."""
    head = [f"**Comparison of `{what.experiment}`**: {count(what.runs, 'finished run')}, "
            f"{plural(len(what.sizes), 'size')} {', '.join(what.sizes)}, {'/'.join(map(str, what.seeds))} "
            f"{plural(max(what.seeds, default=0), 'seed')} per row; Δ is the mean final val loss (nats/token) minus "
            f"`{what.reference}`'s.", ""]
    lines = []
    for key, value in numbers.items():
        if key.startswith(Metric.DELTA):
            lines.append(f"- Δ {key.removeprefix(Metric.DELTA)}: {value:+.4f}")
    for key, value in numbers.items():
        if key.startswith(Metric.MULTIPLIER):
            method = key.removeprefix(Metric.MULTIPLIER)
            lo, hi = numbers.get(Metric.MULTIPLIER_LO + method), numbers.get(Metric.MULTIPLIER_HI + method)
            interval = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
            lines.append(f"- compute multiplier {method}: {value:.2f}x{interval}")
    tail = ["", f"The full report (table, p-values, figures): Artifacts, `{Artifact.COMPARE}report.md`; the table "
            f"alone: `{Artifact.COMPARE}table.md`. These numbers are this run's metrics."]
    return fit_lines(head, lines, tail)


DESCRIPTION_LIMIT = 8000  # MLflow's MAX_TAG_VAL_LENGTH: the store cuts a longer tag wherever the limit falls


def fit_lines(head: list[str], items: list[str], tail: list[str], limit: int = DESCRIPTION_LIMIT) -> str:
    """head, items and tail as lines within `limit` characters: where they do not fit, the items that do and a
    line saying how many more the report holds (never a line cut in two; issue 53)."""
    text = "\n".join(head + items + tail)
    kept = len(items)
    while len(text) > limit and kept:
        kept = min(kept - 1, kept * limit // len(text))  # about the share that fits, then one at a time
        more = f"- ... {len(items) - kept} more rows: see the report artifact `{Artifact.COMPARE}report.md`"
        text = "\n".join(head + items[:kept] + [more] + tail)
    return text


def log_summary_run(client: Any, experiment: str, files: list[Path], rows: list[Row], reference: str,
                    sweep: str | None) -> tuple[str, str]:
    """Log the report as the experiment's summary run in EXPERIMENT-reports: (experiment id, run id). The run
    tagged with this experiment (and this sweep if one was named) is reused while what it compared (its params)
    is the same; a comparison of other runs gets a run of its own (params cannot change)."""
    exp_id = reports_experiment(client, experiment)
    what = compared(experiment, rows, reference)
    params = what.params()
    found = [r for r in search_all(client, exp_id, f"tags.`{SUMMARY_TAG}` = 'true'")  # names compared here: any quote
             if r.data.tags.get(REPORT_OF_TAG) == experiment and r.data.tags.get(Tag.SWEEP_SUMMARY) == sweep
             and all(r.data.params.get(k, v) == v for k, v in params.items())]
    if found:
        run_id = max(found, key=lambda r: r.info.start_time).info.run_id
    else:
        tags = {SUMMARY_TAG: "true", REPORT_OF_TAG: experiment, Tag.RUN_NAME: f"compare-{sweep or experiment}"}
        if sweep:
            tags[Tag.SWEEP_SUMMARY] = sweep
        run_id = client.create_run(exp_id, tags=tags).info.run_id
    for path in files:
        client.log_artifact(run_id, str(path), Artifact.COMPARE.removesuffix("/"))
    from mlflow.entities import Metric as Point  # MLflow loads only where a run is logged
    from mlflow.entities import Param as Pair

    numbers, now = headline(rows, files), int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Point(k, v, now, 0) for k, v in numbers.items()],
                     params=[Pair(k, v) for k, v in params.items()])
    client.set_tag(run_id, Tag.NOTE, description(what, numbers))  # the run's description
    client.set_terminated(run_id, "FINISHED")
    return exp_id, run_id


def addresses(client: Any, experiment: str, reports_id: str | None, run_id: str | None) -> list[str]:
    """Where to look in the UI: the summary run's page and the study's runs table (the training view, with the
    saved view's columns: the study gets the view if it has none)."""
    uri = client.tracking_uri
    remote = uri.startswith(("http://", "https://"))
    base = uri if remote else LOCAL_UI
    lines = [] if remote else [f"open the UI: {command('mlflow')} ui --backend-store-uri {uri}"]
    if run_id:
        lines.append(f"summary run: {run_page(base, reports_id, run_id)}")
    study = client.get_experiment_by_name(experiment)
    if study is not None:
        ensure_view(client, study.experiment_id, study.tags)
        lines.append(f"runs table of '{experiment}': {runs_table(base, study.experiment_id)}")
    return lines
