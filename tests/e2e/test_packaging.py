"""A regular install: the wheel carries the registry, the recipes and the task YAMLs, and `lrattn` works
from a folder outside the checkout. Plus the one CLI: every subcommand listed, fast help, one flag style."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

REPO = REPO_ROOT


def _site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel built from this checkout, installed into a new venv that sees the project's dependencies
    (a .pth line to their site-packages) but not the checkout."""
    root = tmp_path_factory.mktemp("install")
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, text=True, cwd=root)
    wheel = next(wheels.glob("lrattn_lightning-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    Path(_site_packages(python), "project-deps.pth").write_text(_site_packages(Path(sys.executable)) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                           str(wheel)], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outside = root / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    return {"wheel": wheel, "bin": venv / "bin", "python": python, "cwd": outside, "env": env}


def _run(installed: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(installed["bin"] / "lrattn"), *args], cwd=installed["cwd"], env=installed["env"],
                          capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_the_registry_recipes_and_tasks(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for path in ("lrattn_lightning/registry.yaml", "lrattn_lightning/experiments/cpu-demo.yaml",
                 "lrattn_lightning/experiments/paper-0.5b-multinode.yaml",
                 "lrattn_lightning/experiments/sweeps/cpu-study.yaml", "lrattn_lightning/eval/task_configs/lrattn_cloze.yaml"):
        assert path in names, path
    where = subprocess.run([str(installed["python"]), "-c", "import lrattn_lightning; print(lrattn_lightning.__file__)"],
                           cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True, check=True)
    assert str(installed["python"].parent.parent) in where.stdout  # the installed copy, not the checkout


def test_installed_list_and_a_two_step_fit_outside_the_checkout(installed):
    listed = _run(installed, "list")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "p-lr-block-n8-r32" in listed.stdout and "site-packages" in listed.stdout  # the packaged registry
    prep = _run(installed, "prepare", "--max-documents", "60", "--out", "data")  # the hyphenated alias works
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert "read 60 documents" in prep.stderr and "tokens written" in prep.stderr  # progress on long work
    fit = _run(installed, "fit", "--config", "experiments/cpu-demo.yaml", "--size", "tiny", "--ablation",
               "s-lr-full-r16", "--data.data_dir", "data", "--data.batch_size", "2", "--trainer.max_steps", "2",
               "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
               "--trainer.enable_progress_bar", "false")
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert list((installed["cwd"] / "runs").rglob("last.ckpt")) and (installed["cwd"] / "mlflow.db").is_file()
    sweep = _run(installed, "sweep", "experiments/sweeps/cpu-study.yaml", "--dry-run")  # the shipped sweep file
    assert sweep.returncode == 0 and "15 runs" in sweep.stdout, sweep.stderr[-2000:]


def test_help_lists_every_subcommand_quickly():
    from lrattn_lightning.cli import COMMANDS

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lrattn_lightning.cli", "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0
    for name in ("fit", "validate", "test", "list", "prepare", "demo", "eval", "bench", "sweep", "compare",
                 "generate", "chat", "export", "fidelity"):
        assert name in COMMANDS and f"  {name} " in proc.stdout
    assert "lightning" not in subprocess.run(
        [sys.executable, "-c", "import sys, lrattn_lightning.cli; print(' '.join(sys.modules))"],
        capture_output=True, text=True).stdout.split()  # nothing heavy is imported for the table
    assert elapsed < 10  # generous: a loaded machine; the table itself imports nothing heavy


def test_one_flag_style_with_the_hyphenated_alias():
    from lrattn_lightning.core.flags import Parser

    parser = Parser()
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--dry_run", action="store_true")
    assert parser.parse_args(["--max_new_tokens", "3", "--dry-run"]).max_new_tokens == 3
    assert parser.parse_args(["--max-new-tokens=4"]).max_new_tokens == 4
    assert "--max_new_tokens" in parser.format_help() and "--max-new-tokens" not in parser.format_help()


def test_unknown_command_suggests_the_closest(capsys):
    from lrattn_lightning.cli import main

    assert main(["evl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean eval" in err
