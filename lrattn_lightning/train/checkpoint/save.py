"""Checkpoint files that survive what clusters do to a run: kills, full disks, preemption, a second launch.

    AtomicCheckpointIO  writes `.NAME.PID.tmp` beside NAME, fsyncs it and renames it over NAME, so NAME
                        is always a complete checkpoint (the previous one until the new one is whole,
                        whatever $TMPDIR is); loads with `torch.load(weights_only=True)` only.
    LastCheckpoint      the run's one `last.ckpt`: every N steps, once when training ends, and when SIGTERM,
                        SIGINT or SIGHUP arrives, at the end of the optimizer step in progress (all its
                        accumulated micro-batches) or validation batch, on every rank at once; then the run
                        exits 128 + the signal's number. A validation that did not finish is run first on resume.
                        The state it replaces stays as `previous.ckpt`: when a loss turns non-finite at the step
                        last.ckpt holds (those weights produced it), that file is set apart as
                        `diverged-stepNNNNNN.ckpt` and previous.ckpt, the last finite state, becomes last.ckpt.
                        A run that ends with a finite final validation drops previous.ckpt.
Signals and divergences: stop.py; the run folder's lock: lock.py.

Errors are `CheckpointError`s whose message is one line naming the file, the cause and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lrattn_lightning.core.errors import CheckpointError, first_line
from lrattn_lightning.core.files import refuse_link, replacing
from lrattn_lightning.train.checkpoint import stop
from lrattn_lightning.train.checkpoint.load import read_checkpoint_file

TMP_SUFFIX = ".tmp"


def temp_path(path: Path) -> Path:
    """Where the bytes of `path` are written before the rename: hidden, same folder, this process's own."""
    return path.parent / f".{path.name}.{os.getpid()}{TMP_SUFFIX}"


def remove_orphans(folder: Path) -> list[Path]:
    """Delete temp files of saves that never finished (a process killed mid-write); returns them."""
    removed = []
    for path in sorted(folder.glob(f".*.ckpt.*{TMP_SUFFIX}")) if folder.is_dir() else []:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


