"""Interruptions named as they happened, in every command that runs long: demo, fit, sweep, prepare, eval (issue 38).

A real signal from outside to a real `lrattn` process, or to its whole process group where the command starts
children (a sweep's fits, prepare's tokenizer workers, eval's ranks), as a terminal sends Ctrl-C to its foreground
job (a fit's DDP ranks: test_resilience.py, SIGINT to every rank). SIGINT ends the command with exit 130 and one
line saying SIGINT stopped it; SIGTERM with 143 and its own line; a stopped training run is KILLED in MLflow, with
last.ckpt at the step it reached. The commands a stopped demo run and the finished one print (continue, score it)
are run as printed, from the same folder; the command a stopped sweep prints is the one that ran (that command
rerun after a stop: test_sweep_parallel.py). Prepare's SIGINT, to it and to its group with its tokenizer workers,
rides the chain of interruptions in test_data_interrupted.py, which continues from each.

Each process is paused at an exact point (tests/run_hooks.py PauseAt, or a wrapper around eval's scoring) while
the signal is sent, so nothing depends on timing.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.cli import cli_env
from helpers.prepare import gone, prepared_corpus
from helpers.runs import REGISTRY, fit_args, hooks, lrattn, run_cli, step_of
from mlflow.tracking import MlflowClient

# what a short run needs of cpu-demo.yaml's recipe (150 steps of `small`) to be one of `tiny`
TINY = ["--registry", REGISTRY, "--trainer.max_steps", "6", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "2", "--data.batch_size", "2", "--checkpoint_every", "2",
        "--model.warmup_steps", "2", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """60 documents of the bundled corpus, with the local eval tasks (`--tasks local`)."""
    return prepared_corpus(tmp_path_factory, 60, cloze_items=8, perplexity_documents=2)


def launch(cmd: list[str], cwd: Path, group: bool, env: dict[str, str] | None = None):
    """A real process: in a process group of its own when `group` (a terminal's foreground job: its children are
    in it too), else in the tests' group. SIGINT is not ignored in it."""
    env = env or cli_env()
    if group:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def send(proc, signum: int, group: bool) -> None:
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)


