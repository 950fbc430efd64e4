"""Sweeps and the comparison report end to end: real `lrattn fit` processes, a real sqlite MLflow store.

One sweep (2 tiny ablations x 2 seeds, 3 steps each) runs once per module; `compare` reads it back and
a copy of the store is resumed. Sweep files that fail before any run starts are test_sweep_file.py.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.cli import cli_env
from helpers.paths import REPO_ROOT, SWEEP_HOOKS
from helpers.prepare import prepared_corpus
from helpers.runs import SWEEP_ABLATIONS as ABLATIONS
from helpers.runs import run_cli, sweep_runs, write_sweep
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main
from lrattn_lightning.model.accounting import added_flops_percent, count_params
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.sweep.file import load_sweep

REPO = REPO_ROOT
REGISTRY = str(REPO / "registry.yaml")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepared_corpus(tmp_path_factory, 80)


def read_csv(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["ablation"]: row for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def finished_sweep(data_dir, tmp_path_factory) -> Path:
    """The sweep, run once: its folder holds mlflow.db, mlartifacts/ and runs/."""
    folder = tmp_path_factory.mktemp("sweep")
    sweep_file = write_sweep(folder, data_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert main(["sweep", str(sweep_file)]) == 0
    return folder


def test_sweep_lands_every_run_in_sqlite_mlflow(finished_sweep):
    runs = sweep_runs(f"sqlite:///{finished_sweep}/mlflow.db")
    seen = sorted((r.data.tags["ablation"], r.data.tags["seed"]) for r in runs)
    assert seen == [(a, s) for a in ABLATIONS for s in ("0", "1")]
    for run in runs:
        tags = run.data.tags
        assert run.info.status == "FINISHED"
        assert tags["sweep"] == "two-by-two" and tags["size"] == "tiny"
        assert run.info.run_name == f"tiny-{tags['ablation']}-seed{tags['seed']}"
        assert "val/loss" in run.data.metrics
        ckpt = finished_sweep / "runs/sweep-test" / run.info.run_name / "checkpoints/last.ckpt"
        assert ckpt.is_file()
    # seeds differ, so the runs of one ablation differ
    by = {(r.data.tags["ablation"], r.data.tags["seed"]): r.data.metrics["val/loss"] for r in runs}
    assert by[("baseline", "0")] != by[("baseline", "1")]


def test_compare_reads_the_table_and_figures_back(finished_sweep, monkeypatch, capsys):
    monkeypatch.chdir(finished_sweep)
    uri = f"sqlite:///{finished_sweep}/mlflow.db"
    # downstream scores, as the evaluation logs them onto the training runs, become columns when present
    for (ablation, seed), acc in {("s-lr-grid-n4-r16", "0"): 0.5, ("s-lr-grid-n4-r16", "1"): 0.7}.items():
        run = next(r for r in sweep_runs(uri) if (r.data.tags["ablation"], r.data.tags["seed"]) == (ablation, seed))
        MlflowClient(uri).log_metric(run.info.run_id, "eval/lrattn_cloze/acc", acc)
    assert main(["compare", "--experiment", "sweep-test", "--tracking_uri", uri, "--out", "report"]) == 0
    out = finished_sweep / "report"
    rows = read_csv(out / "table.csv")
    assert sorted(rows) == sorted(ABLATIONS)
    # one value checked against the run itself: the S-LR rows' seed-mean val loss and its per-seed values
    runs = {(r.data.tags["ablation"], r.data.tags["seed"]): r for r in sweep_runs(uri)}
    slr = rows["s-lr-grid-n4-r16"]
    losses = [runs[("s-lr-grid-n4-r16", s)].data.metrics["val/loss"] for s in ("0", "1")]
    assert float(slr["val_loss_mean"]) == pytest.approx(sum(losses) / 2, rel=1e-9)
    assert [float(v) for v in slr["val_loss_per_seed"].split(";")] == pytest.approx(losses, abs=1e-6)
    assert slr["n_seeds"] == "2" and slr["seeds"] == "0;1"
    cfg = load_registry(REGISTRY).model("tiny", "s-lr-grid-n4-r16")
    assert int(slr["params"]) == count_params(cfg)
    assert float(slr["added_flops_pct"]) == pytest.approx(added_flops_percent(cfg), rel=1e-4)
    base = [runs[("baseline", s)].data.metrics["val/loss"] for s in ("0", "1")]
    assert float(slr["delta_baseline"]) == pytest.approx(sum(losses) / 2 - sum(base) / 2, rel=1e-6)
    assert 0.0 <= float(slr["p_baseline"]) <= 1.0
    assert rows["baseline"]["delta_baseline"] == ""  # no difference of the reference to itself
    assert float(slr["tokens_per_s"]) > 0
    table_md = (out / "table.md").read_text()
    assert "| s-lr-grid-n4-r16" in table_md or "| **s-lr-grid-n4-r16**" in table_md
    assert "2 (0,1)" in table_md
    assert "lrattn_cloze/acc" in table_md.splitlines()[0] and "0.6000 ± 0.1414" in table_md
    assert float(slr["eval/lrattn_cloze/acc_mean"]) == pytest.approx(0.6)
    assert rows["baseline"]["eval/lrattn_cloze/acc_mean"] == ""
    for stem in ("loss_vs_flops", "training_curves", "routing_heatmaps"):
        png = (out / f"{stem}.png").read_bytes()
        assert png[:8] == PNG and len(png) > 5000, stem
        assert (out / f"{stem}.svg").stat().st_size > 0
    # everything is also an artifact of the experiment's summary run, in an experiment of its own
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sweep-test-reports")
    assert not client.search_runs([client.get_experiment_by_name("sweep-test").experiment_id], "tags.`lrattn.summary` = 'true'")
    summary = client.search_runs([exp.experiment_id], "tags.`lrattn.summary` = 'true'")
    assert len(summary) == 1
    artifacts = {a.path for a in client.list_artifacts(summary[0].info.run_id, "compare")}
    assert {"compare/table.md", "compare/table.csv", "compare/loss_vs_flops.png", "compare/report.md"} <= artifacts
    assert "val loss" in summary[0].data.tags["mlflow.note.content"]
    # a second compare reuses the summary run and is not read as a training run
    assert main(["compare", "--experiment", "sweep-test", "--tracking_uri", uri, "--out", "report"]) == 0
    assert len(client.search_runs([exp.experiment_id], "tags.`lrattn.summary` = 'true'")) == 1
    assert read_csv(out / "table.csv") == rows


def _copy_with_failed(finished_sweep: Path, folder: Path, *names: str) -> tuple[str, dict]:
    """A copy of the finished sweep whose runs `names` ended FAILED (the sweep resumes them)."""
    shutil.copytree(finished_sweep, folder, ignore=shutil.ignore_patterns("report"))
    uri = f"sqlite:///{folder}/mlflow.db"
    runs = {r.info.run_name: r for r in sweep_runs(uri)}
    for name in names:
        MlflowClient(uri).set_terminated(runs[name].info.run_id, "FAILED")
    return uri, {r.info.run_name: r for r in sweep_runs(uri)}


def test_a_resumed_sweep_resumes_the_interrupted_run_and_skips_one_finished_meanwhile(finished_sweep, tmp_path):
    """A copy of the finished sweep whose baseline runs ended FAILED, as if their processes had died after their
    checkpoints: the dry run plans both as resumes and the others as finished. The sweep then resumes seed 0 from
    its last.ckpt into its own MLflow run; MLflow is asked again right before each run, and seed 1 is skipped, as
    another process finished it after the plan. That process is seed 0's fit, which finishes seed 1 as it starts
    (sweep_hooks.FinishRun in the recipe). The other runs are not touched, and a sweep after it has nothing to run.
    The sweep runs in this process, its fits as processes."""
    folder = tmp_path / "copy"
    uri, runs = _copy_with_failed(finished_sweep, folder, "tiny-baseline-seed0", "tiny-baseline-seed1")
    interrupted, meanwhile = runs["tiny-baseline-seed0"], runs["tiny-baseline-seed1"]
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    recipe["trainer"]["callbacks"] = [{"class_path": "sweep_hooks.FinishRun", "init_args": {
        "uri": uri, "run_id": meanwhile.info.run_id}}]
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = {"PYTHONPATH": os.pathsep.join([str(SWEEP_HOOKS), cli_env()["PYTHONPATH"]])}
    planned = run_cli(["sweep", "sweep.yaml", "--dry-run", "--tracking_uri", uri], folder, **env)
    assert planned.returncode == 0, planned.stderr
    states = dict(line.split()[::-1] for line in planned.stdout.splitlines()[1:])
    assert states == {"tiny-baseline-seed0": "resume", "tiny-baseline-seed1": "resume",
                      "tiny-s-lr-grid-n4-r16-seed0": "finished", "tiny-s-lr-grid-n4-r16-seed1": "finished"}
    done = run_cli(["sweep", "sweep.yaml", "--tracking_uri", uri], folder, **env)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "2 finished (skipped), 2 to run" in out, out
    assert "(1/2) tiny-baseline-seed0 (resuming from last.ckpt)" in out, out
    assert "(2/2) tiny-baseline-seed1: skipped, finished meanwhile by another process" in out, out
    assert "done: 1 ran, 0 failed, 3 skipped as finished" in out, out
    after = {r.info.run_name: r for r in sweep_runs(uri)}
    assert sorted(after) == sorted(runs)  # the resumed run logged into its own MLflow run, no new one
    assert after["tiny-baseline-seed0"].info.run_id == interrupted.info.run_id
    assert after["tiny-baseline-seed0"].info.status == after["tiny-baseline-seed1"].info.status == "FINISHED"
    for name in ("tiny-s-lr-grid-n4-r16-seed0", "tiny-s-lr-grid-n4-r16-seed1"):  # the others were not touched
        assert after[name].info.end_time == runs[name].info.end_time
    again = run_cli(["sweep", "sweep.yaml", "--tracking_uri", uri], folder, **env)
    assert "4 finished (skipped), 0 to run" in again.stdout, again.stdout + again.stderr


def test_emit_commands_and_slurm_array(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/emit.db"
    path = write_sweep(tmp_path, data_dir, slurm={"time": "01:00:00", "max_parallel": 2})
    assert main(["sweep", str(path), "--emit", "commands", "--out", "cmds.sh", "--tracking_uri", uri]) == 0
    commands = [line for line in (tmp_path / "cmds.sh").read_text().splitlines() if not line.startswith("#")]
    lrattn = str(Path(sys.executable).parent / "lrattn")  # this environment's, by its path: no venv on PATH needed
    start = f"cd {tmp_path.resolve()} && env OMP_NUM_THREADS=1 {lrattn} fit --config recipe.yaml"
    assert len(commands) == 4 and all(c.startswith(start) for c in commands), commands
    assert "--ablation s-lr-grid-n4-r16 --seed_everything 1" in commands[3]
    assert main(["sweep", str(path), "--emit", "slurm", "--tracking_uri", uri]) == 0
    script = (tmp_path / "runs/sweep-test/sweep-two-by-two.sbatch").read_text()
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --nodes=1" in script
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --time=01:00:00" in script
    assert f'srun {lrattn} "${{ARGS[@]}}"' in script and "ARGS+=(--ckpt_path last)" in script
    assert f"\ncd {tmp_path.resolve()}\n" in script  # submitted from any folder, each task runs where it was emitted
    assert f"#SBATCH --output={tmp_path.resolve()}/runs/sweep-test/slurm/%x-%A_%a.out" in script
    assert "trainer.strategy auto" in script  # the script says which world srun's tasks form
    assert (tmp_path / "runs/sweep-test/slurm").is_dir()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # each array task's arguments parse back to the run's own fit arguments
    sweep, _ = load_sweep(path)
    task = subprocess.run(["bash", "-c", script.split('if [[ -f "$CKPT" ]]')[0].split("set -euo pipefail")[1]
                           + 'printf "%s\\n" "${ARGS[@]}"'], env={"SLURM_ARRAY_TASK_ID": "2", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)
    assert task.stdout.splitlines() == sweep.fit_args(sweep.runs[2], uri)
    assert json.loads(sweep.fit_args(sweep.runs[2])[sweep.fit_args(sweep.runs[2]).index("--run_tags") + 1]) == \
        {"sweep": "two-by-two", "seed": "1"}


# ---- training-time variants of one entry: their own runs, tags and comparison rows ---------------------
def test_variant_runs_carry_their_flags_and_get_their_own_rows(data_dir, tmp_path, monkeypatch, capsys):
    """The gated residual with and without a gate freeze: run names, tags, the flag reaching the module,
    the gate diagnostics (metrics, gates.json, the compare figure) and a row per variant."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = [{"size": "tiny", "ablation": "gated-alpha09", "seed": 0, "variant": "freeze2",
             "args": {"model.gate_freeze_steps": 2}}]
    path = write_sweep(tmp_path, data_dir, name="gates", ablations=["gated-alpha09"], seeds=[0], runs=runs)
    sweep, _ = load_sweep(path)
    assert [r.name for r in sweep.runs] == ["tiny-gated-alpha09-seed0", "tiny-gated-alpha09-freeze2-seed0"]
    args = sweep.fit_args(sweep.runs[1])
    assert args[-2:] == ["--model.gate_freeze_steps", "2"]
    assert json.loads(args[args.index("--run_tags") + 1]) == {"sweep": "gates", "seed": "0", "variant": "freeze2"}
    assert main(["sweep", str(path)]) == 0
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    by_name = {r.info.run_name: r for r in sweep_runs(uri)}
    assert set(by_name) == {"tiny-gated-alpha09-seed0", "tiny-gated-alpha09-freeze2-seed0"}
    frozen, plain = by_name["tiny-gated-alpha09-freeze2-seed0"], by_name["tiny-gated-alpha09-seed0"]
    assert frozen.data.tags["variant"] == "freeze2" and "variant" not in plain.data.tags
    held = sorted((m.step, m.value) for m in client.get_metric_history(frozen.info.run_id, "train/gates_held"))
    assert [v for _, v in held] == [1.0, 1.0, 0.0]  # steps 0, 1 held, released at step 2
    assert "train/gates_held" not in plain.data.metrics
    for run in (frozen, plain):
        metrics = run.data.metrics
        assert not [k for k in metrics if k.startswith("routing/site")]  # per sublayer: routing/gates.json
        assert 0.0 < metrics["routing/mean/alpha"] < 1.0 and "routing/mean/entropy" not in metrics
        gates = json.loads(Path(client.download_artifacts(run.info.run_id, "routing/gates.json", str(tmp_path))).read_text())
        assert len(gates["alpha"]) == 4 and gates["held"] is False
        assert sum(gates["alpha"]) / 4 == pytest.approx(metrics["routing/mean/alpha"], rel=1e-5)
        assert "routing/gates.png" in {a.path for a in client.list_artifacts(run.info.run_id, "routing")}
    capsys.readouterr()
    assert main(["sweep", str(path), "--dry-run"]) == 0  # the variant run is recognised as finished
    assert capsys.readouterr().out.count("  finished  ") == 2
    assert main(["compare", "--experiment", "sweep-test", "--tracking_uri", uri, "--out", "report"]) == 0
    rows = read_csv(tmp_path / "report/table.csv")
    assert set(rows) == {"gated-alpha09", "gated-alpha09+freeze2"}
    assert rows["gated-alpha09+freeze2"]["control"] == "gated-alpha09"
    assert float(rows["gated-alpha09+freeze2"]["delta_control"]) == pytest.approx(
        frozen.data.metrics["val/loss"] - plain.data.metrics["val/loss"], abs=1e-9)
    assert (tmp_path / "report/gate_alphas.png").read_bytes()[:8] == PNG
    assert "gate_alphas.png" in (tmp_path / "report/report.md").read_text()


