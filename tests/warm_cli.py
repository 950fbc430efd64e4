"""`python -m lrattn_lightning.cli ...` for the tests, without paying Python's start-up for each command.

A command run by the tests is a real process: its own pid, exit status, signals, file descriptors, atexit
handlers, and its DDP ranks are processes it starts. What is saved is the ~7 s an `lrattn` process spends
importing torch, Lightning (which imports torchmetrics, hence transformers, scipy, matplotlib) and MLflow
before its first line of work: a server process per pytest process imports them once, then forks for each
command. A new sqlite MLflow store a forked command opens is a copy of one MLflow built once per test run
(tests/store_template.py: MLflow's ~60 migrations, 2-3 s, once instead of once per store). The forked process
sets the command's working folder, environment, argv and standard streams, runs `lrattn_lightning.cli` as
`python -m` does (runpy, as `__main__`), then ends as the interpreter would: non-daemon threads joined, atexit
handlers run (its own and those of the modules the server preloaded), streams flushed, the exit status of
SystemExit, 1 with a traceback for an uncaught exception, killed by SIGINT for an uncaught KeyboardInterrupt;
only the modules' teardown is skipped. This module is the test process's side (and the launchers' in a forked
command); the server and a command's own process are tests/warm_server.py.

The ranks a command's DDP/FSDP launch starts (Lightning's and Fabric's subprocess launchers, which re-run the
command with LOCAL_RANK set) and the fits a sweep starts (tools/sweep/local.py, also when the sweep runs in the
test process: conftest.py) are forked from a server too: the launcher gets a Popen-like handle (pid, stdout,
poll, wait, send_signal) for a process that is not its child. Lightning's rank-zero flag, computed from the
environment when Lightning is imported, is computed again in each forked process.

A server is started for each environment the commands come with, compared on the variables a library may
read at import time (all but WARM_VARIES; PYTHONPATH by where the preloaded packages are found under it, and a
forked command gets the sys.path its own PYTHONPATH makes), at most MAX_SERVERS per test process. A command starts cold (a plain
`subprocess.run`) beyond those, when a test needs a pre-exec hook, a new session or another interpreter (such
tests call subprocess themselves), or everywhere with LRATTN_TESTS_COLD=1. The cold path is what an installed user's `lrattn` is, and
tests/e2e/test_packaging.py runs it from an installed wheel outside the checkout.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODULE = "lrattn_lightning.cli"
PROBE = "warm_probe"  # modules tests/e2e/test_warm_cli.py writes, run warm as `lrattn` is, to compare endings
# variables read when a command runs (not when a library is imported): a difference keeps the command warm
WARM_VARIES = ("TMPDIR", "PYTEST_CURRENT_TEST", "COLUMNS", "LINES",
               # what a rank launch sets (Lightning's launcher) or a command sets for itself before it launches
               "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS",
               "MLFLOW_DISABLE_TELEMETRY", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "TQDM_DISABLE",
               "HF_DATASETS_DISABLE_PROGRESS_BARS",
               # read when a request is made or a logger starts; `lrattn` sets the first five (setdefault) in the
               # process that runs it, the test process included, whose later commands then carry them
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
               "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "LRATTN_TRACKING_RETRY_S")
WARM_VARIES_PREFIXES = ("AWS_", "LRATTN_CACHE_DIR", "MLFLOW_TRACKING_URI")
# (MLflow's sqlite store and GitPython are imported when a command first opens its store: 2 s of a 7 s tiny fit)
PRELOAD = ("lightning.pytorch", "torchmetrics", "mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
           "git", "litdata", "lrattn_lightning.cli", "lrattn_lightning.cli.lightning")


REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of an `lrattn` process in the tests: the checkout and tests/ (run_hooks' callbacks)
    importable, one OpenMP thread, no MLflow store inherited from the shell."""
    path = [str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _varies(name: str) -> bool:
    return name in WARM_VARIES or name.startswith(WARM_VARIES_PREFIXES)


def _fixed(env: dict[str, str], cwd: str | Path | None = None) -> dict[str, str]:
    """The variables a library may read at import, with PYTHONPATH as where the preloaded packages come from under
    it (in `cwd`, which its relative folders name): a command whose PYTHONPATH differs otherwise (the sweep's fits
    have the checkout alone, a test its own folder of modules) is served too, with its own sys.path (_become)."""
    fixed = {k: v for k, v in env.items() if not _varies(k) and k != "PYTHONPATH"}
    fixed["PYTHONPATH"] = json.dumps(_preloaded_from(env.get("PYTHONPATH"), str(cwd or os.getcwd())))
    return fixed


def _path_entries(pythonpath: str | None, cwd: str) -> list[str]:
    """The folders Python puts on sys.path for PYTHONPATH, started in `cwd`: absolute (an empty entry is cwd),
    each once, in order."""
    if not pythonpath:
        return []
    return list(dict.fromkeys(os.path.normpath(os.path.join(cwd, entry)) for entry in pythonpath.split(os.pathsep)))


def _preloaded_from(pythonpath: str | None, cwd: str) -> dict[str, str | None]:
    """Where each preloaded top-level package is found under PYTHONPATH: a folder on it that holds the package,
    else where the interpreter finds it without PYTHONPATH (site-packages, the editable install)."""
    import importlib.machinery
    import importlib.util

    entries = _path_entries(pythonpath, cwd)
    found = {}
    for name in dict.fromkeys(module.split(".")[0] for module in PRELOAD):
        spec = importlib.machinery.PathFinder.find_spec(name, entries) or importlib.util.find_spec(name)
        found[name] = spec.origin if spec is not None else None
    return found


def _say_cold(command: list[str], env: dict[str, str], cwd: str | Path | None = None) -> None:
    """With LRATTN_TESTS_WARM_DEBUG set, a command started cold (or a server) is one line: on stderr, or appended to
    the file the variable names (a path: the whole suite's cold starts, with the test and the variables that kept it
    cold, or that the new server is for)."""
    where = os.environ.get("LRATTN_TESTS_WARM_DEBUG")
    if not where:
        return
    fixed, served = _fixed(env, cwd), _SERVING.get("env") or _fixed(cli_env())
    differ = {k: (served.get(k), fixed.get(k)) for k in sorted(set(fixed) | set(served)) if served.get(k) != fixed.get(k)}
    line = f"warm_cli: cold: {command[:4]} {os.environ.get('PYTEST_CURRENT_TEST', '')} {differ}"
    if os.sep not in where:
        print(line, file=sys.stderr)
        return
    with open(where, "a") as f:
        f.write(line[:2000] + "\n")


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = _fixed(env)
        _say_cold(["(a server starts)"], env)
        self.folder = tempfile.mkdtemp(prefix="lrattn-warm-")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "warm_server.py"), self.path], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(os.path.join(self.folder, "log"), "w"))
        # its imports take ~15 s of CPU; on a 2-core machine loaded 4-fold (seen) more than 120 s of wall clock
        deadline = time.monotonic() + 600
        while not os.path.exists(self.path + ".ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the warm lrattn server did not start: {Path(self.folder, 'log').read_text()}")
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            for name in os.listdir(self.folder):
                os.unlink(os.path.join(self.folder, name))
            os.rmdir(self.folder)


