"""What a command prints when it is done: the figures, the MLflow run and the next commands.

    command      how to call one of our console scripts (lrattn, mlflow) from the user's shell: its bare
                 name where PATH finds this environment's copy, else its path (relative inside cwd)
    store_flags  `--tracking_uri URI` for a printed command, where its default store is not the one used: every
                 command these lines print runs from the same folder as it stands, against the same store and data
    ui_pointer   how to look at a run: the URL of a tracking server's run page, or the `mlflow ui` command
                 for a local store and the page to open then
    fit_summary  the closing lines of `lrattn fit` / `lrattn demo`: final validation, run, checkpoint, next steps
    scoring_summary  those of `lrattn validate` / `lrattn test`: the figures, the step and the run they went to
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lrattn_lightning.data.remote import is_remote

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
    """Lines telling how to open `run_id`'s page (the training view of our experiments)."""
    if uri.startswith(("http://", "https://")):
        return [f"run page: {run_page(uri, experiment_id, run_id)}"]
    return [f"open the UI: {command('mlflow')} ui --backend-store-uri {uri}",
            f"then browse {run_page(LOCAL_UI, experiment_id, run_id)}"]


def fit_summary(cli: Any, prefix: str = "[lrattn fit]") -> list[str]:
    """The closing lines of a fit (rank zero): what it reached, where it is logged and saved, what next."""
    trainer, cfg = cli.trainer, cli.config[cli.subcommand]
    figures = _figures(trainer, lambda k: k in ("val/loss", "val/bpb", "val/ppl")) or "no validation"
    lines = [f"finished at step {trainer.global_step}: {figures}"]
    run = _logged_run(trainer.logger)
    if run:
        run_id, uri, experiment_id = run
        lines.append(f"MLflow run {run_id} ('{cfg.run_name}') in experiment '{cfg.experiment}' at {uri}")
        lines += ui_pointer(uri, experiment_id, run_id)
    lines += _unused_rows(cli.model.cfg.size, cfg.data.data_dir)
    ckpt = Path(cfg.runs_dir) / cfg.experiment / cfg.run_name / "checkpoints" / "last.ckpt"
    if ckpt.exists():
        shown = _shown(ckpt)
        lines.append(f"checkpoint {shown}")
        # eval logs into this run where it finds it: in this store (a default store elsewhere would not have it);
        # it reads the local data folder the checkpoint records, object storage only when named
        score = ["eval", "--checkpoint", shown, "--tasks", "local", *(store_flags(run[1]) if run else [])]
        if is_remote(str(cfg.data.data_dir)):
            score += ["--data_dir", str(cfg.data.data_dir)]
        lines.append(f"score it:  {command('lrattn')} {shlex.join(score)}")
    return [f"{prefix} {line}" for line in lines]


def scoring_summary(cli: Any) -> list[str]:
    """What `lrattn validate` / `lrattn test` of a checkpoint found, and where it was logged."""
    trainer, sub = cli.trainer, cli.subcommand
    step = getattr(cli.model, "report_step", trainer.global_step)
    figures = _figures(trainer, lambda k: k.startswith(f"{sub}/val/")) or "nothing scored"
    lines = [f"step {step}: {figures}"]
    run = _logged_run(trainer.logger)
    if run:
        run_id, uri, experiment_id = run
        lines.append(f"logged at step {step} to MLflow run {run_id} in {uri} (the fit's own val/* are unchanged)")
        lines += ui_pointer(uri, experiment_id, run_id)
    return [f"[lrattn {sub}] {line}" for line in lines]


def _figures(trainer: Any, wanted: Callable[[str], bool]) -> str:
    """The wanted results of the last validation as `name value` pairs, sorted by name ('' if none)."""
    return ", ".join(f"{k} {float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items()) if wanted(k))


def _logged_run(logger: Any) -> tuple[str, str, str | None] | None:
    """(run id, tracking URI, experiment id) of the MLflow run the logger writes to, None without one."""
    run_id, uri = getattr(logger, "run_id", None), getattr(logger, "_tracking_uri", None)
    return (run_id, uri, getattr(logger, "experiment_id", None)) if run_id and uri else None


def _shown(path: Path) -> str:
    """A path as short as it is unambiguous: relative when under the working folder."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unused_rows(size: Any, data_dir: str) -> list[str]:
    """A size whose vocabulary is larger than the data's tokenizer trains only some of its token rows."""
    from lrattn_lightning.data.shards import read_meta

    try:
        meta = read_meta(data_dir)
    except Exception:  # noqa: BLE001 - a note only; the data was checked before training
        return []
    unused = size.vocab_size - meta["vocab_size"]
    if unused <= 0:
        return []
    return [f"note: size '{size.name}' has {size.vocab_size} token ids, the data's {meta['tokenizer'].get('kind')} "
            f"tokenizer uses {meta['vocab_size']}: {unused} embedding and output rows were never trained "
            f"(prepare --tokenizer bpe:{size.vocab_size} uses them all)"]
