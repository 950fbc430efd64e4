"""Runs that survive what clusters do to them: real signals, real processes, a real MLflow server.

Training on the CPU is deterministic, so a run that was stopped and resumed must log the losses of an
uninterrupted one. Bad input (one line, exit 2, before any work) is ../cli/test_bad_inputs.py.
Tests that mount a tmpfs (another filesystem for $TMPDIR, a full disk, a read-only store) need root.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import cli_env
from helpers.paths import REPO_ROOT
from helpers.runs import (
    RUN,
    STRETCHABLE,
    assert_same_losses,
    ckpt_dir,
    fit_args,
    hooks,
    lrattn,
    metric_history,
    run_cli,
    run_process,
    step_of,
    stop_line,
    the_run,
    tmpfs,
)
from helpers.tracking import mlflow_server
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main


# ---- item 4: SIGTERM ------------------------------------------------------------------------------
@pytest.mark.usefixtures("mlflow_store")
def test_sigterm_mid_accumulation_saves_the_step_in_progress_exits_nonzero_and_resume_continues_exactly(
        data, tmp_path, monkeypatch):
    """SIGTERM on the first of two micro-batches of step 5: the step completes (both micro-batches, one optimizer
    step; Lightning alone stopped after the first micro-batch and lost its gradients), last.ckpt is step 6, the state
    it replaced stays as previous.ckpt (step 4: the fallback should step 6 diverge on resume), the fit exits 143 with
    no traceback and its run ends KILLED. The resume continues that run to FINISHED and equals the uninterrupted run
    at every step (loss and gradient norm)."""
    steps, acc = 8, ["--trainer.accumulate_grad_batches", "2", "--trainer.val_check_interval", "6"]
    stopped = run_process(fit_args(data, *acc, "--experiment", "stopped", "--config",
                                   hooks(tmp_path, "term.yaml", ("SigtermAtStep", {"step": 5})), steps=steps, every=4),
                          tmp_path)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert "lrattn: stopped by SIGTERM at step 6" in stopped.stderr  # the step in progress completed
    last = ckpt_dir(tmp_path, "stopped") / "last.ckpt"
    assert step_of(last) == 6 and sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "previous.ckpt"]
    assert step_of(last.parent / "previous.ckpt") == 4
    client, run = the_run(tmp_path, "stopped")
    assert run.info.status == "KILLED"  # not FINISHED: a sweep must not skip it

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(fit_args(data, *acc, "--experiment", "stopped", "--ckpt_path", "last", steps=steps, every=4)) == 0
    assert main(fit_args(data, *acc, "--experiment", "full", steps=steps, every=4)) == 0
    _, resumed = the_run(tmp_path, "stopped")
    _, full = the_run(tmp_path, "full")
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert step_of(last) == steps
    for key in ("train/loss", "train/grad_norm"):
        a, b = metric_history(client, full.info.run_id, key), metric_history(client, resumed.info.run_id, key)
        assert [s for s, _ in a] == [s for s, _ in b] == list(range(steps)), key  # every step once
        for (step, x), (_, y) in zip(a, b, strict=True):
            assert y == pytest.approx(x, rel=1e-5, abs=1e-6), (key, step, a, b)


@pytest.mark.usefixtures("mlflow_store")
def test_with_gradient_accumulation_the_logged_loss_is_the_global_batchs(data, tmp_path):
    """2 micro-batches of 2 windows per step against 1 batch of 4 (same order, no shuffle): the same global
    batches, so every step's loss, gradient norm and learning rate agree (it logged the last micro-batch)."""
    common = ["--data.shuffle", "false", "--trainer.val_check_interval", "4"]
    one = run_cli(fit_args(data, *common, "--experiment", "one", "--data.batch_size", "4", steps=5), tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    acc = run_cli(fit_args(data, *common, "--experiment", "acc", "--trainer.accumulate_grad_batches", "2", steps=5),
                  tmp_path)
    assert acc.returncode == 0, acc.stderr[-3000:]
    client, r1 = the_run(tmp_path, "one")
    _, r2 = the_run(tmp_path, "acc")
    for key in ("train/loss", "train/grad_norm", "train/lr/adamw"):
        a, b = metric_history(client, r1.info.run_id, key), metric_history(client, r2.info.run_id, key)
        assert [s for s, _ in a] == [s for s, _ in b] == list(range(5)), key
        for (step, x), (_, y) in zip(a, b, strict=True):
            assert y == pytest.approx(x, rel=2e-4), (key, step, a, b)


DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
DDP_STEPS = 5  # validations at 2 and 4 in the fit, the final one at 5 after it (LRAttnCLI.after_fit)


@pytest.fixture(scope="module")
def ddp_uninterrupted(data, seeded_folder) -> list[tuple[int, float]]:
    """The losses of the uninterrupted 2-rank run both stops are compared with (run once)."""
    folder = seeded_folder("ddp-full")
    full = run_process(fit_args(data, *DDP, "--experiment", "full", steps=DDP_STEPS, every=4), folder, timeout=400)
    assert full.returncode == 0, full.stderr[-3000:]
    client, run = the_run(folder, "full")
    return metric_history(client, run.info.run_id)


@pytest.mark.usefixtures("mlflow_store")
@pytest.mark.slow
@pytest.mark.parametrize("name, rank", [("SIGHUP", 1), ("SIGINT", None)])
def test_ddp_ranks_stop_together_on_a_signal_to_one_or_all_of_them(data, tmp_path, name, rank, ddp_uninterrupted):
    """2 gloo ranks; SIGHUP (a closed terminal) to rank 1 only, or SIGINT to every rank at the same step (what
    Ctrl-C to the fit's process group delivers: Lightning starts rank 1 as a child in it). The ranks agree on it at
    the end of the step in progress, save it, exit 128 + the signal's number with one line naming it (not one per
    rank), and the run ends KILLED (Lightning's handler broadcast from inside the signal handler and could hang the
    ranks). Rank 0 ends 6 s after rank 1 (SlowRankZeroOnStop): Lightning's watch over the ranks it launched (a 5-s
    poll) would see rank 1's exit first and SIGKILL rank 0 (exit -9). Each stop's checkpoint resumes to the
    uninterrupted run's losses: SIGHUP's to its end; SIGINT's is stopped again by SIGTERM to rank 1 in the final
    validation, which the ranks agree on at each batch as in the fit's validations: exit 143, the run KILLED,
    last.ckpt the last step, no final val/loss logged. (SIGTERM to one rank in training: the FSDP stop in
    test_fsdp.py; in the sanity check: below; each signal in one process: test_signals.py.)"""
    stopped = run_process(fit_args(data, *DDP, "--experiment", "stopped", "--config",
                                   hooks(tmp_path, "stop.yaml", ("SignalAt", {"step": 3, "signal": name, "rank": rank}),
                                         ("SlowRankZeroOnStop", {"seconds": 6})),
                                   steps=DDP_STEPS, every=4), tmp_path, timeout=400)
    assert stopped.returncode == 128 + signal.Signals[name], stopped.stderr[-3000:]
    last = ckpt_dir(tmp_path, "stopped") / "last.ckpt"
    assert stop_line(stopped.stderr) == (f"lrattn: stopped by {name} at step 4; checkpoint {last} holds it, "
                                         "continue with --ckpt_path last")
    assert step_of(last) == 4
    assert the_run(tmp_path, "stopped")[1].info.status == "KILLED"
    # the same command resumes it: SIGHUP's resume finishes; SIGINT's is stopped again by SIGTERM to rank 1 alone in
    # its final validation, where Lightning's handler, broadcasting from inside itself on rank 1, hung both ranks
    again = () if rank else ("--config", hooks(tmp_path, "final.yaml", ("SignalAt", {
        "step": 0, "signal": "SIGTERM", "during": "final_validation", "batch": 0, "rank": 1})))
    resumed = run_process(fit_args(data, *DDP, "--experiment", "stopped", "--ckpt_path", "last", *again,
                                   steps=DDP_STEPS, every=4), tmp_path, timeout=400)
    client, r1 = the_run(tmp_path, "stopped")
    if rank:
        assert resumed.returncode == 0 and r1.info.status == "FINISHED", resumed.stderr[-3000:]
    else:
        assert resumed.returncode == 143, resumed.stderr[-3000:]
        assert stop_line(resumed.stderr) == (f"lrattn: stopped by SIGTERM at step {DDP_STEPS}; checkpoint {last} "
                                             "holds it, continue with --ckpt_path last")
        assert step_of(last) == DDP_STEPS and r1.info.status == "KILLED"
        assert [s for s, _ in metric_history(client, r1.info.run_id, "val/loss")] == [2, 4]  # not the final one
    assert_same_losses(metric_history(client, r1.info.run_id), ddp_uninterrupted)


@pytest.mark.usefixtures("mlflow_store")
@pytest.mark.slow
def test_a_signal_to_one_rank_in_the_sanity_check_stops_both_after_the_first_step(data, tmp_path):
    """SIGTERM to rank 1 alone during Lightning's sanity check (the validation batches it runs before training, as a
    user's fit does): Lightning's own handler, broadcasting from inside itself on rank 1, hung both ranks for good.
    The ranks agree on it at the end of the first step: both save it, exit 143 with one line, the run KILLED."""
    stop = hooks(tmp_path, "sanity.yaml", ("SignalAt", {"step": 0, "signal": "SIGTERM", "during": "sanity",
                                                         "batch": 0, "rank": 1}))
    stopped = run_process(fit_args(data, *DDP, "--config", stop, "--trainer.num_sanity_val_steps", "2",
                                   steps=DDP_STEPS), tmp_path, timeout=400)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = ckpt_dir(tmp_path) / "last.ckpt"
    assert stop_line(stopped.stderr) == (f"lrattn: stopped by SIGTERM at step 1; checkpoint {last} holds it, "
                                         "continue with --ckpt_path last")
    assert step_of(last) == 1 and the_run(tmp_path)[1].info.status == "KILLED"


# ---- items 2 and 6: one last.ckpt, always the newest; no step logged twice ------------------------
@pytest.mark.usefixtures("mlflow_store")
def test_last_ckpt_is_always_the_newest_and_resume_logs_each_step_once(data, tmp_path, monkeypatch):
    """The issue's repro, scaled down: a fit that ends before its first periodic save, resumed to a
    longer run and SIGKILLed after a periodic save, resumed again: it must restore the newest step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(fit_args(data, *STRETCHABLE, steps=3, every=5)) == 0
    folder = ckpt_dir(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and step_of(folder / "last.ckpt") == 3
    killed = run_process(fit_args(data, *STRETCHABLE, "--ckpt_path", "last", "--config",
                                  hooks(tmp_path, "kill.yaml", ("KillAtStep", {"step": 7})), steps=12, every=5), tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "previous.ckpt"] and step_of(folder / "last.ckpt") == 5
    assert main(fit_args(data, *STRETCHABLE, "--ckpt_path", "last", steps=12, every=5)) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and step_of(folder / "last.ckpt") == 12
    client, run = the_run(tmp_path)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(12))  # steps 5 and 6 ran twice but are logged once
    assert not (tmp_path / "runs/lrattn" / RUN / ".lock").exists()


# ---- item 3: atomic checkpoint writes ---------------------------------------------------------------
@pytest.mark.usefixtures("mlflow_store")
def test_sigkill_during_a_checkpoint_write_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch, capsys):
    with tmpfs(tmp_path / "tmpdir", "size=512m") as tmpdir:  # $TMPDIR on another filesystem than the run
        marker = tmp_path / "writing"
        config = hooks(tmp_path, "ballast.yaml", ("BallastAtStep", {"step": 4, "mb": 96, "marker": str(marker)}))
        proc = subprocess.Popen(lrattn(*fit_args(data, "--config", config, steps=6)), cwd=tmp_path,
                                env=cli_env(TMPDIR=str(tmpdir)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        folder = ckpt_dir(tmp_path)
        deadline, partial = time.time() + 120, None
        while partial is None:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            if marker.exists():
                partial = next((p for p in folder.glob(".last.ckpt.*.tmp") if p.stat().st_size > 2**20), None)
            time.sleep(0.001)
        proc.kill()  # SIGKILL while the step-4 checkpoint is being written
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        assert partial.exists() and partial.parent == folder  # the bytes went to the run folder, not $TMPDIR
        assert step_of(folder / "last.ckpt") == 2  # the previous checkpoint, whole and loadable
        assert not any(Path(tmpdir).iterdir())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(fit_args(data, "--ckpt_path", "last", steps=6)) == 0
    assert f"removed {partial.relative_to(tmp_path)}, left by a checkpoint save that never finished" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and step_of(folder / "last.ckpt") == 6


@pytest.mark.usefixtures("mlflow_store")
def test_full_disk_fails_with_one_line_and_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(fit_args(data, "--run_name", "probe", steps=1, every=1)) == 0
    size = (ckpt_dir(tmp_path, run="probe") / "last.ckpt").stat().st_size
    capsys.readouterr()
    with tmpfs(tmp_path / "small", f"size={size * 3 // 2 // 4096 * 4096 + 8192}") as small:  # room for one
        assert main(fit_args(data, "--runs_dir", str(small), steps=6)) == 2
        err = capsys.readouterr().err
        last = small / "lrattn" / RUN / "checkpoints" / "last.ckpt"
        lines = [line for line in err.splitlines() if line.startswith("lrattn:")]
        assert lines == [lines[0]] and f"could not save checkpoint {last}: No space left on device" in lines[0]
        assert "Traceback" not in err
        # (previous.ckpt: a hard link kept before the failed write, the same file: no space taken)
        assert step_of(last) == 2 and sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "previous.ckpt"]
        assert (last.parent / "previous.ckpt").stat().st_ino == last.stat().st_ino


# ---- item 5: a dead MLflow server -----------------------------------------------------------------
@pytest.mark.slow
def test_mlflow_server_killed_mid_run_ends_in_bounded_time_with_one_warning(data, tmp_path):
    """The server (a real process) is killed before step 3 of a fit (in this process: the server's death is the
    point): the fit ends in bounded time, exit 0, with one warning for the failure and one for the run's state."""
    with mlflow_server(tmp_path) as (server, uri):
        config = hooks(tmp_path, "killserver.yaml", ("KillProcessGroupAtStep", {"step": 3, "pgid": server.pid}))
        start = time.time()
        proc = run_cli(fit_args(data, "--tracking_uri", uri, "--config", config, steps=6), tmp_path)
        took = time.time() - start
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert took < 90, took
        warnings = [line for line in proc.stderr.splitlines() if "warning: MLflow" in line]
        assert len(warnings) == 2, warnings  # the failure, then the run's state at the end
        assert f"MLflow {uri} failed at step 3" in warnings[0] and "training and checkpoints continue" in warnings[0]
        assert "stays RUNNING" in warnings[1]
        assert step_of(ckpt_dir(tmp_path) / "last.ckpt") == 6
        assert not (tmp_path / "mlflow.db").exists()


# ---- item 7: concurrency --------------------------------------------------------------------------
def test_two_fits_starting_together_on_a_new_sqlite_store_both_succeed(data, tmp_path):
    procs = [subprocess.Popen(lrattn(*fit_args(data, "--run_name", name, steps=2)), cwd=tmp_path, env=cli_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("lrattn").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b"]
    assert all(r.info.status == "FINISHED" and "train/loss" in r.data.metrics for r in runs)
    assert not list(tmp_path.glob(".mlflow.db.lock"))


def test_a_run_folder_held_by_a_live_process_is_refused_and_a_stale_lock_is_taken_over(data, tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    lock = tmp_path / "runs/lrattn" / RUN / ".lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, f'pid {os.getpid()} on a test host'.encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(fit_args(data, steps=2)) == 2
        err = capsys.readouterr().err
        assert f"run folder runs/lrattn/{RUN} is in use by pid {holder.pid} on a test host" in err
        assert "--run_name" in err and not (tmp_path / "mlflow.db").exists()
    finally:
        holder.kill()
        holder.wait()
    assert lock.exists()  # left by a killed process: stale, taken over
    assert main(fit_args(data, steps=2)) == 0
    assert not lock.exists() and step_of(ckpt_dir(tmp_path) / "last.ckpt") == 2


# ---- item 8: duplicate YAML keys --------------------------------------------------------------------
def test_duplicate_yaml_keys_are_errors_naming_both_lines(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (REPO_ROOT / "registry.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(text) if line.strip().startswith("n_layers:"))
    text.insert(at + 1, text[at])  # the same key again, on the next line
    (tmp_path / "registry.yaml").write_text("\n".join(text) + "\n")
    assert main(["list", "--registry", "registry.yaml"]) == 2
    assert f"registry.yaml: duplicate key 'n_layers' on line {at + 2} (first on line {at + 1})" in capsys.readouterr().err
    (tmp_path / "recipe.yaml").write_text("trainer:\n  max_steps: 2\n")
    (tmp_path / "sweep.yaml").write_text("doc: d\nrecipe: recipe.yaml\nsizes: [tiny]\nablations: [baseline]\n"
                                         "seeds: [0]\nseeds: [1]\n")
    assert main(["sweep", "sweep.yaml", "--dry-run"]) == 2
    assert "sweep.yaml: duplicate key 'seeds' on line 6 (first on line 5)" in capsys.readouterr().err
    (tmp_path / "recipe.yaml").write_text("trainer:\n  max_steps: 2\n  max_steps: 3\n")
    assert main(fit_args(data, "--config", "recipe.yaml")) == 2
    assert "recipe.yaml: duplicate key 'max_steps' on line 3 (first on line 2)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