_SERVING: dict = {}  # in the server and the processes forked from it (warm_server.py): its socket and fixed env
_SERVERS: dict[str, _Server] = {}  # in order of last use, the least recently used first
MAX_SERVERS = 3  # per test process: `cli_env()`'s (never closed) and the most recently used others


def _busy(server: _Server) -> bool:
    """Whether a command forked from the server still runs (its live children)."""
    pid = server.proc.pid
    try:
        return bool(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return False


def _server(env: dict[str, str], cwd: str | Path | None = None) -> _Server | None:
    """A server of this test process whose import-time environment is `env`'s (started on first use). At
    MAX_SERVERS, the least recently used idle server but cli_env()'s is closed for it; None (cold) when all
    are busy."""
    if os.environ.get("LRATTN_TESTS_COLD") == "1":
        return None
    key = json.dumps(_fixed(env, cwd), sort_keys=True)
    if key not in _SERVERS:
        canonical = json.dumps(_fixed(cli_env()), sort_keys=True)
        others = [k for k in _SERVERS if k != canonical]
        if key != canonical and len(others) >= MAX_SERVERS - 1:  # a slot is kept for the environment most use
            idle = [k for k in others if not _busy(_SERVERS[k])]
            if not idle:
                return None
            _SERVERS.pop(idle[0]).close()
        _SERVERS[key] = _Server(env)
        atexit.register(_SERVERS[key].close)
    _SERVERS[key] = _SERVERS.pop(key)  # now the most recently used
    return _SERVERS[key]


def _decode(data: bytes) -> str:
    # as subprocess.run(text=True): the locale's encoding, universal newlines
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False), newline=None).read()


def _request(path: str, module: str, argv: list[str], cwd: Path | str, env: dict[str, str],
             fds: list[int]) -> socket.socket:
    """Ask the server at `path` to run `python -m MODULE ARGV` with these standard streams; the connection
    answers the pid, then the wait status."""
    request = json.dumps({"module": module, "argv": argv, "cwd": str(Path(cwd).resolve()), "env": env}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], fds)
    return conn


def _line(conn: socket.socket, received: bytearray) -> str:
    """The next line the server sends (what follows it stays in `received`)."""
    while b"\n" not in received:
        chunk = conn.recv(64)
        if not chunk:
            raise RuntimeError("the warm lrattn server closed the connection")
        received += chunk
    line, _, rest = bytes(received).partition(b"\n")
    received[:] = rest
    return line.decode()


