"""The LightningModule: loss, optimiser groups, schedule, metrics (train/*, val/*, routing/mean/*).

Checkpoints describe themselves with plain values: the resolved size and ablation as dicts, the
registry hash and the git commit sit in `hyper_parameters` (so `torch.load(weights_only=True)`
works); the tokenizer, data folder and MLflow run are added by train/callbacks/, which the module
installs itself (`configure_callbacks`) with the MLflow params, tags and routing figures. Resuming or
loading a checkpoint into a module built for a different size/ablation is an error.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
from typing import Any, Literal, get_args

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import PACKAGE_ROOT
from lrattn_lightning.model.accounting import model_flops_per_token
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import load_registry, model_config_from_dict
from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL, resolve_impl
from lrattn_lightning.model.routing.kinds import check_training_options, training_flags
from lrattn_lightning.train.callbacks import (
    CheckpointContents,
    RoutingArtifacts,
    RunDescription,
    tokens_per_step,
)
from lrattn_lightning.train.checkpoint.compat import check_loaded
from lrattn_lightning.train.checkpoint.stop import NonFiniteLossError
from lrattn_lightning.train.losses import token_losses
from lrattn_lightning.train.muon import MuonDtype
from lrattn_lightning.train.optim import MUON_VARIANTS, MuonVariant, sharded_grad_norm
from lrattn_lightning.train.optimization import Optimization
from lrattn_lightning.train.schedule import MomentumSchedule
from lrattn_lightning.train.schema import Metric
from lrattn_lightning.train.validation import Validation


def current_git_commit() -> str:
    try:
        root = PACKAGE_ROOT
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class LRAttnModule(Validation, Optimization, L.LightningModule):
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
        muon_dtype: MuonDtype = "auto",
        muon_momentum: float = 0.95,
        muon_momentum_min: float = 0.85,
        muon_momentum_warmup_steps: int = 300,
        muon_momentum_cooldown_steps: int = 100,
        warmup_steps: int = 2000,
        decay_fraction: float = 0.2,
        final_lr_fraction: float = 0.1,
        allow_schedule_change: bool = False,
        schedule_steps: int | None = None,
        z_loss: float = 1e-5,
        compile: bool = False,
        impl: str = DEFAULT_IMPL,
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
        code, `torch`: torch.optim.Muon with match_rms_adamw); muon_dtype the dtype its orthogonaliser runs in
        (`bfloat16`: the originals' rounding; `float32`; `auto`: bfloat16 where the device computes it natively,
        CUDA or a CPU with AMX / AVX-512 BF16, else float32; resolved when the optimiser is built, logged as the
        MLflow param train_muon_dtype_resolved and, when float32, part of the recipe fingerprint); the Muon
        momentum rises from muon_momentum_min to muon_momentum over the first muon_momentum_warmup_steps and falls
        back over the last muon_momentum_cooldown_steps (0 and 0: constant).

        Schedule (warmup-stable-decay learning rates and Muon's momentum, train/optim.py): over schedule_steps, by
        default --trainer.max_steps; steps past its end run at its final values (how a finished run is extended:
        cli/checks.py check_schedule). allow_schedule_change: a resume may stretch the schedule while every step so
        far is the same under the new length.

        gate_freeze_steps, gate_release_loss, gate_grad_normalize: the gated residual's training controls, read by
        its kind only (model/routing/gated.py GateHold, docs/gated-residual.md); set for another kind: one line."""
        super().__init__()
        if model_config is None:
            reg = load_registry(registry)
            cfg = reg.model(size, ablation)
            model_config, registry_sha256 = cfg.to_dict(), reg.sha256
            git_commit = git_commit or current_git_commit()
        else:
            cfg = model_config_from_dict(model_config)
            size, ablation = cfg.size.name, cfg.ablation.name
        self.save_hyperparameters(logger=False)
        # LightningCLI hands save_hyperparameters its own config; the resolved values must win.
        self.hparams.update(size=size, ablation=ablation, model_config=model_config,
                            registry_sha256=registry_sha256, git_commit=git_commit)
        self.cfg = cfg
        if muon_variant not in MUON_VARIANTS:
            raise InputError(f"model.muon_variant: unknown '{muon_variant}'; use one of {', '.join(MUON_VARIANTS)}")
        if muon_dtype not in get_args(MuonDtype):
            raise InputError(f"model.muon_dtype: '{muon_dtype}' is not one of {', '.join(get_args(MuonDtype))}")
        self.momentum_schedule = MomentumSchedule(  # checked now, before any work
            peak=muon_momentum, low=muon_momentum_min, warmup_steps=muon_momentum_warmup_steps,
            cooldown_steps=muon_momentum_cooldown_steps)
        # how AttnRes is computed, not part of the architecture; compiled: the backend torch.compile traces
        self.model = build_decoder(cfg, impl=resolve_impl(impl, compiled=compile), attention=attention)
        self.model.doc_separator = doc_separator if document_masking else None
        # Lightning's model summary counts the FLOPs of one forward of this (one window; was "Total FLOPs: 0")
        self.example_input_array = torch.zeros(1, cfg.size.seq_len, dtype=torch.long)
        self.routing_control = self._routing_control(cfg)
        self._last_train_ce: float | None = None
        self.val_loss = torchmetrics.MeanMetric()
        self.routing_weights: list[torch.Tensor] | None = None  # of a validation's first batch, for the diagnostics
        self._loaded_step: int | None = None
        self._step_losses: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, ce) per micro-batch of this step
        self.last_validated_step: int | None = None

    # ---- what the routing kind does during training (the gated residual's gate hold: gated.py) --------
    def _routing_control(self, cfg: ModelConfig) -> Any:
        """The kind's training control from its flags (a flag that no part of this kind reads is one line)."""
        defaults = {k: v.default for k, v in inspect.signature(LRAttnModule.__init__).parameters.items()}
        given = {k: self.hparams[k] != defaults[k] for k in training_flags()}
        check_training_options(cfg, given)
        flags = {k: self.hparams[k] for k in cfg.kind.training_options}
        return cfg.kind.training_control(self.model.router, flags)

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
        control = self.routing_control
        if control is not None:
            for name, value in control.log_values().items():
                self.log(name, value)
            if control.wants_loss:
                self._last_train_ce = float(self.trainer.strategy.reduce(ce.detach(), reduce_op="mean"))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # the loss of the global batch: the mean over this step's micro-batches (gradient accumulation)
        # and over ranks (DDP); Lightning alone would log the last micro-batch's
        if self._step_losses:
            loss, ce = (torch.stack(column).mean() for column in zip(*self._step_losses, strict=True))
            self._step_losses.clear()
            self.log(Metric.TRAIN_LOSS, loss, prog_bar=True, sync_dist=True)
            self.log(Metric.TRAIN_CE, ce, sync_dist=True)
        per_step = tokens_per_step(self._trainer) if self._trainer is not None else None
        if per_step:  # tokens trained on once this step is taken
            self.log(Metric.TOKENS_SEEN, float((self.global_step + 1) * per_step))
        if getattr(self, "_sharded", False):  # FSDP: the total over every rank's shards
            self.log(Metric.GRAD_NORM, sharded_grad_norm(self.model))
            return
        self.log(Metric.GRAD_NORM, self.gradient_norm())  # before clipping; clipping reuses it (optimization.py)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.routing_control is not None:
            self.routing_control.before_step(self.global_step, self._last_train_ce)

    @property
    def flops_per_batch(self) -> int | None:
        """Model FLOPs of one batch on one device (training: x3), from the data's batch_size and seq_len:
        ThroughputMonitor's FLOP/s and MFU (train/callbacks/monitors.py TokenThroughput)."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        batch, seq = getattr(dm, "batch_size", None), getattr(dm, "seq_len", None)
        if not batch or not seq:
            return None
        cfg = ModelConfig(dataclasses.replace(self.cfg.size, seq_len=int(seq)), self.cfg.ablation)
        return model_flops_per_token(cfg, training=self.trainer.training) * int(batch) * int(seq)

    def configure_callbacks(self) -> list[Callback]:
        """What every run records besides metrics (train/callbacks/): MLflow params, tags and routing
        figures, and the tokenizer / data / MLflow run in checkpoints; also for a Trainer built in Python."""
        return [RunDescription(), RoutingArtifacts(), CheckpointContents()]

    # ---- checkpoints ---------------------------------------------------------------------------
    def on_train_end(self) -> None:
        # the weights are now the fit's own, at trainer.global_step: a validation of them after the fit
        # (lrattn fit's final one) reports there, not at the step a resumed fit was loaded from
        self._loaded_step = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of another architecture, or a resume that changes what the optimizer state restores: one
        line (train/checkpoint/compat.py)."""
        self._loaded_step = checkpoint.get("global_step")
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        check_loaded(checkpoint, self.cfg, self.hparams if fitting else None)
