"""What a `lrattn fit|validate|test` run writes, once its checks passed (a mixin of LRAttnCLI, cli/lightning.py): the
run folder (its lock, orphans of an unfinished save), the MLflow store and logger, the trainer's defaults (atomic
checkpoint writes, last.ckpt, the step monitors) and the validation that ends every fit.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lrattn_lightning.cli import checks
from lrattn_lightning.train.callbacks import StepProgressLog, step_progress_bar, training_monitors
from lrattn_lightning.train.checkpoint import lock, save, stop
from lrattn_lightning.train.checkpoint.save import AtomicCheckpointIO, LastCheckpoint
from lrattn_lightning.train.tracking import (
    RUN_DIR_TAG,
    TrackingLogger,
    artifact_location,
    end_orphaned_runs,
    open_store,
    run_dir_tag,
    run_in_store,
)


class RunOutputs:
    """LightningCLI hooks that write; the CLI holds `subcommand`, `config`, `run_dir`, `tracking_uri`,
    `experiment_id` and `resume_run_id` (set by its checks)."""

    def _claim_run(self, cfg) -> None:
        """The checks passed: from here on this process owns the run folder and writes."""
        if self.subcommand == "fit" and lock.launched_as_rank_zero():
            lock.lock_run_folder(self.run_dir)
            for orphan in save.remove_orphans(self.run_dir / "checkpoints"):
                print(f"[lrattn] removed {orphan}, left by a checkpoint save that never finished", file=sys.stderr)
        if self.tracking_uri is not None:
            self.experiment_id = open_store(self.tracking_uri, cfg.experiment)
            if self.resume_run_id and not run_in_store(self.tracking_uri, self.resume_run_id):
                print(f"[lrattn] MLflow run {self.resume_run_id} of {cfg.ckpt_path} is not in {self.tracking_uri}; "
                      "logging to a new run", file=sys.stderr)
                self.resume_run_id = None
            if self.subcommand == "fit" and lock.launched_as_rank_zero():  # we hold the folder's lock
                end_orphaned_runs(self.tracking_uri, self.experiment_id, self.run_dir, keep=self.resume_run_id)

    def after_fit(self) -> None:
        """A fit always ends with a validation of its final weights (val/loss, routing, heatmap at the last
        step), also when max_steps is not a multiple of val_check_interval, and also when it is resumed at its
        end; the MLflow run is FINISHED only after it. A stop signal that came after the last step stops the run
        before that validation (KILLED, exit 128 + N): the resume then runs it."""
        trainer, model = self.trainer, self.model
        logger = trainer.logger if isinstance(trainer.logger, TrackingLogger) else None
        if trainer.interrupted:
            return
        last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
        if logger is not None:
            logger.final_validation_pending = False
        if trainer.limit_val_batches == 0 or getattr(model, "last_validated_step", None) == trainer.global_step:
            if logger is not None:  # validated at its last step already: the run is complete
                logger.finalize("success")
            if last is not None:
                last.drop_previous(trainer)
            return
        signum = stop.agreed_signal(trainer, stop.NOTED_SIGNAL)
        if signum:
            saved = last is not None and last.holds_step(trainer)
            how = stop.Stop(signum, trainer.global_step, last.path) if saved else stop.Stop(signum)
            stop.LAST_STOP = how
            if logger is not None:
                logger.stopped_by = how.name
                logger.finalize("failed")
            raise SIGTERMException()
        model._loaded_step = None  # the fit's own weights (a fit resumed at its end loaded them): val/*, not validate/*
        trainer.validate(model, datamodule=self.datamodule, verbose=False)
        if last is not None:
            last.drop_previous(trainer)

    def instantiate_trainer(self, **kwargs: Any):
        """Lightning's trainer with this run's defaults where the command line gives none: the MLflow
        logger, atomic checkpoint writes, the run folder; `fit` adds last.ckpt and the step monitors
        (learning rate, Muon momentum, tokens/s: train/callbacks/monitors.py)."""
        cfg, given = self.config[self.subcommand], self.config_init[self.subcommand].trainer
        if given.logger is None:
            kwargs["logger"] = self._tracking_logger(cfg)
        plugins = as_list(given.plugins)
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        if given.default_root_dir is None:
            kwargs["default_root_dir"] = str(self.run_dir)
        if given.strategy == "fsdp":  # FSDP2 through ModelParallelStrategy: CPU (gloo) ranks run it too
            kwargs["strategy"] = checks.fsdp_strategy(given)
        if self.subcommand == "fit":
            last = LastCheckpoint(self.run_dir / "checkpoints", every_n_train_steps=cfg.checkpoint_every)
            kwargs["callbacks"] = [*as_list(given.callbacks), last, *training_monitors(cfg.log_counters)]
        bar = step_progress_bar() if given.enable_progress_bar is not False else None
        if bar is not None and not any(isinstance(c, ProgressBar) for c in as_list(given.callbacks)):
            kwargs["callbacks"] = [*kwargs.get("callbacks", as_list(given.callbacks)), bar]
        every = cfg.get("progress_every")
        every = max(1, (given.max_steps or 0) // 10) if every is None else every
        if self.subcommand == "fit" and given.enable_progress_bar is False and every > 0:  # progress lines instead
            kwargs["callbacks"] = [*kwargs.get("callbacks", as_list(given.callbacks)), StepProgressLog(every)]
        return super().instantiate_trainer(**kwargs)

    def _tracking_logger(self, cfg) -> TrackingLogger:
        logger = TrackingLogger(
            experiment_name=cfg.experiment, experiment_id=self.experiment_id, run_name=cfg.run_name,
            tracking_uri=self.tracking_uri, run_id=self.resume_run_id,
            artifact_location=artifact_location(self.tracking_uri),
            tags={**(cfg.run_tags or {}),  # applied when the run is created; a resumed run keeps its own
                  **({RUN_DIR_TAG: run_dir_tag(self.run_dir)} if self.subcommand == "fit" else {})},
        )
        logger.keep_status = self.subcommand != "fit" and bool(self.resume_run_id)
        logger.final_validation_pending = self.subcommand == "fit"
        logger.log_epoch = bool(cfg.get("log_counters"))
        logger.open_run()
        if self.subcommand == "fit" and self.resume_run_id and lock.launched_as_rank_zero():
            logger.resume_run()
        return logger


def as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
