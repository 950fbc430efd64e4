"""Signals at exact points of a real `lrattn fit` process (tests/run_hooks.py), and what its resume logs.

SIGTERM, SIGINT (Ctrl-C) and SIGHUP (a closed terminal) all stop a fit the same way: the step or validation batch in
progress finishes, last.ckpt is saved at that step, the MLflow run ends KILLED, and the exit code is 128 + the
signal's number (DDP ranks stopped by a signal to one or all of them: test_resilience.py); a SIGHUP ignored at
launch (nohup) stays ignored. A run stopped or killed at any point and resumed must hold every metric of an
uninterrupted run, the validations included, with the same values: training on the CPU is deterministic.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers.cli import cli_env
from helpers.runs import (
    assert_same_run,
    ckpt_dir,
    fit_args,
    histories,
    hooks,
    lrattn,
    run_cli,
    step_of,
    stop_line,
    the_run,
    tmpfs,
)

# every test's fits log to tmp_path's store, seeded (conftest.py mlflow_store): their point is not a new store's set-up
pytestmark = pytest.mark.usefixtures("mlflow_store")

# validations at steps 2, 4, ..., 10; periodic saves at 4 and 8; an ablation with routing diagnostics
STEPS, EVERY, ABLATION = 10, 4, "attnres-full"
RUN = f"tiny-{ABLATION}-seed0"


def args(data: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return fit_args(data, "--experiment", "run", *extra, steps=steps, every=EVERY, ablation=ABLATION)


@pytest.fixture(scope="module")
def uninterrupted(data, seeded_folder) -> dict[str, list[tuple[int, float]]]:
    folder = seeded_folder("uninterrupted")
    done = run_cli(args(data), folder)
    assert done.returncode == 0, done.stderr[-3000:]
    full = histories(folder)
    assert [s for s, _ in full["val/loss"]] == [2, 4, 6, 8, 10] and "val/bpb" in full
    assert any(key.startswith("routing/") for key in full)
    return full


def test_each_signal_stops_with_its_exit_code_and_validations_stopped_midway_run_again_whole_on_resume(
        data, tmp_path, uninterrupted):
    """One run stopped four times, each resumed from last.ckpt by a real process: SIGHUP in the first batch of the
    step-2 validation (no periodic save at 2), SIGKILL in the step-4 validation (right after the periodic save at
    4), SIGTERM in the last batch of the step-6 validation, and Ctrl-C (SIGINT) during step 7: the step finishes,
    then the stop, before the step-8 validation. Each signal stops it the same way: last.ckpt at that step, the one
    MLflow run KILLED, exit 128 + the signal's number (129, 143, 130); each resume makes the run RUNNING again, as
    the SIGKILLed one leaves it. The last of them starts as `nohup lrattn fit ...` does (SIGHUP ignored at launch)
    and gets a SIGHUP at step 6: it stays ignored, the run goes on to the SIGINT. Lightning alone skipped each of
    these validations on resume; the last resume (in this process) ends the run FINISHED with every metric of the
    uninterrupted one."""
    folder = ckpt_dir(tmp_path, "run", RUN)
    last = folder / "last.ckpt"
    stops = [  # (the signal and where, the step last.ckpt holds)
        ({"step": 2, "signal": "SIGHUP", "during": "validation", "batch": 0}, 2),
        ({"step": 4, "signal": "SIGKILL", "during": "validation", "batch": 0}, 4),
        ({"step": 6, "signal": "SIGTERM", "during": "validation", "batch": 1}, 6),
        ({"step": 7, "signal": "SIGINT"}, 8),
    ]
    run_id = None
    for i, (where, step) in enumerate(stops):
        resume = ["--ckpt_path", "last"] if i else []
        ignored_hup = i == len(stops) - 1
        extra = [("SignalAt", {"step": 6, "signal": "SIGHUP"})] if ignored_hup else []
        config = hooks(tmp_path, f"stop{i}.yaml", ("SignalAt", where), *extra)
        stopped = subprocess.run(lrattn(*args(data, *resume, "--config", config)), cwd=tmp_path, env=cli_env(),
                                 capture_output=True, text=True, timeout=300,
                                 preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignored_hup
                                 else None)
        name = where["signal"]
        code = -signal.SIGKILL if name == "SIGKILL" else 128 + signal.Signals[name]
        assert stopped.returncode == code, (where, stopped.stderr[-3000:])
        if name != "SIGKILL":
            assert stop_line(stopped.stderr) == (f"lrattn: stopped by {name} at step {step}; checkpoint {last} "
                                                 "holds it, continue with --ckpt_path last")
        assert step_of(last) == step and {p.name for p in folder.iterdir()} <= {"last.ckpt", "previous.ckpt"}
        _, run = the_run(tmp_path, "run")
        assert run.info.run_id == (run_id or run.info.run_id)  # the one run, continued by every resume
        # a stop ends the run KILLED; a resume makes it RUNNING again, which a SIGKILL (nothing can answer it) leaves
        assert run.info.status == ("RUNNING" if name == "SIGKILL" else "KILLED"), (where, run.info.status)
        run_id = run.info.run_id
    done = run_cli(args(data, "--ckpt_path", "last"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_of(last) == STEPS and [p.name for p in folder.iterdir()] == ["last.ckpt"]
    _, run = the_run(tmp_path, "run")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert_same_run(tmp_path, uninterrupted)


def test_closing_the_terminal_saves_and_stops_although_the_terminal_is_gone(data, tmp_path):
    """A fit with a progress bar in a real terminal (a pty it controls); the terminal is closed during step 2.
    The kernel hangs it up and sends SIGHUP; from then on every write to it fails (EIO), which crashed the
    step before its save. The run saves step 3, ends KILLED and exits 129."""
    master, slave = pty.openpty()
    marker, go = tmp_path / "paused", tmp_path / "go"
    config = hooks(tmp_path, "pause.yaml", ("PauseAt", {"step": 2, "marker": str(marker), "go": str(go)}))

    def controlling_terminal() -> None:  # in the child, after setsid: the pty becomes its terminal
        import fcntl
        import termios
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(lrattn(*args(data, "--config", config, "--trainer.enable_progress_bar", "true", steps=6)),
                            cwd=tmp_path, env=cli_env(), stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=controlling_terminal)
    os.close(slave)
    reading, output = threading.Event(), []

    def drain() -> None:  # keep the terminal's buffer from filling while the fit writes to it
        while reading.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    output.append(os.read(master, 65536))
                except OSError:
                    return

    reading.set()
    reader = threading.Thread(target=drain)
    reader.start()
    try:
        deadline = time.time() + 180
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, b"".join(output)[-3000:]
            time.sleep(0.05)
    finally:
        reading.clear()
        reader.join()
    os.close(master)  # the terminal window closes
    go.touch()
    assert proc.wait(timeout=180) == 128 + signal.SIGHUP, b"".join(output)[-3000:]
    assert step_of(ckpt_dir(tmp_path, "run", RUN) / "last.ckpt") == 3
    assert the_run(tmp_path, "run")[1].info.status == "KILLED"


def test_a_first_save_on_a_full_disk_does_not_advise_a_resume(data, tmp_path, monkeypatch, capsys):
    """No checkpoint could be written, so `--ckpt_path last` would fail: the line says to run again instead."""
    from lrattn_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tmpfs(tmp_path / "small", "size=64k") as small:  # the tiny model's checkpoint is larger
        assert main(fit_args(data, "--runs_dir", str(small), steps=2, every=1)) == 2
        err = capsys.readouterr().err
        folder = small / "lrattn" / "tiny-baseline-seed0" / "checkpoints"
        line = stop_line(err)
        assert line.startswith(f"lrattn: error: could not save checkpoint {folder / 'last.ckpt'}: No space left")
        assert "no checkpoint was written, so there is nothing to resume" in line
        assert "run the same command again" in line
        assert "--ckpt_path" not in line
        assert not list(folder.glob("*.ckpt"))  # so the same command starts again, not refused
