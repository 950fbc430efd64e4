"""The warm `lrattn` server of tests/warm_cli.py, run as a script (`python warm_server.py SOCKET`): it imports torch,
Lightning and MLflow once, then forks for each command it is asked to run; in the command's own process it takes the
command's streams, folder, environment and argv, runs the module as `python -m` does, and ends as the interpreter
ends a program but for the teardown of its modules (_end_without_teardown).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from warm_cli import _SERVING, PRELOAD, Launches, _fixed, _path_entries


def _serve(path: str) -> tuple[dict, list[int]]:
    """The server's loop; in a command's own process it returns that command's request and standard streams."""
    import importlib

    _SERVING.update(path=path, env=_fixed(dict(os.environ)))
    mine = _path_entries(os.environ.get("PYTHONPATH"), os.getcwd())  # (started in the test process's folder)
    _SERVING["base"] = [entry for entry in sys.path[1:] if entry not in mine]  # sys.path without PYTHONPATH
    atexit.register(_end_without_teardown)  # first registered, so in a command's process it runs last

    if sys.platform.startswith("linux"):  # the server ends with the pytest process that started it
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    for name in PRELOAD:
        importlib.import_module(name)
    import store_template  # new sqlite stores copied from one MLflow made here (tests/store_template.py)

    made = os.environ.get(store_template.ENV)  # conftest.py's (2-3 s less a server start), else one of its own
    store_template.install(Path(made) if made else store_template.make_template(Path(path).parent / "template.db"))
    import threading

    assert threading.active_count() == 1, threading.enumerate()  # forking is safe only without threads
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-command waiters are reaped by the system
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(64)
        Path(path + ".ready").touch()
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:  # the waiter: starts the command, reports its pid and its wait status
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                return _wait_for_command(conn)  # (returns only in the command's own process)
            conn.close()


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def _wait_for_command(conn: socket.socket) -> tuple[dict, list[int]]:
    """In the waiter: fork the command's process (which returns the request, to run it at the script's top level)
    and report its pid and wait status; the waiter itself ends here."""
    try:
        request, fds = _recv_request(conn)
        pid = os.fork()
    except BaseException:
        os._exit(1)
    if pid == 0:
        conn.close()
        return request, fds
    try:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{status}\n".encode())
    finally:
        os._exit(0)


def _become(request: dict, fds: list[int]) -> None:
    """In the command's own process: take its standard streams, working folder, environment and argv, as
    `python -m MODULE ARGV` in CWD with ENV would have them."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR of this command, not the server's
    entries = _path_entries(request["env"].get("PYTHONPATH"), request["cwd"])  # as `python -m` in cwd with ENV:
    sys.path[:] = [request["cwd"], *entries, *(p for p in _SERVING["base"] if p not in entries)]  # cwd, PYTHONPATH
    sys.argv = [request["module"], *request["argv"]]  # (argv[0] becomes the module's file, as -m makes it)
    _as_imported_here()


def _as_imported_here() -> None:
    """What Lightning computes from the environment at import, computed for this command's environment; and its
    rank launchers start warm ranks."""
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.fabric.utilities import rank_zero
    from lightning.pytorch.strategies.launchers import subprocess_script as trainer_launcher

    rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    for launcher in (fabric_launcher, trainer_launcher):
        launcher.subprocess = Launches()
    import lrattn_lightning.tools.sweep.local as sweep_launcher

    sweep_launcher.subprocess = Launches()


_ENDING: dict = {}  # in a command's process: {"status": the status it ends with}; empty in the server


def _end_without_teardown() -> None:
    """The last atexit handler of a command's process (the server registers it before it imports anything, so the
    handlers of the modules it preloads and the command's own run before it): after Python joined the non-daemon
    threads, ran those handlers and printed any uncaught exception, end with the status Python would end with,
    skipping the interpreter's teardown. Tearing down the modules of a process forked from the server writes to
    nearly every page it shares with the server (reference counts): ~3 s a command on a slow CPU, 0.3 s `lrattn
    list` took 3.1 s. In the server itself it does nothing."""
    if "status" not in _ENDING:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if _ENDING["status"] == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends Python killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(_ENDING["status"] & 0xFF)


def _run_command(module: str) -> None:
    """`python -m MODULE` in this process, recording the status Python's exit gives it (SystemExit's code, 1 for
    an uncaught exception or a non-integer code, SIGINT for KeyboardInterrupt); the exception goes on to Python."""
    import runpy

    _ENDING["status"] = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
        _ENDING["status"] = 0 if code is None else code if isinstance(code, int) else 1
        raise
    except KeyboardInterrupt:
        _ENDING["status"] = -signal.SIGINT
        raise
    except BaseException:
        _ENDING["status"] = 1
        raise


if __name__ == "__main__":
    # The server; in a command's process, the command, run as `python -m` runs it, and then the interpreter ends as
    # it ends any program (non-daemon threads joined, atexit handlers run, an uncaught exception printed), but for
    # the teardown of its modules (_end_without_teardown).
    command, streams = _serve(sys.argv[1])
    _become(command, streams)
    _run_command(command["module"])
