"""The tests' pre-imported `lrattn` (tests/warm_cli.py) gives what a fresh `python -m lrattn_lightning.cli` gives:
the same exit status, stdout and stderr, and a timeout that ends the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import warm_cli

LRATTN = [sys.executable, "-m", "lrattn_lightning.cli"]


def both(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    env = warm_cli.cli_env()
    warm = warm_cli.run([*LRATTN, *args], cwd=cwd, env=env, timeout=300)
    cold = subprocess.run([*LRATTN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return warm, cold


@pytest.mark.parametrize("args", [["list", "--size", "tiny"], ["nope"], ["fit", "--size", "tiny", "--ablation",
                                                                        "attnres-ful"], []])
def test_a_forked_command_answers_as_a_fresh_process(args, tmp_path):
    warm, cold = both(args, tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.returncode in (0, 2) and (warm.stdout or warm.stderr)


def test_the_server_is_used_and_a_timeout_ends_the_command(tmp_path):
    env = warm_cli.cli_env()
    assert warm_cli._server(env) is not None  # the forked path, not the cold one
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):  # the whole bundled corpus takes seconds
        warm_cli.run([*LRATTN, "prepare", "--source", "stdlib-docs", "--out", str(tmp_path / "d"), "--num_workers",
                      "1"], cwd=tmp_path, env=env, timeout=0.5)
    assert time.monotonic() - start < 60


def test_the_common_environment_keeps_its_server_and_others_take_turns(monkeypatch):
    """CI at stop 36: three other environments came first in one test process and cli_env()'s commands ran cold.
    Later, a test whose environment came after MAX_SERVERS others ran all its commands cold. Now cli_env()'s
    server is never closed, and a new environment closes the least recently used idle other one."""
    closed = []

    class Cheap:
        def __init__(self, env, command=("sleep", "30")):  # a process without children: idle
            self.env, self.proc = env, subprocess.Popen(command, start_new_session=True)

        def close(self):  # (also at exit: warm_cli registers it)
            if self.proc.poll() is None:
                closed.append(self.env.get("LRATTN_TEST_ENV", "canonical"))
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    monkeypatch.setattr(warm_cli, "_Server", Cheap)
    monkeypatch.setattr(warm_cli, "_SERVERS", {})
    try:
        others = [warm_cli.cli_env(LRATTN_TEST_ENV=str(i)) for i in range(warm_cli.MAX_SERVERS + 1)]
        first = [warm_cli._server(env) for env in others[:warm_cli.MAX_SERVERS - 1]]
        assert all(isinstance(server, Cheap) for server in first) and closed == []
        common = warm_cli._server(warm_cli.cli_env())
        assert isinstance(common, Cheap) and len(warm_cli._SERVERS) == warm_cli.MAX_SERVERS
        warm_cli._server(others[0])  # used again: now others[1] is the least recently used
        assert isinstance(warm_cli._server(others[-1]), Cheap)
        assert closed == ["1"] and len(warm_cli._SERVERS) == warm_cli.MAX_SERVERS
        assert warm_cli._server(warm_cli.cli_env()) is common
        for key, server in warm_cli._SERVERS.items():  # each other server runs a command: none is closed
            if server is not common:
                server.close()
                warm_cli._SERVERS[key] = Cheap(server.env, ["sh", "-c", "sleep 30 & wait"])
        deadline = time.monotonic() + 10
        while not all(warm_cli._busy(server) for server in warm_cli._SERVERS.values() if server is not common) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not warm_cli._busy(common)
        closed.clear()
        assert warm_cli._server(warm_cli.cli_env(LRATTN_TEST_ENV="busy")) is None and closed == []
    finally:
        for server in warm_cli._SERVERS.values():
            server.close()


PREPARE = ["prepare", "--source", "stdlib-docs", "--max_documents", "8", "--out", "d"]  # writes on both streams


@pytest.fixture(scope="module")
def popen_answers(tmp_path_factory) -> dict:
    """What a real Popen of PREPARE returns from communicate(): streams apart, and stderr into stdout."""
    answers = {}
    for merge in (False, True):
        cwd = tmp_path_factory.mktemp("cold")
        proc = subprocess.Popen([*LRATTN, *PREPARE], cwd=cwd, env=warm_cli.cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True)
        answers[merge] = (proc.communicate(timeout=120), proc.returncode, cwd / "d/meta.json", proc.pid)
    return answers


@pytest.mark.parametrize("streams", [(subprocess.PIPE, subprocess.PIPE), (subprocess.DEVNULL, subprocess.PIPE),
                                     (subprocess.PIPE, subprocess.STDOUT), (subprocess.PIPE, subprocess.DEVNULL)])
def test_a_forked_handle_communicates_as_popen_does(streams, popen_answers, tmp_path):
    """Launches.Popen's handle with each stream a pipe, /dev/null or stderr into stdout: communicate() returns
    what a real Popen's does (None for a stream not piped), and the handle is a process of its own."""
    stdout, stderr = streams
    (out, err), code, meta, pid = popen_answers[stderr == subprocess.STDOUT]
    want = (out if stdout == subprocess.PIPE else None, err if stderr == subprocess.PIPE else None)
    warm = warm_cli.Launches.Popen([*LRATTN, *PREPARE], cwd=tmp_path, env=warm_cli.cli_env(), stdout=stdout,
                                   stderr=stderr, text=True)
    assert isinstance(warm, warm_cli._Forked) and warm.pid not in (os.getpid(), pid)
    assert warm.communicate(timeout=120) == want and all(part for part in want if part is not None)
    assert warm.returncode == code == 0
    splits = [json.loads(path.read_text())["splits"] for path in (tmp_path / "d/meta.json", meta)]
    assert splits[0] == splits[1] and splits[0]["train"]["tokens"] > 0