def wait_for(paths: list[Path], proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{paths} never appeared"
        time.sleep(0.05)


def pause(folder: Path, step: int) -> tuple[str, Path, Path]:
    """A --config that pauses a fit before optimizer step `step` (touching `marker`) until `go` exists."""
    marker, go = folder / "paused", folder / "go"
    return hooks(folder, "pause.yaml", ("PauseAt", {"step": step, "marker": str(marker), "go": str(go)})), marker, go


def one_line(stderr: str, start: str = "lrattn:") -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(start)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def printed_command(text: str) -> list[str]:
    """The `lrattn ...` command a line prints (between backticks, or after 'score it:'), as argv for lrattn()."""
    shown = text.split("`")[1] if "`" in text else text.split("score it:", 1)[1]
    words = shlex.split(shown)
    assert Path(words[0]).name == "lrattn", shown
    return words[1:]


def runs(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, experiment
    return [r for r in client.search_runs([found.experiment_id]) if "lrattn.summary" not in r.data.tags]


# ---- demo ---------------------------------------------------------------------------------------------------
def test_demo_stopped_names_the_signal_and_its_printed_commands_continue_and_score_the_run(data, tmp_path):
    """Ctrl-C exited 0 with no line and the run KILLED; now 130 and one line naming SIGINT and the command that
    continues this demo run (its generated name, the store and paths given). That command finishes the same run,
    and the 'score it' line it ends with scores it into the same store (it sent the scores to ./mlflow.db). (SIGTERM
    to a fit: test_signals.py; the demo's stop is the fit's.)"""
    name = "SIGINT"
    config, marker, go = pause(tmp_path, 2)
    uri = "sqlite:///elsewhere.db"
    proc = launch(lrattn("demo", "--size", "tiny", "--ablation", "baseline", "--data", str(data), *TINY,
                         "--tracking_uri", uri, "--config", config), tmp_path, group=False)
    wait_for([marker], proc)
    send(proc, signal.Signals[name], group=False)
    go.touch()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.Signals[name], err[-3000:]
    line = one_line(err)
    assert line.startswith(f"lrattn: stopped by {name} at step 3; checkpoint "), line
    (run,) = runs(f"sqlite:///{tmp_path / 'elsewhere.db'}", "cpu-demo")
    assert run.info.status == "KILLED" and not (tmp_path / "mlflow.db").exists()
    ckpt = tmp_path / "runs" / "cpu-demo" / run.info.run_name / "checkpoints" / "last.ckpt"
    assert step_of(ckpt) == 3
    again = printed_command(line)
    assert again[:1] == ["demo"] and again[-2:] == ["--ckpt_path", "last"], again
    assert again[again.index("--run_name") + 1] == run.info.run_name and again[again.index("--tracking_uri") + 1] == uri
    done = run_cli(again, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "never trained" not in done.stdout, done.stdout  # the demo's own corpus and size: not the user's concern
    (resumed,) = runs(f"sqlite:///{tmp_path / 'elsewhere.db'}", "cpu-demo")
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED" and step_of(ckpt) == 6
    score = printed_command(next(line for line in done.stdout.splitlines() if line.startswith("[lrattn demo] score it:")))
    scored = run_cli(score, tmp_path)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert f"to training run {run.info.run_id}" in scored.stdout, scored.stdout[-2000:]
    (evaluated,) = runs(f"sqlite:///{tmp_path / 'elsewhere.db'}", "cpu-demo")
    assert "eval/lrattn_cloze/acc" in evaluated.data.metrics and not (tmp_path / "mlflow.db").exists()


# ---- sweep --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, group", [("SIGINT", True), ("SIGTERM", False)])  # each signal, each way it comes
def test_a_stopped_sweep_names_the_signal_and_the_command_that_continues_it(data, tmp_path, name, group):
    """Ctrl-C to a sweep went on to its fit as SIGTERM and was reported as 'stopped by SIGTERM', exit 143. Now the
    fit gets the signal that came (to the sweep, or to the whole group, as a terminal sends it), the run is KILLED at
    the step it reached, no further run starts, the exit is 128 + N and the last line names the signal and the
    command that continues the sweep: the same command, whatever the signal. (That the same command after a SIGINT
    resumes the stopped runs and finishes the sweep: test_sweep_parallel.py's stop test, which runs it.)"""
    config, marker, go = pause(tmp_path, 2)
    recipe = {"trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 4, "val_check_interval": 2,
                          "limit_val_batches": 2, "num_sanity_val_steps": 0, "log_every_n_steps": 1,
                          "enable_model_summary": False},
              "model": {"warmup_steps": 1}, "data": {"data_dir": str(data), "batch_size": 2}, "checkpoint_every": 2}
    recipe["trainer"]["callbacks"] = yaml.safe_load(Path(config).read_text())["trainer"]["callbacks"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "stops", "doc": "a sweep stopped by a signal", "recipe": "recipe.yaml", "registry": REGISTRY,
        "sizes": ["tiny"], "ablations": ["baseline"], "seeds": [0, 1], "env": {"OMP_NUM_THREADS": "1"}}))
    uri = f"sqlite:///{tmp_path / 'sweeps.db'}"
    proc = launch(lrattn("sweep", "sweep.yaml", "--tracking_uri", uri), tmp_path, group=group)
    wait_for([marker], proc)
    send(proc, signal.Signals[name], group)
    go.touch()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.Signals[name], out[-3000:] + err[-3000:]
    lines = out.strip().splitlines()
    assert "Traceback" not in err and not any(other in out for other in ("SIGTERM", "SIGINT") if other != name), out
    assert f"[sweep stops] tiny-baseline-seed0: stopped by {name} at step 3 after " in out, out
    assert "0 failed, 1 stopped" in out and "1 not started" in out, out
    assert lines[-1].startswith(f"[sweep stops] stopped by {name}: no further runs start; continue with `"), lines[-1]
    (run,) = runs(uri, "stops")
    assert run.info.run_name == "tiny-baseline-seed0" and run.info.status == "KILLED"
    assert step_of(tmp_path / "runs" / "stops" / "tiny-baseline-seed0" / "checkpoints" / "last.ckpt") == 3
    if group:  # the fit went with the group: no process of this folder is left
        assert gone(str(tmp_path))
    assert printed_command(lines[-1]) == ["sweep", "sweep.yaml", "--tracking_uri", uri]  # the command that ran


