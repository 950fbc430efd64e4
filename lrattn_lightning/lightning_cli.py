"""`lrattn fit|validate|test|demo`: the LightningCLI subclass and what it checks before any work.

The architecture comes only from the registry (`--size`, `--ablation`, on the command line or in the
recipe); recipes in experiments/ hold the training knobs. Everything is checked before the first step:
names (closest names on a typo), numbers, the data folder, a checkpoint's architecture; then the run
folder is claimed (a lock), the MLflow store opened (under a lock), and training starts. The provenance
of a run (resolved config, registry hash, git commit) is the module's to resolve, not a flag. Only
LightningCLI's public hooks are overridden; the trainer gets the MLflow logger, atomic checkpoint
writes, last.ckpt and the step monitors of train/callbacks.py as `instantiate_trainer` arguments.
`cli.py` is the `lrattn` dispatcher that imports this module only for these subcommands.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import logging
import math
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lrattn_lightning.data.datamodule import TokenDataModule
from lrattn_lightning.data.shards import validate_data_dir
from lrattn_lightning.errors import Parser, UsageError, check_name, packaged
from lrattn_lightning.train import checkpointing
from lrattn_lightning.train.callbacks import StepProgressLog, step_progress_bar, training_monitors
from lrattn_lightning.train.checkpointing import (
    AtomicCheckpointIO,
    LastCheckpoint,
    NonFiniteLossError,
    load_checkpoint_file,
)
from lrattn_lightning.train.lit_module import LRAttnModule, architecture_differences
from lrattn_lightning.train.summary import fit_summary, scoring_summary
from lrattn_lightning.train.tracking import (
    RUN_DIR_TAG,
    TrackingLogger,
    artifact_location,
    end_orphaned_runs,
    open_store,
    resolve_tracking_uri,
    run_dir_tag,
    run_in_store,
)


class MLflowSaveConfig(SaveConfigCallback):
    """Logs the resolved config.yaml to the MLflow run (the stock callback needs a log_dir)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, save_to_log_dir=False, **kwargs)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if isinstance(trainer.logger, MLFlowLogger):
            text = self.parser.dump(self.config, skip_none=False)
            trainer.logger.experiment.log_text(trainer.logger.run_id, text, "config.yaml")


class LRAttnCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"},
                "test": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser) -> None:
        # No default architecture: a run of the wrong model for hours is worse than an error at once.
        parser.add_argument("--size", type=str | None, default=None, help="registry size name (`lrattn list`); required")
        parser.add_argument("--ablation", type=str | None, default=None, help="registry ablation name; required")
        parser.add_argument("--registry", type=str | None, default=None, help="registry.yaml (default: ./registry.yaml)")
        parser.add_argument("--experiment", type=str, default="lrattn", help="MLflow experiment name")
        parser.add_argument("--run_name", type=str | None, default=None, help="default: SIZE-ABLATION-seedN")
        parser.add_argument("--runs_dir", type=str, default="runs", help="checkpoints go to RUNS_DIR/EXPERIMENT/RUN_NAME")
        parser.add_argument("--checkpoint_every", type=int, default=100, help="save last.ckpt every N steps")
        parser.add_argument("--tracking_uri", type=str | None, default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
        parser.add_argument("--mlflow_fallback_local", type=bool, default=False, help="log locally if the server is down")
        parser.add_argument("--log_counters", type=bool, default=False,
                            help="also log Lightning's running counts (train/batches, samples, lengths, time)")
        parser.add_argument("--init_from", type=str | None, default=None,
                            help="fit: start from another run's checkpoint wherever names and shapes match "
                                 "(upcycling; the optimiser and schedule start fresh)")
        parser.add_argument("--progress_every", type=int | None, default=None,
                            help="without a progress bar: a progress line every N steps (default: a tenth of the run; 0: none)")
        parser.add_argument("--run_tags", type=dict[str, str] | None, default=None,
                            help='extra MLflow tags of a new run, e.g. \'{"sweep": "cpu-study", "seed": "0"}\'')
        parser.link_arguments("size", "model.size", compute_fn=lambda name: name or "")
        parser.link_arguments("ablation", "model.ablation", compute_fn=lambda name: name or "")
        parser.link_arguments("registry", "model.registry")
        # Provenance is resolved by the module (registry, git), never given: as link targets these fields
        # are off the command line and out of config.yaml, and a checkpoint's stored values are replaced.
        for field in PROVENANCE:
            parser.link_arguments("registry", f"model.{field}", compute_fn=resolved_by_the_module)

    # ---- checks before any work ----------------------------------------------------------------
    def parse_arguments(self, parser, args) -> None:
        # jsonargparse's errors (an unknown flag, a missing --config file) raise instead of printing the
        # whole usage: they become one line naming the flag and the closest ones
        for each in (parser, *getattr(self, "_subcommand_parsers", {}).values()):
            each.exit_on_error = False
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:
            sub = next((a for a in (args or sys.argv[1:]) if a in self.subcommands()), None)
            raise UsageError(_parse_error(str(err), getattr(self, "_subcommand_parsers", {}).get(sub, parser), sub)) from None
        self._ckpt_head = None
        sub = self.config.get("subcommand")
        if sub:  # names become folders: checked before anything is read or written
            if self.config[sub].get("run_name") is not None:
                check_name(self.config[sub].run_name, "--run_name")
            check_name(self.config[sub].experiment, "--experiment")
        # Read a --ckpt_path file now: Lightning loads it next for its hyper-parameters, and would
        # show a truncated or foreign file as a traceback.
        path = self.config[sub].get("ckpt_path") if sub else None
        if path and path != "last":
            self._ckpt_head = _read_checkpoint(path)

    def before_instantiate_classes(self) -> None:
        from lrattn_lightning.model.registry import load_registry, load_yaml_strict, read_yaml_text

        cfg = self.config[self.subcommand]
        for recipe in cfg.get("config") or []:  # jsonargparse keeps the last of a duplicated key; we refuse it
            load_yaml_strict(read_yaml_text(Path(recipe.absolute), "recipe"), recipe.relative)
        _check_numbers(self.subcommand, cfg)
        self._name_architecture(cfg)
        registry = load_registry(cfg.registry)
        if self._ablation_from_ckpt and cfg.ablation not in registry.ablations:
            ablation = self._ckpt_head["model_config"]["ablation"]
            router = f" (routing external, router {ablation.get('router')})" if ablation.get("routing") == "external" else ""
            raise UsageError(f"ablation '{cfg.ablation}'{router} of --ckpt_path {cfg.ckpt_path} is not in registry "
                             f"{registry.path}; pass --registry FILE, the registry the checkpoint was trained with")
        model_cfg = registry.model(cfg.size, cfg.ablation)  # unknown names list the closest
        cfg.model.size, cfg.model.ablation = cfg.size, cfg.ablation
        if cfg.data.seq_len is None:
            cfg.data.seq_len = model_cfg.size.seq_len
        elif cfg.data.seq_len > model_cfg.size.seq_len:
            raise UsageError(f"--data.seq_len={cfg.data.seq_len} exceeds seq_len={model_cfg.size.seq_len} of size "
                             f"'{cfg.size}'; use a shorter window or a larger size")
        validate_data_dir(cfg.data.data_dir, model_cfg.size, cfg.data.seq_len)
        if self.subcommand == "fit":
            _check_one_batch(cfg)
        if cfg.model.get("impl") == "triton" and model_cfg.kind.takes_impl:  # CUDA or the interpreter
            from lrattn_lightning.model.routing.triton_ops import availability_error

            if (error := availability_error()) is not None:
                raise UsageError(error)
        self._check_attention(cfg)
        if cfg.trainer.get("strategy") == "fsdp":  # checked now: instantiate_trainer builds it after the run folder
            fsdp_strategy(cfg.trainer)
        self.upcycling = self._check_init_from(cfg, model_cfg)
        seed = cfg.seed_everything if isinstance(cfg.seed_everything, int) else 0
        if cfg.run_name is None:  # (the registry's names could still make one too long)
            cfg.run_name = check_name(f"{cfg.size}-{cfg.ablation}-seed{seed}", "the default run name SIZE-ABLATION-seedN")
        self.run_dir = Path(cfg.runs_dir) / cfg.experiment / cfg.run_name
        self.resume_run_id = self._check_checkpoint(cfg, model_cfg)
        self.tracking_uri = self.experiment_id = None
        if cfg.trainer.logger is None:
            self.tracking_uri = resolve_tracking_uri(cfg.tracking_uri, cfg.mlflow_fallback_local)
        self._claim_run(cfg)

    def _check_init_from(self, cfg, model_cfg):
        """--init_from: which tensors the source checkpoint gives (a shape conflict is one line, now)."""
        source = cfg.get("init_from")
        if source is None:
            return None
        if self.subcommand != "fit":
            raise UsageError(f"--init_from is for fit (upcycling a new run); {self.subcommand} reads --ckpt_path")
        if cfg.get("ckpt_path"):  # a resume: its checkpoint holds this run's weights already
            print(f"[lrattn fit] --init_from {source} is not applied: resuming from --ckpt_path {cfg.ckpt_path}",
                  file=sys.stderr)
            return None
        from lrattn_lightning.train.checkpoints import init_weights_from

        return init_weights_from(source, model_cfg)  # its InputError is one line, as every bad input

    def before_fit(self) -> None:
        """Upcycling (--init_from): this run's initialisation, then the source's tensors where they match."""
        up = self.upcycling
        if up is None:
            return
        self.model.model.load_state_dict(up.loaded, strict=False)
        self.model.init_from_params = {"init_from": str(up.path.resolve()), "init_from_step": up.step,
                                       "init_from_source": up.source, "init_from_run": up.mlflow_run or "none",
                                       "init_from_new_tensors": len(up.new)}
        if checkpointing.launched_as_rank_zero():
            for line in up.summary():
                print(f"[lrattn fit] {line}", flush=True)

    def _check_attention(self, cfg) -> None:
        """FlexAttention has no backward on CPU: a CPU fit with --model.attention flex would fail at its first step."""
        if self.subcommand != "fit" or cfg.model.get("attention") != "flex":
            return
        import torch

        accelerator = str(cfg.trainer.get("accelerator") or "auto")
        if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
            raise UsageError(f"--model.attention flex: FlexAttention has no backward on CPU (torch {torch.__version__}); "
                             "train with --model.attention sdpa here (same results), flex on CUDA")

    def _name_architecture(self, cfg) -> None:
        """--size and --ablation are required; validate/test may take them from their checkpoint."""
        if self.subcommand != "fit" and not cfg.get("ckpt_path"):
            raise UsageError(f"{self.subcommand} needs --ckpt_path: a checkpoint of `lrattn fit` (a file, or 'last' "
                             "with the run's --size/--ablation/--run_name); without one it would score random weights")
        self._ablation_from_ckpt = False
        if self._ckpt_head is not None and self.subcommand != "fit":
            self._ablation_from_ckpt = not cfg.ablation
            cfg.size = cfg.size or self._ckpt_head["model_config"]["size"]["name"]
            cfg.ablation = cfg.ablation or self._ckpt_head["model_config"]["ablation"]["name"]
            trained_on = self._ckpt_head["data"].get("data_dir")
            default = inspect.signature(TokenDataModule).parameters["data_dir"].default
            if trained_on and cfg.data.data_dir == default and Path(trained_on, "meta.json").is_file():
                cfg.data.data_dir = trained_on  # no --data.data_dir: the held-out split the checkpoint trained with
        missing = [f"--{k}" for k in ("size", "ablation") if not cfg.get(k)]
        if missing:
            raise UsageError(f"{self.subcommand} needs {' and '.join(missing)}: name the architecture from the registry "
                             "(`lrattn list` shows them), e.g. --size small --ablation s-lr-block-n8-r64")

    def _check_checkpoint(self, cfg, model_cfg) -> str | None:
        """Resolve --ckpt_path (`last`), refuse another architecture; the MLflow run it trained, if any."""
        ckpt_dir = self.run_dir / "checkpoints"
        ckpt_path, stored = cfg.get("ckpt_path"), self._ckpt_head
        if self.subcommand == "fit" and ckpt_path is None and ckpt_dir.exists() and any(ckpt_dir.glob("*.ckpt")):
            raise UsageError(f"{ckpt_dir} already holds checkpoints of run '{cfg.run_name}'; resume with "
                             "--ckpt_path last, or start a new run with --run_name NAME")
        if ckpt_path == "last":
            newest = checkpointing.newest_last(ckpt_dir)
            if newest is None:
                raise UsageError(f"--ckpt_path last: no {ckpt_dir / 'last.ckpt'}; check --run_name/--experiment")
            if newest.name != "last.ckpt":
                print(f"[lrattn] --ckpt_path last: {newest} is newer than last.ckpt (a folder from before one "
                      "last.ckpt); resuming from it", file=sys.stderr)
            ckpt_path = cfg.ckpt_path = str(newest)
            stored = _read_checkpoint(ckpt_path)
        if stored is None:
            return None
        # the architecture is re-resolved from the registry (provenance links) and checked equal here
        config = stored["model_config"]
        diffs = architecture_differences(config, model_cfg)
        if diffs:
            raise UsageError(
                f"--ckpt_path {ckpt_path} was trained with a different architecture (size '{config['size']['name']}', "
                f"ablation '{config['ablation']['name']}'); pass those names. Differences: " + "; ".join(diffs[:6]))
        _check_checkpoint_data(self.subcommand, cfg, ckpt_path, stored)
        # resuming, validating or testing a checkpoint logs into the MLflow run that trained it
        if self.subcommand == "fit":
            _check_schedule(cfg, stored)
        return stored["mlflow"].get("run_id")

    def _claim_run(self, cfg) -> None:
        """The checks passed: from here on this process owns the run folder and writes."""
        if self.subcommand == "fit" and checkpointing.launched_as_rank_zero():
            checkpointing.lock_run_folder(self.run_dir)
            for orphan in checkpointing.remove_orphans(self.run_dir / "checkpoints"):
                print(f"[lrattn] removed {orphan}, left by a checkpoint save that never finished", file=sys.stderr)
        if self.tracking_uri is not None:
            self.experiment_id = open_store(self.tracking_uri, cfg.experiment)
            if self.resume_run_id and not run_in_store(self.tracking_uri, self.resume_run_id):
                print(f"[lrattn] MLflow run {self.resume_run_id} of {cfg.ckpt_path} is not in {self.tracking_uri}; "
                      "logging to a new run", file=sys.stderr)
                self.resume_run_id = None
            if self.subcommand == "fit" and checkpointing.launched_as_rank_zero():  # we hold the folder's lock
                end_orphaned_runs(self.tracking_uri, self.experiment_id, self.run_dir, keep=self.resume_run_id)

    def after_fit(self) -> None:
        """A fit always ends with a validation of its final weights (val/loss, routing, heatmap at the last
        step), also when max_steps is not a multiple of val_check_interval, and also when it is resumed at its
        end; the MLflow run is FINISHED only after it. A stop signal that came after the last step stops the run
        before that validation (KILLED, exit 128 + N): the resume then runs it."""
        trainer, model = self.trainer, self.model
        logger = trainer.logger if isinstance(trainer.logger, TrackingLogger) else None
        if trainer.interrupted:
            return
        last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
        if logger is not None:
            logger.final_validation_pending = False
        if trainer.limit_val_batches == 0 or getattr(model, "last_validated_step", None) == trainer.global_step:
            if logger is not None:  # validated at its last step already: the run is complete
                logger.finalize("success")
            if last is not None:
                last.drop_previous(trainer)
            return
        signum = _agreed(trainer, checkpointing.NOTED_SIGNAL)
        if signum:
            saved = last is not None and last._last_global_step_saved == trainer.global_step > 0
            stop = checkpointing.Stop(signum, trainer.global_step, last.path) if saved else checkpointing.Stop(signum)
            checkpointing.LAST_STOP = stop
            if logger is not None:
                logger.stopped_by = stop.name
                logger.finalize("failed")
            raise SIGTERMException()
        model._loaded_step = None  # the fit's own weights (a fit resumed at its end loaded them): val/*, not validate/*
        trainer.validate(model, datamodule=self.datamodule, verbose=False)
        if last is not None:
            last.drop_previous(trainer)

    def instantiate_trainer(self, **kwargs: Any):
        """Lightning's trainer with this run's defaults where the command line gives none: the MLflow
        logger, atomic checkpoint writes, the run folder; `fit` adds last.ckpt and the step monitors
        (learning rate, Muon momentum, tokens/s: train/callbacks.py)."""
        cfg, given = self.config[self.subcommand], self.config_init[self.subcommand].trainer
        if given.logger is None:
            kwargs["logger"] = self._tracking_logger(cfg)
        plugins = _as_list(given.plugins)
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        if given.default_root_dir is None:
            kwargs["default_root_dir"] = str(self.run_dir)
        if given.strategy == "fsdp":  # FSDP2 through ModelParallelStrategy: CPU (gloo) ranks run it too
            kwargs["strategy"] = fsdp_strategy(given)
        if self.subcommand == "fit":
            last = LastCheckpoint(self.run_dir / "checkpoints", every_n_train_steps=cfg.checkpoint_every)
            kwargs["callbacks"] = [*_as_list(given.callbacks), last, *training_monitors(cfg.log_counters)]
        bar = step_progress_bar() if given.enable_progress_bar is not False else None
        if bar is not None and not any(isinstance(c, ProgressBar) for c in _as_list(given.callbacks)):
            kwargs["callbacks"] = [*kwargs.get("callbacks", _as_list(given.callbacks)), bar]
        every = cfg.get("progress_every")
        every = max(1, (given.max_steps or 0) // 10) if every is None else every
        if self.subcommand == "fit" and given.enable_progress_bar is False and every > 0:  # progress lines instead
            kwargs["callbacks"] = [*kwargs.get("callbacks", _as_list(given.callbacks)), StepProgressLog(every)]
        return super().instantiate_trainer(**kwargs)

    def _tracking_logger(self, cfg) -> TrackingLogger:
        logger = TrackingLogger(
            experiment_name=cfg.experiment, experiment_id=self.experiment_id, run_name=cfg.run_name,
            tracking_uri=self.tracking_uri, run_id=self.resume_run_id,
            artifact_location=artifact_location(self.tracking_uri),
            tags={**(cfg.run_tags or {}),  # applied when the run is created; a resumed run keeps its own
                  **({RUN_DIR_TAG: run_dir_tag(self.run_dir)} if self.subcommand == "fit" else {})},
        )
        logger.keep_status = self.subcommand != "fit" and bool(self.resume_run_id)
        logger.final_validation_pending = self.subcommand == "fit"
        logger.log_epoch = bool(cfg.get("log_counters"))
        logger.open_run()
        if self.subcommand == "fit" and self.resume_run_id and checkpointing.launched_as_rank_zero():
            logger.skip_logged_steps()
        return logger


PROVENANCE = ("model_config", "registry_sha256", "git_commit")


def fsdp_strategy(trainer_cfg):
    """`--trainer.strategy fsdp`: Lightning's ModelParallelStrategy (FSDP2, `fully_shard` in the module's
    configure_model) over every rank, one data-parallel dimension; full-state checkpoint files (gathered on rank
    0, atomic like every checkpoint here). Lightning's FSDPStrategy (FSDP1) refuses CPU accelerators; this one
    runs the same code on CPU (gloo) and GPU (nccl) ranks."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    devices, nodes = trainer_cfg.devices, int(trainer_cfg.num_nodes or 1)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise UsageError(f"--trainer.strategy fsdp needs --trainer.devices N (a number of devices per node), got "
                         f"{devices!r}")
    return ModelParallelStrategy(data_parallel_size=devices * nodes, tensor_parallel_size=1,
                                 save_distributed_checkpoint=False)


def _agreed(trainer, signum: int) -> int:
    """The highest stop signal any rank noted (every rank calls this at the same point)."""
    if trainer.world_size == 1:
        return signum
    import torch

    flag = torch.tensor(float(signum), device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(flag, reduce_op="max"))


def resolved_by_the_module(registry: str | None) -> None:
    """The value of a provenance field on the command line: none (LRAttnModule resolves it)."""
    return None


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def _check_numbers(subcommand: str, cfg) -> None:
    """Values Lightning would take apart with a traceback, or accept with a meaning nobody wants."""
    trainer, data = cfg.trainer, cfg.data
    if subcommand == "fit" and (not isinstance(trainer.max_steps, int) or trainer.max_steps == 0 or trainer.max_steps < -1):
        raise UsageError(f"--trainer.max_steps {trainer.max_steps}: give a positive number of optimizer steps "
                         "(or -1 to let --trainer.max_epochs decide)")
    if subcommand == "fit" and cfg.checkpoint_every < 1:
        raise UsageError(f"--checkpoint_every {cfg.checkpoint_every}: give a positive number of steps between saves")
    for name, value, least in (("--data.seq_len", data.seq_len, 1), ("--data.batch_size", data.batch_size, 1),
                               ("--data.num_workers", data.num_workers, 0)):
        if value is not None and value < least:
            raise UsageError(f"{name} {value}: must be an integer >= {least}")
    _check_training_numbers(subcommand, cfg)
    for name in ("limit_val_batches", "limit_test_batches"):
        value = trainer.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value == 1:
            print(f"[lrattn] warning: --trainer.{name} 1 means ONE batch in Lightning (an integer counts batches); "
                  f"pass 1.0 for the whole validation split", file=sys.stderr)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_training_numbers(subcommand: str, cfg) -> None:
    """The optimiser's, schedule's and trainer's numbers, checked before a run folder or MLflow run exists (torch,
    Lightning and the scheduler would refuse some only at the first step, after the run was created, and take
    others, such as a negative warmup, with a meaning nobody wants)."""
    if subcommand != "fit":
        return
    m, trainer = cfg.model, cfg.trainer
    rules = [  # (flag, value, ok, what it must be)
        *((f"--model.{k}", m.get(k), lambda v: _number(v) and v >= 0, "a number >= 0 (0: that group stays fixed)")
          for k in ("lr", "muon_lr")),
        *((f"--model.{k}", m.get(k), lambda v: _number(v) and v >= 0, "a number >= 0")
          for k in ("weight_decay", "muon_weight_decay", "z_loss")),
        *((f"--model.{k}", m.get(k), lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
           "an integer >= 0") for k in ("warmup_steps", "muon_momentum_warmup_steps", "muon_momentum_cooldown_steps")),
        *((f"--model.{k}", m.get(k), lambda v: _number(v) and 0 <= v <= 1, "a fraction in [0, 1]")
          for k in ("decay_fraction", "final_lr_fraction")),
        ("--model.betas", m.get("betas"), lambda v: isinstance(v, list | tuple) and len(v) == 2
         and all(_number(b) and 0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. [0.9, 0.95]"),
        ("--trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches"),
         lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), "an integer >= 1"),
        ("--trainer.val_check_interval", trainer.get("val_check_interval"),
         lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
         or (isinstance(v, float) and 0 < v <= 1), "a number of steps >= 1 or a fraction of an epoch in (0, 1]"),
        ("--trainer.gradient_clip_val", trainer.get("gradient_clip_val"), lambda v: v is None or (_number(v) and v >= 0),
         "a number >= 0 (0 or null: no clipping)"),
        ("--trainer.log_every_n_steps", trainer.get("log_every_n_steps"),
         lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), "an integer >= 1"),
    ]
    for flag, value, ok, what in rules:
        if not ok(value):
            raise UsageError(f"{flag} {value}: must be {what}")


def _devices(trainer) -> int:
    """Processes that split the training windows (devices x nodes); 1 where the count is left to Lightning."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    count = len(devices) if isinstance(devices, list | tuple) else devices if isinstance(devices, int) and devices > 0 else 1
    return count * (nodes if isinstance(nodes, int) and nodes > 0 else 1)


def _check_one_batch(cfg) -> None:
    """A train split with fewer windows than one batch on every device trains nothing (0 steps) and would still
    end 'finished': one line instead, before any work."""
    from lrattn_lightning.data.shards import check_shards, count_windows

    windows = count_windows(check_shards(cfg.data.data_dir, "train"), cfg.data.seq_len + 1)
    world, batch = _devices(cfg.trainer), cfg.data.batch_size
    if windows < batch * world:
        per = f"{batch} windows per device x {world} devices" if world > 1 else f"--data.batch_size {batch} windows"
        raise UsageError(f"the train split of {cfg.data.data_dir} has {windows} windows of seq_len + 1 = "
                         f"{cfg.data.seq_len + 1} tokens, and one batch needs {per}; use a smaller --data.batch_size "
                         "or --data.seq_len, or prepare more data")


def _same_folder(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def _check_checkpoint_data(subcommand: str, cfg, ckpt_path: str, stored: dict) -> None:
    """validate/test score with the checkpoint's tokenizer (another one's ids are other text to the model); a resume
    continues at its position in the data folder it trained on (litdata refuses another folder only after the
    model was restored)."""
    from lrattn_lightning.train.checkpoints import check_tokenizer

    if subcommand in ("validate", "test") and stored.get("tokenizer"):
        check_tokenizer(stored["tokenizer"], ckpt_path, cfg.data.data_dir, "--data.data_dir")
    trained_on = (stored.get("data") or {}).get("data_dir")
    if subcommand == "fit" and trained_on and not _same_folder(str(cfg.data.data_dir), str(trained_on)):
        raise UsageError(f"--data.data_dir {cfg.data.data_dir}: checkpoint {ckpt_path} trained on {trained_on}, and a "
                         f"resume continues at its position in that folder; resume with --data.data_dir {trained_on} "
                         "(or start a new run, e.g. --init_from the checkpoint)")


def _parse_error(message: str, parser, subcommand: str | None) -> str:
    """jsonargparse's error as one line; an unknown flag (command line) or key (--config file) with the closest."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and not o.endswith((".help", "+"))]
    help_ = f"`lrattn {subcommand or 'fit'} --help` lists them"
    unknown = re.findall(r"(?:^|\s)(--?[^\s=]+)", message.partition("unrecognized arguments:")[2])
    if unknown:
        return f"unknown flag{'s' if len(unknown) > 1 else ''} " + "; ".join(_closest(f, flags) for f in unknown) + f"; {help_}"
    keys = re.findall(r"does not accept option '([^']+)'", message)
    if keys:
        keys_known = [f[2:] for f in flags]
        return (f"unknown key{'s' if len(keys) > 1 else ''} in a --config file: " +
                "; ".join(_closest(k, keys_known) for k in keys) + f"; {help_}")
    linked = re.search(r"resolved_by_the_module\(registry\) --> (model\.\w+)", message)
    if linked:  # a link target: provenance comes from the registry and git
        return f"--{linked.group(1)} is recorded by lrattn from the registry and git, not set by a flag; drop it"
    # e.g. 'Parser key "config": File does not exist: ...' -> '--config: File does not exist: ...'
    return re.sub(r'^Parser key "([^"]+)":\s*', r"--\1: ", " ".join(message.split()))


def _closest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"{name} (closest: {', '.join(close)})" if close else name


def _check_schedule(cfg, stored: dict) -> None:
    """A resume keeps the schedule's length: another --trainer.max_steps would change the learning rate and
    momentum of steps already shaped by the old one (a longer run restarted the warm-down). With
    --model.allow_schedule_change the new length is taken when the two schedules agree on every step so far:
    the run then equals one launched with the new length (extending the stable phase, decay at the new end)."""
    from lrattn_lightning.train.optim import MomentumSchedule, first_schedule_difference

    old, new, step = stored["schedule"].get("total_steps"), cfg.trainer.max_steps, stored.get("global_step") or 0
    if old is None or new == old or new < 0:
        return
    m = cfg.model
    if not m.allow_schedule_change:
        raise UsageError(f"--trainer.max_steps {new}: the checkpoint's schedule is {old} steps; resuming with another "
                         f"length changes the learning rate of a run in progress. Resume with --trainer.max_steps {old}, "
                         "or pass --model.allow_schedule_change true to continue as a run launched with "
                         f"{new} steps (possible until its schedule departs from the old one)")
    momentum = (MomentumSchedule(peak=m.muon_momentum, low=m.muon_momentum_min, warmup_steps=m.muon_momentum_warmup_steps,
                                 cooldown_steps=m.muon_momentum_cooldown_steps) if m.optimizer == "muon_adamw" else None)
    differs = first_schedule_difference(old, new, step, m.warmup_steps, m.decay_fraction, m.final_lr_fraction, momentum)
    if differs is not None:
        raise UsageError(f"--trainer.max_steps {new} with --model.allow_schedule_change: the {old}-step schedule this "
                         f"checkpoint (step {step}) followed departs from a {new}-step one at step {differs} (its "
                         "warm-down or momentum cooldown had begun); resume with --trainer.max_steps "
                         f"{old}, or change the length from an earlier checkpoint")
    print(f"[lrattn] schedule length {old} -> {new} steps at step {step} (--model.allow_schedule_change): the run "
          f"continues as one launched with {new} steps", file=sys.stderr)


def _read_checkpoint(path: str) -> dict:
    """The plain-value head of a checkpoint: its model_config and MLflow run; one-line errors otherwise."""
    ckpt = load_checkpoint_file(path, mmap=True)  # tensors stay on disk: only the plain values are read
    stored = (ckpt.get("hyper_parameters") or {}).get("model_config")
    if not isinstance(stored, dict):
        raise UsageError(f"--ckpt_path {path}: not an lrattn_lightning checkpoint (no model_config hyper-parameter)")
    return {"model_config": stored, "mlflow": ckpt.get("mlflow") or {}, "schedule": ckpt.get("schedule") or {},
            "global_step": ckpt.get("global_step"), "data": ckpt.get("data") or {}, "tokenizer": ckpt.get("tokenizer")}


# What Lightning prints that does not concern the run: cloud tips, the seed (it is in config.yaml and the
# MLflow params), deprecations inside Lightning itself, and remarks on choices made here on purpose.
QUIET_MESSAGES = ("💡 Tip", "Seed set to")
QUIET_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"Your `IterableDataset` has `__len__` defined",
                  r"Be aware that when using `ckpt_path`", r".*callbacks used to create the Trainer.*will override",
                  r"The number of training batches \(\d+\) is smaller than the logging interval")


class _QuietFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(QUIET_MESSAGES)


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _QuietFilter) for f in handler.filters):
                handler.addFilter(_QuietFilter())
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def run_lightning(argv: list[str]) -> LRAttnCLI:
    # From the console script the arguments are sys.argv itself, which DDP re-executes in each child.
    args = None if argv == sys.argv[1:] else argv
    quiet_lightning()
    # `lrattn demo` and shipped recipe paths hand LightningCLI rewritten arguments on purpose
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    return LRAttnCLI(
        LRAttnModule,
        TokenDataModule,
        args=args,
        seed_everything_default=0,
        save_config_callback=MLflowSaveConfig,
        # the optimiser is the module's (--model.optimizer, lr, ...): Lightning's automatic --optimizer and
        # --lr_scheduler would train with another one while MLflow records ours
        auto_configure_optimizers=False,
        trainer_defaults={"gradient_clip_val": 1.0, "log_every_n_steps": 10},
    )



def demo_main(argv: list[str]) -> int:
    """The README's main job: prepare the embedded corpus, train `small` briefly, point at MLflow."""
    parser = Parser(prog="lrattn demo", description=demo_main.__doc__)
    parser.add_argument("--ablation", default="s-lr-block-n8-r64")
    parser.add_argument("--size", default="small")
    parser.add_argument("--data", default="data/stdlib-docs-byte")
    parser.add_argument("--run_name", default=None, help="default: SIZE-ABLATION-DATE-TIME (each demo a new run)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment name (fit's default)")
    args, rest = parser.parse_known_args(argv)
    for flag, value in (("--experiment", args.experiment), ("--run_name", args.run_name)):
        if value is not None:  # checked before the corpus is prepared; fit checks them again
            rest = [flag, check_name(value, flag), *rest]
    if not Path(args.data, "meta.json").exists():
        from lrattn_lightning.data.prepare import prepare_main

        code = prepare_main(["--source", "stdlib-docs", "--tokenizer", "byte", "--out", args.data])
        if code:  # stopped by a signal, or a worker failed: it said why; no fit on a half-prepared folder
            return code
    recipe = Path("experiments/cpu-demo.yaml")
    recipe = recipe if recipe.is_file() else packaged(str(recipe))
    if args.run_name is None:  # each demo is a new run
        rest = ["--run_name", f"{args.size}-{args.ablation}-{time.strftime('%Y%m%d-%H%M%S')}", *rest]
    try:
        cli = run_lightning(["fit", "--config", str(recipe), "--size", args.size,
                             "--ablation", args.ablation, "--data.data_dir", args.data, *rest])
    finally:
        checkpointing.release_run_locks()
    print("\n" + "\n".join(fit_summary(cli, "[lrattn demo]")))
    return 0




# ---- lrattn sweep: fit's own parser checks every run's arguments ------------------------------------
class _ParserBuilt(Exception):
    pass


class _FitParserOnly:
    """Stands in for LRAttnCLI's `parse_arguments` hook: LightningCLI calls it right after building the parser,
    so raising there hands the parser over before anything is parsed, instantiated or written."""

    def parse_arguments(self, parser, args) -> None:
        raise _ParserBuilt(parser)


def fit_parser():
    """`lrattn fit`'s parser for `lrattn sweep` to check every run's arguments with: the same LRAttnCLI classes
    and arguments, built without subcommands (`run=False`), so it lacks only Trainer.fit's own arguments
    (--ckpt_path, which the sweep sets itself)."""
    cli = type("SweepFitParser", (_FitParserOnly, LRAttnCLI), {})
    try:  # exit_on_error=False: a bad argument raises ArgumentError instead of printing usage and exiting
        cli(LRAttnModule, TokenDataModule, run=False, parser_kwargs={"exit_on_error": False})
    except _ParserBuilt as built:
        return built.args[0]
    raise RuntimeError("LightningCLI did not call parse_arguments")  # pragma: no cover


def sweep_main(argv: list[str]) -> int:
    """`lrattn sweep` with fit's parser (tools/sweep.py)."""
    from lrattn_lightning.tools.sweep import main

    return main(argv, fit_parser=fit_parser)


def run_subcommand(argv: list[str]) -> int:
    """fit / validate / test with Lightning's own failures as one line and exit codes: 3 for a non-finite
    loss, 128 + the signal's number for SIGTERM, SIGINT or SIGHUP (143, 130, 129: a checkpoint at the
    current step was saved); the run folder is released."""
    import contextlib

    from lrattn_lightning.errors import one_line

    fit = argv[:1] == ["fit"]
    try:
        with checkpointing.stop_signals_noted() if fit else contextlib.nullcontext():
            cli = run_lightning(argv)
            if cli.subcommand == "fit" and cli.trainer.is_global_zero:
                print("\n".join(fit_summary(cli)))
            elif cli.subcommand in ("validate", "test") and cli.trainer.is_global_zero:
                print("\n".join(scoring_summary(cli)))
            late = checkpointing.NOTED_SIGNAL if fit else 0
        if late:  # the run had ended (validated, FINISHED, checkpoint written): nothing was cut short
            print(f"[lrattn] {signal.Signals(late).name} came after the run finished; nothing was lost", file=sys.stderr)
        return 0
    except MisconfigurationException as err:
        print(f"lrattn: error: {one_line(err)}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        div = checkpointing.LAST_DIVERGENCE
        print(f"lrattn: training stopped: {err}" + (f"; {div.describe()}" if div is not None and fit else ""),
              file=sys.stderr)
        return 3
    except SIGTERMException:  # also SIGINT and SIGHUP (LastCheckpoint)
        stop = checkpointing.LAST_STOP or checkpointing.Stop()
        where = (f" at step {stop.step}; checkpoint {stop.path} holds it, continue with --ckpt_path last"
                 if stop.path else "; nothing to save yet")
        print(f"lrattn: stopped by {stop.name}{where}", file=sys.stderr)
        return stop.exit_code
    finally:
        checkpointing.release_run_locks()
