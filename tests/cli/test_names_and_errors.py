"""Names that become paths stay one folder, and bad input is one line (issue 19, items 1 and 8).

Every case runs `lrattn` as a real subprocess from a scratch working folder and checks the exit code, that
stderr is exactly one line `lrattn: error: ...` (or `lrattn COMMAND: error: ...`), and that nothing was
created anywhere under the test's folder (inside or outside the runs folder) by a command that was refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import REGISTRY, fit_args, run_cli
from helpers.tracking import seed_store

LONG = "x" * 300


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def one_error_line(proc, prefix: str = "lrattn: error: ") -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr[-3000:]
    return lines[0]


@pytest.fixture
def scratch(tmp_path) -> Path:
    """The working folder, inside tmp_path: a name that escapes it lands in tmp_path, which is watched too."""
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    return work


# ---- item 1: run and experiment names are one safe folder name ------------------------------------------
BAD_NAMES = {
    # case: (flags, words the one line must hold)
    "run name ../../escape": (["--run_name", "../../escape"], ["--run_name '../../escape' is a path"]),
    "absolute run name": (["--run_name", "ABS"], ["--run_name", "is a path"]),
    "experiment ../../E": (["--experiment", "../../E"], ["--experiment '../../E' is a path"]),
    "run name ..": (["--run_name", ".."], ["--run_name '..' is a path"]),
    "run name .": (["--run_name", "."], ["--run_name '.' is a path"]),
    "experiment .": (["--experiment", "."], ["--experiment '.' is a path"]),
    "nested run name": (["--run_name", "a/b/c"], ["--run_name 'a/b/c' is a path"]),
    "empty run name": (["--run_name", ""], ["--run_name is empty"]),
    "run name with a newline": (["--run_name", "a\nb"], ["--run_name 'a\\nb' holds '\\n'"]),
    "300-character run name": (["--run_name", LONG], ["--run_name", "is too long (300 characters, at most 100)"]),
}


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_a_name_that_is_not_one_folder_is_refused_before_any_work(case, data, scratch, tmp_path):
    flags, needles = BAD_NAMES[case]
    flags = [str(tmp_path / "abs" / "path") if f == "ABS" else f for f in flags]
    before = tree(tmp_path)
    proc = run_cli(fit_args(data, "--runs_dir", "runs", *flags), cwd=scratch)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_error_line(proc)
    for needle in needles:
        assert needle in line, line
    assert "writable" not in line  # the long name is named as such, not as an unwritable --runs_dir
    assert tree(tmp_path) == before  # no runs folder, lock, MLflow store or checkpoint, here or outside


def test_validate_checks_the_names_too(data, scratch, tmp_path):
    before = tree(tmp_path)
    proc = run_cli(["validate", "--registry", REGISTRY, "--data.data_dir", str(data), "--ckpt_path", "missing.ckpt",
                    "--experiment", "../E"], cwd=scratch)
    assert proc.returncode == 2
    assert "--experiment '../E' is a path" in one_error_line(proc)
    assert tree(tmp_path) == before


def test_demo_checks_the_names_before_preparing_its_corpus(scratch, tmp_path):
    before = tree(tmp_path)
    proc = run_cli(["demo", "--size", "tiny", "--run_name", "../x"], cwd=scratch)
    assert proc.returncode == 2
    assert "--run_name '../x' is a path" in one_error_line(proc)
    assert tree(tmp_path) == before  # no data/ prepared, no runs/


def test_a_good_name_with_capitals_dots_and_underscores_trains_into_its_folder(data, scratch, tmp_path, store_template):
    seed_store(scratch, store_template)
    proc = run_cli(fit_args(data, "--runs_dir", "runs", "--experiment", "Exp_1", "--run_name", "My_Run.2", steps=2),
                   cwd=scratch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (scratch / "runs" / "Exp_1" / "My_Run.2" / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in (scratch / "runs").iterdir()) == ["Exp_1"]


SWEEP_HEAD = "doc: names\nrecipe: experiments/cpu-demo.yaml\n"
GRID = "sizes: [tiny]\nablations: [baseline]\nseeds: [0]\n"
BAD_SWEEPS = {
    "experiment ../../E": ("sweep.yaml", "experiment: ../../E\n" + GRID, "field 'experiment': value '../../E' is a path"),
    "name ..": ("sweep.yaml", "name: ..\n" + GRID, "field 'name': value '..' is a path"),
    "file stem with a space": ("my sweep.yaml", GRID, "field 'name (by default the file's stem)': value 'my sweep' holds ' '"),
    "variant ../x": ("sweep.yaml", "runs:\n  - {size: tiny, ablation: baseline, seed: 0, variant: ../x, "
                     "args: {model.lr: 0.01}}\n", "field 'runs[0].variant': value '../x' is a path"),
    "long name": ("sweep.yaml", f"name: {LONG}\n" + GRID, "is too long (300 characters"),
}


@pytest.mark.parametrize("case", list(BAD_SWEEPS))
def test_sweep_names_that_become_paths_are_one_folder(case, scratch, tmp_path):
    filename, body, needle = BAD_SWEEPS[case]
    (scratch / filename).write_text(SWEEP_HEAD + body)
    before = tree(tmp_path)
    for dry in (["--dry-run"], []):
        proc = run_cli(["sweep", filename, *dry], cwd=scratch)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert needle in one_error_line(proc)
    assert tree(tmp_path) == before


# ---- item 8: one line everywhere ------------------------------------------------------------------------
class RunsCode:
    """Pickles as a call of os.system: a checkpoint holding it runs `touch MARKER` when fully unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def bad_checkpoints(scratch) -> dict[str, Path]:
    (scratch / "random.ckpt").write_bytes(np.random.default_rng(0).bytes(4096))
    torch.save({"state_dict": {}, "payload": RunsCode(scratch.parent / "PWNED")}, scratch / "code.ckpt")
    torch.save({"payload": RunsCode(scratch.parent / "PWNED")}, scratch / "code-legacy.ckpt",
               _use_new_zipfile_serialization=False)
    return {"random": scratch / "random.ckpt", "code": scratch / "code.ckpt", "code-legacy": scratch / "code-legacy.ckpt"}


