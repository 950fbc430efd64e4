"""How a fit ends, told honestly: diverged, stopped after its last step, killed right after a save.

Real `lrattn fit` commands (a real process where a signal comes), real signals and a real MLflow store. A run whose
loss turns non-finite never keeps the state that produced it as last.ckpt and ends FAILED with a tag. One run is then
killed and stopped in turn: a SIGKILL right after a checkpoint is written loses no metric; a stop signal that arrives
after the last step but before the final validation ends the run KILLED (exit 128 + N) and the resume runs that
validation; one after the final validation changes nothing (FINISHED, exit 0).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from helpers.runs import (
    REGISTRY,
    assert_same_run,
    fit_args,
    histories,
    hooks,
    metric_history,
    run_cli,
    run_process,
    step_of,
    stop_line,
    the_run,
)

# every test's fits log to tmp_path's store, seeded (conftest.py mlflow_store): their point is not a new store's set-up
pytestmark = pytest.mark.usefixtures("mlflow_store")

STEPS = 5  # validations at 2 and 4 inside the fit, the final one at 5 after it (LRAttnCLI.after_fit)
RUN = "tiny-baseline-seed0"


def args(data: Path, *extra: str) -> list[str]:
    return fit_args(data, "--experiment", "run", *extra, steps=STEPS, every=1)


def checkpoints(folder: Path) -> Path:
    return folder / "runs" / "run" / RUN / "checkpoints"


@pytest.fixture(scope="module")
def uninterrupted(data, seeded_folder) -> dict[str, list[tuple[int, float]]]:
    folder = seeded_folder("uninterrupted")
    done = run_cli(args(data), folder)
    assert done.returncode == 0, done.stderr[-3000:]
    full = histories(folder)
    assert [s for s, _ in full["val/loss"]] == [2, 4, 5]
    assert [s for s, _ in full["train/loss"]] == list(range(STEPS))
    return full


def test_divergence_sets_the_bad_state_apart_and_fails_the_run(data, tmp_path):
    """An absurd learning rate: the step whose loss is non-finite had its checkpoint written (a save every step);
    that state is set apart, last.ckpt is the step before (finite weights, a finite loss), the run is FAILED and
    tagged, and evaluation commands refuse the diverged file in one line."""
    done = run_cli(args(data, "--model.lr", "1e6", "--model.muon_lr", "1e6", "--trainer.max_steps", "40"), tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    line = stop_line(done.stderr)
    # where it shows first depends on the CPU's arithmetic (a Xeon: a training loss; an AMD EPYC with AVX2: the
    # validation after a finite training step): either way that step is set apart
    found = re.search(r"non-finite (training|validation) loss \(\w+\) at step (\d+); its checkpoint is set apart as "
                      r"diverged-step(\d{6})\.ckpt; the last finite state is step (\d+) \(", line)
    assert found, line
    which, step, kept = found.group(1), int(found.group(2)), int(found.group(4))
    assert int(found.group(3)) == step and kept == step - 1 and "lower learning rate" in line
    folder = checkpoints(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [f"diverged-step{step:06d}.ckpt", "last.ckpt"]
    last = torch.load(folder / "last.ckpt", weights_only=True)
    assert last["global_step"] == kept
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())
    client, run = the_run(tmp_path, "run")
    assert run.info.status == "FAILED"
    assert re.fullmatch(rf"non-finite {which} loss \(\w+\) at step {step}", run.data.tags["lrattn.diverged"])
    results = {k: v for k, v in run.data.metrics.items() if k.startswith(("val/", "train/loss", "train/ce"))}
    assert "val/loss" in results and all(v == v for v in results.values()), results  # no NaN logged as a result

    # the set-apart state: its weights are finite (huge) or not; either way one line, nothing logged
    diverged = folder / f"diverged-step{step:06d}.ckpt"
    gen = run_cli(["generate", "--checkpoint", str(diverged), "--prompt", "x"], tmp_path)
    assert gen.returncode == 2 and "Traceback" not in gen.stderr, gen.stderr[-2000:]
    assert re.search(r"non-finite (weights|logits)", gen.stderr) and "diverged" in gen.stderr
    before = len(client.search_runs([run.info.experiment_id]))
    val = run_cli(["validate", "--ckpt_path", str(diverged), "--registry", REGISTRY, "--data.data_dir", str(data),
                   "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"], tmp_path)
    assert val.returncode == 3, val.stderr[-2000:]
    assert "non-finite validation loss" in stop_line(val.stderr)
    run = client.get_run(run.info.run_id)
    assert not any(k.startswith("validate/val") for k in run.data.metrics) and run.info.status == "FAILED"
    assert len(client.search_runs([run.info.experiment_id])) == before


# the chain's stops after the last step, in turn: (during, batch) of run_hooks.SignalAt and the exit code
LATE_STOPS = (
    ("train_end", 0, 143),  # after the last step's save, before the final validation
    ("final_validation", 0, 143),  # in its first batch: it stops, and runs again whole on resume
    ("final_validation", 1, 0),  # in its last batch: it completes; the run is FINISHED, nothing to resume
)


def test_a_kill_after_a_save_loses_no_metric_and_each_late_stop_ends_as_the_run_did(data, tmp_path, uninterrupted):
    """One run, a real process each time, continued by the same command with --ckpt_path last.

    - SIGKILL right after step 3's save. Lightning logs a step's metrics after the checkpoint callbacks, so a process
      killed between the save and that logging once resumed after step 2's metrics and never logged step 3's; they
      are logged before the save now.
    - Then each of LATE_STOPS. The first resume trains steps 3 and 4 and is stopped after its last step's save; the
      next two resume at step 5 and only run the final validation. A stop before that validation completes exits
      143, the run KILLED, last.ckpt holding step 5; one in its last batch changes nothing (FINISHED, exit 0).
    - The run then holds what the uninterrupted one logged: val/loss at 2, 4 and 5 (not validate/val/loss), every
      metric once and equal."""
    last = checkpoints(tmp_path) / "last.ckpt"
    kill = hooks(tmp_path, "kill.yaml", ("KillBeforeStepLog", {"step": 3}))
    killed = run_process(args(data, "--config", kill), tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert step_of(last) == 3
    for during, batch, code in LATE_STOPS:
        stop = hooks(tmp_path, f"stop-{during}-{batch}.yaml",
                     ("SignalAt", {"step": 0, "during": during, "batch": batch}))
        stopped = run_process(args(data, "--ckpt_path", "last", "--config", stop), tmp_path)
        assert stopped.returncode == code, (during, batch, stopped.stderr[-3000:])
        client, run = the_run(tmp_path, "run")
        assert step_of(last) == STEPS
        if code:
            assert stop_line(stopped.stderr) == (f"lrattn: stopped by SIGTERM at step {STEPS}; checkpoint {last} "
                                                 "holds it, continue with --ckpt_path last")
            assert run.info.status == "KILLED"
            assert [step for step, _ in metric_history(client, run.info.run_id, "val/loss")] == [2, 4]
        else:
            assert "[lrattn] SIGTERM came after the run finished; nothing was lost" in stopped.stderr
    assert run.info.status == "FINISHED"
    assert_same_run(tmp_path, uninterrupted)


def test_a_resume_whose_first_loss_is_non_finite_sets_the_file_it_resumed_from_apart(data, tmp_path):
    """last.ckpt of a finished run planted with its weights times infinity (inf or NaN: weights a learning rate too
    high could leave in a run killed between a save and the next step), trained on from it: the loss of the step it
    resumed at is non-finite. Those weights are the file it resumed from, so that file is set apart, as one this process had saved
    would be; the finished run kept no previous state, so none is left, and the line says so."""
    assert run_cli(args(data), tmp_path).returncode == 0
    last = checkpoints(tmp_path) / "last.ckpt"
    state = torch.load(last, weights_only=True)
    state["state_dict"] = {k: v * float("inf") if v.is_floating_point() else v for k, v in state["state_dict"].items()}
    torch.save(state, last)
    done = run_cli(args(data, "--ckpt_path", "last", "--model.schedule_steps", str(STEPS), "--trainer.max_steps",
                        str(STEPS + 2)), tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    assert re.search(rf"non-finite (training|validation) loss \(\w+\) at step {STEPS}; its checkpoint is set apart as "
                     rf"diverged-step{STEPS:06d}\.ckpt; no checkpoint of a finite state is left", stop_line(done.stderr))
    assert sorted(p.name for p in last.parent.iterdir()) == [f"diverged-step{STEPS:06d}.ckpt"]
