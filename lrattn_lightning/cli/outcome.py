"""The closing lines of `lrattn fit` / `validate` / `test`: a finished LightningCLI's values, read off it here and
handed to train/summary.py as plain values (RunEnd, names, paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lrattn_lightning.train.summary import RunEnd, fit_summary, scoring_summary


def run_end(trainer: Any, step: int) -> RunEnd:
    """The trainer's last results and the MLflow run its logger wrote to (if any), at `step`."""
    logger = trainer.logger
    return RunEnd(step=step, metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
                  run_id=getattr(logger, "run_id", None), tracking_uri=getattr(logger, "_tracking_uri", None),
                  experiment_id=getattr(logger, "experiment_id", None))


def fit_lines(cli: Any, prefix: str = "[lrattn fit]", data_notes: bool = True) -> list[str]:
    """fit_summary of a finished `lrattn fit` (or `lrattn demo`'s fit: `data_notes` False on its own corpus)."""
    cfg, size = cli.config[cli.subcommand], cli.model.cfg.size
    checkpoint = Path(cfg.runs_dir) / cfg.experiment / cfg.run_name / "checkpoints" / "last.ckpt"
    return fit_summary(run_end(cli.trainer, cli.trainer.global_step), run_name=cfg.run_name,
                       experiment=cfg.experiment, checkpoint=checkpoint, data_dir=cfg.data.data_dir,
                       size_name=size.name, vocab_size=size.vocab_size, prefix=prefix,
                       data_notes=data_notes)


def scoring_lines(cli: Any) -> list[str]:
    """scoring_summary of a finished `lrattn validate` / `lrattn test` of a checkpoint, at the checkpoint's step."""
    step = getattr(cli.model, "report_step", cli.trainer.global_step)
    return scoring_summary(run_end(cli.trainer, step), cli.subcommand)
