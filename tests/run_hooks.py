"""Callbacks the training tests inject through the CLI (`--config` with class_path run_hooks.X).

They act on a real training process: SIGKILL it mid-run, send it a signal at an exact point, or poison a
weight to force a NaN loss.
"""

import os
import signal
import time
from signal import Signals

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


class SlowRankZeroOnStop(Callback):
    """Rank 0 takes `seconds` longer than the other ranks to end after a stop (a slow store or a large checkpoint):
    they exit first, a while before it does."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == 0:
            time.sleep(self.seconds)


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


class SignalAt(Callback):
    """Send this process the real signal `signal` ("SIGTERM", "SIGINT", "SIGHUP") at an exact point: when
    optimizer step `step` is about to run, or (`during: validation`) at the end of batch `batch` of the
    validation that follows step `step` (the validation logged at step `step`), or (`during: train_end`) when
    training has ended (after the last step's save, before `lrattn fit`'s final validation), or (`during:
    final_validation`) at the end of batch `batch` of that final validation; with `rank`, only that rank's
    process gets it."""

    def __init__(self, step: int, signal: str = "SIGTERM", during: str = "train", batch: int = 0,
                 rank: int | None = None):
        self.step, self.signum, self.during, self.batch, self.rank = step, Signals[signal], during, batch, rank
        self.sent = False

    def _send(self, trainer) -> None:
        if not self.sent and self.rank in (None, trainer.global_rank):
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.during == "train" and trainer.global_step == self.step:
            self._send(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if (self.during == "validation" and not trainer.sanity_checking and trainer.state.fn == "fit"
                and trainer.global_step == self.step and batch_idx == self.batch):
            self._send(trainer)
        if self.during == "final_validation" and trainer.state.fn == "validate" and batch_idx == self.batch:
            self._send(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.during == "train_end":
            self._send(trainer)


class PauseAt(Callback):
    """When optimizer step `step` is about to run, touch `marker` and wait until `go` exists (a test does
    something to the process meanwhile, e.g. closes its terminal)."""

    def __init__(self, step: int, marker: str, go: str, timeout: float = 120.0):
        self.step, self.marker, self.go, self.timeout = step, marker, go, timeout

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            open(self.marker, "w").close()
            deadline = time.time() + self.timeout
            while not os.path.exists(self.go) and time.time() < deadline:
                time.sleep(0.05)


class KillBeforeStepLog(Callback):
    """SIGKILL this process once the optimizer step that makes global_step `step` is done and its checkpoint
    written, at the moment Lightning would log that step's metrics (after every callback's on_train_batch_end)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, pl_module):
        connector = trainer._logger_connector
        log_step = connector.update_train_step_metrics

        def update_train_step_metrics():
            saved = getattr(trainer.checkpoint_callback, "_last_global_step_saved", None)
            if trainer.global_step == self.step and saved == self.step:  # the save is done, the logging not
                os.kill(os.getpid(), signal.SIGKILL)
            log_step()

        connector.update_train_step_metrics = update_train_step_metrics


class PlantLinkAtStep(Callback):
    """Before optimizer step `step`, replace each of `paths` (whatever is there) by a symbolic link to `target`: what
    another user who can write into the run folder could do while the run trains (tests/e2e/test_planted_links.py)."""

    def __init__(self, step: int, paths: list[str], target: str):
        self.step, self.paths, self.target = step, paths, target

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            for path in self.paths:
                if os.path.lexists(path):
                    os.unlink(path)
                os.symlink(self.target, path)