class _RecordingWriter:
    """A file's `write` that remembers the OSError behind torch's generic 'unexpected pos' RuntimeError."""

    def __init__(self, file: Any):
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _cause(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (" (the disk is full)" if err.errno == errno.ENOSPC else "")
    return first_line(err, limit=160, typed=True)


def atomic_torch_save(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save to a temp file in the destination folder, fsync, rename over `path`, fsync the folder. The temp is
    created O_EXCL|O_NOFOLLOW and `path` may not be a link (core/files.py): a planted link is refused, not followed."""
    path = Path(path)
    tmp = temp_path(path)
    writer = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path, "wb", "checkpoint", temporary=tmp, durable=True) as file:
            writer = _RecordingWriter(file)
            torch.save(checkpoint, writer)
    except BaseException as err:  # `replacing` removed its temporary (a link planted in its place stays)
        if isinstance(err, OSError | RuntimeError):
            cause = _cause(writer.error if writer is not None and writer.error is not None else err)
            # a previous checkpoint is there to resume from; without one the run can only start again
            then = ("the previous checkpoint there is unchanged. Free space or fix the folder, then resume with "
                    "--ckpt_path last") if path.exists() else ("no checkpoint was written, so there is nothing to "
                    "resume. Free space or fix the folder, then run the same command again")
            raise CheckpointError(f"could not save checkpoint {path}: {cause}; {then}") from err
        raise


def newest_last(folder: Path) -> Path | None:
    """The run's newest `last` checkpoint. Folders written before there was one `last.ckpt` may also hold
    `last-vN.ckpt` files (and a stale `last.ckpt`): the highest global step wins."""
    candidates = sorted(Path(folder).glob("last*.ckpt"))
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    steps = {}
    for path in candidates:
        with contextlib.suppress(CheckpointError):
            steps[path] = int(read_checkpoint_file(path, mmap=True).get("global_step", -1))
    return max(steps, key=lambda p: (steps[p], p.name == "last.ckpt")) if steps else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's CheckpointIO with whole-file-or-nothing saves and weights-only loads (see module doc)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote stores: Lightning's own
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Callable | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Checkpoints hold plain values by design (lit_module.py), so nothing needs unpickling: never
        # weights_only=False, whoever asks (Lightning's --ckpt_path restore, final validation, validate/test).
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        return read_checkpoint_file(path, map_location=map_location if map_location is not None else "cpu")


class LastCheckpoint(ModelCheckpoint):
    """One `last.ckpt` per run, always the newest state (see module doc). No versioned `last-vN.ckpt`."""

    def __init__(self, dirpath: Path, every_n_train_steps: int):
        super().__init__(dirpath=dirpath, filename="step{step:06d}", every_n_train_steps=every_n_train_steps, save_top_k=0,
                         save_last=True, enable_version_counter=False)
        stop.LAST_STOP = stop.LAST_DIVERGENCE = None
        self._signum = 0  # the stop signal this process received, 0 if none (all its handler does but pass it on)
        self._stopped_by = 0  # the one every rank agreed on
        self._launcher: Any = None
        self._step_at_batch_start = -1
        self._mid_step = False  # the last training batch accumulated gradients without an optimizer step
        self._validating = False  # a validation of the fit has started and not yet finished
        self._resumed_step = -1  # the step of the last.ckpt this fit resumed from, -1 if none

    @property
    def path(self) -> Path:
        return Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"

    @property
    def previous(self) -> Path:
        return Path(self.dirpath) / "previous.ckpt"

    def _save_now(self, trainer) -> None:
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """last.ckpt's state before this save stays as previous.ckpt (a hard link: no copy, and last.ckpt is never
        missing), the state to fall back to if the new one turns out to diverge."""
        if Path(filepath) == self.path and trainer.is_global_zero and self.path.is_file():
            refuse_link(self.path, "checkpoint")
            refuse_link(self.previous, "checkpoint")
            keep = temp_path(self.previous)
            try:
                os.link(self.path, keep, follow_symlinks=False)
                os.replace(keep, self.previous)
            except OSError:  # a filesystem without hard links: the previous state is not kept
                with contextlib.suppress(OSError):
                    keep.unlink()
        super()._save_checkpoint(trainer, filepath)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        with contextlib.suppress(OSError, TypeError):
            if os.path.samefile(trainer.ckpt_path, self.path):  # resumed from this run's last.ckpt
                self._resumed_step = int(checkpoint["global_step"])

    def holds_step(self, trainer) -> bool:
        """Whether last.ckpt holds the weights of the current step: saved by this process, or the file this fit
        resumed from (a run resumed at its end trains no step and saves nothing: a stop in its final validation,
        or a non-finite loss at the step it resumed at, is about that file's step)."""
        step = trainer.global_step
        return step > 0 and step in (self._last_global_step_saved, self._resumed_step)

    def drop_previous(self, trainer) -> None:
        """The run finished with a finite final validation: last.ckpt is good, its fallback is not needed."""
        if trainer.is_global_zero:
            with contextlib.suppress(FileNotFoundError):
                self.previous.unlink()

    def _set_apart_diverged(self, trainer, exception: BaseException) -> None:
        """The loss of step N is non-finite: if last.ckpt holds step N (the weights that produced it), set it apart
        and make previous.ckpt last.ckpt again; say what is kept (LAST_DIVERGENCE)."""
        step = trainer.global_step
        set_apart = None
        if trainer.is_global_zero and self.holds_step(trainer) and self.path.is_file():
            set_apart = self.path.with_name(f"diverged-step{step:06d}.ckpt")
            refuse_link(set_apart, "checkpoint")
            os.replace(self.path, set_apart)
            if self.previous.is_file():
                os.replace(self.previous, self.path)
        last_step = None
        if self.path.is_file():
            with contextlib.suppress(CheckpointError):
                last_step = int(read_checkpoint_file(self.path, mmap=True).get("global_step", -1))
        stop.LAST_DIVERGENCE = stop.Divergence(step, set_apart, last_step, self.path)
        for logger in trainer.loggers:  # the MLflow run ends FAILED with a tag that says where
            if hasattr(logger, "diverged"):
                logger.diverged = str(exception).split(";")[0]

    def _unsaved(self, trainer) -> bool:
        return (trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
                and not trainer.fast_dev_run and self._last_global_step_saved != trainer.global_step)

    # ---- SIGTERM, SIGINT, SIGHUP ------------------------------------------------------------------
    # Lightning's own SIGTERM handler broadcasts from inside the signal handler, so ranks that get the signal
    # at different moments issue mismatched collectives and can hang; and it stops at the next micro-batch,
    # losing the gradients accumulated so far. Ctrl-C (SIGINT) is a KeyboardInterrupt that ends the run
    # FAILED without a save, and SIGHUP (a closed terminal) kills it outright. Here the handler only notes
    # the signal; at the end of each optimizer step (and of each validation batch) the ranks agree on it with
    # one all-reduce, the same collective at the same point on every rank, and then hand it to Lightning,
    # which stops them together. A SIGINT or SIGHUP that was ignored when the run started (nohup, a
    # background job of a script) stays ignored.
    def on_sanity_check_start(self, trainer, pl_module) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        self._take_signals(trainer)  # (Lightning registered its handler just now; the first step agrees on it)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._take_signals(trainer)  # (Lightning registered its handler just now, or before the sanity check)

    def _take_signals(self, trainer) -> None:
        """This process's stop signals go to _note_signal from here on (Lightning's teardown restores the original
        handlers); one that came while the run was starting stops it at the first point the ranks agree."""
        if threading.current_thread() is threading.main_thread():
            self._launcher = trainer.strategy.launcher
            for signum in stop.STOP_SIGNALS:
                if signum == signal.SIGTERM or signal.getsignal(signum) is not signal.SIG_IGN:
                    signal.signal(signum, self._note_signal)
        self._signum = max(self._signum, stop.NOTED_SIGNAL)

    def _note_signal(self, signum: int, _frame: Any) -> None:
        if not self._signum and self._launcher is not None:
            self._launcher.kill(signum)  # pass it on to the ranks this process launched (as Lightning does)
        stop.note_stop_signal(signum)  # (after training, `lrattn fit` still sees it)
        self._signum = max(self._signum, signum)

    def _stop_on_signal(self, trainer) -> None:
        """Agree on a signal; if there is one, Lightning raises SIGTERMException on every rank after this batch."""
        self._stopped_by = stop.agreed_signal(trainer, self._signum)
        if self._stopped_by:
            trainer._signal_connector.received_sigterm = True
            stop.adopt_ranks(self._launcher)  # (every rank is still here: none has exited yet)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stepped = trainer.global_step != self._step_at_batch_start  # not in the middle of an accumulation
        if stepped and all(getattr(logger, "drops_repeated_steps", False) for logger in trainer.loggers):
            # Lightning logs this step's metrics after this hook: a process killed right after the save below
            # would lose them for good (its resume starts after this step). Log them first; Lightning's own call
            # then finds them logged.
            trainer._logger_connector.update_train_step_metrics()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._mid_step = not stepped
        if stepped and not trainer.received_sigterm:
            self._stop_on_signal(trainer)  # this is the state to resume
        if stepped and trainer.received_sigterm and self._unsaved(trainer):
            self._save_now(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._validating = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if trainer.state.fn == TrainerFn.VALIDATING:  # the final validation `lrattn fit` runs after training: its
            self._take_signals(trainer)  # own trainer.validate registered Lightning's handler again

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        # (a validation between the micro-batches of a step stops at the end of that step instead)
        if self._validating and not self._mid_step and not trainer.received_sigterm:
            self._stop_on_signal(trainer)  # Lightning stops the validation; on_exception saves the step it validates
        elif trainer.state.fn == TrainerFn.VALIDATING and not trainer.received_sigterm:
            self._stop_on_signal(trainer)  # the final validation: the ranks agree at each batch, as in the fit

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validating = False  # it finished: its results are logged
        super().on_validation_end(trainer, pl_module)
        if trainer.received_sigterm and self._unsaved(trainer):
            self._save_now(trainer)  # stopped at its last batch: the state after the validation is the one to resume

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of a step whose validation has not finished (due next, or stopped by a signal) resumes
        into that validation, whole, before training on: else Lightning would skip it on resume."""
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or "loops" not in checkpoint:
            return
        if self._validating or _validation_due(trainer):
            mark_validation_pending(checkpoint["loops"]["fit_loop"], in_validation=self._validating)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, stop.NonFiniteLossError):
            self._set_apart_diverged(trainer, exception)
            return
        if not isinstance(exception, SIGTERMException):
            return  # a crash (OOM, a bug) keeps the last checkpoint instead of saving a state of unknown worth
        stop.adopt_ranks(self._launcher)  # (stopped by Lightning's own handler, before the ranks could agree)
        if self._unsaved(trainer) and trainer.global_step > 0:  # the signal came during validation: the
            self._save_now(trainer)                              # checkpoint resumes into it (on_save_checkpoint)
        signum = self._stopped_by or signal.SIGTERM  # (Lightning's own handler, before training started)
        saved = self.holds_step(trainer)
        stop.LAST_STOP = stop.Stop(signum, trainer.global_step, self.path) if saved else stop.Stop(signum)
        for logger in trainer.loggers:  # the MLflow run ends as KILLED, not FAILED
            if hasattr(logger, "stopped_by"):
                logger.stopped_by = stop.LAST_STOP.name

    def on_train_end(self, trainer, pl_module) -> None:
        """The final state, once: unless the periodic save just wrote this very step."""
        if self._unsaved(trainer):
            self._save_now(trainer)


def _validation_due(trainer) -> bool:
    """Whether the optimizer step that just ended (a save from on_train_batch_end) is followed by a validation."""
    loop = trainer.fit_loop.epoch_loop
    done = loop.batch_progress.total
    at_batch_end = done.completed == done.processed - 1  # Lightning counts the batch complete after the hooks
    return (at_batch_end and not loop._should_accumulate()
            and loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def mark_validation_pending(fit_loop: dict[str, Any], in_validation: bool) -> None:
    """Rewrite a checkpoint's fit-loop progress to "the training batch is done, the validation after it has
    started and no batch of it is done", the state Lightning restarts mid-evaluation from: on resume its
    loop runs that validation first, from its first batch (metric states are not checkpointed, so a
    validation cannot continue half-way), then trains on. Saved from on_train_batch_end, Lightning would
    read the state as "before the validation" and skip it on resume; saved during the validation, as
    "after it" and skip it too. The step's training state (weights, optimizer, data position) is unchanged."""
    train = fit_loop["epoch_loop.batch_progress"]
    for counts in (train["total"], train["current"]):
        counts["completed"] = counts["processed"]
    val = fit_loop["epoch_loop.val_loop.batch_progress"]
    before = val["total"]["completed"] - (val["current"]["completed"] if in_validation else 0)
    val["total"] = {"ready": before + 1, "started": before + 1, "processed": before, "completed": before}
    val["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    val["is_last_batch"] = False
