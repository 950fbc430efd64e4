"""`lrattn sweep` at a lab's scale (issue 53): fit flags parsed once per distinct configuration, not per run; SLURM
arrays split at the cluster's MaxArraySize; a progress line for slow work. benchmarks/sweep-scale times it."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.prepare import prepared_corpus
from helpers.runs import write_sweep
from helpers.tracking import free_port

from lrattn_lightning.cli import main
from lrattn_lightning.cli.sweep import fit_parser
from lrattn_lightning.tools.sweep import sweep as sweep_module
from lrattn_lightning.tools.sweep.file import load_sweep


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepared_corpus(tmp_path_factory, 80)


@pytest.fixture(scope="module")
def parser():
    return fit_parser()


class Counting:
    """The real fit parser, its parse_args calls counted (and the runs they parsed recorded)."""

    def __init__(self, parser) -> None:
        self.parser, self.parsed = parser, []

    def get_defaults(self):
        return self.parser.get_defaults()

    def parse_args(self, args):
        self.parsed.append(args[args.index("--run_name") + 1])
        return self.parser.parse_args(args)


def variants(n: int, bad: int | None = None) -> list[dict]:
    """n listed runs, each a variant with its own LR (a configuration of its own); `bad`: that one's LR a word."""
    return [{"size": "tiny", "ablation": "baseline", "seed": 100 + i, "variant": f"lr{i}",
             "args": {"model.lr": "fast" if i == bad else 1e-4 * (i + 1)}} for i in range(n)]


def test_flags_are_parsed_once_per_configuration(data_dir, tmp_path, parser):
    """A grid of sizes x ablations x seeds is one configuration; each variant's args and each size's size_args make
    one more; runs sharing a configuration are not parsed again, and every configuration is."""
    path = write_sweep(tmp_path, data_dir, seeds=list(range(40)), runs=variants(3) + [
        {"size": "tiny", "ablation": "s-lr-grid-n4-r16", "seed": 500, "variant": "lr0", "args": {"model.lr": 1e-4}}])
    sweep, _ = load_sweep(path)
    assert len(sweep.runs) == 2 * 40 + 4
    counting = Counting(parser)
    sweep_module.check_fit_args(sweep, None, [], counting)
    # the grid's first run, then each variant's first: the same LR under another ablation shares lr0's configuration
    assert counting.parsed == ["tiny-baseline-seed0", "tiny-baseline-lr0-seed100", "tiny-baseline-lr1-seed101",
                               "tiny-baseline-lr2-seed102"]
    keys = sweep_module.configurations(sweep)
    assert len(keys) == 4 and all(run in sweep.runs for run in keys.values())
    with_size_args = load_sweep(write_sweep(tmp_path, data_dir, seeds=list(range(5)),
                                            size_args={"tiny": {"trainer.max_steps": 5}}))[0]
    assert len(sweep_module.configurations(with_size_args)) == 1  # every run of that size has them


