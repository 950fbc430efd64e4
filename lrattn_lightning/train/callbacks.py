"""Callbacks: what a run records beside the model's math (MLflow, checkpoint contents) and the step monitors.

    RunDescription      at fit start: every resolved size/ablation field, the optimiser and recipe settings
                        as MLflow params (a new run only: a resumed run keeps its own), and the tags ablation,
                        size, control, git_commit, registry_sha256
    RoutingArtifacts    after each validation/test, at the step of the weights scored: routing/heatmap.png,
                        routing/weights.json, routing/sites.json (the gated residual: routing/gates.png,
                        routing/gates.json); the mean diagnostics are the module's metrics
    CheckpointContents  plain values in every checkpoint: the tokenizer spec (a file-backed tokenizer's text
                        under `content`), the data folder and the MLflow run (what `lrattn eval` rebuilds from)
    training_monitors   Lightning's LearningRateMonitor (`train/lr/<group>`: train/lr/muon, train/lr/adamw),
                        MuonMomentumMonitor (`train/momentum/muon`, scheduled with the LR) and TokenThroughput,
                        Lightning's ThroughputMonitor counting tokens (`train/device/items_per_sec`: tokens/s
                        on one device; `train/items_per_sec` over all devices when there are several)

`LRAttnModule.configure_callbacks` installs the first three, so a Trainer built in Python records what
`lrattn fit` records; `lrattn fit` adds the monitors (lightning_cli.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.loggers import MLFlowLogger

from lrattn_lightning.model.accounting import added_flops_percent, count_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.train import diagnostics

# the module's settings logged as `train_<name>` params
TRAIN_PARAMS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_variant", "muon_momentum",
                "muon_momentum_min", "muon_momentum_warmup_steps", "muon_momentum_cooldown_steps", "warmup_steps",
                "decay_fraction", "final_lr_fraction", "z_loss", "compile", "document_masking", "impl",
                "gate_freeze_steps", "gate_release_loss", "gate_grad_normalize")


def flat_run_params(cfg: ModelConfig) -> dict[str, Any]:
    """Every resolved size and ablation field as one flat, searchable dict (MLflow params)."""
    size, abl = cfg.to_dict()["size"], cfg.to_dict()["ablation"]
    params = {"size": size.pop("name"), "ablation": abl.pop("name")}
    params.update({k: v for k, v in size.items() if k != "doc"})
    params.update({k: ("null" if v is None else v) for k, v in abl.items() if k not in ("doc", "tags")})
    params["key_dim"] = cfg.key_dim if cfg.ablation.routing == "attnres" else 0
    params["block_ends"] = ",".join(map(str, cfg.block_ends())) or "full"
    params["params"] = count_params(cfg)
    params["added_flops_pct"] = round(added_flops_percent(cfg), 6)
    return params


def tokens_per_step(trainer: L.Trainer | None) -> int | None:
    """Tokens of one optimizer step over all devices, from the datamodule's batch_size and seq_len."""
    dm = trainer.datamodule if trainer is not None else None
    batch, seq = getattr(dm, "batch_size", None), getattr(dm, "seq_len", None)
    if not batch or not seq:
        return None
    return int(batch) * int(seq) * trainer.world_size * trainer.accumulate_grad_batches


def _mlflow(trainer: L.Trainer) -> MLFlowLogger | None:
    """The MLflow logger, on global rank zero outside the sanity check; None otherwise."""
    logger = trainer.logger
    if not isinstance(logger, MLFlowLogger) or trainer.sanity_checking or not trainer.is_global_zero:
        return None
    return logger


