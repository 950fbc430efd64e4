"""Tracking stores that fail mid-run, and runs whose tracking a kill cut short: a real `mlflow server` killed
and started again, a real sqlite store on a tmpfs that fills up (root only), a fit SIGKILLed before its first
checkpoint, and `lrattn compare` on runs whose last validation is not at their last step.

The callbacks that act inside the training process are tests/run_hooks.py's ServerOutage and FillDiskAtStep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import RUN, ckpt_dir, fit_args, hooks, run_cli, run_process, step_of, the_run, tmpfs
from helpers.tracking import free_port
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from run_hooks import start_server

from lrattn_lightning.cli import main

STEPS = 12  # validations at steps 4, 8 and 12 (the final one)
VAL = ["--trainer.val_check_interval", "4", "--checkpoint_every", "4"]


@contextlib.contextmanager
def one_worker_server(folder: Path):
    """A real `mlflow server` with one worker (four take minutes to start on a busy 2-core machine) in its own
    process group: (its command, uri, a file holding the pid of the process group to kill). Stopped on exit."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
               "--artifacts-destination", str(folder / "art")]
    uri, pidfile = f"http://127.0.0.1:{port}", folder / "server.pid"
    start_server(command, str(folder), uri, pidfile)
    try:
        yield command, uri, pidfile
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pidfile.read_text()), signal.SIGKILL)


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def mlflow_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "MLflow" in line and line.startswith("[lrattn]")]


