"""No command writes outside the folders it was given.

Every everyday command runs, as an installed user would, from a scratch working folder whose parent, home
folder and temp folder are watched (one real process runs them in turn, so what the libraries write when they are
imported is written, once, under the watched home and temp folders): afterwards the working folder holds only what the commands were told to
write (the data folder, the runs folder, the MLflow store and its artifacts, the export, the report), the
parent and the checkout are unchanged, the home folder holds nothing but matplotlib's font cache (a library
cache, rebuilt when missing), and the temp folder is empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

GIVEN = {"data", "runs", "mlflow.db", "mlartifacts", "hf", "report", "sweep.yaml"}
HOME_CACHES = (Path(".cache/matplotlib"), Path(".config/matplotlib"))  # matplotlib's font list


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """path -> (mtime_ns, size) of every file under root, and a folder's entries, except folders named in `skip`.
    A folder is compared by what it holds, not by its mtime: a skipped entry made meanwhile by another test's
    process (a __pycache__ written where PYTHONDONTWRITEBYTECODE is unset) changes its parent's mtime, not a file."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        out[str(Path(folder).relative_to(root))] = tuple(sorted(dirs + files))
        for name in files:
            path = Path(folder, name)
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_mtime_ns, st.st_size)
    return out


def changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@pytest.fixture
def sandbox(tmp_path):
    """(run, work, home, tmp): `run(commands, stdin)` runs each `lrattn ARGS` of `commands` in turn, in one new
    process started in work/ with HOME and TMPDIR inside tmp_path, `stdin` its standard input."""
    work, home, tmp = (tmp_path / name for name in ("work", "home", "tmp"))
    for folder in (work, home, tmp):
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HF_", "XDG_"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH="")

    def run(commands: list[list[str]], stdin: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-c", RUN_IN_TURN, json.dumps(commands)], cwd=work, env=env,
                              input=stdin, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    return run, work, home, tmp


# each command through `lrattn`'s main, as `lrattn ARGS` runs it; the first that fails ends the process, named
RUN_IN_TURN = """
import json, sys
from lrattn_lightning.cli import main
for args in json.loads(sys.argv[1]):
    code = main(args)
    if code:
        sys.exit(f"lrattn {' '.join(args)}: exit {code}")
"""

SWEEP = f"""doc: a one-run sweep for the stray-writes check
recipe: {REPO_ROOT / 'experiments' / 'cpu-demo.yaml'}
experiment: stray-check
sizes: [tiny]
ablations: [baseline]
seeds: [0]
"""


def test_no_command_writes_outside_the_folders_it_was_given(sandbox, tmp_path):
    run, work, home, tmp = sandbox
    # (and setuptools' ignored build outputs, which test_packaging's wheel build rewrites meanwhile in the other
    # test process)
    skip = ("__pycache__", ".git", ".venv", ".pytest_cache", ".ruff_cache", "build", "lrattn_lightning.egg-info")
    repo_before, parent_before = snapshot(REPO_ROOT, skip), snapshot(tmp_path, ("work", "tmp"))
    (work / "sweep.yaml").write_text(SWEEP)

    ckpt = "runs/cpu-demo/r1/checkpoints/last.ckpt"
    run([["prepare", "--source", "stdlib-docs", "--tokenizer", "byte", "--out", "data", "--max_documents", "60"],
         ["fit", "--config", "experiments/cpu-demo.yaml", "--size", "tiny", "--ablation", "p-lr-full-r32",
          "--data.data_dir", "data", "--data.batch_size", "2", "--trainer.max_steps", "4",
          "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2", "--checkpoint_every", "2",
          "--run_name", "r1", "--trainer.enable_progress_bar", "false"],
         ["validate", "--ckpt_path", ckpt, "--data.data_dir", "data", "--trainer.limit_val_batches", "2"],
         ["eval", "--checkpoint", ckpt, "--tasks", "local", "--limit", "4"],
         ["generate", "--checkpoint", ckpt, "--prompt", "def ", "--max_new_tokens", "4"],
         ["chat", "--checkpoint", ckpt, "--max_new_tokens", "4"],  # (the one that reads stdin)
         ["export", "--checkpoint", ckpt, "--out", "hf/model"],
         ["list", "--size", "tiny"],
         ["sweep", "sweep.yaml", "--dry-run"],
         ["compare", "--experiment", "cpu-demo", "--out", "report"]], stdin="hello\n/quit\n")

    assert {p.name for p in work.iterdir()} <= GIVEN, sorted(p.name for p in work.iterdir())
    assert changed(repo_before, snapshot(REPO_ROOT, skip)) == [], "the checkout was written to"
    strays = [p for p in changed(parent_before, snapshot(tmp_path, ("work", "tmp"))) if not home_cache(Path(p))]
    assert strays == [], strays
    left = [str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()]
    assert left == [], left  # (empty folders a library made once, e.g. torchinductor_root, are left alone)


def home_cache(path: Path) -> bool:
    """home/ itself, a folder on the way to a library cache, or something inside one."""
    caches = [Path("home") / c for c in HOME_CACHES]
    return any(path == c or path.is_relative_to(c) or c.is_relative_to(path) for c in caches)