class RunDescription(Callback):
    """The run's params and tags at fit start (see module doc)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logger = _mlflow(trainer)
        if logger is None:
            return
        client, run_id, hp, cfg = logger.experiment, logger.run_id, pl_module.hparams, pl_module.cfg
        run = client.get_run(run_id)  # None when the store is unreachable (the logger drops the calls)
        if run is not None and "ablation" not in run.data.params:  # a resumed run keeps its original params
            logger.log_hyperparams({
                **flat_run_params(cfg),
                "registry_sha256": hp.registry_sha256,
                **{f"train_{k}": v for k, v in hp.items() if k in TRAIN_PARAMS},
                **recipe_params(trainer),
            })
        tags = {"ablation": cfg.ablation.name, "size": cfg.size.name, "control": cfg.ablation.control or "none",
                "git_commit": hp.git_commit, "registry_sha256": hp.registry_sha256}
        for key, value in tags.items():
            client.set_tag(run_id, key, value)


def recipe_params(trainer: L.Trainer) -> dict[str, Any]:
    """The training settings that decide a result, as flat params (also in config.yaml)."""
    dm = trainer.datamodule
    meta = getattr(dm, "meta", None) if dm is not None else None
    tokenizer = meta.get("tokenizer", {}) if isinstance(meta, dict) else {}
    return {
        "train_max_steps": trainer.max_steps,
        "train_batch_size": getattr(dm, "batch_size", None),
        "train_seq_len": getattr(dm, "seq_len", None),
        "train_tokens_per_step": tokens_per_step(trainer),
        "train_seed": os.environ.get("PL_GLOBAL_SEED"),
        "train_data_dir": str(getattr(dm, "data_dir", None)),
        "train_tokenizer": tokenizer.get("kind", "unknown") + (f":{tokenizer['vocab_size']}" if "vocab_size" in tokenizer else ""),
        "train_precision": str(trainer.precision),
        "train_devices": trainer.num_devices,
        "train_num_nodes": trainer.num_nodes,
        "train_accumulate_grad_batches": trainer.accumulate_grad_batches,
        "train_gradient_clip_val": trainer.gradient_clip_val,
    }


class RoutingArtifacts(Callback):
    """The routing of the first validation batch as MLflow artifacts (see module doc). Runs before the
    module's own epoch-end hook, which reports the mean diagnostics and clears `routing_weights`."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights, logger = getattr(pl_module, "routing_weights", None), _mlflow(trainer)
        if weights is None or logger is None:
            return
        import matplotlib.pyplot as plt

        cfg, step = pl_module.cfg, pl_module.report_step
        title = f"{cfg.ablation.name} @ {cfg.size.name}, step {step}"
        client, run_id = logger.experiment, logger.run_id
        if cfg.ablation.routing == "gated":
            stats = diagnostics.gate_stats(weights)
            alphas = [r["alpha"] for r in stats]
            fig = diagnostics.gate_figure({cfg.ablation.name: alphas}, title, initial=cfg.initial_gates())
            client.log_figure(run_id, fig, "routing/gates.png")
            client.log_dict(run_id, {"step": step, "held": pl_module.model.router.gates_held, "alpha": alphas,
                                     "saturated": [r["saturated"] for r in stats]}, "routing/gates.json")
        else:
            stats = diagnostics.site_stats(weights)  # per read site: one table per validation, not 4 x 2L metrics
            matrix = diagnostics.mean_weights(weights)
            fig = diagnostics.heatmap_figure(matrix, title)
            client.log_figure(run_id, fig, "routing/heatmap.png")
            client.log_dict(run_id, {"step": step, "sites_by_sources": matrix}, "routing/weights.json")
            client.log_dict(run_id, {"step": step, "sites": [{"site": j, **row} for j, row in enumerate(stats, 1)]},
                            "routing/sites.json")
        plt.close(fig)

    on_test_epoch_end = on_validation_epoch_end


class CheckpointContents(Callback):
    """The tokenizer, the data folder, the trained window (`--data.seq_len`) and the MLflow run in every
    checkpoint, as plain values."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        datamodule = trainer.datamodule
        meta = getattr(datamodule, "meta", None)
        if isinstance(meta, dict):  # what evaluation needs to rebuild the tokenizer
            spec = dict(meta["tokenizer"])
            if "file" in spec:  # file-backed tokenizers travel inside the checkpoint
                spec["content"] = (Path(datamodule.data_dir) / spec["file"]).read_text(encoding="utf-8")
            checkpoint["tokenizer"] = spec
            checkpoint["data"] = {"data_dir": str(Path(datamodule.data_dir).resolve()), "source": meta.get("source"),
                                  "seq_len": getattr(datamodule, "seq_len", None)}  # the trained window
        if isinstance(trainer.logger, MLFlowLogger):
            checkpoint["mlflow"] = {
                "run_id": trainer.logger.run_id,
                "experiment_id": trainer.logger.experiment_id,
                "tracking_uri": trainer.logger._tracking_uri,
            }


# ---- step monitors: `lrattn fit` installs them -----------------------------------------------------------
class MuonMomentumMonitor(Callback):
    """`train/momentum/<group>` of each Muon group at each logged step, beside LearningRateMonitor's
    `train/lr/<group>`: the momentum the scheduler (train/optim.py WarmupStableDecay) set for that step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:  # the live groups, also after a resume
                if group.get("use_muon"):
                    pl_module.log(f"train/momentum/{group.get('name', 'muon')}", group["momentum"])


def sequences_in(batch: torch.Tensor) -> int:
    return batch.shape[0]


def tokens_in(batch: torch.Tensor) -> int:
    """Predicted tokens of a batch of (B, T + 1) token windows: inputs are [:, :-1], targets [:, 1:]."""
    return batch.shape[0] * (batch.shape[1] - 1)


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor with samples = sequences and items = predicted tokens, and the module's
    `flops_per_batch` for FLOP/s (and MFU on a GPU Lightning knows). Each rate averages the steps since the
    previous log: the window spans log_every_n_steps optimizer steps."""

    def __init__(self) -> None:
        super().__init__(batch_size_fn=sequences_in, length_fn=tokens_in)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.kwargs["window_size"] = max(2, trainer.log_every_n_steps * trainer.accumulate_grad_batches + 1)
        super().setup(trainer, pl_module, stage)


def training_monitors() -> list[Callback]:
    """The step monitors of `lrattn fit`: learning rate, Muon momentum, tokens/s (see module doc)."""
    return [LearningRateMonitor(logging_interval="step"), MuonMomentumMonitor(), TokenThroughput()]
