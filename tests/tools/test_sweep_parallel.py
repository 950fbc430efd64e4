"""`lrattn sweep FILE --parallel N` and emitted command files that run as written (issue 55): real `lrattn fit`
processes on a tiny corpus, a real sqlite MLflow store, a real signal to a sweep process, the scaling study's own
xargs line from another folder without the venv on PATH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.cli import cli_env, in_process
from helpers.paths import REPO_ROOT, SWEEP_HOOKS
from helpers.prepare import prepared_corpus
from helpers.runs import sweep_runs, write_sweep
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main

XARGS = "xargs -P 2 -d '\\n' -I{} sh -c '{}'"  # GNU xargs: each line to sh with its quotes (tools/sweep/sweep.py)



@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepared_corpus(tmp_path_factory, 80)


def probed_sweep(folder: Path, data: Path, probe: Path, hold_step: int | None = None, **changes) -> Path:
    """write_sweep's sweep with sweep_hooks.SweepProbe in its recipe and no OMP_NUM_THREADS of its own."""
    path = write_sweep(folder, data, env={"PYTHONPATH": str(SWEEP_HOOKS)}, **changes)
    probe.mkdir()
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    recipe["trainer"]["callbacks"] = [{"class_path": "sweep_hooks.SweepProbe",
                                       "init_args": {"folder": str(probe), "hold_step": hold_step}}]
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return path


def test_a_stop_signal_stops_every_running_fit_and_the_same_command_resumes_them(data_dir, tmp_path):
    """SIGINT to a `lrattn sweep --parallel 2` process of three runs while its first two fits train: both get it, save
    last.ckpt and stop; the sweep waits for them, prints a line per stopped run, starts no third and exits 130. The
    same command again resumes both from their checkpoints into their own MLflow runs and finishes them, and the
    third: two fits at once, never more, each on one thread whatever OMP_NUM_THREADS the sweep was given, their own
    lines only in their logs."""
    probe = tmp_path / "probe"
    names = [f"tiny-baseline-seed{seed}" for seed in range(3)]
    path = probed_sweep(tmp_path, data_dir, probe, hold_step=1, ablations=["baseline"], seeds=[0, 1, 2])
    env = cli_env()  # no store; and sweep_hooks importable: the sweep checks the recipe's callback itself
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SWEEP_HOOKS), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "2"  # what the fits would inherit; the sweep's env does not set it
    command = [sys.executable, "-m", "lrattn_lightning.cli", "sweep", str(path), "--parallel", "2"]
    # real processes, as a user's: the sweep and the fits it starts
    sweep = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while len(list(probe.glob("*.ready"))) < 2:  # both fits hold before step 1: two at once
        assert sweep.poll() is None and time.time() < deadline, sweep.communicate()[0] if sweep.poll() else "timeout"
        time.sleep(0.1)
    sweep.send_signal(signal.SIGINT)
    time.sleep(1.0)  # the signal forwarded while both still hold
    (probe / "release").touch()
    out = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 130, out
    for name in names[:2]:
        assert out.count(f"] {name}: stopped by SIGINT at step ") == 1, out  # its own line, as it stopped
        assert (tmp_path / "runs/sweep-test" / name / "checkpoints/last.ckpt").is_file()
    assert "done: 0 ran, 0 failed, 2 stopped" in out and "stopped by SIGINT: no further runs start" in out, out
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    stopped = {r.info.run_name: r for r in sweep_runs(uri)}
    assert sorted(stopped) == names[:2] and {r.info.status for r in stopped.values()} == {"KILLED"}

    # the same command (here: in process; its fits are processes)
    again = in_process(command[3:], tmp_path, PYTHONPATH=env["PYTHONPATH"], OMP_NUM_THREADS="2")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert "3 to run, 2 at once (OMP_NUM_THREADS=1 each)" in out, out
    assert out.count("(resuming from last.ckpt)") == 2 and "done: 3 ran, 0 failed" in out, out
    # the terminal: one line as each run starts, one as it ends; the fits' own lines only in their logs
    assert out.count("training; its output goes to") == 3 and out.count(": ok after") == 3, out
    assert "train/loss" not in out, out
    after = {r.info.run_name: r for r in sweep_runs(uri)}
    assert sorted(after) == names and {r.info.status for r in after.values()} == {"FINISHED"}
    assert {n: after[n].info.run_id for n in stopped} == {n: r.info.run_id for n, r in stopped.items()}
    assert all("[lrattn fit] step " in (tmp_path / "runs/sweep-test" / name / "fit.log").read_text() for name in names)
    # two at once, never more: the most MLflow runs open at one time (a stopped run's from its start to its end
    # after the resume; the third started when one of them had finished)
    events = sorted([(r.info.start_time, 1) for r in after.values()] + [(r.info.end_time, -1) for r in after.values()])
    open_runs = [sum(d for _, d in events[:k + 1]) for k in range(len(events))]
    assert max(open_runs) == 2, events
    # each hold at step 1 passed: the two stopped fits' (together, above), the third's; the resumed start past it
    assert [json.loads(p.read_text()) for p in probe.glob("*.held")] == [True] * 3
    seen = [json.loads(p.read_text()) for p in probe.glob("*.json")]  # two stopped fits, three after
    assert len(seen) == 5 and all(s["omp"] == "1" and s["threads"] == 1 for s in seen), seen
    client = MlflowClient(uri)
    for run in after.values():  # every step logged once over the stop and the resume
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1, 2]


def test_parallel_below_one_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, tmp_path / "no-data")
    assert main(["sweep", str(path), "--parallel", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["lrattn: error: --parallel 0: the number of fits to run at once, 1 or more"]


def test_emitted_commands_run_as_written_from_another_folder(data_dir, tmp_path, monkeypatch):
    """The scaling study's recipe (docs/scaling-study.md): the command file emitted in the study's folder, run with
    the doc's own xargs line from another folder whose shell has no venv on PATH: `--run_tags`' JSON survives, the
    fit finds the recipe and writes its run and store where the sweep would have. One run: what is checked is the
    line as written (fits at once into one store: the stop test's resume above)."""
    work, elsewhere = tmp_path / "study", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    write_sweep(work, data_dir, ablations=["baseline"], seeds=[1])
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["sweep", "sweep.yaml", "--emit", "commands", "--out", "all.sh"]) == 0
    text = (work / "all.sh").read_text()
    doc = (REPO_ROOT / "docs/scaling-study.md").read_text()
    line = next(li for li in doc.splitlines() if "| xargs " in li).split("#")[0].strip()
    (elsewhere / "all.sh").write_text(text)
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "-c", line], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = sweep_runs(f"sqlite:///{work}/mlflow.db")
    assert [r.info.run_name for r in runs] == ["tiny-baseline-seed1"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert {(r.data.tags["sweep"], r.data.tags["seed"]) for r in runs} == {("two-by-two", "1")}
    assert sorted(p.name for p in elsewhere.iterdir()) == ["all.sh"]  # nothing written where it was run from
    assert line == f"grep -v ladder-xl all.sh | {XARGS}"  # the doc's line, as the emitted header gives it
    assert f"it changes to {work.resolve()}" in text and f"#   {XARGS} < FILE" in text
