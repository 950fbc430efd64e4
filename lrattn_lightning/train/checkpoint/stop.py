"""How a fit stops: the stop signals it notes, the exit code they give, and what a divergence kept.

    stop_signals_noted  inside it SIGTERM, SIGINT and SIGHUP are noted (NOTED_SIGNAL), not fatal: `lrattn fit`
                        decides where it stops (after a step's save, before its final validation) and exits
                        128 + the signal's number; LastCheckpoint (save.py) notes those that come during the
                        sanity check, training and the final validation
    agreed_signal       the highest signal any rank noted (one all-reduce at the same point on every rank)
    Stop, LAST_STOP     how the last fit of this process stopped on a signal, and the checkpoint saved then
    NonFiniteLossError, Divergence, LAST_DIVERGENCE   a non-finite loss, and which checkpoint is the last finite one
    stop_signals_raise  for a command with nothing to save (`lrattn eval`): inside, a stop signal raises StopSignal
                        (128 + its number, one line), except within `held()`, where it waits for the end (logging)
    adopt_ranks, await_ranks   on a stop, rank 0 takes the ranks it launched out of Lightning's watch (which would
                        SIGKILL it when one of them exits 128 + N first) and waits for them before it exits
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREEMPTED_EXIT_CODE = 128 + 15  # what a shell reports for a process ended by SIGTERM; non-zero for schedulers
# What stops a fit cleanly: a scheduler's preemption or `kill`, Ctrl-C, a closed terminal. Where ranks got
# different ones they agree on the highest number: SIGTERM (the scheduler's) over SIGINT over SIGHUP.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class Stop:
    """How the last fit of this process stopped on a signal: which one, and the checkpoint saved then."""

    signum: int = signal.SIGTERM
    step: int | None = None
    path: Path | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal ended; non-zero for schedulers


LAST_STOP: Stop | None = None
# A stop signal this process received outside training (inside stop_signals_noted), 0 if none; LastCheckpoint
# notes the ones it receives during training here too. `lrattn fit` stops before its final validation on it.
NOTED_SIGNAL = 0


def note_stop_signal(signum: int, _frame: Any = None) -> None:
    global NOTED_SIGNAL
    if signum == signal.SIGHUP:
        detach_hung_up_terminal()
    NOTED_SIGNAL = max(NOTED_SIGNAL, signum)


@contextlib.contextmanager
def stop_signals_noted() -> Iterator[None]:
    """Inside, a stop signal is noted, not fatal: `lrattn fit` decides where it stops (after a step's save, before
    its final validation) and exits 128 + its number. A SIGINT or SIGHUP ignored at launch (nohup) stays ignored;
    the handlers before are restored after."""
    global NOTED_SIGNAL
    NOTED_SIGNAL = 0
    with _handling(note_stop_signal):
        yield


@contextlib.contextmanager
def _handling(handler: Any) -> Iterator[None]:
    """Inside, `handler` takes every stop signal but a SIGINT or SIGHUP ignored at launch (nohup); the handlers
    before are restored after. Only the main thread can install handlers: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, previous in before.items():
        if signum == signal.SIGTERM or previous is not signal.SIG_IGN:
            signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


class StopSignal(BaseException):
    """SIGTERM, SIGINT or SIGHUP ended a command that has nothing to save: it exits 128 + the signal's number with
    one line. A BaseException, like KeyboardInterrupt, so that no `except Exception` of a library swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_HOLD = False  # inside held(): a stop signal is noted (HELD_SIGNAL), not raised
HELD_SIGNAL = 0
# called with the signal before StopSignal is raised: passes it on to processes this one launched (eval's ranks)
PASS_ON: list[Any] = []


def _raise_stop(signum: int, _frame: Any = None) -> None:
    global HELD_SIGNAL, _HOLD
    if signum == signal.SIGHUP:
        detach_hung_up_terminal()
    for pass_on in PASS_ON:
        with contextlib.suppress(Exception):
            pass_on(signum)
    if _HOLD:
        HELD_SIGNAL = max(HELD_SIGNAL, signum)
        return
    _HOLD = True  # a second one (Ctrl-C pressed twice, the group's and a forwarded one) must not interrupt the exit
    raise StopSignal(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Inside, SIGTERM, SIGINT or SIGHUP raises StopSignal in the main thread (Ctrl-C no longer ends in a
    KeyboardInterrupt traceback, SIGTERM no longer kills without a word). A SIGINT or SIGHUP ignored at launch
    stays ignored; the handlers before are restored after (a launched rank that stopped ignores the ones still
    to come: cli/__init__.py)."""
    global HELD_SIGNAL, _HOLD
    HELD_SIGNAL, _HOLD = 0, False
    try:
        with _handling(_raise_stop):
            yield
    finally:
        PASS_ON.clear()


