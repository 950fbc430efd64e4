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
