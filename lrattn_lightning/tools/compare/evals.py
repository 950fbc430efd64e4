"""Which downstream scores share a cell of `lrattn compare`'s table: like is pooled only with like.

A run's `eval/<task>/<metric>` is its latest evaluation of the task; `lrattn eval` (and the fit's EvalCallback)
tags the run with the configuration of that evaluation (`lrattn.eval_config/<task>`, eval/tasks.py
`config_tags`). Scores of one task pool into one cell only across runs whose configuration agrees in

    limit         the documents per task (None: every one)
    num_fewshot   the task's few-shot count
    data          the prepared folder a local task (or the validation loss) read; None for lm-eval's own datasets

Where the runs of a study carry several configurations of one task, each gets its own column,
`task/metric [limit 80]` (the label names only what differs), and a line under the table says so. Runs from
before the tag: their latest `eval/results-*.json` artifact holding the task gives limit and few-shot (the data
folder of a local task: not recorded); without one the configuration is unknown, a column of its own when
others are known. A cell's seed count is its own: the runs of the row that have the score.

Some of lm-eval's numbers say nothing at a study's scale: its per-run bootstrap standard errors (`*_stderr`:
not the spread over seeds the tests use) and sample counts (`sample_len`, the validation's `tokens`, `windows`).
They leave the main table for the report's appendix (`in_appendix`); table.csv keeps every column.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lrattn_lightning.eval.tasks import CONFIG_TAG, LOCAL_TASKS
from lrattn_lightning.train.schema import Metric

if TYPE_CHECKING:
    from lrattn_lightning.tools.compare.table import Row

POOL_KEYS = ("limit", "num_fewshot", "data")  # what must agree for two runs' scores to share a cell
STDERR = re.compile(r"(^|_)stderr(_|$)")  # lm-eval's acc_stderr, word_perplexity_stderr, ...
COUNTS = {"sample_len", "val/tokens", "val/windows"}  # a group's documents; the validation's tokens and windows
UNRECORDED = "not recorded"


def task_of(key: str) -> str:
    """'eval/<task>/<metric>' -> task."""
    return key.removeprefix(Metric.EVAL).rsplit("/", 1)[0]


def in_appendix(key: str) -> bool:
    """A bookkeeping number (a bootstrap stderr, a sample count), not a score compared across seeds."""
    metric = key.rsplit("/", 1)[-1]
    return bool(STDERR.search(metric)) or metric in COUNTS or key.removeprefix(Metric.EVAL) in COUNTS


def canonical(config: dict[str, Any] | None) -> str | None:
    """The part of a configuration that must agree, as one comparable string (None: unknown)."""
    if config is None:
        return None
    limit = config.get("limit")
    limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
    return json.dumps({"limit": limit, "num_fewshot": config.get("num_fewshot"), "data": config.get("data")},
                      sort_keys=True)


def run_configs(client: Any, run: Any) -> dict[str, str | None]:
    """task -> canonical configuration of the run's latest evaluation of it (None: unknown), for every task the
    run has eval/ metrics of."""
    tasks = {task_of(k) for k in run.data.metrics if k.startswith(Metric.EVAL)}
    out: dict[str, str | None] = {}
    for task in tasks:
        text = run.data.tags.get(CONFIG_TAG + task)
        try:
            out[task] = canonical(json.loads(text)) if text else None
        except json.JSONDecodeError:
            out[task] = None
    missing = [t for t, c in out.items() if c is None]
    if missing:
        out.update(_from_results(client, run.info.run_id, missing))
    return out


def _from_results(client: Any, run_id: str, tasks: list[str]) -> dict[str, str | None]:
    """Configurations of runs evaluated before the tag: from the latest results JSON holding each task."""
    try:
        files = sorted((a.path for a in client.list_artifacts(run_id, "eval") if a.path.endswith(".json")), reverse=True)
    except Exception:  # noqa: BLE001 - no artifacts (a store without them): unknown
        return {}
    found: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:  # results-stepNNNNNN-<time>-<id>.json: the latest first
            try:
                data = json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text())
            except Exception:  # noqa: BLE001 - an unreadable file tells nothing
                continue
            config = data.get("config") or {}
            for task in tasks:
                if task in found or task not in (data.get("results") or {}) and not (task == "val" and "validation" in data):
                    continue
                shots = ((data.get("configs") or {}).get(task) or {}).get("num_fewshot", config.get("num_fewshot"))
                local = task in LOCAL_TASKS or task == "val"
                found[task] = canonical({"limit": None if task == "val" else config.get("limit"),
                                         "num_fewshot": None if task == "val" else shots,
                                         "data": UNRECORDED if local else None})
            if len(found) == len(tasks):
                break
    return found


def describe(config: str | None, differs: set[str]) -> str:
    """A configuration in a column label, by the fields that differ among the task's configurations."""
    if config is None:
        return "config not recorded"
    c = json.loads(config)
    words = []
    if "limit" in differs:
        words.append("all items" if c["limit"] is None else f"limit {c['limit']}")
    if "num_fewshot" in differs:
        words.append("shots ?" if c["num_fewshot"] is None else f"{c['num_fewshot']}-shot")
    if "data" in differs:
        words.append("data " + ("—" if c["data"] is None else c["data"] if c["data"] == UNRECORDED else
                                Path(c["data"]).name or c["data"]))
    return ", ".join(words)


