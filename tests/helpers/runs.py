"""`lrattn fit` and sweeps as the tests run them, and what they leave behind: the arguments of a tiny CPU fit, the
command in this process or as a real one (helpers/cli.py), --config files adding tests/run_hooks.py's callbacks, the
one MLflow run of an experiment, its metric histories and checkpoints."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from helpers.cli import as_process, in_process, lrattn
from helpers.paths import REGISTRY_PATH

REGISTRY = str(REGISTRY_PATH)
RUN = "tiny-baseline-seed0"  # fit_args' run name (size, ablation, seed)

# a schedule without warm-down or momentum cooldown, its warmup shorter than any run here: its length may change
# on resume (--model.allow_schedule_change)
STRETCHABLE = ("--model.warmup_steps", "1", "--model.decay_fraction", "0.0", "--model.muon_momentum_cooldown_steps",
               "0", "--model.allow_schedule_change", "true")


def fit_args(data: Path, *extra: str, steps: int = 4, every: int = 2, ablation: str = "baseline", batch_size: int = 2,
             lightning_checks: bool = False) -> list[str]:
    """`lrattn fit` of the tiny size on `data`, on the CPU: validation (2 batches) every 2 steps, a checkpoint every
    `every`, warmup 2, then `extra`; without Lightning's sanity validation and model summary (a shorter, quieter
    run) unless `lightning_checks`, as a user's fit has them."""
    return [
        "fit", "--size", "tiny", "--ablation", ablation, "--registry", REGISTRY,
        "--data.data_dir", str(data), "--data.batch_size", str(batch_size),
        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
        *(() if lightning_checks else ("--trainer.num_sanity_val_steps", "0")), "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        *(() if lightning_checks else ("--trainer.enable_model_summary", "false")),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--model.warmup_steps", "2", "--checkpoint_every", str(every), *extra,
    ]


def slr_fit_args(data: Path, *extra: str, steps: int = 4, ablation: str = "s-lr-grid-n4-r16") -> list[str]:
    """The training tests' fit: fit_args of an S-LR ablation (sliced keys, routing diagnostics) at batch 4, with
    Lightning's sanity validation and model summary as a user gets them."""
    return fit_args(data, *extra, steps=steps, ablation=ablation, batch_size=4, lightning_checks=True)


__all__ = ["lrattn"]  # (the command line of a real process, helpers/cli.py's, for the modules that import it here)


def run_cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`lrattn ARGS` in this process from folder `cwd`, `env` set for it (helpers/cli.py's in_process)."""
    return in_process(args, cwd, **env)


def run_process(args: list[str], cwd: Path, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """`lrattn ARGS` as a real process (`python -m lrattn_lightning.cli`), `env` added to cli_env()'s: for a test
    whose point is a process (ranks, signals, an exit on a kill)."""
    return as_process(args, cwd, timeout=timeout, **env)


def hooks(folder: Path, name: str, *callbacks: tuple[str, dict]) -> str:
    """A --config file `folder/name` that adds run_hooks callbacks (tests/run_hooks.py), (class, init_args) each,
    to the trainer."""
    path = folder / name
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": f"run_hooks.{cls}", "init_args": args} for cls, args in callbacks]}}))
    return str(path)


def ckpt_dir(folder: Path, experiment: str = "lrattn", run: str = RUN) -> Path:
    return folder / "runs" / experiment / run / "checkpoints"


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def the_run(folder: Path | None, experiment: str = "lrattn", uri: str | None = None):
    """(client, run): the one run of `experiment` in the store at `uri`, by default folder/mlflow.db."""
    uri = uri or f"sqlite:///{folder}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} not in {uri}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def metric_history(client: MlflowClient, run_id: str, key: str = "train/loss") -> list[tuple[int, float]]:
    """Every (step, value) logged for `key`, by step (a step logged twice appears twice)."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def losses_by_step(client: MlflowClient, run_id: str, key: str = "train/loss") -> dict[int, float]:
    """{step: value} of `key`; where a resumed run logged a step again, its later value."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


def assert_same_losses(resumed: list[tuple[int, float]], full: list[tuple[int, float]]) -> None:
    assert [s for s, _ in resumed] == [s for s, _ in full]  # every step once: no duplicates after a resume
    for (step, a), (_, b) in zip(resumed, full, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (step, resumed, full)


def histories(folder: Path, experiment: str = "run") -> dict[str, list[tuple[int, float]]]:
    """Every metric the run logged, its (step, value) pairs; not the measured speeds (train/device/*,
    validate/device/*), which differ from run to run."""
    client, run = the_run(folder, experiment)
    return {key: metric_history(client, run.info.run_id, key) for key in run.data.metrics
            if "/device/" not in key}


def assert_same_run(folder: Path, full: dict[str, list[tuple[int, float]]]) -> None:
    """The resumed run logged exactly what the uninterrupted one did: every metric at every step once, equal."""
    resumed = histories(folder)
    assert sorted(resumed) == sorted(full)
    differ = {key: (resumed[key], values) for key, values in full.items() if resumed[key] != values}
    assert not differ, differ


def stop_line(stderr: str) -> str:
    """The one `lrattn:` line a stopped command wrote (and no traceback)."""
    lines = [line for line in stderr.splitlines() if line.startswith("lrattn:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` (root only; the test is skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


SWEEP_ABLATIONS = ["baseline", "s-lr-grid-n4-r16"]  # write_sweep's


def write_sweep(folder: Path, data: Path, **changes) -> Path:
    """A tiny recipe and a sweep file of SWEEP_ABLATIONS x seeds 0, 1 in `folder`; `changes` edit the sweep."""
    recipe = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "val_check_interval": 3,
                    "limit_val_batches": 2, "num_sanity_val_steps": 0, "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"warmup_steps": 1},
        "data": {"data_dir": str(data), "batch_size": 2},
        "checkpoint_every": 2,
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    sweep = {"name": "two-by-two", "doc": "test sweep", "recipe": "recipe.yaml", "experiment": "sweep-test",
             "registry": REGISTRY, "sizes": ["tiny"], "ablations": SWEEP_ABLATIONS, "seeds": [0, 1],
             "env": {"OMP_NUM_THREADS": "1"}, **changes}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def sweep_runs(uri: str, experiment: str = "sweep-test") -> list:
    """The fits of write_sweep's experiment (its summary run left out)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    return [r for r in client.search_runs([exp.experiment_id]) if "lrattn.summary" not in r.data.tags]
