"""The tests run most `lrattn` commands in their own process (tests/helpers/cli.py): a command gives what a process
would (its exit code, its lines on stdout and stderr, its files) and leaves the test process as it found it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import mlflow
import torch
from helpers.cli import in_process
from helpers.runs import fit_args

from lrattn_lightning.train.checkpoint import stop


def state() -> dict:
    """What a command could change in the process that runs it, and a later test would notice."""
    loggers = [logging.root, *(log for log in logging.root.manager.loggerDict.values() if isinstance(log, logging.Logger))]
    return {
        "cwd": os.getcwd(), "env": dict(os.environ), "argv": list(sys.argv), "path": list(sys.path),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)},
        "torch": (torch.get_num_threads(), torch.get_float32_matmul_precision(),
                  torch.are_deterministic_algorithms_enabled()),
        "mlflow": (mlflow.active_run(), mlflow.get_tracking_uri()),
        "streams": (sys.stdin, sys.stdout, sys.stderr, [os.fstat(fd).st_ino for fd in (0, 1, 2)]),
        "handlers": {log.name: list(log.handlers) for log in loggers if log.name in ("root", "lightning.pytorch")},
        "threads": {(t.ident, t.name, t.daemon) for t in threading.enumerate()},  # daemons too: none is left running
        "stops": (stop.NOTED_SIGNAL, stop.LAST_STOP, stop.LAST_DIVERGENCE),
    }


def test_a_command_in_process_says_what_a_process_would_and_leaves_the_process_as_found(data, tmp_path):
    before = state()
    done = in_process(fit_args(data, steps=2), tmp_path, LRATTN_TEST_VARIABLE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[lrattn fit]" in done.stdout + done.stderr  # its lines, captured at the descriptors
    assert (tmp_path / "mlflow.db").is_file() and list(tmp_path.glob("runs/lrattn/*/checkpoints/last.ckpt"))
    bad = in_process(["fit", "--size", "tiny", "--trainer.max_stpes", "3"], tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("lrattn: error: unknown flag --trainer.max_stpes"), bad.stderr
    listed = in_process(["list", "--size", "tiny"], tmp_path)
    assert listed.returncode == 0 and "at size 'tiny'" in listed.stdout and listed.stderr == ""
    assert state() == before