def run(cmd: list[str], *, cwd: Path | str, env: dict[str, str], timeout: float | None = None,
        capture_output: bool = True, text: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=, env=, capture_output=True, text=True, timeout=, input=) for
    `[sys.executable, "-m", "lrattn_lightning.cli", ...]`, forked from the warm server when it can be."""
    assert capture_output and text, "warm_cli.run captures text output, as the tests' helpers do"
    server = None
    if cmd[:2] == [sys.executable, "-m"] and len(cmd) > 2 and (cmd[2] == MODULE or cmd[2].startswith(PROBE)):
        server = _server(env, cwd)
    if server is None:
        _say_cold(cmd, env, cwd)
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, input=input)
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if input is not None:
            stdin.write(input.encode(locale.getpreferredencoding(False)))
            stdin.seek(0)
        with _request(server.path, cmd[2], cmd[3:], cwd, env, [stdin.fileno(), out.fileno(), err.fileno()]) as conn:
            received = bytearray()
            pid = int(_line(conn, received))
            conn.settimeout(timeout)
            try:
                status = _line(conn, received)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                conn.settimeout(None)
                _line(conn, received)
                out.seek(0)
                err.seek(0)
                raise subprocess.TimeoutExpired(cmd, timeout, _decode(out.read()), _decode(err.read())) from None
        code = os.waitstatus_to_exitcode(int(status))
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, _decode(out.read()), _decode(err.read()))


class Launches:
    """Stands for the `subprocess` module in a launcher of `lrattn` processes (Lightning's rank launchers, the
    sweep's runs): its Popen forks `python -m lrattn_lightning.cli...` from the server when the environment
    allows, with the standard streams it is given (inherited, a pipe, stderr into stdout)."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(command, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, errors=None,  # noqa: N802
              **kwargs):
        command = list(command)
        env = dict(os.environ if env is None else env)
        path = None
        if not kwargs and command[:2] == [sys.executable, "-m"] and command[2].startswith(MODULE) and \
                stdin in (None, subprocess.DEVNULL) and stdout in (None, subprocess.PIPE, subprocess.DEVNULL) and \
                stderr in (None, subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL):
            if _SERVING:  # in a command forked from the server
                path = _SERVING["path"] if _fixed(env, cwd) == _SERVING["env"] else None
            else:  # in the test process
                server = _server(env, cwd)
                path = server.path if server is not None else None
        if path is None:
            _say_cold(command, env, cwd)
            return subprocess.Popen(command, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                    errors=errors, **kwargs)
        return _Forked(path, command, env, cwd or os.getcwd(), stdin, stdout, stderr, text, errors)


class _Forked:
    """A Popen-like handle (pid, stdout, stderr, poll, wait, communicate, send_signal) on a command forked from
    the server: not a child of this process. stdin: None or DEVNULL; stdout: None, PIPE or DEVNULL; stderr:
    those or STDOUT."""

    def __init__(self, path: str, command: list[str], env: dict[str, str], cwd: str, stdin: int | None,
                 stdout: int | None, stderr: int | None, text: bool, errors: str | None) -> None:
        self.args, self.returncode, self._received = command, None, bytearray()
        self.stdout = self.stderr = None
        fds, ours = [0, 1, 2], []  # the command's standard streams; the ends this process closes once sent

        def stream(which: int | None, into: int) -> Any:
            if which == subprocess.PIPE:  # (stdout or stderr: Launches sends a piped stdin cold)
                read, fds[into] = os.pipe()
                ours.append(fds[into])
                return open(read, "r" if text else "rb", errors=errors if text else None)  # noqa: SIM115
            if which == subprocess.DEVNULL:
                fds[into] = os.open(os.devnull, os.O_RDONLY if into == 0 else os.O_WRONLY)
                ours.append(fds[into])
            return None

        stream(stdin, 0)
        self.stdout = stream(stdout, 1)
        if stderr == subprocess.STDOUT:
            fds[2] = fds[1]
        else:
            self.stderr = stream(stderr, 2)
        try:
            self._conn = _request(path, command[2], command[3:], cwd, env, fds)
        finally:
            for fd in ours:
                os.close(fd)
        self.pid = int(_line(self._conn, self._received))

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        """(stdout, stderr) read to their ends (None where not a pipe), then the exit status, as Popen's."""
        assert input is None, "a forked command's stdin is this process's or /dev/null"
        found: dict[int, Any] = {}
        readers = [threading.Thread(target=lambda i=i, f=f: found.__setitem__(i, f.read()), daemon=True)
                   for i, f in enumerate((self.stdout, self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return found.get(0), found.get(1)

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self.returncode = os.waitstatus_to_exitcode(int(_line(self._conn, self._received)))
                self._conn.close()
            except (TimeoutError, BlockingIOError):  # (a zero timeout makes the socket non-blocking)
                return None
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