# ---- two sweeps of one experiment at once ----------------------------------------------------------------
@pytest.mark.parametrize("lock", [".lock", ".sweep.lock"])  # a plain `lrattn fit` / another sweep
def test_a_run_held_by_a_live_process_is_skipped(finished_sweep, tmp_path, monkeypatch, capsys, lock):
    folder = tmp_path / "copy"
    uri, runs = _copy_with_failed(finished_sweep, folder, "tiny-baseline-seed1")
    run_dir = folder / "runs/sweep-test/tiny-baseline-seed1"
    holder = subprocess.Popen(  # a real process holding the lock as checkpoint/lock.py's FileLock takes it
        [sys.executable, "-c", "import sys; from lrattn_lightning.train.checkpoint.lock import FileLock; "
         "lock = FileLock(sys.argv[1]).acquire(blocking=False); print('held', flush=True); sys.stdin.read(); "
         "lock.release()",
         str(run_dir / lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.name != lock}  # checkpoints/, fit.log
    try:
        assert holder.stdout.readline() == "held\n"
        monkeypatch.chdir(folder)
        assert main(["sweep", "sweep.yaml", "--tracking_uri", uri]) == 0
    finally:
        holder.communicate("")
    out = capsys.readouterr().out
    who = "a live process holds its run folder" if lock == ".lock" else "another sweep runs it"
    assert f"(1/1) tiny-baseline-seed1: skipped, {who} (pid {holder.pid} on " in out, out
    assert "done: 0 ran, 0 failed, 3 skipped as finished, 1 skipped as running in another process" in out
    after = {r.info.run_name: r for r in sweep_runs(uri)}
    assert after["tiny-baseline-seed1"].info.status == "FAILED"  # not started here
    assert after["tiny-baseline-seed1"].info.end_time == runs["tiny-baseline-seed1"].info.end_time
    after = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.name != lock}
    assert after == before and sorted(before) == ["checkpoints", "fit.log"]  # the sweep left nothing of its own


def test_two_sweeps_at_once_run_each_run_exactly_once(data_dir, tmp_path):
    """Two real `lrattn sweep` processes started together on one sweep of one run and one sqlite store: both exit
    0, the run is trained by exactly one of them (the other skips it), and its MLflow history holds each step
    once. (A run held by another sweep's lock or finished meanwhile: the tests above.)"""
    path = write_sweep(tmp_path, data_dir, ablations=["baseline"], seeds=[0])
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    procs = [subprocess.Popen([sys.executable, "-m", "lrattn_lightning.cli", "sweep", str(path)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    both = "".join(outs)
    assert both.count("tiny-baseline-seed0: ok after") == 1, both  # trained by one sweep, skipped by the other
    assert sum(int(out.split("done: ")[1].split(" ran")[0]) for out in outs) == 1
    runs = sweep_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert [r.info.run_name for r in runs] == ["tiny-baseline-seed0"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for run in runs:
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1, 2]
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [3]


def test_a_run_another_sweep_file_finished_counts_as_finished(data_dir, tmp_path, monkeypatch, capsys):
    """A screen and a study in one experiment share a run (same name, same folder): the study skips it as
    finished instead of resuming it; a FINISHED run of the name without the sweep's tags, or of another name,
    does not count. A real sqlite store, runs created as `lrattn fit` tags them."""
    from lrattn_lightning.tools.sweep.sweep import finished_runs

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/shared.db"
    path = write_sweep(tmp_path, data_dir)
    sweep, _ = load_sweep(path)
    first, second, third = sweep.runs[:3]
    client = MlflowClient(uri)
    exp = client.create_experiment("sweep-test")
    for run, name, tags in ((first, first.name, {"sweep": "the-screen", "seed": str(first.seed)}),
                            (second, second.name, {}),  # a plain fit of the name: no sweep seed tag
                            (third, "someone-else", {"sweep": "the-screen", "seed": str(third.seed)})):
        made = client.create_run(exp, run_name=name, tags={"size": run.size, "ablation": run.ablation, **tags})
        client.set_terminated(made.info.run_id, "FINISHED")
    assert finished_runs(sweep, uri) == {first}
    assert main(["sweep", str(path), "--dry_run", "--tracking_uri", uri]) == 0
    assert f"finished  {first.name}" in capsys.readouterr().out


def test_a_dry_run_writes_nothing(data_dir, tmp_path, monkeypatch, capsys):
    """`lrattn sweep --dry-run` with the default store (sqlite:///mlflow.db in the working folder) lists the
    runs and leaves the folder as it was: no empty mlflow.db, no runs folder."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr("lrattn_lightning.train.store._USER_TRACKING_URI", None)
    folder = tmp_path / "work"
    folder.mkdir()
    path = write_sweep(folder, data_dir)
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.chdir(folder)
    assert main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("new ") == 4, out
    assert sorted(p.name for p in folder.iterdir()) == before  # recipe.yaml, sweep.yaml only


@pytest.mark.parametrize("argv, rc", [(["--dry-run"], 0), (["--emit", "commands", "--out", "-"], 0),
                                      ([], 2)])  # []: the local runs, stopped by the missing data before any fit
def test_one_command_reads_the_registry_once(tmp_path, monkeypatch, capsys, argv, rc):
    """`lrattn sweep` reads its registry file once (load_sweep) and hands the Registry down to the router check
    and the local runs: every read of a registry file ends in parse_registry, counted here as it runs."""
    from lrattn_lightning.model import registry as registry_module

    reads: list[str] = []
    parse = registry_module.parse_registry

    def counted(raw, **kwargs):
        reads.append(kwargs.get("path", "<dict>"))
        return parse(raw, **kwargs)

    monkeypatch.setattr(registry_module, "parse_registry", counted)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = write_sweep(tmp_path, tmp_path / "no-data")
    assert main(["sweep", str(path), "--tracking_uri", f"sqlite:///{tmp_path}/once.db", *argv]) == rc
    assert reads == [REGISTRY], (reads, capsys.readouterr())


def test_a_diverged_run_is_not_resumed_again(finished_sweep, tmp_path, monkeypatch, capsys):
    """A run that ended FAILED on a non-finite loss (what `lrattn fit` tags, tests/e2e/test_run_endings.py) would
    diverge again at the same step if resumed: the sweep says so and leaves it, and its exit code is not 0."""
    uri, runs = _copy_with_failed(finished_sweep, tmp_path / "copy", "tiny-baseline-seed1")
    diverged = runs["tiny-baseline-seed1"]
    MlflowClient(uri).set_tag(diverged.info.run_id, "lrattn.diverged", "non-finite training loss (nan) at step 2")
    monkeypatch.chdir(tmp_path / "copy")
    capsys.readouterr()
    assert main(["sweep", "sweep.yaml", "--dry-run", "--tracking_uri", uri]) == 0
    states = dict(line.split()[::-1] for line in capsys.readouterr().out.splitlines()[1:])
    assert states["tiny-baseline-seed1"] == "diverged"
    assert main(["sweep", "sweep.yaml", "--tracking_uri", uri]) == 1
    out = capsys.readouterr().out
    assert ("tiny-baseline-seed1: diverged (non-finite training loss (nan) at step 2); not resumed" in out
            and "3 finished (skipped), 0 to run" in out), out
    after = MlflowClient(uri).get_run(diverged.info.run_id)
    assert after.info.status == "FAILED" and after.info.end_time == diverged.info.end_time
    capsys.readouterr()
    assert main(["sweep", "sweep.yaml", "--emit", "commands", "--out", "-", "--tracking_uri", uri]) == 0
    assert "tiny-baseline-seed1" not in capsys.readouterr().out.split("skipped)", 1)[1]  # no command for it
