"""The LightningModule: loss, optimiser groups, schedule, metrics (train/*, val/*, routing/mean/*).

Checkpoints describe themselves with plain values: the resolved size and ablation as dicts, the
registry hash and the git commit sit in `hyper_parameters` (so `torch.load(weights_only=True)`
works); the tokenizer, data folder and MLflow run are added by train/callbacks.py, which the module
installs itself (`configure_callbacks`) with the MLflow params, tags and routing figures. Resuming or
loading a checkpoint into a module built for a different size/ablation is an error.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm

from lrattn_lightning.data.shards import bits_per_byte
from lrattn_lightning.errors import InputError
from lrattn_lightning.model.accounting import model_flops_per_token
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.model.routing.base import compile_impl
from lrattn_lightning.model.routing.kinds import check_training_options
from lrattn_lightning.train import diagnostics
from lrattn_lightning.train.callbacks import (
    CheckpointContents,
    RoutingArtifacts,
    RunDescription,
    tokens_per_step,
)
from lrattn_lightning.train.checkpointing import NonFiniteLossError
from lrattn_lightning.train.optim import (
    MUON_VARIANTS,
    MomentumSchedule,
    MuonVariant,
    WarmupStableDecay,
    build_optimizer,
    sharded_grad_norm,
)


def current_git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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
        allow_schedule_change: bool = False,
        z_loss: float = 1e-5,
        compile: bool = False,
        impl: Literal["fast", "reference", "compiled", "triton"] = "fast",
        document_masking: bool = False,
        attention: Literal["sdpa", "flex"] = "sdpa",
        routing_diagnostics: bool = True,
        gate_freeze_steps: int = 0,
        gate_release_loss: float | None = None,
        gate_grad_normalize: bool = False,
        model_config: dict | None = None,
        registry_sha256: str | None = None,
        git_commit: str | None = None,
        doc_separator: int | None = None,
    ):
        """size/ablation name registry entries; model_config (set when loading a checkpoint) wins over them.

        document_masking: attend only within documents (the paper's recipe); the separator is the data's
        EOS id, found at fit time and kept as `doc_separator` so checkpoints mask alike in evaluation.
        attention: how that mask reaches the token attention, `sdpa` (a dense mask) or `flex` (FlexAttention's
        block mask: skips cross-document blocks, CUDA for training); the same results (model/decoder.py).

        Optimiser (lrattn_lightning/train/optim.py): muon_variant picks the Muon update (`reference`: the paper's
        code, `torch`: torch.optim.Muon with match_rms_adamw); the Muon momentum rises from
        muon_momentum_min to muon_momentum over the first muon_momentum_warmup_steps and falls back over
        the last muon_momentum_cooldown_steps (0 and 0: constant).

        Gated residual only (routing: gated; lrattn_lightning/model/routing/gated.py, docs/gated-residual.md):
        gate_freeze_steps holds every gate at alpha = 0.5 for the first N optimiser steps; gate_release_loss
        holds it until a step's training cross-entropy (mean over ranks) is <= X (with both: until both are
        met); the release is for good and the hold travels in checkpoints. gate_grad_normalize replaces the
        gradient reaching each sublayer's gate tensor alpha by G / (||G|| + 1e-6), clipped to |.| < 1."""
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
            raise InputError(f"model.muon_variant: unknown '{muon_variant}'; use one of {', '.join(MUON_VARIANTS)}")
        self.momentum_schedule = MomentumSchedule(  # checked now, before any work
            peak=muon_momentum, low=muon_momentum_min, warmup_steps=muon_momentum_warmup_steps,
            cooldown_steps=muon_momentum_cooldown_steps)
        # how AttnRes is computed, not part of the architecture; compiled: the backend torch.compile traces
        self.model = build_decoder(cfg, impl=compile_impl(impl) if compile else impl, attention=attention)
        self.model.doc_separator = doc_separator if document_masking else None
        # Lightning's model summary counts the FLOPs of one forward of this (one window; was "Total FLOPs: 0")
        self.example_input_array = torch.zeros(1, cfg.size.seq_len, dtype=torch.long)
        self._check_gate_schedule(cfg)
        self._last_train_ce: float | None = None
        self.val_loss = torchmetrics.MeanMetric()
        self.routing_weights: list[torch.Tensor] | None = None  # of a validation's first batch, for the diagnostics
        self._loaded_step: int | None = None
        self._step_losses: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, ce) per micro-batch of this step
        self.last_validated_step: int | None = None

    # ---- the gated residual's training-time controls --------------------------------------------
    def _check_gate_schedule(self, cfg: ModelConfig) -> None:
        hp = self.hparams
        given = {"gate_freeze_steps": hp.gate_freeze_steps != 0, "gate_release_loss": hp.gate_release_loss is not None,
                 "gate_grad_normalize": bool(hp.gate_grad_normalize)}
        check_training_options(cfg, given)  # a flag no part of this routing kind reads is one line
        if not set(given) <= set(cfg.kind.training_options):
            return
        steps = hp.gate_freeze_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InputError(f"model.gate_freeze_steps: must be an integer >= 0 (steps with alpha held at 0.5), got {steps!r}")
        loss = hp.gate_release_loss
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, int | float) or not 0 < loss < math.inf):
            raise InputError(f"model.gate_release_loss: must be a positive training loss in nats or null, got {loss!r}")
        if not isinstance(hp.gate_grad_normalize, bool):
            raise InputError(f"model.gate_grad_normalize: must be true or false, got {hp.gate_grad_normalize!r}")
        router = self.model.router
        router.gate_grad_normalize = hp.gate_grad_normalize
        router.set_gate_hold(self._gate_schedule_active)  # a checkpoint's stored hold replaces this on load

    @property
    def _gate_schedule_active(self) -> bool:
        return "gate_freeze_steps" in self.cfg.kind.training_options and (
            self.hparams.gate_freeze_steps > 0 or self.hparams.gate_release_loss is not None)

    def _update_gate_hold(self) -> None:
        """Release held gates once the step count and the loss allow it (for good: a release is not undone)."""
        router = self.model.router
        if not self._gate_schedule_active or not router.gates_held:
            return
        hp = self.hparams
        if self.global_step < hp.gate_freeze_steps:
            return
        if hp.gate_release_loss is not None and (self._last_train_ce is None or self._last_train_ce > hp.gate_release_loss):
            return
        router.set_gate_hold(False)

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
            raise InputError("model.document_masking: the data names no EOS id (meta.json 'eos_id'); prepare the "
                             "data with `lrattn prepare`, or set --model.document_masking false")
        self.hparams.doc_separator = int(eos)
        self.model.doc_separator = int(eos)

    def configure_model(self) -> None:
        """FSDP (`--trainer.strategy fsdp`: Lightning's ModelParallelStrategy, which hands us its device mesh):
        FSDP2's fully_shard on every attention and MLP (the modules the decoder calls) and on the decoder (the
        embedding, the router, the head); then torch.compile when asked."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not getattr(self, "_sharded", False):
            from torch.distributed.fsdp import fully_shard

            dp = mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer.attn, mesh=dp)
                fully_shard(layer.mlp, mesh=dp)
            fully_shard(self.model, mesh=dp)
            self._sharded = True
            self.example_input_array = None  # the summary's FLOPs forward would run on rank 0 alone
        if self.hparams.compile:
            self.compile_step()

    def compile_step(self, backend: str = "inductor") -> None:
        """torch.compile the decoder, and the training loss as one region with it: Inductor then fuses the
        head's cross-entropy and z-loss passes (at `small` on CPU a step takes ~450 ms this way against
        ~580 ms with the decoder compiled alone and ~615 ms eager). Idempotent."""
        if getattr(self, "_compiled_losses", None) is not None:
            return
        self.model.compile(backend=backend)
        self._compiled_losses = torch.compile(self.model_losses, backend=backend)

    def model_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, z-loss term) of the decoder on `inputs` against `targets` (token_losses)."""
        return token_losses(self.model(inputs), targets)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        ce, z = (getattr(self, "_compiled_losses", None) or self.model_losses)(inputs, targets)
        loss = ce + self.hparams.z_loss * z
        bad = not bool(torch.isfinite(loss))
        if self.trainer.strategy.reduce_boolean_decision(bad, all=False):
            raise NonFiniteLossError(f"non-finite training loss ({loss.item()}) at step {self.global_step}")
        self._step_losses.append((loss.detach(), ce.detach()))  # logged once per optimizer step (below)
        if self._gate_schedule_active:
            self.log("train/gates_held", float(self.model.router.gates_held))
            if self.hparams.gate_release_loss is not None and self.model.router.gates_held:
                self._last_train_ce = float(self.trainer.strategy.reduce(ce.detach(), reduce_op="mean"))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # the loss of the global batch: the mean over this step's micro-batches (gradient accumulation)
        # and over ranks (DDP); Lightning alone would log the last micro-batch's
        if self._step_losses:
            loss, ce = (torch.stack(column).mean() for column in zip(*self._step_losses, strict=True))
            self._step_losses.clear()
            self.log("train/loss", loss, prog_bar=True, sync_dist=True)
            self.log("train/ce", ce, sync_dist=True)
        per_step = tokens_per_step(self._trainer) if self._trainer is not None else None
        if per_step:  # tokens trained on once this step is taken
            self.log("train/tokens_seen", float((self.global_step + 1) * per_step))
        if getattr(self, "_sharded", False):  # FSDP: the total over every rank's shards
            self.log("train/grad_norm", sharded_grad_norm(self.model))
            return
        norms = grad_norm(self.model, norm_type=2)  # Lightning's: per parameter and the total, before clipping
        if norms:
            self.log("train/grad_norm", norms["grad_2.0_norm_total"])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._update_gate_hold()


    @property
    def flops_per_batch(self) -> int | None:
        """Model FLOPs of one batch on one device (training: x3), from the data's batch_size and seq_len:
        ThroughputMonitor's FLOP/s and MFU (train/callbacks.py TokenThroughput)."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        batch, seq = getattr(dm, "batch_size", None), getattr(dm, "seq_len", None)
        if not batch or not seq:
            return None
        cfg = ModelConfig(dataclasses.replace(self.cfg.size, seq_len=int(seq)), self.cfg.ablation)
        return model_flops_per_token(cfg, training=self.trainer.training) * int(batch) * int(seq)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimiser of `configure_optimizers`, without its schedule (`lrattn bench`'s train step)."""
        hp = self.hparams
        return build_optimizer(
            self.model, kind=hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
            muon_lr=hp.muon_lr, muon_weight_decay=hp.muon_weight_decay, muon_momentum=hp.muon_momentum,
            muon_variant=hp.muon_variant,
        )

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        if hp.optimizer == "muon_adamw" and "FSDP" in type(self.trainer.strategy).__name__:
            raise InputError("model.optimizer: Muon under Lightning's FSDPStrategy (FSDP1) is not supported; use "
                             "--trainer.strategy fsdp (FSDP2, which Muon gathers whole matrices under), or ddp")
        opt = self.make_optimizer()
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        # one scheduler: the learning rate of every group and the momentum of the Muon group, per step;
        # its name is LearningRateMonitor's metric prefix: train/lr/muon, train/lr/adamw
        schedule = WarmupStableDecay(opt, total, hp.warmup_steps, hp.decay_fraction, hp.final_lr_fraction,
                                     self.momentum_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step", "name": "train/lr"}}

    def configure_callbacks(self) -> list[Callback]:
        """What every run records besides metrics (train/callbacks.py): MLflow params, tags and routing
        figures, and the tokenizer / data / MLflow run in checkpoints; also for a Trainer built in Python."""
        return [RunDescription(), RoutingArtifacts(), CheckpointContents()]

    # ---- validation ----------------------------------------------------------------------------
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        record = batch_idx == 0 and self.hparams.routing_diagnostics and self.cfg.kind.diagnostics is not None
        out = self.model(inputs, return_routing=record)
        logits = out.logits if record else out
        if record:
            self.routing_weights = out.routing
        ce, _ = token_losses(logits, targets)
        self.val_loss.update(ce, weight=targets.numel())

    @property
    def report_step(self) -> int:
        """The step results belong to: the training step while fitting, the checkpoint's step when a
        checkpoint is validated or tested (not 0), so curves and the heatmap sit at the right place."""
        if self._trainer is None or self.trainer.training or self.trainer.state.fn == "fit":
            return self.global_step
        return self._loaded_step if self._loaded_step is not None else self.global_step

    @property
    def report_prefix(self) -> str:
        """'' while fitting; 'validate/' or 'test/' for `lrattn validate` / `lrattn test` of a checkpoint: those
        may score other batches than the fit's validations (another --trainer.limit_val_batches), so their
        results sit beside the run's val/* under their own names, never over them."""
        fn = self.trainer.state.fn if self._trainer is not None else None  # (fit's final validation: loaded none)
        return f"{fn.value}/" if fn in ("validate", "test") and self._loaded_step is not None else ""

    def _report(self, name: str, value: Any, **kwargs: Any) -> None:
        """A validation result: self.log for the progress bar and callbacks, and to the logger at report_step
        (the number of optimizer steps behind the weights), so in-fit, final and checkpoint validations
        all sit at the step of the weights they scored."""
        name = self.report_prefix + name
        self.log(name, value, logger=False, **kwargs)
        if self.logger is not None and not self.trainer.sanity_checking and self.trainer.is_global_zero:
            self.logger.log_metrics({name: float(value)}, step=self.report_step)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        if not self.trainer.sanity_checking and not bool(torch.isfinite(loss)):  # never logged as a result
            whose = (f"of checkpoint step {self.report_step}" if self.report_prefix else f"at step {self.report_step}")
            raise NonFiniteLossError(f"non-finite validation loss ({float(loss)}) {whose}")
        if not self.trainer.sanity_checking:
            self.last_validated_step = self.report_step
        self._report("val/loss", loss, prog_bar=True, sync_dist=False)
        bytes_per_token = getattr(self.trainer.datamodule, "bytes_per_token", None) if self.trainer.datamodule else None
        if callable(bytes_per_token):
            bpt = bytes_per_token("val")
            if bpt:
                self._report("val/bpb", bits_per_byte(loss, bpt))
        if self.routing_weights is not None:  # RoutingArtifacts logged the figures before this hook
            self._report_routing(self.routing_weights)
            self.routing_weights = None

    def _report_routing(self, weights: list[torch.Tensor]) -> None:
        """The mean over read sites as metrics routing/mean/<stat> (the gated residual: over sublayers,
        routing/mean/alpha and saturated; mixing weights: none); per site they are artifacts (RoutingArtifacts)."""
        for stat, value in diagnostics.mean_stats(self.cfg, weights).items():
            self._report(f"routing/mean/{stat}", value)

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end

    # ---- checkpoints ---------------------------------------------------------------------------
    def on_train_end(self) -> None:
        # the weights are now the fit's own, at trainer.global_step: a validation of them after the fit
        # (lrattn fit's final one) reports there, not at the step a resumed fit was loaded from
        self._loaded_step = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._loaded_step = checkpoint.get("global_step")
        stored = checkpoint.get("hyper_parameters", {}).get("model_config")
        if stored is None:
            raise InputError("checkpoint has no 'model_config' hyper-parameter: it was not written by lrattn_lightning")
        diffs = architecture_differences(stored, self.cfg)
        if diffs:
            raise InputError(
                "checkpoint was trained with a different architecture; pass the same --size/--ablation "
                f"({stored['size']['name']} / {stored['ablation']['name']}). Differences: " + "; ".join(diffs)
            )
        if self._trainer is not None and self.trainer.state.fn == "fit":
            self._check_restored_optimizer(checkpoint.get("hyper_parameters", {}))

    def _check_restored_optimizer(self, stored: dict[str, Any]) -> None:
        """A resumed fit restores the optimizer's settings with its state (torch's load_state_dict), so a
        changed learning rate or weight decay would be silently ignored: refuse it instead."""
        for key in RESTORED_WITH_OPTIMIZER:
            if key in stored and _plain(stored[key]) != _plain(self.hparams[key]):
                raise InputError(
                    f"--model.{key}: the checkpoint was trained with {_plain(stored[key])!r}, this run passes "
                    f"{_plain(self.hparams[key])!r}; resuming restores the optimizer's settings from the checkpoint, "
                    "so resume with the same value (or start a new run)")


# Optimizer settings a resumed fit takes from the checkpoint's optimizer state, not from the command line.
RESTORED_WITH_OPTIMIZER = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "betas")

# What describes an entry rather than builds it: editing these in registry.yaml keeps checkpoints loadable.
DESCRIPTIVE_FIELDS = frozenset({"doc", "control", "tags"})


def architecture_differences(stored: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """Architecture fields (not doc/control/tags) where a checkpoint's model_config differs from `cfg`."""
    mine, stored = cfg.to_dict(), ModelConfig.with_defaults(stored)  # fields newer than the checkpoint: defaults
    return [
        f"{part}.{key}: checkpoint {stored[part].get(key)!r} vs now {value!r}"
        for part in ("size", "ablation") for key, value in mine[part].items()
        if key not in DESCRIPTIVE_FIELDS and _plain(stored[part].get(key)) != _plain(value)
    ]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
