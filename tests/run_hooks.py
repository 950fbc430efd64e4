"""Callbacks the training tests inject through the CLI (`--config` with class_path run_hooks.X).

They act on a real training process: SIGKILL it mid-run, send it a signal at an exact point, poison a
weight to force a NaN loss, or fail its tracking store (kill the MLflow server and start it again, fill its disk).
"""

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
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
    final_validation`) at the end of batch `batch` of that final validation, or (`during: sanity`) at the end of
    batch `batch` of Lightning's sanity check before training; with `rank`, only that rank's process gets it."""

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
        if self.during == "sanity" and trainer.sanity_checking and batch_idx == self.batch:
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


def _alive(uri: str) -> bool:
    try:
        urllib.request.urlopen(uri + "/health", timeout=2).read()
        return True
    except OSError:
        return False


class ServerOutage(Callback):
    """Kill the MLflow server (the process group whose pid is in `pidfile`) before step `down`; start it again,
    the same command (same port, same store), before step `up`, and wait until it answers."""

    def __init__(self, down: int, up: int, pidfile: str, command: list[str], cwd: str, uri: str):
        self.down, self.up, self.pidfile, self.command, self.cwd, self.uri = down, up, Path(pidfile), command, cwd, uri

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.down and _alive(self.uri):
            os.killpg(int(self.pidfile.read_text()), signal.SIGKILL)
            while _alive(self.uri):
                time.sleep(0.05)
        if trainer.global_step == self.up and not _alive(self.uri):
            start_server(self.command, self.cwd, self.uri, self.pidfile)


def start_server(command: list[str], cwd: str, uri: str, pidfile: Path) -> None:
    server = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    pidfile.write_text(str(server.pid))
    deadline = time.time() + 300
    while not _alive(uri):
        assert time.time() < deadline and server.poll() is None, "mlflow server did not come up"
        time.sleep(0.2)


def fill_disk(folder: Path) -> None:
    """Write `folder/ballast` until the filesystem has no byte left."""
    with open(folder / "ballast", "ab", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)


class FillDiskAtStep(Callback):
    """Fill the filesystem of `folder` before step `step`; with `free`, delete the ballast before that step."""

    def __init__(self, step: int, folder: str, free: int | None = None):
        self.step, self.folder, self.free = step, Path(folder), free

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not (self.folder / "ballast").exists():
            fill_disk(self.folder)
        if trainer.global_step == self.free:
            (self.folder / "ballast").unlink(missing_ok=True)