INFERENCE = {
    "generate": (lambda c: ["generate", "--checkpoint", c, "--prompt", "def "], "lrattn generate: error: "),
    "chat": (lambda c: ["chat", "--checkpoint", c], "lrattn chat: error: "),
    "export": (lambda c: ["export", "--checkpoint", c, "--out", "hf"], "lrattn export: error: "),
}


@pytest.mark.parametrize("command", list(INFERENCE))
def test_generate_chat_export_refuse_a_checkpoint_with_code_in_one_line_without_unsafe_advice(
        command, bad_checkpoints, scratch, tmp_path):
    make, prefix = INFERENCE[command]
    for kind in ("code", "code-legacy", "random"):
        before = tree(tmp_path)
        proc = run_cli(make(bad_checkpoints[kind].name), cwd=scratch)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = one_error_line(proc, prefix)
        assert "weights_only" not in proc.stderr and "Traceback" not in proc.stderr
        if kind == "random":
            assert "is not a checkpoint (not a torch.save file)" in line, line
        else:
            assert f"checkpoint {kind}.ckpt was not loaded: it asks to unpickle posix.system" in line, line
        assert tree(tmp_path) == before  # the code never ran (no PWNED), no export folder


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_random_bytes_as_a_checkpoint_are_not_a_checkpoint_not_an_mmap_error(
        subcommand, data, bad_checkpoints, scratch, tmp_path):
    args = (fit_args(data, "--ckpt_path", "random.ckpt") if subcommand == "fit" else
            ["validate", "--registry", REGISTRY, "--data.data_dir", str(data), "--ckpt_path", "random.ckpt"])
    before = tree(tmp_path)
    proc = run_cli(args, cwd=scratch)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "checkpoint random.ckpt cannot be read: it is not a checkpoint (not a torch.save file)" in line, line
    assert "mmap" not in line
    assert tree(tmp_path) == before


UNKNOWN_FLAGS = {
    # case: (flags, a recipe's text or None, words the one line must hold)
    "--trainer.max_stpes": (["--trainer.max_stpes", "3"], None,
                            ["unknown flag --trainer.max_stpes (closest: --trainer.max_steps", "lrattn fit --help"]),
    "--modle.lr": (["--modle.lr=1"], None, ["unknown flag --modle.lr (closest: --model.lr"]),
    "two flags": (["--modle.lr", "1", "--trainer.max_stpes", "3"], None,
                  ["unknown flags --modle.lr (closest: --model.lr", "--trainer.max_stpes (closest: --trainer.max_steps"]),
    "a key in a recipe": (["--config", "recipe.yaml"], "trainer:\n  max_stpes: 3\n",
                          ["unknown key in a --config file: trainer.max_stpes (closest: trainer.max_steps"]),
    "a missing --config": (["--config", "nope.yaml"], None, ["--config: File does not exist", "nope.yaml"]),
}


@pytest.mark.parametrize("case", list(UNKNOWN_FLAGS))
def test_an_unknown_flag_is_one_line_naming_the_closest_flags(case, data, scratch, tmp_path):
    flags, recipe, needles = UNKNOWN_FLAGS[case]
    if recipe is not None:
        (scratch / "recipe.yaml").write_text(recipe)
    before = tree(tmp_path)
    proc = run_cli(fit_args(data, *flags), cwd=scratch)
    assert proc.returncode == 2
    line = one_error_line(proc)  # not jsonargparse's 85 lines of usage
    for needle in needles:
        assert needle in line, line
    assert tree(tmp_path) == before