@dataclass(frozen=True)
class EvalColumn:
    key: str  # eval/<task>/<metric>
    config: str | None  # the canonical configuration its runs share (None: unknown)
    label: str  # task/metric, `[...]` when the task ran under several configurations
    appendix: bool

    def values(self, row: Row) -> list[float]:
        return [r.metrics[self.key] for r in row.runs
                if self.key in r.metrics and r.eval_configs.get(task_of(self.key)) == self.config]

    def cell(self, row: Row) -> tuple[float | None, float | None, int]:
        """(mean, std over seeds, seeds) of the row's runs with this score under this configuration."""
        values = self.values(row)
        if not values:
            return None, None, 0
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None), len(values)


def eval_columns(rows: list[Row]) -> list[EvalColumn]:
    """One column per (metric, configuration) the rows' runs carry, in the order of the metric's name."""
    configs: dict[str, set] = {}
    for row in rows:
        for run in row.runs:
            for key in run.metrics:
                if key.startswith(Metric.EVAL):
                    configs.setdefault(key, set()).add(run.eval_configs.get(task_of(key)))
    columns = []
    for key in sorted(configs):
        found = sorted(configs[key], key=lambda c: (c is None, c or ""))
        name = key.removeprefix(Metric.EVAL)
        if len(found) == 1:
            columns.append(EvalColumn(key, found[0], name, in_appendix(key)))
            continue
        known = [json.loads(c) for c in found if c is not None]
        differs = {k for k in POOL_KEYS if len({json.dumps(c[k]) for c in known}) > 1} or set(POOL_KEYS)
        columns += [EvalColumn(key, c, f"{name} [{describe(c, differs)}]", in_appendix(key)) for c in found]
    return columns


def cell_text(column: EvalColumn, row: Row, digits: int = 4) -> str:
    """mean ± std, with `(n k)` where fewer of the row's seeds have the score."""
    mean, std, n = column.cell(row)
    if mean is None:
        return "—"
    text = f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")
    return text + (f" (n {n})" if n != len(row.runs) else "")


def pooling_note(rows: list[Row]) -> str:
    """The lines under the table on eval columns: which tasks ran under several configurations, and the n."""
    columns = eval_columns(rows)
    split: dict[str, list[str]] = {}
    for column in columns:
        if "[" in column.label and not column.appendix:
            split.setdefault(column.key.removeprefix(Metric.EVAL), []).append(column.label)
    lines = []
    if split:
        lines.append("Downstream scores pool only runs whose evaluation shared one configuration (limit, few-shot, "
                     "data folder): " + "; ".join(f"`{k}` ran under {len(v)}, shown apart as "
                                                  + ", ".join(f"`{label}`" for label in v) for k, v in split.items())
                     + " (a run counts under the configuration of its latest evaluation of the task).")
    if any(c.cell(row)[2] not in (0, len(row.runs)) for c in columns if not c.appendix for row in rows):
        lines.append("A downstream cell's `(n k)`: only k of the row's seeds have that score; its mean and std are "
                     "over those k.")
    if any(c.appendix for c in columns):
        lines.append("lm-eval's per-run bootstrap standard errors and sample counts are not compared across seeds: "
                     "they are in the report's appendix, not in this table.")
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def appendix_table(rows: list[Row], label: Any) -> str:
    """The appendix of report.md: the bookkeeping columns, one row per table row (`label(row)`: its name)."""
    columns = [c for c in eval_columns(rows) if c.appendix]
    if not columns:
        return ""
    head = ["row", *[c.label for c in columns]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join([label(row), *[cell_text(c, row) for c in columns]]) + " |" for row in rows]
    return "\n".join(lines) + "\n"
