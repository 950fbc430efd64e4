"""stop.adopt_ranks / await_ranks against Lightning's real watch over launched ranks (_ChildProcessObserver).

The watch's victim here is a stand-in process, never the test's own: its main_pid is a `sleep` that plays rank 0.
"""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lrattn_lightning.train.checkpoint import stop


def _exits(code: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])


def _watch(rank_zero: subprocess.Popen, procs: list[subprocess.Popen]) -> _ChildProcessObserver:
    watch = _ChildProcessObserver(main_pid=rank_zero.pid, child_processes=procs, sleep_period=0.05)
    watch.start()
    return watch


@pytest.mark.parametrize("adopted", [False, True])
def test_a_rank_that_exits_143_first_kills_rank_zero_unless_adopted(adopted):
    """Unadopted, Lightning's watch SIGKILLs the stand-in rank 0 once rank 1 exits 143 (the bug); adopted, the
    watch's list is empty (it reads as "all finished"), rank 0 lives and await_ranks collects rank 1's 143."""
    rank_zero = subprocess.Popen(["sleep", "30"])
    try:
        launcher = SimpleNamespace(procs=[subprocess.Popen([sys.executable, "-c", "import time, sys; "
                                                            "time.sleep(0.3); sys.exit(143)"])])
        watch = _watch(rank_zero, launcher.procs)
        if adopted:
            stop.adopt_ranks(launcher)
            assert launcher.procs == [] and len(stop.ADOPTED) == 1
        watch.join(timeout=10)
        assert not watch.is_alive()
        if not adopted:
            assert rank_zero.wait(timeout=10) == -9  # (waited for: a loaded machine delivers the SIGKILL late)
            return
        assert rank_zero.poll() is None, rank_zero.returncode
        (rank_one,) = stop.ADOPTED
        stop.await_ranks(timeout=10)
        assert rank_one.returncode == 143 and stop.ADOPTED == []
    finally:
        stop.ADOPTED.clear()
        rank_zero.kill()
        rank_zero.wait()


def test_await_ranks_kills_a_rank_still_running_after_the_timeout():
    done, hung = _exits(0), subprocess.Popen(["sleep", "30"])
    launcher = SimpleNamespace(procs=[done, hung])
    stop.adopt_ranks(launcher)
    started = time.monotonic()
    stop.await_ranks(timeout=0.5)
    assert time.monotonic() - started < 5
    assert (done.returncode, hung.returncode) == (0, -9)
    assert stop.ADOPTED == [] and launcher.procs == []


def test_a_launcher_without_ranks_adopts_nothing():
    for launcher in (None, SimpleNamespace(), SimpleNamespace(procs=[])):
        stop.adopt_ranks(launcher)
    assert stop.ADOPTED == []
    stop.await_ranks(timeout=0)  # nothing to wait for
