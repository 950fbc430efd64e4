"""What a researcher sees in the first hour: what `fit`, `validate`, `list` and MLflow show, and no noise.

Real runs (`lrattn` subprocesses from a scratch folder, a real sqlite MLflow store): the run page says what
ran (description, experiment kind), the metrics are the ones a researcher reads (rates, not Lightning's
running counters; evaluation rates at the training step they follow).
"""

from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from test_resilience import data, fit_args, run_cli  # noqa: F401

COUNTERS = ("train/batches", "train/samples", "train/lengths", "train/time", "validate/batches", "validate/time")


@pytest.fixture(scope="module")
def fitted(data, tmp_path_factory):  # noqa: F811
    """One finished fit of `attnres-full` at `tiny` (6 steps, validations at 3 and 6) and its MLflow run."""
    folder = tmp_path_factory.mktemp("first-hour")
    proc = run_cli(fit_args(data, "--ablation", "attnres-full", "--trainer.val_check_interval", "3",
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


def test_counters_are_logged_when_asked(data, tmp_path):  # noqa: F811
    proc = run_cli(fit_args(data, "--log_counters", "true", steps=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("lrattn").experiment_id])[0]
    assert {"train/batches", "train/samples", "train/time"} <= set(run.data.metrics)


def test_list_says_at_which_size_it_counts(tmp_path):
    proc = run_cli(["list", "--size", "tiny"], tmp_path)
    assert proc.returncode == 0 and "at size 'tiny'" in proc.stdout
    proc = run_cli(["list"], tmp_path)
    assert "at size 'paper-0.5b'" in proc.stdout, proc.stdout[:500]



def test_lightnings_automatic_optimizer_flags_are_refused(data, tmp_path):  # noqa: F811
    """--optimizer/--lr_scheduler would train with another optimiser while MLflow records ours."""
    for flags in (["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.5"], ["--lr_scheduler", "StepLR"]):
        proc = run_cli(fit_args(data, *flags, steps=2), tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert "unknown flag" in proc.stderr and flags[0] in proc.stderr
        assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
    assert "--optimizer " not in run_cli(["fit", "--help"], tmp_path).stdout
