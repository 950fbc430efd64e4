"""Callbacks the training tests inject through the CLI (`--config` with class_path run_hooks.X).

They act on a real training process: SIGKILL it mid-run, or poison a weight to force a NaN loss.
"""

import os
import signal

import torch
from lightning.pytorch.callbacks import Callback


class KillAtStep(Callback):
    """SIGKILL this process when the optimizer step `step` is about to run (no clean-up, like an OOM kill)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PoisonAtStep(Callback):
    """Set the embedding to NaN before step `step`, so that step's loss is NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.embed.weight.fill_(float("nan"))


class SigtermAtStep(Callback):
    """Send this process a real SIGTERM when optimizer step `step` is about to run (what SLURM does on preemption);
    with `rank`, only that rank's process gets it (the others learn of it from the run)."""

    def __init__(self, step: int, rank: int | None = None):
        self.step, self.rank, self.sent = step, rank, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent and self.rank in (None, trainer.global_rank):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class BallastAtStep(Callback):
    """Make the checkpoint of step `step` large (`mb` tensors of 1 MiB), so writing it takes a while; touch
    `marker` first, so that a test can SIGKILL the process while the file is being written."""

    def __init__(self, step: int, mb: int, marker: str):
        self.step, self.mb, self.marker = step, mb, marker

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == self.step:
            checkpoint["ballast"] = [torch.full((2**18,), float(i)) for i in range(self.mb)]
            open(self.marker, "w").close()


class KillProcessGroupAtStep(Callback):
    """SIGKILL process group `pgid` (an MLflow server started in its own session) before step `step`."""

    def __init__(self, step: int, pgid: int):
        self.step, self.pgid = step, pgid

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.killpg(self.pgid, signal.SIGKILL)