# ---- eval ---------------------------------------------------------------------------------------------------
# `lrattn eval` with a pause before it scores (in every rank: `paused-RANK`), as a script: its ranks re-run it.
# Stopped there, rank 0 of two ends 6 s after rank 1: Lightning's watch over the ranks it launched (a 5-s poll)
# would see rank 1's exit first and SIGKILL rank 0.
EVAL_PAUSED = """import os, sys, time
from lrattn_lightning.eval import lm
scoring = lm._Progress.__init__
def paused(self, *args, **kwargs):
    folder = os.path.dirname(os.path.abspath(__file__))
    rank = os.environ.get("LOCAL_RANK", "0")
    open(os.path.join(folder, "paused-" + rank), "w").close()
    try:
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
    except BaseException:
        if rank == "0" and sys.argv[sys.argv.index("--devices") + 1] != "1":
            time.sleep(6)
        raise
    scoring(self, *args, **kwargs)
lm._Progress.__init__ = paused
from lrattn_lightning.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("trained")
    done = run_cli(fit_args(data, steps=2), folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "runs" / "lrattn" / "tiny-baseline-seed0" / "checkpoints" / "last.ckpt", f"sqlite:///{folder}/mlflow.db"


@pytest.mark.parametrize("name, group, devices", [("SIGTERM", False, 1), ("SIGINT", True, 2)])  # each signal, each way
def test_a_stopped_eval_names_the_signal_and_logs_nothing(checkpoint, tmp_path, name, group, devices):
    """Ctrl-C was a KeyboardInterrupt traceback and SIGTERM a silent kill: now one line naming the signal, 128 + N,
    nothing logged; to the group of a two-rank eval, every rank ends and still only one line is printed."""
    ckpt, uri = checkpoint
    script = tmp_path / "eval_paused.py"
    script.write_text(EVAL_PAUSED)
    cmd = [sys.executable, str(script), "eval", "--checkpoint", str(ckpt), "--tasks", "local", "--limit", "4",
           "--tracking_uri", uri, "--devices", str(devices), "--accelerator", "cpu"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=group,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for([tmp_path / f"paused-{rank}" for rank in range(devices)], proc)
    send(proc, signal.Signals[name], group)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.Signals[name], err[-3000:]
    assert one_line(err) == (f"lrattn: eval stopped by {name}; nothing was logged; run the same command again to "
                             "evaluate")
    (run,) = runs(uri, "lrattn")
    assert not any(key.startswith("eval/") for key in run.data.metrics)
    if group:
        assert gone(str(script))


def test_ctrl_c_where_a_command_does_not_take_it_is_one_line(checkpoint, tmp_path):
    """`lrattn chat` waiting for a line (as any command while its module is imported): Ctrl-C was a
    KeyboardInterrupt traceback; now one line and 130."""
    ckpt, _ = checkpoint
    proc = subprocess.Popen(lrattn("chat", "--checkpoint", str(ckpt)), cwd=tmp_path, env=cli_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().startswith("lrattn chat:")  # then it waits for the first line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and one_line(err) == "lrattn: chat stopped by SIGINT", err[-3000:]
