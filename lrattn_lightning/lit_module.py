"""The LightningModule: loss, optimiser groups, schedule, torchmetrics, MLflow-facing logging.

Checkpoints describe themselves with plain values: the resolved size and ablation as dicts, the
registry hash and the git commit sit in `hyper_parameters` (so `torch.load(weights_only=True)`
works), and the MLflow run id sits under `checkpoint["mlflow"]`. Resuming or loading a checkpoint
into a module built for a different size/ablation is an error.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import MLFlowLogger

from lrattn_lightning import diagnostics
from lrattn_lightning.accounting import added_flops_percent, count_params
from lrattn_lightning.config import ModelConfig
from lrattn_lightning.decoder import build_decoder
from lrattn_lightning.optim import (
    MUON_VARIANTS,
    MomentumSchedule,
    MuonVariant,
    WarmupStableDecay,
    build_optimizer,
)
from lrattn_lightning.registry import load_registry


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN/inf loss; the last saved checkpoint is the last good one."""


def current_git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, mean z-loss term logsumexp^2), both in float32."""
    logits = logits.float().flatten(0, 1)
    ce = F.cross_entropy(logits, targets.flatten())
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return ce, z


class LRAttnModule(L.LightningModule):
    def __init__(
        self,
        size: str = "small",
        ablation: str = "baseline",
        registry: str | None = None,
        optimizer: Literal["muon_adamw", "adamw"] = "muon_adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        muon_lr: float = 1e-3,
        muon_weight_decay: float = 0.1,
        muon_variant: MuonVariant = "reference",
        muon_momentum: float = 0.95,
        muon_momentum_min: float = 0.85,
        muon_momentum_warmup_steps: int = 300,
        muon_momentum_cooldown_steps: int = 100,
        warmup_steps: int = 2000,
        decay_fraction: float = 0.2,
        final_lr_fraction: float = 0.1,
        z_loss: float = 1e-5,
        compile: bool = False,
        impl: Literal["fast", "reference"] = "fast",
        document_masking: bool = False,
        routing_diagnostics: bool = True,
        model_config: dict | None = None,
        registry_sha256: str | None = None,
        git_commit: str | None = None,
        doc_separator: int | None = None,
    ):
        """size/ablation name registry entries; model_config (set when loading a checkpoint) wins over them.

        document_masking: attend only within documents (the paper's recipe); the separator is the data's
        EOS id, found at fit time and kept as `doc_separator` so checkpoints mask alike in evaluation.

        Optimiser (lrattn_lightning/optim.py): muon_variant picks the Muon update (`reference`: the paper's
        code, `torch`: torch.optim.Muon with match_rms_adamw); the Muon momentum rises from
        muon_momentum_min to muon_momentum over the first muon_momentum_warmup_steps and falls back over
        the last muon_momentum_cooldown_steps (0 and 0: constant)."""
        super().__init__()
        if model_config is None:
            reg = load_registry(registry)
            cfg = reg.model(size, ablation)
            model_config, registry_sha256 = cfg.to_dict(), reg.sha256
            git_commit = git_commit or current_git_commit()
        else:
            cfg = ModelConfig.from_dict(model_config)
            size, ablation = cfg.size.name, cfg.ablation.name
        self.save_hyperparameters(logger=False)
        # LightningCLI hands save_hyperparameters its own config; the resolved values must win.
        self.hparams.update(size=size, ablation=ablation, model_config=model_config,
                            registry_sha256=registry_sha256, git_commit=git_commit)
        self.cfg = cfg
        if muon_variant not in MUON_VARIANTS:
            raise ValueError(f"model.muon_variant: unknown '{muon_variant}'; use one of {', '.join(MUON_VARIANTS)}")
        self.momentum_schedule = MomentumSchedule(  # checked now, before any work
            peak=muon_momentum, low=muon_momentum_min, warmup_steps=muon_momentum_warmup_steps,
            cooldown_steps=muon_momentum_cooldown_steps)
        self.model = build_decoder(cfg, impl=impl)  # how routing is computed; not part of the architecture
        self.model.doc_separator = doc_separator if document_masking else None
        self.val_loss = torchmetrics.MeanMetric()
        self._routing_weights: list[torch.Tensor] | None = None
        self._step_clock: float | None = None

    # ---- model ---------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Document masking: the separator is the EOS id of the data the module trains or validates on."""
        if not self.hparams.document_masking:
            return
        meta = getattr(self.trainer.datamodule, "meta", None) if self._trainer is not None else None
        eos = meta.get("eos_id") if isinstance(meta, dict) else None
        if eos is None:
            eos = self.hparams.doc_separator
        if eos is None:
            raise ValueError("model.document_masking: the data names no EOS id (meta.json 'eos_id'); prepare the "
                             "data with `lrattn prepare`, or set --model.document_masking false")
        self.hparams.doc_separator = int(eos)
        self.model.doc_separator = int(eos)

    def configure_model(self) -> None:
        if self.hparams.compile and not getattr(self, "_compiled", False):
            self.model.compile()
            self._compiled = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        ce, z = token_losses(self.model(inputs), targets)
        loss = ce + self.hparams.z_loss * z
        bad = not bool(torch.isfinite(loss))
        if self.trainer.strategy.reduce_boolean_decision(bad, all=False):
            raise NonFiniteLossError(
                f"non-finite loss ({loss.item()}) at step {self.global_step}; training stopped. The last good "
                f"checkpoint is the newest one in the run's checkpoint folder (resume with --ckpt_path last)."
            )
        # averaged over ranks, so a DDP run logs the loss of its global batch
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/ce", ce, sync_dist=True)
        for group in self.optimizers().param_groups:  # the live groups, also after a resume
            self.log(f"train/lr_{group.get('name', 'group')}", group["lr"])
            if group.get("use_muon"):
                self.log(f"train/momentum_{group.get('name', 'group')}", group["momentum"])
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            self.log("train/grad_norm", norm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_clock = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        if self._step_clock is None:
            return
        seconds = time.perf_counter() - self._step_clock
        tokens = (batch.shape[1] - 1) * batch.shape[0] * self.trainer.world_size
        self.log("train/tokens_per_s", tokens / max(seconds, 1e-9), prog_bar=True)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimiser of `configure_optimizers`, without its schedule (`lrattn bench --step module`)."""
        hp = self.hparams
        return build_optimizer(
            self.model, kind=hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
            muon_lr=hp.muon_lr, muon_weight_decay=hp.muon_weight_decay, muon_momentum=hp.muon_momentum,
            muon_variant=hp.muon_variant,
        )

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        strategy = type(self.trainer.strategy).__name__
        if hp.optimizer == "muon_adamw" and "FSDP" in strategy:
            raise ValueError(
                "model.optimizer: Muon orthogonalises whole matrices, which FSDP shards across ranks; "
                "use --model.optimizer adamw with --trainer.strategy fsdp, or keep Muon with ddp"
            )
        opt = self.make_optimizer()
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        # one scheduler: the learning rate of every group and the momentum of the Muon group, per step
        schedule = WarmupStableDecay(opt, total, hp.warmup_steps, hp.decay_fraction, hp.final_lr_fraction,
                                     self.momentum_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ---- validation ----------------------------------------------------------------------------
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        record = batch_idx == 0 and self.hparams.routing_diagnostics and self.cfg.ablation.routing == "attnres"
        out = self.model(inputs, return_routing=record)
        logits = out.logits if record else out
        if record:
            self._routing_weights = out.routing
        ce, _ = token_losses(logits, targets)
        self.val_loss.update(ce, weight=targets.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        bytes_per_token = getattr(self.trainer.datamodule, "bytes_per_token", None) if self.trainer.datamodule else None
        if callable(bytes_per_token):
            bpt = bytes_per_token("val")
            if bpt:
                self.log("val/bpb", loss / math.log(2) / bpt)
        if self._routing_weights is not None:
            self._log_routing(self._routing_weights)
            self._routing_weights = None

    def _log_routing(self, weights: list[torch.Tensor]) -> None:
        stats = diagnostics.site_stats(weights)
        for j, row in enumerate(stats, start=1):
            for stat, value in row.items():
                self.log(f"routing/site{j:02d}/{stat}", value)
        for stat in diagnostics.STATS:
            self.log(f"routing/mean/{stat}", sum(r[stat] for r in stats) / len(stats))
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        if isinstance(self.logger, MLFlowLogger):
            matrix = diagnostics.mean_weights(weights)
            fig = diagnostics.heatmap_figure(
                matrix, f"{self.cfg.ablation.name} @ {self.cfg.size.name}, step {self.global_step}"
            )
            client, run_id = self.logger.experiment, self.logger.run_id
            client.log_figure(run_id, fig, "routing/heatmap.png")
            client.log_dict(run_id, {"step": self.global_step, "sites_by_sources": matrix}, "routing/weights.json")
            import matplotlib.pyplot as plt

            plt.close(fig)

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end

    # ---- run description -----------------------------------------------------------------------
    def on_fit_start(self) -> None:
        if not isinstance(self.logger, MLFlowLogger) or not self.trainer.is_global_zero:
            return
        client, run_id = self.logger.experiment, self.logger.run_id
        run = client.get_run(run_id)
        if "ablation" not in run.data.params:  # a resumed run keeps its original params
            self.logger.log_hyperparams({
                **flat_run_params(self.cfg),
                "registry_sha256": self.hparams.registry_sha256,
                **{f"train_{k}": v for k, v in self.hparams.items()
                   if k in ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_variant",
                            "muon_momentum", "muon_momentum_min", "muon_momentum_warmup_steps",
                            "muon_momentum_cooldown_steps", "warmup_steps", "decay_fraction", "final_lr_fraction",
                            "z_loss", "compile")},
            })
        tags = {
            "ablation": self.cfg.ablation.name,
            "size": self.cfg.size.name,
            "control": self.cfg.ablation.control or "none",
            "git_commit": self.hparams.git_commit,
            "registry_sha256": self.hparams.registry_sha256,
        }
        for key, value in tags.items():
            client.set_tag(run_id, key, value)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        meta = getattr(datamodule, "meta", None)
        if isinstance(meta, dict):  # what evaluation needs to rebuild the tokenizer, as plain values
            spec = dict(meta["tokenizer"])
            if "file" in spec:  # file-backed tokenizers travel inside the checkpoint
                spec["content"] = (Path(datamodule.data_dir) / spec["file"]).read_text(encoding="utf-8")
            checkpoint["tokenizer"] = spec
            checkpoint["data"] = {"data_dir": str(Path(datamodule.data_dir).resolve()), "source": meta.get("source")}
        if isinstance(self.logger, MLFlowLogger):
            checkpoint["mlflow"] = {
                "run_id": self.logger.run_id,
                "experiment_id": self.logger.experiment_id,
                "tracking_uri": self.logger._tracking_uri,
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        stored = checkpoint.get("hyper_parameters", {}).get("model_config")
        if stored is None:
            raise ValueError("checkpoint has no 'model_config' hyper-parameter: it was not written by lrattn_lightning")
        diffs = architecture_differences(stored, self.cfg)
        if diffs:
            raise ValueError(
                "checkpoint was trained with a different architecture; pass the same --size/--ablation "
                f"({stored['size']['name']} / {stored['ablation']['name']}). Differences: " + "; ".join(diffs)
            )


def architecture_differences(stored: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """Fields (docs aside) where a checkpoint's model_config differs from `cfg`, as readable lines."""
    mine = cfg.to_dict()
    return [
        f"{part}.{key}: checkpoint {stored[part].get(key)!r} vs now {value!r}"
        for part in ("size", "ablation") for key, value in mine[part].items()
        if key != "doc" and _plain(stored[part].get(key)) != _plain(value)
    ]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
