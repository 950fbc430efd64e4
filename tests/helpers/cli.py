"""`lrattn ARGS` as the tests run it: in this process (`lrattn_lightning.cli.main(argv)`) when a test's point is what
the command does (its exit code, its lines, the files and MLflow runs it writes), as a real process (`python -m
lrattn_lightning.cli`) when the point is a process (signals, DDP ranks, an exit on a kill, atexit, packaging).

in_process() gives the command what a process would have of its own, and takes back what it leaves: its working
folder, environment (cli_env()'s, as a real process gets, plus the test's variables), argv, standard streams at
the file-descriptor level (Lightning and rich write to the descriptors; log handlers bound to pytest's streams are
pointed at ours), signal handlers, warning filters, logging, torch's threads and precision, MLflow's active run and
tracking URI, and lrattn's record of stops. An uncaught exception is a traceback on the captured stderr and exit
status 1, as a process would end. tests/cli/test_commands_in_process.py holds it to that.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from helpers.paths import REPO_ROOT, TESTS_DIR


def lrattn(*args: str) -> list[str]:
    """The command line of `lrattn ARGS` as a real process."""
    return [sys.executable, "-m", "lrattn_lightning.cli", *args]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of an `lrattn` process in the tests: the checkout and tests/ (run_hooks' callbacks)
    importable, one OpenMP thread, no MLflow store inherited from the shell."""
    path = [str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def as_process(args: list[str], cwd: Path, timeout: float = 300, input: str | None = None,  # noqa: A002
               **env: str) -> subprocess.CompletedProcess:
    """`lrattn ARGS` as a real process in `cwd`, `env` added to cli_env()'s; its text output captured."""
    return subprocess.run(lrattn(*args), cwd=cwd, env=cli_env(**env), capture_output=True, text=True,
                          timeout=timeout, input=input)


# what a command may change in lrattn's stop module (train/checkpoint/stop.py): put back as it was
_STOP_STATE = ("LAST_STOP", "NOTED_SIGNAL", "_HOLD", "HELD_SIGNAL", "LAST_DIVERGENCE")
_SIGNALS = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)]


def _loggers() -> dict[str, logging.Logger]:
    found = {name: log for name, log in logging.root.manager.loggerDict.items() if isinstance(log, logging.Logger)}
    return {"": logging.root, **found}


@contextlib.contextmanager
def _streams(stdin: str | None) -> Iterator[tuple[io.BufferedRandom, io.BufferedRandom]]:
    """Descriptors 0, 1 and 2 and sys.stdin/stdout/stderr on temporary files (stdin holds `stdin`, else nothing:
    an end of file, as a process given no input), for the command's time; the files' handles (out, err)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        inp.write((stdin or "").encode())
        inp.seek(0)
        saved = [os.dup(fd) for fd in (0, 1, 2)]
        old = sys.stdin, sys.stdout, sys.stderr
        handlers = [h for log in _loggers().values() for h in log.handlers
                    if isinstance(h, logging.StreamHandler) and h.stream in old[1:]]
        bound = [(h, h.stream) for h in handlers]
        for fd, file in enumerate((inp, out, err)):
            os.dup2(file.fileno(), fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        for handler, stream in bound:
            handler.setStream(sys.stdout if stream is old[1] else sys.stderr)
        try:
            yield out, err
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            sys.stdin, sys.stdout, sys.stderr = old
            for handler, stream in bound:
                handler.setStream(stream)
            for fd, copy in enumerate(saved):
                os.dup2(copy, fd)
                os.close(copy)


def _text(file: io.BufferedRandom) -> str:
    file.seek(0)
    return io.TextIOWrapper(file, encoding="utf-8", errors="replace", newline=None).read()


@contextlib.contextmanager
def _kept_as_found() -> Iterator[None]:
    """Whatever a command changes in the process's own state, put back afterwards (see the module's docstring)."""
    import mlflow

    from lrattn_lightning.train.checkpoint import stop

    uri = mlflow.get_tracking_uri() if mlflow.tracking.is_tracking_uri_set() else None  # (MLFlowLogger sets it)
    cwd, environ, argv, path = os.getcwd(), dict(os.environ), list(sys.argv), list(sys.path)
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    deterministic = torch.are_deterministic_algorithms_enabled()
    loggers = {name: (log.level, list(log.handlers), log.propagate, log.disabled) for name, log in _loggers().items()}
    stops = {name: getattr(stop, name) for name in _STOP_STATE}
    try:
        with warnings.catch_warnings():
            yield
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(uri)  # (None: unset, as it was)
        for name, value in stops.items():
            setattr(stop, name, value)
        for name, log in _loggers().items():
            if name not in loggers:  # made by the command: kept as it is (a library's, set up once per process)
                continue
            level, kept, propagate, disabled = loggers[name]
            log.setLevel(level)
            log.handlers[:] = kept
            log.propagate, log.disabled = propagate, disabled
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        sys.argv[:], sys.path[:] = argv, path
        os.environ.clear()
        os.environ.update(environ)
        tempfile.tempdir = None
        os.chdir(cwd)


def in_process(args: list[str], cwd: Path, input: str | None = None,  # noqa: A002
               **env: str) -> subprocess.CompletedProcess:
    """`lrattn ARGS` run by `lrattn_lightning.cli.main` in this process from folder `cwd` with cli_env()'s environment,
    `env` added, `input` its stdin: (exit code, stdout, stderr) as subprocess.run(text=True) gives them, the process
    left as it was found."""
    from lrattn_lightning.cli import main

    with _kept_as_found():
        commanded = cli_env(**env)  # (PYTHONPATH: what the command starts, a sweep's fits, imports run_hooks too)
        os.environ.clear()
        os.environ.update(commanded)
        tempfile.tempdir = None  # (a TMPDIR of the command's own)
        os.chdir(cwd)
        sys.argv[:] = ["lrattn", *args]
        with _streams(input) as (out, err):
            try:
                code = main(list(args))
            except SystemExit as end:
                code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
                if not isinstance(end.code, int | None):
                    print(end.code, file=sys.stderr)
            except Exception:  # a process prints it and ends with 1
                traceback.print_exc()
                code = 1
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            stdout, stderr = _text(out), _text(err)
    return subprocess.CompletedProcess(["lrattn", *args], code, stdout, stderr)