@pytest.mark.parametrize("bad", [0, 1, 29])  # the first, a middle and the last of the configurations
def test_a_bad_value_in_any_configuration_still_fails_in_one_line(data_dir, tmp_path, monkeypatch, capsys, bad):
    path = write_sweep(tmp_path, data_dir, runs=variants(30, bad=bad))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["sweep", str(path), "--dry-run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    progress = re.compile(r"^\[sweep two-by-two\] checking the fit flags of 31 configurations \(34 runs\): \d+/31$")
    assert all(progress.match(line) for line in lines[:-1]), lines  # (a loaded machine: progress first)
    err = lines[-1]
    assert err.startswith("lrattn: error: ") and f"run tiny-baseline-lr{bad}-seed{100 + bad}:" in err, err
    assert "model.lr" in err and "fast" in err


@pytest.mark.parametrize("bad", [[10], [2, 10], [0, 1]])  # in the second share only, in both, twice in the first
def test_configurations_checked_in_shares_say_the_first_bad_run(data_dir, tmp_path, parser, monkeypatch, bad):
    """Fit's flags checked by several processes at once, a contiguous share of the configurations each
    (`_check_in_shares`, here 4 a share at least: two shares on two CPUs): the bad run said is the first, as one
    process checking them all would say it, whichever share found it."""
    if threading.active_count() > 1:
        pytest.skip("threads run in this process (pytest-xdist's worker): FitCheck checks in place here")
    monkeypatch.setattr(sweep_module, "SHARE", 4)
    runs = variants(12)
    for i in bad:
        runs[i]["args"]["model.lr"] = "fast"
    sweep, _ = load_sweep(write_sweep(tmp_path, data_dir, runs=runs))
    with pytest.raises(sweep_module.SweepError, match=rf"run tiny-baseline-lr{bad[0]}-seed{100 + bad[0]}: .*model.lr"):
        fit_check(sweep, lambda: parser).wait()
    runs[bad[0]]["args"]["model.lr"] = 1e-3
    for i in bad[1:]:
        runs[i]["args"]["model.lr"] = 1e-3
    fit_check(load_sweep(write_sweep(tmp_path, data_dir, runs=runs))[0], lambda: parser).wait()  # all good: nothing


class Slow(Counting):
    """The real fit parser, each parse 0.3 s slower, each process that parses noted in `folder` (its pid)."""

    def __init__(self, parser, folder: Path) -> None:
        super().__init__(parser)
        self.folder = folder

    def parse_args(self, args):
        (self.folder / str(os.getpid())).touch()
        time.sleep(0.3)
        return super().parse_args(args)


def test_a_stopped_check_ends_its_shares_with_it(data_dir, tmp_path, parser, monkeypatch):
    """FitCheck.stop() (the sweep interrupted) ends the check's child at once, and the processes parsing its shares
    with it: none goes on parsing after the command has ended."""
    if threading.active_count() > 1:
        pytest.skip("threads run in this process (pytest-xdist's worker): FitCheck checks in place here")
    monkeypatch.setattr(sweep_module, "SHARE", 4)
    pids = tmp_path / "pids"
    pids.mkdir()
    sweep, _ = load_sweep(write_sweep(tmp_path, data_dir, runs=variants(12)))
    check = fit_check(sweep, lambda: Slow(parser, pids))
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:  # both shares parsing
        time.sleep(0.05)
    assert len(list(pids.iterdir())) == 2
    check.stop()
    time.sleep(0.5)
    for pid in (int(p.name) for p in pids.iterdir()):
        status = Path(f"/proc/{pid}/status")
        state = status.read_text().split("State:")[1].split()[0] if status.exists() else "gone"
        assert state in ("gone", "Z", "X"), (pid, state)  # ended (a zombie: ended, not yet reaped by init)


@pytest.mark.parametrize("runs, size", [(7, 3), (6, 3), (6, 6), (1, 1), (8, 1)])
def test_slurm_arrays_split_at_max_array_size(data_dir, tmp_path, monkeypatch, capsys, runs, size):
    """More unfinished runs than MaxArraySize: one script per `size` runs, each an array from 0 to at most
    size - 1, together every run once in the sweep's order, each task's arguments its run's."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/emit.db"
    path = write_sweep(tmp_path, data_dir, ablations=["baseline"], seeds=list(range(runs)))
    assert main(["sweep", str(path), "--emit", "slurm", "--tracking_uri", uri, "--max_array_size", str(size)]) == 0
    out = capsys.readouterr().out
    parts = sorted((tmp_path / "runs/sweep-test").glob("sweep-two-by-two*.sbatch"))
    expected = -(-runs // size)
    assert len(parts) == expected, out
    sweep, _ = load_sweep(path)
    seen = []
    for k, part in enumerate(parts):
        script = part.read_text()
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
        tasks = min(size, runs - k * size)
        assert f"#SBATCH --array=0-{tasks - 1}\n" in script
        if expected > 1:
            assert part.name == f"sweep-two-by-two.part{str(k + 1).zfill(len(str(expected)))}.sbatch"
            assert f"part {k + 1} of {expected}: {tasks} of the {runs} runs" in script
        for task in range(tasks):
            done = subprocess.run(["bash", "-c", script.split('if [[ -f "$CKPT" ]]')[0].split("set -euo pipefail")[1]
                                   + 'printf "%s\\n" "${ARGS[@]}"'],
                                  env={"SLURM_ARRAY_TASK_ID": str(task), "PATH": "/usr/bin:/bin"},
                                  capture_output=True, text=True)
            seen.append(done.stdout.splitlines())
    assert seen == [sweep.fit_args(run, uri) for run in sweep.runs]
    if expected > 1:
        assert f"wrote {expected} sbatch scripts" in out and "do sbatch" in out
        glob = re.search(r"for f in (.+); do sbatch", out).group(1)
        listed = subprocess.run(["bash", "-c", f"printf '%s\\n' {glob}"], capture_output=True, text=True, cwd=tmp_path)
        assert listed.stdout.split() == [str(p.relative_to(tmp_path)) for p in parts]


def test_max_array_size_from_the_sweep_file_and_bad_values(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = write_sweep(tmp_path, data_dir, ablations=["baseline"], seeds=list(range(5)), slurm={"max_array_size": 2})
    assert main(["sweep", str(path), "--emit", "slurm"]) == 0
    assert len(list((tmp_path / "runs/sweep-test").glob("*.part*.sbatch"))) == 3
    assert main(["sweep", str(path), "--emit", "slurm", "--out", "-"]) == 2  # three scripts cannot go to stdout
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "need 3 sbatch scripts at MaxArraySize 2" in err, err
    for value in (0, "many", True):
        path = write_sweep(tmp_path, data_dir, slurm={"max_array_size": value})
        assert main(["sweep", str(path), "--emit", "slurm", "--out", "-"]) == 2
        err = capsys.readouterr().err
        assert "field 'slurm.max_array_size'" in err and "MaxArraySize" in err, err
    assert main(["sweep", str(path), "--emit", "slurm", "--max_array_size", "0"]) == 2
    assert "--max_array_size 0" in capsys.readouterr().err


def test_progress_speaks_only_for_slow_work(capsys):
    quick = sweep_module.Progress("quick", 10, after=60)
    for i in range(10):
        quick.update(i)
    quick.done()
    assert capsys.readouterr().err == ""
    slow = sweep_module.Progress("slow", 10, after=0, every=0)
    for i in range(3):
        slow.update(i)
    slow.done()
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["slow: 0/10", "slow: 1/10", "slow: 2/10"] and lines[3].startswith("slow: done in ")


# ---- the check in a child, the recipe read once, the emitted files written as they are made ------------------
class Refusing(Counting):
    """The real fit parser, refusing every run's arguments (argparse's way)."""

    def parse_args(self, args):
        raise argparse.ArgumentError(None, f"bad value for --run_name {args[args.index('--run_name') + 1]}")


@pytest.fixture(params=["forked", "in place"])
def check_where(request):
    """Where FitCheck checks: forked (this process has one thread), or in place (another thread runs, as under
    pytest-xdist's worker, where it raised at construction, before any `first()` could hold it)."""
    if request.param == "forked":
        if threading.active_count() > 1:
            pytest.skip("threads run in this process (pytest-xdist's worker): FitCheck checks in place here")
        yield request.param
        return
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        yield request.param
    finally:
        done.set()
        other.join()


def test_the_fit_check_says_its_verdict_where_it_is_awaited(data_dir, tmp_path, parser, check_where):
    """FitCheck (forked where it may be, else in place) raises the check's SweepError, or a RuntimeError for a
    check that broke, in this process, at wait(); an error meanwhile is said after the check's own (`first`)."""
    sweep, _ = load_sweep(write_sweep(tmp_path, data_dir))
    fit_check(sweep, lambda: Counting(parser)).wait()  # good flags: nothing

    check = fit_check(sweep, lambda: Refusing(parser))
    with pytest.raises(sweep_module.SweepError, match=r"run tiny-baseline-seed0: bad value for --run_name"):
        with check.first():
            raise OSError("the store is down")  # the bad flag is the one line said, not this

    check = sweep_module.FitCheck(lambda: Refusing(parser))  # an error before the sweep is read (a bad file):
    with pytest.raises(OSError, match="bad sweep file"):  # that error is the line, the check ends unheard
        with check.first():
            raise OSError("bad sweep file")
    assert check.pid is None

    def broken():
        raise KeyError("no parser")

    with pytest.raises(RuntimeError, match="checking the sweep's fit flags failed: KeyError"):
        fit_check(sweep, broken).wait()


def fit_check(sweep, make_parser) -> sweep_module.FitCheck:
    """A FitCheck begun (forked where it may be) and handed `sweep`, as `lrattn sweep` does once it read the file."""
    check = sweep_module.FitCheck(make_parser)
    check.start(sweep, None, [])
    return check


def test_a_bad_flag_is_said_before_an_unreachable_store(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, data_dir, args={"trainer.max_steps": "many"})
    assert main(["sweep", str(path), "--tracking_uri", f"http://127.0.0.1:{free_port()}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lrattn: error: ") and "trainer.max_steps" in err and "many" in err, err


def test_the_recipe_is_read_once_for_every_run(data_dir, tmp_path, monkeypatch, capsys):
    """An emitted SLURM script asks for each run's checkpoint (runs_dir): the recipe was read and parsed once per
    run (100,000 reads for a lab's sweep); now once per command, plus fit's own parse per configuration."""
    from lrattn_lightning.tools.sweep import file as file_module

    monkeypatch.chdir(tmp_path)
    reads = []
    read = file_module.read_yaml_text
    monkeypatch.setattr(file_module, "read_yaml_text", lambda path, what: reads.append(what) or read(path, what))
    path = write_sweep(tmp_path, data_dir, ablations=["baseline"], seeds=list(range(30)))
    assert main(["sweep", str(path), "--emit", "slurm", "--tracking_uri", f"sqlite:///{tmp_path}/e.db"]) == 0
    assert reads.count("recipe") == 1, reads


@pytest.mark.parametrize("emit, size", [("commands", None), ("slurm", 1001), ("slurm", 4)])
def test_emitted_files_are_the_texts_the_emitters_make(data_dir, tmp_path, monkeypatch, capsys, emit, size):
    """What `--emit` writes line by line (a file or several, or stdout) is byte for byte emit_commands' or
    emit_slurm_parts' text, and --dry-run's listing is a line per run as print() wrote it."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/e.db"
    path = write_sweep(tmp_path, data_dir, seeds=list(range(5)), runs=variants(3))
    sweep, _ = load_sweep(path)
    steps = sweep_module.plan(sweep, uri)
    limit = ["--max_array_size", str(size)] if size else []
    if emit == "commands":
        expected = [sweep_module.emit_commands(sweep, steps, uri)]
    else:
        expected = sweep_module.emit_slurm_parts(sweep, steps, uri, max_array_size=size)
    out = tmp_path / "out" / f"emitted.{'sh' if emit == 'commands' else 'sbatch'}"
    assert main(["sweep", str(path), "--emit", emit, "--tracking_uri", uri, "--out", str(out), *limit]) == 0
    written = sorted(out.parent.iterdir())
    assert [p.read_text() for p in written] == expected and len(expected) == (4 if size == 4 else 1)
    if len(expected) == 1:
        capsys.readouterr()
        assert main(["sweep", str(path), "--emit", emit, "--tracking_uri", uri, "--out", "-", *limit]) == 0
        assert capsys.readouterr().out == expected[0]
    capsys.readouterr()
    assert main(["sweep", str(path), "--dry-run", "--tracking_uri", uri]) == 0
    listing = capsys.readouterr().out.splitlines(keepends=True)
    assert listing[1:] == [f"  {state:9s} {run.name}\n" for run, state in steps]


def test_the_forked_check_is_tested_under_xdist_too():
    """Under pytest-xdist the worker runs threads, so the tests above of the forked check (what `lrattn sweep` runs:
    its process has one thread) skip themselves there: here they run in a fresh pytest process of one thread, and
    must all pass, none skipped. Without xdist they ran above, and this has nothing to add."""
    if threading.active_count() == 1:
        pytest.skip("one thread: the forked check's tests ran in this process")
    from helpers.paths import REPO_ROOT

    picked = "shares_say_the_first_bad_run or stopped_check_ends or (verdict_where_it_is_awaited and forked)"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           __file__, "-k", picked], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    tail = done.stdout[-1500:] + done.stderr[-1500:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b5 passed\b", summary) and "skipped" not in summary, tail
