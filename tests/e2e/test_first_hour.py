"""What a researcher sees in the first hour: what `fit`, `validate`, `list` and MLflow show, and no noise.

Real runs (`lrattn` subprocesses from a scratch folder, a real sqlite MLflow store): the run page says what
ran (description, experiment kind), the metrics are the ones a researcher reads (rates, not Lightning's
running counters; evaluation rates at the training step they follow).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.runs import fit_args, run_cli
from mlflow.tracking import MlflowClient

COUNTERS = ("train/batches", "train/samples", "train/lengths", "train/time", "validate/batches", "validate/time")


@pytest.fixture(scope="module")
def fitted(data, seeded_folder):
    """One finished fit of `attnres-full` at `tiny` (6 steps, validations at 3 and 6; progress bar and model
    summary on, as a user sees them) and its MLflow run."""
    # (seeded: a new store's set-up lines are test_a_fits_terminal_holds_only_what_concerns_its_run's)
    folder = seeded_folder("first-hour")
    proc = run_cli(fit_args(data, "--ablation", "attnres-full", "--trainer.val_check_interval", "3",
                            "--trainer.enable_progress_bar", "true", "--trainer.enable_model_summary", "true",
                            steps=6, every=3), folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lrattn")
    run = client.search_runs([experiment.experiment_id])[0]
    return folder, client, experiment, run, proc


def test_the_experiment_opens_in_the_training_view(fitted):
    _, _, experiment, _, _ = fitted
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"


def test_the_run_description_says_what_ran(fitted):
    _, _, _, run, _ = fitted
    text = run.data.tags["mlflow.note.content"]
    assert "**attnres-full** at size **tiny**" in text and "Full AttnRes" in text  # the entry's doc
    assert "Control: `baseline`" in text and "6 steps" in text and "parameters" in text
    from importlib.metadata import version

    assert run.data.tags["lrattn_version"] == version("lrattn-lightning")


def test_only_rates_are_logged_and_validation_rates_sit_at_training_steps(fitted):
    _, client, _, run, _ = fitted
    metrics = set(run.data.metrics)
    assert "train/device/items_per_sec" in metrics and "validate/device/items_per_sec" in metrics
    assert not metrics & set(COUNTERS), metrics & set(COUNTERS)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "validate/device/items_per_sec")]
    val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")]
    assert steps == val_steps == [3, 6]


def test_a_fit_ends_saying_what_it_reached_where_it_is_and_what_next(fitted):
    folder, _, experiment, run, proc = fitted
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[lrattn fit]")]
    val = {k: run.data.metrics[k] for k in ("val/loss", "val/bpb")}
    assert lines[0] == f"[lrattn fit] finished at step 6: val/bpb {val['val/bpb']:.4f}, val/loss {val['val/loss']:.4f}"
    assert f"MLflow run {run.info.run_id} ('tiny-attnres-full-seed0') in experiment 'lrattn'" in lines[1]
    assert lines[2].endswith(f"ui --backend-store-uri sqlite:///{folder / 'mlflow.db'}")
    assert lines[3] == f"[lrattn fit] then browse http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert lines[4] == (f"[lrattn fit] runs table: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs"
                        "?workflowType=machine_learning&compareRunsMode=TABLE&viewStateShareKey=lrattn-runs")
    assert "size 'tiny' has 512 token ids, the data's byte tokenizer uses 257: 255" in lines[5]
    ckpt = "runs/lrattn/tiny-attnres-full-seed0/checkpoints/last.ckpt"
    assert lines[6] == f"[lrattn fit] checkpoint {ckpt}" and (folder / ckpt).is_file()
    assert lines[7].endswith(f"eval --checkpoint {ckpt} --tasks local") and len(lines) == 8


def test_the_progress_bar_and_model_summary_say_nothing_misleading(fitted):
    _, _, _, run, proc = fitted
    out = proc.stdout + proc.stderr
    assert "Epoch 0/-2" not in out and "v_num" not in out and "Total FLOPs: 0" not in out, out[-3000:]
    assert "Total FLOPs:" in out and "step" in out and "6/6" in out, out[-3000:]
    assert "epoch" not in run.data.metrics  # Lightning's counter (--log_counters true logs it)


def test_a_fits_terminal_holds_only_what_concerns_its_run(data, tmp_path):
    """No echo of the run's own settings (`limit_val_batches=1.0` means all batches), of the module's callbacks
    replacing the CLI's, or of a new MLflow store's table set-up (issue 55)."""
    proc = run_cli(fit_args(data, "--trainer.limit_val_batches", "1.0", steps=2, every=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for noise in ("was configured so 100%", "configure_callbacks", "Creating initial MLflow database tables",
                  "Updating database tables"):
        assert noise not in out, out[-3000:]
    assert "[lrattn fit] finished at step 2" in proc.stdout


def test_validating_other_batches_logs_beside_the_fit_never_over_it(fitted, data):
    folder, client, _, run, _ = fitted
    before = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")]
    ckpt = folder / "runs/lrattn/tiny-attnres-full-seed0/checkpoints/last.ckpt"
    proc = run_cli(["validate", "--size", "tiny", "--ablation", "attnres-full", "--data.data_dir", str(data),
                    "--data.batch_size", "2", "--trainer.limit_val_batches", "5", "--trainer.enable_progress_bar",
                    "false", "--ckpt_path", str(ckpt)], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = client.get_run(run.info.run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")] == before
    [scored] = client.get_metric_history(run.info.run_id, "validate/val/loss")
    assert scored.step == 6 and scored.value != before[-1][1]  # 5 batches, not the fit's 2
    assert any(k.startswith("validate/routing/mean/") for k in after.data.metrics), sorted(after.data.metrics)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[lrattn validate]")]
    assert lines[0].startswith("[lrattn validate] step 6: ") and f"validate/val/loss {scored.value:.4f}" in lines[0]
    assert f"MLflow run {run.info.run_id}" in lines[1] and not any("TrainerFn" in k for k in after.data.metrics)


def test_compare_shows_the_seed_a_plain_fit_trained_with(fitted):
    folder, _, _, _, _ = fitted
    proc = run_cli(["compare", "--experiment", "lrattn", "--no-summary-run", "--out", str(folder / "report")], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 (0)" in proc.stdout and "(?)" not in proc.stdout, proc.stdout


@pytest.mark.usefixtures("mlflow_store")
def test_counters_are_logged_when_asked(data, tmp_path):
    proc = run_cli(fit_args(data, "--log_counters", "true", steps=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("lrattn").experiment_id])[0]
    assert {"train/batches", "train/samples", "train/time", "epoch"} <= set(run.data.metrics)


def test_list_says_at_which_size_it_counts(tmp_path):
    proc = run_cli(["list", "--size", "tiny"], tmp_path)
    assert proc.returncode == 0 and "at size 'tiny'" in proc.stdout
    proc = run_cli(["list"], tmp_path)
    assert "at size 'paper-0.5b'" in proc.stdout, proc.stdout[:500]



def test_lightnings_automatic_optimizer_flags_are_refused(data, tmp_path):
    """--optimizer/--lr_scheduler would train with another optimiser while MLflow records ours."""
    for flags in (["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.5"], ["--lr_scheduler", "StepLR"]):
        proc = run_cli(fit_args(data, *flags, steps=2), tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert "unknown flag" in proc.stderr and flags[0] in proc.stderr
        assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
    assert "--optimizer " not in run_cli(["fit", "--help"], tmp_path).stdout


def _runs(folder):
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name("lrattn").experiment_id])


@pytest.mark.usefixtures("mlflow_store")
def test_a_resume_with_another_schedule_length_is_refused_unless_asked(data, tmp_path):
    """A longer --trainer.max_steps on resume restarted the warm-down; now it is an error, and with
    --model.allow_schedule_change the run equals one launched with the new length, while that holds."""
    flat = ("--model.decay_fraction", "0.0", "--model.muon_momentum_cooldown_steps", "0")  # no decay, no cooldown
    first, full, decaying = (tmp_path / n for n in ("resumed", "full", "decaying"))
    for folder in (first, full, decaying):
        folder.mkdir()
    assert run_cli(fit_args(data, *flat, steps=4, every=2), first).returncode == 0
    proc = run_cli(fit_args(data, *flat, "--ckpt_path", "last", steps=6, every=2), first)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "--trainer.max_steps 6" in proc.stderr and "allow_schedule_change" in proc.stderr
    proc = run_cli(fit_args(data, *flat, "--ckpt_path", "last", "--model.allow_schedule_change", "true",
                            "--trainer.enable_progress_bar", "true", steps=6, every=2), first)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "6/6" in proc.stdout and "2/2" not in proc.stdout, proc.stdout[-2000:]  # steps of the run, not of the resume
    assert run_cli(fit_args(data, *flat, steps=6, every=2), full).returncode == 0
    (client, [resumed]), (client_full, [uninterrupted]) = _runs(first), _runs(full)
    for key in ("train/loss", "train/lr/muon", "val/loss"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(resumed.info.run_id, key))
        want = sorted((m.step, m.value) for m in client_full.get_metric_history(uninterrupted.info.run_id, key))
        assert [s for s, _ in got] == [s for s, _ in want] and np.allclose([v for _, v in got], [v for _, v in want],
                                                                          rtol=1e-6, atol=0), key
    assert resumed.data.params["train_max_steps"] == "4" and resumed.data.params.get(
        "train_max_steps_from_step_4") == "6", resumed.data.params
    # a schedule whose warm-down had begun cannot be stretched: its learning rates would change
    assert run_cli(fit_args(data, "--model.decay_fraction", "0.5", steps=4, every=2), decaying).returncode == 0
    proc = run_cli(fit_args(data, "--model.decay_fraction", "0.5", "--ckpt_path", "last",
                            "--model.allow_schedule_change", "true", steps=8, every=2), decaying)
    assert proc.returncode == 2 and "differs from a 8-step one from step" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.usefixtures("mlflow_store")
def test_a_finished_run_trains_on_with_its_schedule_kept(data, tmp_path):
    """A finished run's warm-down is done, so no resume follows a longer schedule: `--trainer.max_steps 8` (also with
    --model.allow_schedule_change) is one line that points to --model.schedule_steps 4 and to --init_from its
    checkpoint (it pointed to an earlier checkpoint, which a finished run does not keep), and both work. With
    --model.schedule_steps 4 the same MLflow run goes on to step 8, steps 4-8 at the schedule's final learning rate,
    and logs what a run launched with `--trainer.max_steps 8 --model.schedule_steps 4` logs: the extension is that
    recipe, and its fingerprint says so."""
    decay = ("--model.decay_fraction", "0.5")  # steps 2-4 decay to x0.1 (the default momentum schedule: warmup only)
    extended, launched = tmp_path / "extended", tmp_path / "launched"
    for folder in (extended, launched):
        folder.mkdir()
    assert run_cli(fit_args(data, *decay, steps=4, every=2), extended).returncode == 0
    ckpt = "runs/lrattn/tiny-baseline-seed0/checkpoints/last.ckpt"
    for asked in ((), ("--model.allow_schedule_change", "true")):
        proc = run_cli(fit_args(data, *decay, "--ckpt_path", "last", *asked, steps=8, every=2), extended)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert "keep that schedule with --model.schedule_steps 4 (steps 4 to 8 at its final values" in proc.stderr
        assert f"--run_name NEW --init_from {ckpt}" in proc.stderr and (extended / ckpt).is_file()
        assert "earlier checkpoint" not in proc.stderr
    proc = run_cli(fit_args(data, *decay, "--ckpt_path", "last", "--model.schedule_steps", "4", steps=8, every=2),
                   extended)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training on to step 8 with the 4-step schedule this run followed" in proc.stderr
    assert run_cli(fit_args(data, *decay, "--model.schedule_steps", "4", steps=8, every=2), launched).returncode == 0
    (client, [run]), (client_launched, [reference]) = _runs(extended), _runs(launched)
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/lr/muon", "train/lr/adamw", "val/loss"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        want = sorted((m.step, m.value) for m in client_launched.get_metric_history(reference.info.run_id, key))
        assert [s for s, _ in got] == [s for s, _ in want] and np.allclose([v for _, v in got], [v for _, v in want],
                                                                          rtol=1e-6, atol=0), key
    muon = dict(sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/lr/muon")))
    assert [s for s in muon if s >= 4] == [4, 5, 6, 7] and all(v == pytest.approx(muon[4]) for s, v in muon.items()
                                                              if s >= 4)
    assert muon[4] == pytest.approx(0.1 * max(muon.values()))  # the final learning rate, held
    params = run.data.params
    assert (params["train_max_steps"], params["train_schedule_steps"], params["train_max_steps_from_step_4"]) == (
        "4", "4", "8") and not any(k.startswith("train_schedule_steps_from") for k in params), params
    assert run.data.tags["lrattn.recipe"] == reference.data.tags["lrattn.recipe"]
    # the other way it points to: a new run from these weights, with a fresh optimizer and schedule
    proc = run_cli(fit_args(data, *decay, "--run_name", "more", "--init_from", ckpt, steps=8, every=2), extended)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.usefixtures("mlflow_store")
def test_a_finished_run_without_momentum_cooldown_trains_on_and_stays_finished(data, tmp_path):
    """cpu-demo, cpu-study and scaling-cpu set muon_momentum_cooldown_steps 0 (constant momentum): extending such a
    finished run (`--ckpt_path last --trainer.max_steps 8 --model.schedule_steps 4`) divided by the zero cooldown
    at the first step past the schedule and flipped the MLflow run from FINISHED to FAILED. Now the extra steps run
    at the schedule's final learning rate and the momentum it kept, and the run stays FINISHED."""
    flat = ("--model.muon_momentum_warmup_steps", "0", "--model.muon_momentum_cooldown_steps", "0",
            "--model.decay_fraction", "0.5")
    assert run_cli(fit_args(data, *flat, steps=4, every=2), tmp_path).returncode == 0
    proc = run_cli(fit_args(data, *flat, "--ckpt_path", "last", "--model.schedule_steps", "4", steps=8, every=2),
                   tmp_path)
    assert proc.returncode == 0 and "ZeroDivisionError" not in proc.stderr, proc.stderr[-2000:]
    client, [run] = _runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.params["train_max_steps_from_step_4"] == "8"
    momentum = dict(sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/momentum/muon")))
    assert sorted(momentum) == list(range(8)) and all(v == pytest.approx(0.95) for v in momentum.values()), momentum


def test_validate_reads_the_split_its_checkpoint_trained_on_and_a_missing_folder_names_the_command(fitted, tmp_path):
    folder, client, _, run, _ = fitted
    ckpt = folder / "runs/lrattn/tiny-attnres-full-seed0/checkpoints/last.ckpt"
    proc = run_cli(["validate", "--ckpt_path", str(ckpt), "--trainer.limit_val_batches", "2", "--data.batch_size", "2",
                    "--trainer.enable_progress_bar", "false", "--tracking_uri", f"sqlite:///{folder / 'mlflow.db'}"],
                   tmp_path)  # no --size, --ablation, --data.data_dir: all from the checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]
    fit_last = client.get_metric_history(run.info.run_id, "val/loss")[-1].value
    assert f"validate/val/loss {fit_last:.4f}" in proc.stdout  # the fit's 2 batches of the same split
    proc = run_cli(["fit", "--size", "tiny", "--ablation", "baseline", "--data.data_dir", "nowhere"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "lrattn: error: data dir nowhere is missing or empty; create it with `lrattn prepare --source stdlib-docs "
        "--tokenizer byte --out nowhere` (the bundled corpus; --source FILES for your own corpus)"), proc.stderr


@pytest.mark.usefixtures("mlflow_store")
def test_a_resume_from_a_named_checkpoint_file_takes_the_command_lines_settings(data, tmp_path):
    """`--ckpt_path FILE` resumed with the file's hyper-parameters over the command line's --model.* (LightningCLI
    restores them; `last` is no file when it does), so a changed --model.lr was dropped unchecked and
    --model.schedule_steps ignored. Now a named file resumes as `last` does."""
    decay = ("--model.decay_fraction", "0.5")
    assert run_cli(fit_args(data, *decay, steps=4, every=2), tmp_path).returncode == 0
    ckpt = str(tmp_path / "runs/lrattn/tiny-baseline-seed0/checkpoints/last.ckpt")
    proc = run_cli(fit_args(data, *decay, "--ckpt_path", ckpt, "--model.lr", "0.5", steps=4, every=2), tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "lrattn: error: --model.lr: the checkpoint was trained with 0.0003, this run passes 0.5" in proc.stderr
    proc = run_cli(fit_args(data, *decay, "--ckpt_path", ckpt, "--model.schedule_steps", "4", steps=6, every=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training on to step 6 with the 4-step schedule this run followed" in proc.stderr
