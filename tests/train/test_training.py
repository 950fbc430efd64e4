"""The training platform end to end: LightningCLI + litdata shards + a real MLflow store.

Everything runs the real `lrattn` command (in-process or as a subprocess) on tiny models.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers.prepare import four_window_corpus
from helpers.runs import REGISTRY, losses_by_step, run_cli, run_process, slr_fit_args, the_run
from helpers.tracking import free_port, mlflow_server

from lrattn_lightning.cli import main
from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.model.accounting import added_flops_percent, count_params
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.train.muon import resolve_muon_dtype


@pytest.mark.usefixtures("mlflow_store")
def test_fit_logs_everything_to_sqlite_mlflow(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(slr_fit_args(tiny_data)) == 0
    client, run = the_run(tmp_path)
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    reg = load_registry(REGISTRY)
    cfg = reg.model("tiny", "s-lr-grid-n4-r16")
    assert params["ablation"] == "s-lr-grid-n4-r16" and params["key_source"] == "sliced"
    assert params["rank"] == "16" and params["blocks"] == "4" and params["block_summary"] == "sum"
    assert params["key_norm"] == "rms" and params["embedding_key"] == "sliced" and params["d_model"] == "32"
    assert int(params["params"]) == count_params(cfg)
    assert float(params["added_flops_pct"]) == pytest.approx(added_flops_percent(cfg), rel=1e-4)
    assert tags["ablation"] == "s-lr-grid-n4-r16" and tags["control"] == "attnres-block-n8"
    assert tags["registry_sha256"] == reg.sha256 and tags["git_commit"]
    for key in ("train/loss", "train/ce", "val/loss", "val/bpb", "train/grad_norm", "train/device/items_per_sec",
                "train/lr/adamw", "train/lr/muon", "train/momentum/muon", "train/device/flops_per_sec",
                "train/tokens_seen", "routing/mean/entropy",
                "routing/mean/eff_sources", "routing/mean/top1", "routing/mean/embedding"):
        assert key in metrics, key
    assert not [k for k in metrics if k.startswith("routing/site")]  # per-site numbers live in routing/sites.json
    assert metrics["train/tokens_seen"] == 4 * 4 * 32  # after the 4th update: 4 steps x 4 sequences x 32 tokens
    sites = json.loads(Path(client.download_artifacts(run.info.run_id, "routing/sites.json", str(tmp_path))).read_text())
    assert [row["site"] for row in sites["sites"]] == [1, 2, 3, 4] and sites["step"] == 4
    assert sum(r["entropy"] for r in sites["sites"]) / 4 == pytest.approx(metrics["routing/mean/entropy"], rel=1e-5)
    for key, value in (("train_max_steps", "4"), ("train_batch_size", "4"), ("train_seq_len", "32"),
                       ("train_seed", "0"), ("train_precision", "32-true"), ("train_devices", "1"),
                       ("train_num_nodes", "1"), ("train_tokenizer", "byte"), ("train_muon_variant", "reference"),
                       ("train_muon_dtype", "auto"), ("train_muon_dtype_resolved", resolve_muon_dtype("auto", "cpu"))):
        assert params[key] == value, key
    parts = json.loads(tags["lrattn.recipe_parts"])  # float32 Muon is recipe; bfloat16 is the part's absence
    assert parts["optimizer"].get("muon_dtype", "bfloat16") == params["train_muon_dtype_resolved"]
    assert metrics["train/device/items_per_sec"] > 0
    # byte tokenizer: ~1 byte per token, so bits per byte ~ loss / ln 2
    assert metrics["val/bpb"] == pytest.approx(metrics["val/loss"] / 0.6931471805599453, rel=0.1)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "routing")}
    assert {"routing/heatmap.png", "routing/weights.json"} <= artifacts
    heatmap = Path(client.download_artifacts(run.info.run_id, "routing/heatmap.png", str(tmp_path)))
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # the checkpoint describes itself with plain values
    ckpt = torch.load(tmp_path / "runs/lrattn/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["model_config"]["ablation"]["name"] == "s-lr-grid-n4-r16"
    assert ckpt["mlflow"]["run_id"] == run.info.run_id
    assert ckpt["tokenizer"]["kind"] == "byte"


@pytest.mark.usefixtures("mlflow_store")
def test_a_trainer_built_in_python_records_what_lrattn_fit_records(tiny_data, tmp_path):
    """The module installs the MLflow and checkpoint callbacks itself (configure_callbacks)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger

    from lrattn_lightning.data.datamodule import TokenDataModule
    from lrattn_lightning.train.lit_module import LRAttnModule

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="py", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts"))
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=logger, limit_val_batches=1, val_check_interval=2,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    module = LRAttnModule.from_names(size="tiny", ablation="s-lr-grid-n4-r16", registry=REGISTRY, warmup_steps=1)
    trainer.fit(module, datamodule=TokenDataModule(str(tiny_data), batch_size=2, seq_len=16))
    client, run = the_run(tmp_path, "py")
    assert run.data.tags["ablation"] == "s-lr-grid-n4-r16" and run.data.params["train_seq_len"] == "16"
    assert "routing/heatmap.png" in {a.path for a in client.list_artifacts(run.info.run_id, "routing")}
    ckpt = torch.load(tmp_path / "ck/last.ckpt", weights_only=True)
    assert ckpt["tokenizer"]["kind"] == "byte" and ckpt["mlflow"]["run_id"] == run.info.run_id


