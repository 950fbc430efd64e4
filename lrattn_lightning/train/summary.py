"""What a command prints when it is done: the figures, the MLflow run and the next commands.

    command      how to call one of our console scripts (lrattn, mlflow) from the user's shell: its bare
                 name where PATH finds this environment's copy, else its path (relative inside cwd)
    store_flags  `--tracking_uri URI` for a printed command, where its default store is not the one used: every
                 command these lines print runs from the same folder as it stands, against the same store and data
    ui_pointer   how to look at a run: the URL of a tracking server's run page, or the `mlflow ui` command
                 for a local store and the page to open then
    fit_summary  the closing lines of `lrattn fit` / `lrattn demo`: final validation, run, checkpoint, next steps
    scoring_summary  those of `lrattn validate` / `lrattn test`: the figures, the step and the run they went to

Both take plain values (RunEnd: the step, the results, the MLflow run), not the LightningCLI: cli/outcome.py
reads them off a finished command.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lrattn_lightning.data.remote import is_remote
from lrattn_lightning.train.runs_view import runs_table
from lrattn_lightning.train.schema import Metric

LOCAL_UI = "http://127.0.0.1:5000"


def command(tool: str) -> str:
    """`tool` as the user types it: bare when PATH resolves it to this interpreter's copy, else its path."""
    mine = Path(sys.executable).parent / tool
    if not mine.exists():
        return tool
    found = shutil.which(tool)
    if found and Path(found).resolve() == mine.resolve():
        return tool
    return _shown(mine.absolute())


def store_flags(uri: str) -> list[str]:
    """`--tracking_uri URI` where a command without it would take another store (train/tracking.py
    default_tracking_uri: $MLFLOW_TRACKING_URI, else ./mlflow.db), else nothing."""
    from lrattn_lightning.train.store import absolute_sqlite, default_tracking_uri

    return [] if absolute_sqlite(uri) == default_tracking_uri() else ["--tracking_uri", uri]


def run_page(base: str, experiment_id: str | None, run_id: str | None) -> str:
    """The run's page in MLflow 3's "Model training" view (the UI opens in its GenAI view unless told)."""
    if experiment_id and run_id:
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    return f"{base.rstrip('/')}/#/?workflowType=machine_learning"


def ui_pointer(uri: str, experiment_id: str | None, run_id: str | None) -> list[str]:
    """Lines telling how to open `run_id`'s page and its experiment's runs table (the training view, with the
    columns of the experiment's saved view: train/runs_view.py)."""
    remote = uri.startswith(("http://", "https://"))
    base = uri if remote else LOCAL_UI
    table = [f"runs table: {runs_table(base, experiment_id)}"] if experiment_id else []
    if remote:
        return [f"run page: {run_page(uri, experiment_id, run_id)}", *table]
    return [f"open the UI: {command('mlflow')} ui --backend-store-uri {uri}",
            f"then browse {run_page(LOCAL_UI, experiment_id, run_id)}", *table]


@dataclass(frozen=True)
class RunEnd:
    """What a finished fit, validate or test reached, as plain values (cli/outcome.py reads them off the CLI)."""

    step: int  # the step its results belong to (a checkpoint's own for validate / test)
    metrics: dict[str, float]  # the results of its last validation, by metric name
    run_id: str | None = None  # the MLflow run it logged to (None: none)
    tracking_uri: str | None = None
    experiment_id: str | None = None

    @property
    def run(self) -> tuple[str, str, str | None] | None:
        """(run id, tracking URI, experiment id) of the MLflow run it logged to, None without one."""
        return (self.run_id, self.tracking_uri, self.experiment_id) if self.run_id and self.tracking_uri else None


def fit_summary(end: RunEnd, *, run_name: str, experiment: str, checkpoint: Path, data_dir: str, size_name: str,
                vocab_size: int, prefix: str = "[lrattn fit]", data_notes: bool = True) -> list[str]:
    """The closing lines of a fit (rank zero): what it reached, where it is logged and saved, what next.
    `checkpoint`: where its last.ckpt is (named only if it exists); size_name, vocab_size: the model's size;
    `data_notes`: whether notes about the data's fit to the size concern the user (not `lrattn demo`'s own corpus)."""
    figures = _figures(end.metrics, lambda k: k in (Metric.VAL_LOSS, Metric.VAL_BPB)) or "no validation"
    lines = [f"finished at step {end.step}: {figures}"]
    run = end.run
    if run:
        run_id, uri, experiment_id = run
        lines.append(f"MLflow run {run_id} ('{run_name}') in experiment '{experiment}' at {uri}")
        lines += ui_pointer(uri, experiment_id, run_id)
    lines += _unused_rows(size_name, vocab_size, data_dir) if data_notes else []
    if checkpoint.exists():
        shown = _shown(checkpoint)
        lines.append(f"checkpoint {shown}")
        # eval logs into this run where it finds it: in this store (a default store elsewhere would not have it);
        # it reads the local data folder the checkpoint records, object storage only when named
        score = ["eval", "--checkpoint", shown, "--tasks", "local", *(store_flags(run[1]) if run else [])]
        if is_remote(str(data_dir)):
            score += ["--data_dir", str(data_dir)]
        lines.append(f"score it:  {command('lrattn')} {shlex.join(score)}")
    return [f"{prefix} {line}" for line in lines]


def scoring_summary(end: RunEnd, subcommand: str) -> list[str]:
    """What `lrattn validate` / `lrattn test` (`subcommand`) of a checkpoint found, and where it was logged."""
    figures = _figures(end.metrics, lambda k: k.startswith(f"{subcommand}/{Metric.VAL}"))
    lines = [f"step {end.step}: {figures or 'nothing scored'}"]
    run = end.run
    if run:
        run_id, uri, experiment_id = run
        lines.append(f"logged at step {end.step} to MLflow run {run_id} in {uri} (the fit's own val/* are unchanged)")
        lines += ui_pointer(uri, experiment_id, run_id)
    return [f"[lrattn {subcommand}] {line}" for line in lines]


def _figures(metrics: dict[str, float], wanted: Callable[[str], bool]) -> str:
    """The wanted results as `name value` pairs, sorted by name ('' if none)."""
    return ", ".join(f"{k} {float(v):.4f}" for k, v in sorted(metrics.items()) if wanted(k))


def _shown(path: Path) -> str:
    """A path as short as it is unambiguous: relative when under the working folder."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unused_rows(size_name: str, vocab_size: int, data_dir: str) -> list[str]:
    """A size whose vocabulary is larger than the data's tokenizer trains only some of its token rows."""
    from lrattn_lightning.data.shards import read_meta

    try:
        meta = read_meta(data_dir)
    except Exception:  # noqa: BLE001 - a note only; the data was checked before training
        return []
    unused = vocab_size - meta["vocab_size"]
    if unused <= 0:
        return []
    return [f"note: size '{size_name}' has {vocab_size} token ids, the data's {meta['tokenizer'].get('kind')} "
            f"tokenizer uses {meta['vocab_size']}: {unused} embedding and output rows were never trained "
            f"(prepare --tokenizer bpe:{vocab_size} uses them all)"]
