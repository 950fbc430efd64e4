"""CheckpointContents: plain values in every checkpoint beside the weights: the tokenizer spec (a file-backed
tokenizer's text under `content`), the data folder and trained window, the learning-rate schedule's length and the
MLflow run (what `lrattn eval` and a resume rebuild from)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger


class CheckpointContents(Callback):
    """The tokenizer, the data folder, the trained window (`--data.seq_len`) and the MLflow run in every
    checkpoint, as plain values."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        datamodule = trainer.datamodule
        meta = getattr(datamodule, "meta", None)
        if isinstance(meta, dict):  # what evaluation needs to rebuild the tokenizer
            spec = dict(meta["tokenizer"])
            if "file" in spec:  # file-backed tokenizers travel inside the checkpoint
                spec["content"] = datamodule.local_file(spec["file"]).read_text(encoding="utf-8")  # (s3:// fetched)
            checkpoint["tokenizer"] = spec
            checkpoint["data"] = {"data_dir": datamodule.location(), "source": meta.get("source"),
                                  "seq_len": getattr(datamodule, "seq_len", None)}  # the trained window
        schedules = [c.scheduler for c in trainer.lr_scheduler_configs if hasattr(c.scheduler, "total_steps")]
        if schedules:  # the length the learning-rate schedule was built for: a resume must keep it (or say so)
            checkpoint["schedule"] = {"total_steps": int(schedules[0].total_steps)}
        if isinstance(trainer.logger, MLFlowLogger):
            checkpoint["mlflow"] = {
                "run_id": trainer.logger.run_id,
                "experiment_id": trainer.logger.experiment_id,
                "tracking_uri": trainer.logger._tracking_uri,
            }
