"""`--trainer.strategy fsdp` (FSDP2 through Lightning's ModelParallelStrategy) on two CPU (gloo) ranks: the same
run as one process, step by step, with AdamW and with both Muon variants (whole matrices gathered)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT
from helpers.prepare import four_window_corpus
from helpers.runs import (
    assert_same_losses,
    ckpt_dir,
    fit_args,
    hooks,
    losses_by_step,
    metric_history,
    run_cli,
    run_process,
    slr_fit_args,
    step_of,
    the_run,
)


@pytest.fixture(scope="module")
def four_windows(tmp_path_factory) -> Path:
    """The DDP test's corpus: a train split of exactly 4 windows (helpers.prepare.four_window_corpus)."""
    return four_window_corpus(tmp_path_factory.mktemp("fsdp"))


def _common(steps: int, *extra: str) -> list[str]:
    return ["--data.shuffle", "false", "--trainer.limit_val_batches", "1.0", "--trainer.val_check_interval",
            str(steps // 2), "--trainer.check_val_every_n_epoch", "null", "--model.warmup_steps", "2",
            "--trainer.gradient_clip_val", "1.0", *extra]


def _fsdp_args(data: Path, ablation: str, *extra: str, steps: int = 12) -> list[str]:
    """The pair's two-rank FSDP fit (batch 2 a rank), without its experiment."""
    return slr_fit_args(data, *_common(steps, *extra), "--data.batch_size", "2", "--trainer.devices", "2",
                        "--trainer.strategy", "fsdp", ablation=ablation, steps=steps)


def _pair(data: Path, tmp_path: Path, ablation: str, *extra: str, steps: int = 12):
    one = run_cli(slr_fit_args(data, *_common(steps, *extra), "--experiment", "one", ablation=ablation, steps=steps),
                  tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_process([*_fsdp_args(data, ablation, *extra, steps=steps), "--experiment", "two"], tmp_path,
                      timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    client, r1 = the_run(tmp_path, "one")
    _, r2 = the_run(tmp_path, "two")
    return client, r1, r2


# the paper's Muon (reference variant, bfloat16 orthogonaliser) on the P-LR block entry: its pair below, and its
# FSDP run the uninterrupted one the stop test resumes to
MUON = ("p-lr-block-n4-r32", "--model.optimizer", "muon_adamw", "--model.muon_lr", "0.02")
REFERENCE = ("--model.muon_variant", "reference", "--model.muon_dtype", "bfloat16")


@pytest.fixture(scope="module")
def reference_muon_pair(four_windows, seeded_folder):
    """The pair (one process, two FSDP ranks) of the paper's Muon, run once for the two tests that read it:
    (folder, client, one's run, two's run)."""
    folder = seeded_folder("fsdp-muon-reference")
    return (folder, *_pair(four_windows, folder, *MUON, *REFERENCE))


@pytest.mark.usefixtures("mlflow_store")
@pytest.mark.slow
@pytest.mark.parametrize("ablation", ["baseline", "attnres-full"])  # P-LR block: the Muon runs below (AdamW beside)
def test_fsdp_on_two_cpu_ranks_equals_one_process_with_adamw(four_windows, tmp_path, ablation):
    client, r1, r2 = _pair(four_windows, tmp_path, ablation, "--model.optimizer", "adamw")
    a, b = losses_by_step(client, r1.info.run_id), losses_by_step(client, r2.info.run_id)
    assert sorted(a) == sorted(b) == list(range(12))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-5), (step, a, b)
    assert a[11] < a[0]
    assert r2.data.metrics["val/loss"] == pytest.approx(r1.data.metrics["val/loss"], rel=1e-5)
    assert r2.data.params["train_strategy"] == "fsdp"


@pytest.mark.usefixtures("mlflow_store")
@pytest.mark.slow
@pytest.mark.parametrize("variant, dtype, rel", [("reference", "bfloat16", 2e-3), ("torch", "float32", 1e-4)])
def test_muon_under_fsdp_orthogonalises_whole_matrices_as_one_process_does(four_windows, tmp_path, request, variant,
                                                                           dtype, rel):
    """Muon's matrices are sharded by rows under FSDP2; each step gathers the whole momentum direction (in the
    orthogonaliser's dtype), every rank orthogonalises each shape's batch of them and keeps its rows. The losses
    follow the one-process run's at bf16 tolerance for bfloat16 (the orthogonalisers round to it between iterations,
    and the reduce-scatter sums in another order), and closer for float32. Each variant and each dtype once (the
    gather does not depend on the variant, nor the variant's step on the dtype: both variants at both dtypes in one
    process are tests/train/test_muon_dtype.py's)."""
    if variant == "reference":
        _, client, r1, r2 = request.getfixturevalue("reference_muon_pair")
    else:
        client, r1, r2 = _pair(four_windows, tmp_path, *MUON, "--model.muon_variant", variant, "--model.muon_dtype",
                               dtype)
    a, b = losses_by_step(client, r1.info.run_id), losses_by_step(client, r2.info.run_id)
    assert sorted(a) == sorted(b) == list(range(12))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=rel), (step, a, b)
    assert r2.data.params["train_muon_dtype_resolved"] == dtype
    assert a[11] < a[0] - 0.1  # Muon trains: not a run that stands still
    assert r2.data.params["train_optimizer"] == "muon_adamw"


@pytest.mark.slow
def test_an_fsdp_run_stops_together_resumes_exactly_and_its_checkpoint_serves_every_command(
        four_windows, reference_muon_pair, monkeypatch, capsys):
    """Two FSDP ranks with the paper's Muon (reference variant: momentum buffers sharded, the neuron-wise
    second moment whole), the pair's FSDP run above: SIGTERM to rank 1 before step 3; the ranks agree, save step 4
    (one full-state file, gathered on rank 0) and exit 143. The resume crosses warmup-stable into the decay and
    equals the uninterrupted run (the pair's) at every later step and validation. (Its four windows make every step
    an epoch: a resume within an epoch is the DDP stop's, tests/e2e/test_resilience.py.) The checkpoint then serves
    validate, generate and export in one process."""

    from lrattn_lightning.cli import main

    folder, client, _, full = reference_muon_pair
    fsdp = _fsdp_args(four_windows, *MUON, *REFERENCE)
    stopped = run_process([*fsdp, "--experiment", "stopped", "--config",
                           hooks(folder, "term.yaml", ("SigtermAtStep", {"step": 3, "rank": 1}))], folder, timeout=400)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "lrattn: stopped by SIGTERM at step 4" in stopped.stderr
    last = ckpt_dir(folder, "stopped", "tiny-p-lr-block-n4-r32-seed0") / "last.ckpt"
    assert last.is_file() and step_of(last) == 4  # one file, not a folder of shards
    resumed = run_process([*fsdp, "--experiment", "stopped", "--ckpt_path", "last"], folder, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, run = the_run(folder, "stopped")
    assert_same_losses(metric_history(client, run.info.run_id), metric_history(client, full.info.run_id))
    vals = [metric_history(client, r.info.run_id, "val/loss") for r in (run, full)]
    assert [s for s, _ in vals[0]] == [s for s, _ in vals[1]] == [6, 12]
    for (_, a), (_, b) in zip(*vals, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    monkeypatch.chdir(folder)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["validate", "--ckpt_path", str(last), "--trainer.limit_val_batches", "2",
                 "--trainer.enable_progress_bar", "false"]) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(last), "--prompt", "def ", "--max_new_tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["export", "--checkpoint", str(last), "--out", str(folder / "hf")]) == 0
    assert (folder / "hf" / "model.safetensors").is_file()


def test_the_slurm_emission_of_the_fsdp_recipe_names_its_strategy(tmp_path, monkeypatch):
    """experiments/fsdp-7b-multinode.yaml as a one-run sweep, emitted for SLURM: 4 nodes x 8 tasks, FSDP2."""
    import yaml

    from lrattn_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = REPO_ROOT / "experiments" / "fsdp-7b-multinode.yaml"
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "seven", "doc": "one 7B run", "recipe": str(recipe), "sizes": ["d4096-7b"],
        "ablations": ["p-lr-block-n8-r32"], "seeds": [0]}))
    assert main(["sweep", "sweep.yaml", "--emit", "slurm", "--out", "seven.sbatch",
                 "--tracking_uri", f"sqlite:///{tmp_path}/emit.db"]) == 0
    script = (tmp_path / "seven.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "FSDP2 world" in script and "trainer.strategy fsdp" in script


def test_fsdp_without_a_number_of_devices_is_one_line_before_any_work(data, tmp_path, monkeypatch, capsys):

    from lrattn_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = fit_args(data, "--trainer.strategy", "fsdp", "--trainer.devices", "auto")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "lrattn: error: --trainer.strategy fsdp needs --trainer.devices N (a number of devices per " \
                      "node), got 'auto'", err
    assert not (tmp_path / "runs").exists()