def ignore_stop_signals() -> None:
    """For a process that is ending on a stop signal and has nothing left to do."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Inside, a stop signal waits (HELD_SIGNAL): what is being written (results to MLflow) is written whole."""
    global _HOLD
    _HOLD = True
    try:
        yield
    finally:
        _HOLD = False


# ---- the ranks this process launched --------------------------------------------------------------------
# Lightning's launcher watches the ranks it started from a thread (a poll every 5 s) and SIGKILLs them and
# itself as soon as one has exited non-zero. Meant for a crashed rank, it also ended a stop whenever rank 1
# exited 143 while rank 0 still worked (a slow store, a large checkpoint): rank 0 died by SIGKILL (-9) wherever
# it was (before its line, or before it closed the MLflow run), and no 143 reached a scheduler's requeue.
ADOPTED: list[subprocess.Popen] = []  # the ranks this process launched, out of Lightning's watch; awaited


def agreed_signal(trainer: Any, signum: int) -> int:
    """The highest stop signal any rank noted, 0 if none: a collective, which every rank calls at the same point."""
    if trainer.world_size == 1:
        return signum
    import torch

    flag = torch.tensor(float(signum), device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(flag, reduce_op="max"))


def adopt_ranks(launcher: Any) -> None:
    """The ranks agreed to stop: take those `launcher` started out of its watch (the watcher reads the launcher's
    own list, and an empty one reads as "all finished"); await_ranks() waits for them instead."""
    procs = getattr(launcher, "procs", None)
    if isinstance(procs, list) and procs:
        ADOPTED.extend(procs)
        procs.clear()


def await_ranks(timeout: float = 120.0) -> None:
    """Wait for the adopted ranks to end (they save and stop as this one does); SIGKILL any still running after
    `timeout` seconds, as Lightning's watch would have."""
    deadline = time.monotonic() + timeout
    while ADOPTED:
        proc = ADOPTED.pop()
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN/inf training or validation loss (the message names the step and what was kept)."""


@dataclass(frozen=True)
class Divergence:
    """What became of the checkpoints when a fit diverged at `step`."""

    step: int
    set_apart: Path | None  # the checkpoint of `step`, whose weights produced the non-finite loss
    last_step: int | None  # the step last.ckpt now holds (the last finite state), None: no checkpoint left
    path: Path

    def describe(self) -> str:
        apart = f"its checkpoint is set apart as {self.set_apart.name}; " if self.set_apart else ""
        if self.last_step is None:
            kept = "no checkpoint of a finite state is left"
        else:
            kept = f"the last finite state is step {self.last_step} ({self.path})"
        return (f"{apart}{kept}. Resuming repeats the same steps: start a new run with a lower learning rate "
                "(or --init_from a finite checkpoint)")


LAST_DIVERGENCE: Divergence | None = None


def detach_hung_up_terminal() -> None:
    """After a hangup every write to the terminal fails (EIO): a progress bar or a log line would crash the
    step in progress and lose the save. Point a stdout/stderr that is such a terminal at /dev/null (a hung-up
    terminal is a character device that no longer answers as a tty); files, pipes and live terminals stay."""
    null = os.stat(os.devnull).st_rdev
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            mode, device = os.fstat(fd).st_mode, os.fstat(fd).st_rdev
            if stat.S_ISCHR(mode) and device != null and not os.isatty(fd):
                sink = os.open(os.devnull, os.O_WRONLY)
                os.dup2(sink, fd)
                os.close(sink)