PROBE = '''
import atexit, logging, sys, threading, time  # (logging registers its shutdown first, as the server's preloads did)

class Closing(logging.Handler):
    def emit(self, record):
        pass

    def close(self):  # logging.shutdown, an atexit handler registered before the probe's
        print("logging shut down", flush=True)
        super().close()

logging.getLogger("probe").addHandler(Closing())
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.3)
    print("thread joined", flush=True)
threading.Thread(target=late).start()  # non-daemon: Python joins it before the atexit handlers
how = sys.argv[1]
print("start", sys.argv[1:], flush=True)
if how == "exit":
    sys.exit(int(sys.argv[2]))
if how == "message":
    sys.exit("a message instead of a status")
if how == "raise":
    raise ValueError("uncaught")
if how == "interrupt":
    raise KeyboardInterrupt
'''


@pytest.mark.parametrize("how", [["normal"], ["exit", "0"], ["exit", "3"], ["exit", "300"], ["message"], ["raise"],
                                 ["interrupt"]])
def test_a_forked_process_ends_as_python_ends_a_program(how, tmp_path):
    """Joined non-daemon threads, atexit handlers (also one registered before the command ran: logging's, which the
    server's preloads registered), the exit status (SystemExit's code modulo 256, 1 for a message
    or an uncaught exception, killed by SIGINT for KeyboardInterrupt) and what Python prints, as a fresh
    interpreter ends, although the forked process skips the modules' teardown."""
    (tmp_path / f"{warm_cli.PROBE}_ending.py").write_text(PROBE)
    cmd = [sys.executable, "-m", f"{warm_cli.PROBE}_ending", *how]
    env = warm_cli.cli_env()
    assert warm_cli._server(env) is not None
    warm = warm_cli.run(cmd, cwd=tmp_path, env=env, timeout=120)
    cold = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert warm.returncode == cold.returncode, (warm, cold)
    ending = "thread joined\natexit ran\nlogging shut down\n"  # the handlers registered before the command's too
    assert warm.stdout == cold.stdout and ending in warm.stdout, (warm.stdout, cold.stdout)
    assert own_lines(warm.stderr) == own_lines(cold.stderr) and (how[0] != "raise" or own_lines(warm.stderr))
    expected = {"normal": 0, "message": 1, "raise": 1, "interrupt": -signal.SIGINT}
    assert warm.returncode == (int(how[1]) % 256 if how[0] == "exit" else expected[how[0]])


def own_lines(stderr: str) -> list[str]:
    """What Python printed, from the probe's own frames on (the frames that ran it differ: <frozen runpy> when
    cold, warm_cli's and runpy's when forked)."""
    lines = stderr.splitlines()
    mine = [i for i, line in enumerate(lines) if f"{warm_cli.PROBE}_ending.py" in line]
    return lines[mine[0]:] if mine else lines


PATH_PROBE = """import json, sys
import my_own_module
print(json.dumps({"path": list(dict.fromkeys(sys.path)), "mine": my_own_module.__file__}))
"""


@pytest.mark.parametrize("pythonpath", ["mods", "mods:", "", None, "{repo}:mods"])
def test_a_command_with_another_pythonpath_is_served_with_its_own_sys_path(pythonpath, tmp_path):
    """The sweep's fits name the checkout alone, a test its own folder of modules: such a PYTHONPATH finds the
    preloaded packages where cli_env()'s does, so the same server forks the command, with the sys.path (in order,
    each folder once) and imports that a fresh `python -m` in that folder with that environment has."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "my_own_module.py").write_text("")
    (tmp_path / "my_own_module.py").write_text("")  # what the command's folder (first on sys.path) gives
    (tmp_path / f"{warm_cli.PROBE}_path.py").write_text(PATH_PROBE)
    env = warm_cli.cli_env()
    server = warm_cli._server(env)
    if pythonpath is None:
        env.pop("PYTHONPATH")
    else:
        env["PYTHONPATH"] = pythonpath.format(repo=warm_cli.REPO)
    assert warm_cli._server(env, tmp_path) is server  # the same server, no other started
    cmd = [sys.executable, "-m", f"{warm_cli.PROBE}_path"]
    warm = warm_cli.run(cmd, cwd=tmp_path, env=env, timeout=120)
    cold = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert warm.returncode == cold.returncode == 0, (warm.stderr[-2000:], cold.stderr[-2000:])
    assert json.loads(warm.stdout) == json.loads(cold.stdout)
    assert str(tmp_path / "mods") in json.loads(cold.stdout)["path"] or not pythonpath


def test_a_pythonpath_that_moves_a_preloaded_package_gets_its_own_server(tmp_path):
    """A folder on PYTHONPATH that holds a package the server imported (here `git`) would change that import:
    such a command is not forked from cli_env()'s server."""
    (tmp_path / "pkgs" / "git").mkdir(parents=True)
    (tmp_path / "pkgs" / "git" / "__init__.py").write_text("")
    env = warm_cli.cli_env()
    moved = {**env, "PYTHONPATH": f"pkgs:{env['PYTHONPATH']}"}  # (relative: to the command's folder)
    assert warm_cli._fixed(moved, tmp_path) != warm_cli._fixed(env, tmp_path)
    assert warm_cli._fixed({**env, "PYTHONPATH": str(warm_cli.REPO)}, tmp_path) == warm_cli._fixed(env, tmp_path)