def test_provenance_is_not_a_command_line_argument(tiny_data, tmp_path, monkeypatch, capsys):
    """The resolved config, registry hash and git commit come from the registry and git, never a flag."""
    monkeypatch.chdir(tmp_path)
    for flag, value in (("--model.git_commit", "fake"), ("--model.registry_sha256", "0"), ("--model.model_config", "{}")):
        assert main(slr_fit_args(tiny_data, flag, value)) == 2  # jsonargparse: a link target
        err = capsys.readouterr().err.strip()
        assert err == f"lrattn: error: {flag} is recorded by lrattn from the registry and git, not set by a flag; drop it"
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("mlflow_store")
def test_validate_and_test_a_checkpoint_log_into_its_training_run(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(slr_fit_args(tiny_data, steps=2)) == 0
    ckpt = tmp_path / "runs/lrattn/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt"
    common = ["--size", "tiny", "--ablation", "s-lr-grid-n4-r16", "--registry", REGISTRY, "--data.data_dir", str(tiny_data),
              "--data.batch_size", "4", "--trainer.limit_val_batches", "3", "--trainer.limit_test_batches", "3",
              "--trainer.enable_progress_bar", "false", "--ckpt_path", str(ckpt)]
    client, run = the_run(tmp_path)
    client.set_terminated(run.info.run_id, "KILLED")  # as a preempted fit leaves it
    assert main(["validate", *common]) == 0
    assert main(["test", *common]) == 0
    client, run = the_run(tmp_path)  # still one run: the training run
    assert run.info.status == "KILLED"  # scoring a checkpoint does not finish its run (a sweep would skip it)
    fit_val = client.get_metric_history(run.info.run_id, "val/loss")
    assert [m.step for m in fit_val] == [2]  # the fit's own: validate and test log beside it, under their names
    [validated] = client.get_metric_history(run.info.run_id, "validate/val/loss")
    [tested] = client.get_metric_history(run.info.run_id, "test/val/loss")
    assert validated.value == pytest.approx(tested.value, rel=1e-6)  # same weights, same held-out data
    assert validated.step == tested.step == 2  # at the checkpoint's step, not 0
    weights = json.loads(Path(client.download_artifacts(run.info.run_id, "routing/weights.json", str(tmp_path))).read_text())
    assert weights["step"] == 2


@pytest.mark.usefixtures("mlflow_store")
def test_a_fit_always_validates_its_final_weights(tiny_data, tmp_path, monkeypatch):
    """max_steps 3 with validation every 2 steps: the fit still ends with val/loss and a heatmap at step 3."""
    monkeypatch.chdir(tmp_path)
    assert main(slr_fit_args(tiny_data, steps=3)) == 0
    client, run = the_run(tmp_path)
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/loss"))
    assert steps == [2, 3]
    weights = json.loads(Path(client.download_artifacts(run.info.run_id, "routing/weights.json", str(tmp_path))).read_text())
    assert weights["step"] == 3
    assert len(list((tmp_path / "runs").rglob("*.ckpt"))) == 1  # one final checkpoint


@pytest.mark.usefixtures("mlflow_store")
def test_checkpoint_under_other_ablation_is_an_error(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(slr_fit_args(tiny_data, steps=2)) == 0
    ckpt = tmp_path / "runs/lrattn/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt"
    rc = main(slr_fit_args(tiny_data, "--ckpt_path", str(ckpt), "--run_name", "other", steps=3, ablation="baseline"))
    assert rc == 2
    assert "different architecture" in capsys.readouterr().err


@pytest.mark.usefixtures("mlflow_store")
def test_resume_after_sigkill_continues_the_same_loss_sequence(tiny_data, tmp_path):
    """An uninterrupted run and a run SIGKILLed at step 5 then resumed from last.ckpt log the same losses."""
    steps = 8
    full = run_cli(slr_fit_args(tiny_data, "--experiment", "full", steps=steps), tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    (tmp_path / "kill.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: run_hooks.KillAtStep\n      init_args: {step: 5}\n")
    killed = run_process(slr_fit_args(tiny_data, "--experiment", "killed", "--config", "kill.yaml", steps=steps),
                         tmp_path)
    assert killed.returncode == -signal.SIGKILL
    ckpt_dir = tmp_path / "runs/killed/tiny-s-lr-grid-n4-r16-seed0/checkpoints"
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 4  # lost at most one interval
    resumed = run_cli(slr_fit_args(tiny_data, "--experiment", "killed", "--ckpt_path", "last", steps=steps), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, run_full = the_run(tmp_path, "full")
    _, run_resumed = the_run(tmp_path, "killed")  # the resumed run logs into the same MLflow run
    a = losses_by_step(client, run_full.info.run_id)
    b = losses_by_step(client, run_resumed.info.run_id)
    assert sorted(a) == sorted(b) == list(range(steps))
    for step in range(steps):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, b)


@pytest.mark.usefixtures("mlflow_store")
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_data, tmp_path):
    (tmp_path / "poison.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: run_hooks.PoisonAtStep\n      init_args: {step: 3}\n")
    proc = run_cli(slr_fit_args(tiny_data, "--config", "poison.yaml", steps=6), tmp_path)
    assert proc.returncode == 3
    assert "non-finite training loss" in proc.stderr and "at step 3" in proc.stderr
    ckpt = torch.load(tmp_path / "runs/lrattn/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in ckpt["state_dict"].values())


@pytest.mark.slow
@pytest.mark.usefixtures("mlflow_store")
def test_ddp_two_processes_gloo_match_one_process(tmp_path):
    """2 ranks x batch 2 vs 1 rank x batch 4 on a train split of exactly 4 windows: every step's global
    batch is the whole split in both set-ups, so the rank-averaged losses must agree step by step."""
    data = four_window_corpus(tmp_path)
    common = ["--data.shuffle", "false", "--model.optimizer", "adamw", "--trainer.limit_val_batches", "1.0",
              "--trainer.val_check_interval", "1"]
    one = run_cli(slr_fit_args(data, *common, "--experiment", "one", steps=4), tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_process(slr_fit_args(data, *common, "--experiment", "two", "--data.batch_size", "2",
                                   "--trainer.devices", "2", "--trainer.strategy", "ddp", steps=4), tmp_path,
                      timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    client, r1 = the_run(tmp_path, "one")
    _, r2 = the_run(tmp_path, "two")
    a, b = losses_by_step(client, r1.info.run_id), losses_by_step(client, r2.info.run_id)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), (a, b)
    assert a[3] < a[0]
    assert r2.data.metrics["val/loss"] == pytest.approx(r1.data.metrics["val/loss"], rel=1e-4)


@pytest.mark.slow
def test_logs_to_a_real_mlflow_server_over_http(tiny_data, tmp_path):
    with mlflow_server(tmp_path) as (_, uri):
        proc = run_cli(slr_fit_args(tiny_data, "--tracking_uri", uri, steps=2), tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        client, run = the_run(None, uri=uri)
        assert run.data.params["ablation"] == "s-lr-grid-n4-r16"
        assert "val/loss" in run.data.metrics
        assert "routing/heatmap.png" in {a.path for a in client.list_artifacts(run.info.run_id, "routing")}
        assert not (tmp_path / "mlflow.db").exists()


# ---- bad input: a clear error before any work, nothing left behind ---------------------------------
def _fails(tmp_path, monkeypatch, capsys, args, *needles):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_unknown_names_suggest_closest(tiny_data, tmp_path, monkeypatch, capsys):
    args = slr_fit_args(tiny_data)
    args[args.index("--ablation") + 1] = "s-lr-blok-n8-r64"
    _fails(tmp_path, monkeypatch, capsys, args, "unknown ablation 's-lr-blok-n8-r64'", "s-lr-block-n8-r64")
    args = slr_fit_args(tiny_data)
    args[args.index("--size") + 1] = "tyni"
    _fails(tmp_path, monkeypatch, capsys, args, "unknown size 'tyni'", "tiny")


def test_missing_and_empty_data(tmp_path, monkeypatch, capsys):
    _fails(tmp_path, monkeypatch, capsys, slr_fit_args(tmp_path / "nope"), "lrattn prepare")
    (tmp_path / "empty").mkdir()
    _fails(tmp_path, monkeypatch, capsys, slr_fit_args(tmp_path / "empty"), "empty")


def test_corrupted_shard(tiny_data, tmp_path, monkeypatch, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_data, broken)
    chunk = sorted((broken / "train").glob("chunk-*.bin"))[0]
    chunk.write_bytes(chunk.read_bytes()[:100])
    _fails(tmp_path, monkeypatch, capsys, slr_fit_args(broken), str(chunk.name))


def test_sequence_longer_than_size(tiny_data, tmp_path, monkeypatch, capsys):
    _fails(tmp_path, monkeypatch, capsys, slr_fit_args(tiny_data, "--data.seq_len", "64"), "seq_len", "tiny")


def test_data_vocab_larger_than_model(tmp_path, monkeypatch, capsys):
    data = tmp_path / "bpe"
    prepare(source="stdlib-docs", out_dir=data, tokenizer="bpe:600", max_documents=60, val_fraction=0.2,
            cloze_items=0, perplexity_documents=0)
    _fails(tmp_path, monkeypatch, capsys, slr_fit_args(data), "vocab_size 600", "512")


def test_unreachable_server_fails_or_falls_back(tiny_data, tmp_path, monkeypatch, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    _fails(tmp_path, monkeypatch, capsys, slr_fit_args(tiny_data, "--tracking_uri", dead), "unreachable", "--mlflow_fallback_local")
    assert main(slr_fit_args(tiny_data, "--tracking_uri", dead, "--mlflow_fallback_local", "true", steps=2)) == 0
    the_run(tmp_path)