# ---- item 5: a server that dies and comes back ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("retry", ["0", "30"])
def test_a_server_back_mid_run_gets_everything_and_compare_reads_the_last_validation(data, tmp_path, retry):
    """Killed before step 5 (after the step-4 validation), back before step 9 of 14. With checks at every call
    ("0") the logger notices at step 9; with the default 30 s it may notice only when the fit ends, before the
    final validation at 14 (which `lrattn fit` runs after the fit). Either way the run is FINISHED with every
    train/loss step and the validations at 4, 8, 12 and 14 (the issue: val/loss at step 4 only, reported by
    compare as the result)."""
    steps = 14
    with one_worker_server(tmp_path) as (command, uri, pidfile):
        config = hooks(tmp_path, "outage.yaml", ("ServerOutage", {"down": 5, "up": 9, "pidfile": str(pidfile),
                                                                  "command": command, "cwd": str(tmp_path), "uri": uri}))
        env = {} if retry == "30" else {"LRATTN_TRACKING_RETRY_S": retry}
        proc = run_cli(fit_args(data, *VAL, "--tracking_uri", uri, "--config", config, steps=steps), tmp_path, **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = mlflow_warnings(proc.stderr)
        assert len(lines) == 2, lines  # the outage, then its end
        assert f"MLflow {uri} failed at step 5" in lines[0] and "held in memory" in lines[0]
        assert f"MLflow {uri} is back at step" in lines[1] and "since step 5" in lines[1]
        back = int(lines[1].split("is back at step ")[1].split(":")[0])
        assert back == 9 if retry == "0" else 9 <= back <= steps
        client, run = the_run(tmp_path, uri=uri)
        assert run.info.status == "FINISHED"
        assert steps_of(client, run.info.run_id, "train/loss") == list(range(steps))
        assert steps_of(client, run.info.run_id, "val/loss") == [4, 8, 12, 14]
        gap = run.data.tags["lrattn.tracking_gap"]
        assert gap.startswith("MLflow unreachable at steps 5-") and "nothing was lost" in gap, gap
        assert run.data.tags["lrattn.last_step"] == str(steps)
        final = max(client.get_metric_history(run.info.run_id, "val/loss"), key=lambda m: m.step).value
        assert main(["compare", "--experiment", "lrattn", "--tracking_uri", uri, "--out", str(tmp_path / "rep"),
                     "--no-summary-run"]) == 0
        table = (tmp_path / "rep/table.csv").read_text().splitlines()
        assert float(table[1].split(",")[4]) == pytest.approx(final, abs=1e-9)
        assert "Not counted" not in (tmp_path / "rep/table.md").read_text()


# ---- item 6: the local store's disk fills up --------------------------------------------------------
@pytest.mark.parametrize("free", [None, 6])
def test_a_full_store_disk_is_one_warning_and_training_goes_on(data, tmp_path, free):
    """The sqlite store on its own 16 MB tmpfs, filled before step 3 (the issue: 31,083 stderr lines, 698
    tracebacks, a warning quoting sqlalchemy's 'Query-invoked autoflush', the run left RUNNING without a word).
    Checkpoints live on another disk and are written throughout. Freed before step 6: everything is written."""
    with tmpfs(tmp_path / "store", "size=16m") as store:
        db = store / "mlflow.db"
        config = hooks(tmp_path, "fill.yaml", ("FillDiskAtStep", {"step": 3, "folder": str(store), "free": free}))
        proc = run_cli(fit_args(data, *VAL, "--tracking_uri", f"sqlite:///{db}", "--config", config, steps=STEPS),
                       tmp_path, LRATTN_TRACKING_RETRY_S="0")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "autoflush" not in proc.stderr
        assert len(proc.stderr.splitlines()) < 30, proc.stderr[-3000:]
        lines = mlflow_warnings(proc.stderr)
        assert len(lines) == 2, lines
        assert lines[0].startswith(f"[lrattn] warning: MLflow store sqlite:///{db} failed at step 3: the disk holding "
                                   f"{db} is full (database or disk is full)"), lines[0]
        assert "training and checkpoints continue" in lines[0]
        assert step_of(ckpt_dir(tmp_path) / "last.ckpt") == STEPS
        client, run = the_run(tmp_path, uri=f"sqlite:///{db}")
        if free is None:
            assert "stays RUNNING" in lines[1] and f"the disk holding {db} still full" in lines[1], lines[1]
            assert run.info.status == "RUNNING"
            assert steps_of(client, run.info.run_id, "train/loss") == [0, 1, 2]
        else:
            assert f"is back at step {free}" in lines[1], lines[1]
            assert run.info.status == "FINISHED"
            assert steps_of(client, run.info.run_id, "train/loss") == list(range(STEPS))
            assert steps_of(client, run.info.run_id, "val/loss") == [4, 8, 12]
            assert run.data.tags["lrattn.tracking_gap"].startswith("MLflow failing at steps 3-6")


# ---- item 8: a fit killed before its first checkpoint -----------------------------------------------
def test_a_run_left_running_by_a_killed_fit_is_marked_killed_by_the_next_start(data, tmp_path, monkeypatch, capsys):
    """SIGKILL at step 1, before the first checkpoint: its MLflow run stays RUNNING. A start of another run
    folder of the same name, or one refused because a live process holds the folder, leave it alone; the
    next start of its own folder marks it KILLED, says why, and makes the one new run."""
    killed = run_process(fit_args(data, "--config", hooks(tmp_path, "kill.yaml", ("KillAtStep", {"step": 1})), steps=4),
                         tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    client, orphan = the_run(tmp_path)
    assert orphan.info.status == "RUNNING" and not list(ckpt_dir(tmp_path).glob("*.ckpt"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    assert main(fit_args(data, "--runs_dir", "elsewhere", steps=2)) == 0  # the same name, another folder
    assert "left RUNNING" not in capsys.readouterr().err
    assert client.get_run(orphan.info.run_id).info.status == "RUNNING"

    lock = tmp_path / "runs/lrattn" / RUN / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(fit_args(data, steps=2)) == 2  # a live holder: refused before touching MLflow
        assert "is in use by" in capsys.readouterr().err
        assert client.get_run(orphan.info.run_id).info.status == "RUNNING"
    finally:
        holder.kill()
        holder.wait()

    assert main(fit_args(data, steps=2)) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "left RUNNING" in line]
    assert lines == [f"[lrattn] MLflow run {orphan.info.run_id} ('{RUN}') was left RUNNING by a fit of runs/lrattn/"
                     f"{RUN} that was killed before it could end it; marked KILLED"], lines
    ended = client.get_run(orphan.info.run_id)
    assert ended.info.status == "KILLED" and "died without ending it" in ended.data.tags["lrattn.killed_reason"]
    exp = client.get_experiment_by_name("lrattn")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'RUNNING'")
    assert runs == []  # the new runs (here and elsewhere) are FINISHED, the orphan KILLED


# ---- item 5: compare leaves out a run whose last validation is not at its last step -----------------
def _finished_run(client: MlflowClient, exp: str, seed: int, val: dict[int, float], train_steps: int,
                  max_steps: int | None, last_step: int | None = None, gap: str | None = None) -> str:
    tags = {"seed": str(seed), "control": "none", "mlflow.runName": f"tiny-baseline-seed{seed}",
            "lrattn.recipe": "one-recipe", "lrattn.recipe_parts": "{}"}  # (as a fit tags it: one recipe, pooled)
    tags.update({"lrattn.last_step": str(last_step)} if last_step else {})
    tags.update({"lrattn.tracking_gap": gap} if gap else {})
    run_id = client.create_run(exp).info.run_id
    params = {"ablation": "baseline", "size": "tiny", "params": "1000", "added_flops_pct": "0.0"}
    params.update({"train_max_steps": str(max_steps)} if max_steps is not None else {})
    metrics = [Metric("train/loss", 5.0 - s / 10, 1000 + s, s) for s in range(train_steps)]
    metrics += [Metric("val/loss", v, 2000 + s, s) for s, v in val.items()]
    client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(run_id, "FINISHED")
    return run_id


def test_compare_leaves_out_runs_whose_last_validation_is_not_their_last_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("cmp")
    _finished_run(client, exp, 0, {4: 3.9, 8: 3.5, 12: 3.1}, 12, max_steps=12, last_step=12)
    _finished_run(client, exp, 1, {4: 3.2768}, 5, max_steps=12, gap="MLflow unreachable at steps 5-")  # the issue
    _finished_run(client, exp, 2, {12: 3.0}, 12, max_steps=None)  # no max_steps: train/loss ends at 11 -> 12
    _finished_run(client, exp, 3, {4: 3.4}, 8, max_steps=-1)  # max_epochs decided: train/loss ends at 7 -> 8
    _finished_run(client, exp, 4, {8: 3.2}, 8, max_steps=12, last_step=8)  # stopped by max_time at 8: fine
    assert main(["compare", "--experiment", "cmp", "--tracking_uri", uri, "--out", "rep", "--no-summary-run"]) == 0
    out = capsys.readouterr().out
    row = (tmp_path / "rep/table.csv").read_text().splitlines()[1].split(",")
    assert row[2:4] == ["3", "0;2;4"] and float(row[4]) == pytest.approx((3.1 + 3.0 + 3.2) / 3)
    note = ("Not counted: 2 FINISHED runs whose last validation is not at their last step, so their val/loss is "
            "an earlier value, not their result: `tiny-baseline-seed1` (val/loss last at step 4 of 12; "
            "lrattn.tracking_gap: MLflow unreachable at steps 5-); `tiny-baseline-seed3` (val/loss last at step 4 "
            "of 8).")
    table_md = (tmp_path / "rep/table.md").read_text()
    assert note in table_md and note in out and note in (tmp_path / "rep/report.md").read_text()
    assert table_md.index(note) > table_md.index("(0,2,4")  # under the table
    assert "3.2768" not in table_md.split("Not counted")[0]

    only_stale = client.create_experiment("stale")
    _finished_run(client, only_stale, 0, {4: 3.2768}, 5, max_steps=12)
    assert main(["compare", "--experiment", "stale", "--tracking_uri", uri, "--out", "rep2", "--no-summary-run"]) == 2
    err = capsys.readouterr().err
    assert ("lrattn: error: experiment 'stale' has no FINISHED training runs with val/loss at their last step "
            "(1 whose last validation is earlier: tiny-baseline-seed0)") in err


def test_a_bad_retry_interval_is_one_line_before_any_work(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("LRATTN_TRACKING_RETRY_S", "soon")
    assert main(fit_args(data, steps=2)) == 2
    assert "lrattn: error: $LRATTN_TRACKING_RETRY_S='soon': give the seconds" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
