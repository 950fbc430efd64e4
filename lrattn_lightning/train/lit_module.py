"""The LightningModule: loss, optimiser groups, schedule, metrics (train/*, val/*, routing/mean/*).

Built from typed groups (train/settings.py): the ModelConfig, OptimiserSettings, RuntimeSettings and the routing
kinds' training options. The module is built from one validated ModelConfig: `LRAttnModule.from_config(cfg, optimiser,
runtime)` (`lrattn bench`, Python) hands it over as is; `LRAttnModule.from_names(size, ablation)` resolves the names in
the registry first (the registry's hash and the git commit recorded). Lightning builds it from plain values:
LightningCLI hands `model_config` as the dict of the config the CLI resolved and checked once (with its provenance
`registry_sha256`, `git_commit`), and the module takes that ModelConfig itself (`building_from`), not a second
reading of the dict; load_from_checkpoint hands a checkpoint's dict, which is read and checked. The module reads no
registry and runs no git.

The settings keep their flat names (`--model.lr`, `--model.gate_freeze_steps`, the checkpoint's hyper_parameters):
every recipe, sweep file and checkpoint of before the groups means what it meant; train/settings.py says why.

Checkpoints describe themselves with plain values: the resolved size and ablation as dicts, the registry hash and the
git commit sit in `hyper_parameters` (so `torch.load(weights_only=True)` works); the tokenizer, data folder and
MLflow run are added by train/callbacks/, which the module installs itself (`configure_callbacks`) with the
MLflow params, tags and routing figures. Resuming or loading a checkpoint into a module built for a different
size/ablation is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import model_flops_per_token
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import Registry, load_registry, model_config_from_dict
from lrattn_lightning.train.callbacks import (
    CheckpointContents,
    RoutingArtifacts,
    RunDescription,
    tokens_per_step,
)
from lrattn_lightning.train.checkpoint.compat import check_loaded
from lrattn_lightning.train.checkpoint.stop import NonFiniteLossError
from lrattn_lightning.train.losses import head_token_losses, token_losses
from lrattn_lightning.train.optim import sharded_grad_norm
from lrattn_lightning.train.optimization import Optimization
from lrattn_lightning.train.schema import Metric
from lrattn_lightning.train.settings import (
    OptimiserSettings,
    Provenance,
    RuntimeSettings,
    current_git_commit,
    module_settings,
)
from lrattn_lightning.train.validation import Validation

__all__ = ["LRAttnModule", "building_from"]

_HANDED: ContextVar[ModelConfig | None] = ContextVar("lrattn_handed_model_config", default=None)


@contextmanager
def building_from(cfg: ModelConfig) -> Iterator[None]:
    """Within it, a module Lightning builds from `cfg`'s own dict (LightningCLI hands the module plain values) takes
    `cfg` itself: resolved and checked once by the caller (`lrattn fit|validate|test`), not again from its dict. Any
    other dict (a checkpoint's hyper-parameters) is read and checked as it comes."""
    token = _HANDED.set(cfg)
    try:
        yield
    finally:
        _HANDED.reset(token)


class LRAttnModule(Validation, Optimization, L.LightningModule):
    def __init__(self, size: str = "small", ablation: str = "baseline", registry: str | None = None,
                 model_config: dict | None = None, registry_sha256: str | None = None, git_commit: str | None = None,
                 **settings: Any):
        """model_config: the resolved ModelConfig (from_config, from_names) or its dict (LightningCLI's, a
        checkpoint's: read once); size/ablation/registry are recorded, never resolved here (from_names does).

        settings: the flat settings of train/settings.py (OptimiserSettings, RuntimeSettings, the routing kinds'
        training options), each `--model.NAME` on the command line."""
        super().__init__()
        chosen = module_settings(**settings)  # the typed groups; a bad value is one line, before any work
        if model_config is None:
            raise InputError(f"LRAttnModule needs its ModelConfig: LRAttnModule.from_names({size!r}, {ablation!r}) "
                             "resolves the names in the registry, LRAttnModule.from_config(cfg) takes a resolved one")
        self.resolved_from: Registry | None = None  # the registry the names were resolved in (from_names)
        given = isinstance(model_config, ModelConfig)  # validated already: no round trip through a dict
        handed = _HANDED.get()  # the CLI's own ModelConfig, handed over as its dict (building_from)
        if given:
            cfg = model_config
        elif handed is not None and model_config == handed.to_dict():
            cfg = handed
        else:  # plain values from outside (a checkpoint's hyper-parameters): read and checked
            cfg = model_config_from_dict(model_config)
        self.save_hyperparameters(ignore=["model_config"] if given else None, logger=False)
        for key, value in chosen.flat().items():  # every setting, given or not (checkpoints, MLflow params)
            self.hparams.setdefault(key, value)
        # LightningCLI hands save_hyperparameters its own config; the resolved values win, the config as plain
        # values (its one dict: ModelConfig.to_dict) so checkpoints load with torch.load(weights_only=True).
        self.hparams.update(size=cfg.size.name, ablation=cfg.ablation.name, model_config=cfg.to_dict(),
                            registry_sha256=registry_sha256, git_commit=git_commit)
        self.cfg, self.optimiser, self.runtime = cfg, chosen.optimiser, chosen.runtime
        self.momentum_schedule = chosen.optimiser.momentum_schedule()
        run = chosen.runtime  # how AttnRes is computed, not part of the architecture; compiled: what torch.compile traces
        self.model = build_decoder(cfg, impl=run.impl, attention=run.attention, compiled=run.compile)
        self.model.doc_separator = run.doc_separator if run.document_masking else None
        # Lightning's model summary counts the FLOPs of one forward of this (one window; was "Total FLOPs: 0")
        self.example_input_array = torch.zeros(1, cfg.size.seq_len, dtype=torch.long)
        self.routing_control = chosen.routing_control(cfg, self.model.router)  # the kind's (gated: the gate hold)
        self._last_train_ce: float | None = None
        self.val_loss = torchmetrics.MeanMetric()
        self.routing_weights: list[torch.Tensor] | None = None  # of a validation's first batch, for the diagnostics
        self._loaded_step: int | None = None
        self._step_losses: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, ce) per micro-batch of this step
        self.last_validated_step: int | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, optimiser: OptimiserSettings | None = None,
                    runtime: RuntimeSettings | None = None, routing: dict[str, Any] | None = None,
                    provenance: Provenance | None = None) -> LRAttnModule:
        """The module for a resolved ModelConfig: no registry read, no git run (provenance: what to record)."""
        provenance = provenance or Provenance.of(cfg, None)
        flat = {f.name: getattr(group, f.name) for group in (optimiser or OptimiserSettings(),
                                                              runtime or RuntimeSettings())
                for f in dataclasses.fields(group)}
        return cls(model_config=cfg, registry_sha256=provenance.registry_sha256, git_commit=provenance.git_commit,
                   **flat, **(routing or {}))

    @classmethod
    def from_names(cls, size: str, ablation: str, registry: str | None = None, **settings: Any) -> LRAttnModule:
        """The module for registry names (a Python convenience): the registry read once (unknown names list the
        closest), its hash and the git commit recorded; settings as in __init__."""
        reg = load_registry(registry)
        module = cls(model_config=reg.model(size, ablation), registry=registry, registry_sha256=reg.sha256,
                     git_commit=current_git_commit(), **settings)
        module.resolved_from = reg
        return module

    # ---- model ---------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Document masking: the separator is the EOS id of the data the module trains or validates on."""
        if not self.runtime.document_masking:
            return
        meta = getattr(self.trainer.datamodule, "meta", None) if self._trainer is not None else None
        eos = meta.get("eos_id") if isinstance(meta, dict) else None
        if eos is None:
            eos = self.runtime.doc_separator
        if eos is None:
            raise InputError("model.document_masking: the data names no EOS id (meta.json 'eos_id'); prepare the "
                             "data with `lrattn prepare`, or set --model.document_masking false")
        self.hparams.doc_separator = int(eos)
        self.runtime = dataclasses.replace(self.runtime, doc_separator=int(eos))
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
        if self.runtime.compile:
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
        """(cross-entropy, z-loss term) of the decoder on `inputs` against `targets`: token_losses of its logits,
        or head_token_losses of its features and head weight (`loss_impl`: chunked)."""
        if self.chunked_loss():
            return head_token_losses(self.model(inputs, head=False), self.model.head.weight, targets)
        return token_losses(self.model(inputs), targets)

    def chunked_loss(self) -> bool:
        """Whether the training loss forms the logits in chunks (RuntimeSettings.loss_impl; `auto`: on CUDA, eager,
        the head's weight not sharded by FSDP)."""
        choice = self.runtime.loss_impl
        if choice != "auto":
            return choice == "chunked"
        weight = self.model.head.weight
        return (weight.device.type == "cuda" and not self.runtime.compile and not getattr(self, "_sharded", False)
                and not torch.compiler.is_compiling())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        ce, z = (getattr(self, "_compiled_losses", None) or self.model_losses)(inputs, targets)
        loss = ce + self.optimiser.z_loss * z
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
