"""`lrattn fit|validate|test|demo`: the LightningCLI subclass and what it checks before any work.

The architecture comes only from the registry (`--size`, `--ablation`, on the command line or in the
recipe); recipes in experiments/ hold the training knobs. Everything is checked before the first step:
names (closest names on a typo), numbers, the data folder, a checkpoint's architecture; then the run
folder is claimed (a lock), the MLflow store opened (under a lock), and training starts (cli/outputs.py: what a
run writes). The registry is read once, here: (--size, --ablation) resolve to one ModelConfig, which the checks
use and LRAttnModule is built from, with the run's provenance (the config as plain values, the registry's hash,
the git commit: link targets, never flags). Only LightningCLI's public hooks are overridden; the trainer gets the
MLflow logger, atomic checkpoint writes, last.ckpt and the step monitors of train/callbacks/ as
`instantiate_trainer` arguments. `cli/__init__.py` is the `lrattn` dispatcher that imports this module only for
these subcommands.
"""

from __future__ import annotations

import argparse
import copy
import logging
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lrattn_lightning.cli import checks
from lrattn_lightning.cli.outcome import fit_lines, scoring_lines
from lrattn_lightning.cli.outputs import RunOutputs
from lrattn_lightning.core.errors import UsageError
from lrattn_lightning.core.malloc import keep_freed_memory
from lrattn_lightning.core.names import check_name
from lrattn_lightning.data.datamodule import TokenDataModule
from lrattn_lightning.data.shards import training_window, validate_data_dir
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.train.checkpoint import lock, stop
from lrattn_lightning.train.checkpoint.stop import NonFiniteLossError
from lrattn_lightning.train.lit_module import LRAttnModule, building_from
from lrattn_lightning.train.schema import Artifact, Param
from lrattn_lightning.train.settings import Provenance, current_git_commit
from lrattn_lightning.train.tracking import resolve_tracking_uri


class MLflowSaveConfig(SaveConfigCallback):
    """Logs the resolved config.yaml to the MLflow run (the stock callback needs a log_dir)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, save_to_log_dir=False, **kwargs)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if isinstance(trainer.logger, MLFlowLogger):
            text = self.parser.dump(self.config, skip_none=False)
            trainer.logger.experiment.log_text(trainer.logger.run_id, text, Artifact.CONFIG)


class LRAttnCLI(RunOutputs, LightningCLI):
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
        # Provenance is resolved here (registry, git), never given: as link targets these fields are off the command
        # line and out of config.yaml, and a checkpoint's stored values are replaced (before_instantiate_classes).
        for field in PROVENANCE:
            parser.link_arguments("registry", f"model.{field}", compute_fn=resolved_by_lrattn)

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
            raise UsageError(checks.parse_error(str(err), getattr(self, "_subcommand_parsers", {}).get(sub, parser), sub)) from None
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
            self._ckpt_head = checks.read_checkpoint_head(path)
        # Lightning then puts a --ckpt_path file's hyper-parameters over the command line's --model.* (not for
        # `last`, which is no file yet): a resume would drop a changed --model.lr unchecked, or --model.schedule_steps
        # altogether. A fit takes the command line's, as with `last`; compat.py and check_schedule compare them.
        self._given_model = copy.deepcopy(self.config[sub].model) if sub == "fit" and self._ckpt_head else None

    def before_instantiate_classes(self) -> None:
        from lrattn_lightning.core.files import load_yaml_strict, read_yaml_text

        cfg = self.config[self.subcommand]
        if self._given_model is not None:
            cfg.model = self._given_model
        for recipe in cfg.get("config") or []:  # jsonargparse keeps the last of a duplicated key; we refuse it
            load_yaml_strict(read_yaml_text(Path(recipe.absolute), "recipe"), recipe.relative)
        checks.check_numbers(self.subcommand, cfg)
        from_ckpt = checks.name_architecture(self.subcommand, cfg, self._ckpt_head)
        self.registry = registry = load_registry(cfg.registry)  # the one read of the registry in this command
        if from_ckpt and cfg.ablation not in registry.ablations:
            ablation = self._ckpt_head["model_config"]["ablation"]
            router = f" (routing external, router {ablation['router']})" if ablation.get("router") else ""
            raise UsageError(f"ablation '{cfg.ablation}'{router} of --ckpt_path {cfg.ckpt_path} is not in registry "
                             f"{registry.path}; pass --registry FILE, the registry the checkpoint was trained with")
        model_cfg = registry.model(cfg.size, cfg.ablation)  # unknown names list the closest; the module records its names
        cfg.data.seq_len = training_window(cfg.data.seq_len, model_cfg.size, "--data.seq_len")
        validate_data_dir(cfg.data.data_dir, model_cfg.size, cfg.data.seq_len, registry.sizes.values())
        if self.subcommand == "fit":
            checks.check_one_batch(cfg)
        if model_cfg.kind.takes_impl:  # the backend the kind resolves (fast for gated_dynamic: one line) runs here
            from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL, availability

            impl = model_cfg.kind.resolve_impl(model_cfg, cfg.model.get("impl") or DEFAULT_IMPL)
            if (error := availability(impl)) is not None:  # (triton: CUDA or the interpreter)
                raise UsageError(error)
        checks.check_attention(self.subcommand, cfg)
        if cfg.trainer.get("strategy") == "fsdp":  # checked now: instantiate_trainer builds it after the run folder
            checks.fsdp_strategy(cfg.trainer)
        self.upcycling = checks.check_init_from(self.subcommand, cfg, model_cfg)
        seed = cfg.seed_everything if isinstance(cfg.seed_everything, int) else 0
        if cfg.run_name is None:  # (the registry's names could still make one too long)
            cfg.run_name = check_name(f"{cfg.size}-{cfg.ablation}-seed{seed}", "the default run name SIZE-ABLATION-seedN")
        self.run_dir = Path(cfg.runs_dir) / cfg.experiment / cfg.run_name
        self.resume_run_id = checks.check_checkpoint(self.subcommand, cfg, model_cfg, self.run_dir, self._ckpt_head)
        self.tracking_uri = self.experiment_id = None
        if cfg.trainer.logger is None:
            self.tracking_uri = resolve_tracking_uri(cfg.tracking_uri, cfg.mlflow_fallback_local)
        # the module is built from this ModelConfig: it reads no registry and runs no git itself
        provenance = Provenance.of(model_cfg, registry.sha256, current_git_commit())
        for field in PROVENANCE:
            setattr(cfg.model, field, getattr(provenance, field))
        self.model_cfg = model_cfg
        self._claim_run(cfg)

    def instantiate_classes(self) -> None:
        with building_from(self.model_cfg):  # the module takes this ModelConfig, not a second reading of its dict
            super().instantiate_classes()

    def after_instantiate_classes(self) -> None:
        self.model.resolved_from = self.registry  # (the run's description quotes the paper size's FLOPs from it)

    def before_fit(self) -> None:
        """Upcycling (--init_from): this run's initialisation, then the source's tensors where they match."""
        up = self.upcycling
        if up is None:
            return
        self.model.model.load_state_dict(up.loaded, strict=False)
        self.model.init_from_params = {Param.INIT_FROM: str(up.path.resolve()), Param.INIT_FROM_STEP: up.step,
                                       Param.INIT_FROM_SOURCE: up.source, Param.INIT_FROM_RUN: up.mlflow_run or "none",
                                       Param.INIT_FROM_NEW: len(up.new)}
        if lock.launched_as_rank_zero():
            for line in up.summary():
                print(f"[lrattn fit] {line}", flush=True)


PROVENANCE = ("model_config", "registry_sha256", "git_commit")


def resolved_by_lrattn(registry: str | None) -> None:
    """The value of a provenance field on the command line: none (before_instantiate_classes sets it)."""
    return None


# What Lightning prints that does not concern the run: cloud tips, the seed (it is in config.yaml and the
# MLflow params), deprecations inside Lightning itself, and remarks on choices made here on purpose.
# Lightning's info lines that echo a run's own settings back or concern the platform's set-up, not the run:
# the module's own callbacks replacing the CLI's of the same types, `limit_val_batches=1.0` meaning all batches
QUIET_MESSAGES = ("💡 Tip", "Seed set to", "The following callbacks returned in `LightningModule.configure_callbacks`",
                  "`Trainer(limit_")
QUIET_LOGGERS = ("mlflow.store.db.utils",)  # "Creating initial MLflow database tables...": a new store's set-up
QUIET_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"Your `IterableDataset` has `__len__` defined",
                  r"Be aware that when using `ckpt_path`", r".*callbacks used to create the Trainer.*will override",
                  r"The number of training batches \(\d+\) is smaller than the logging interval")


class _QuietFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(QUIET_MESSAGES)


def quiet_lightning() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _QuietFilter) for f in handler.filters):
                handler.addFilter(_QuietFilter())
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def bound_yaml_values() -> None:
    """jsonargparse's YAML loader (every --config file and YAML value on the command line) checks each text
    against core/files.py's limits first: a billion-laughs or 10,000-deep --config is one line naming the file,
    not minutes of jsonargparse walking what PyYAML built. The values are still jsonargparse's own."""
    from jsonargparse import get_loader, set_loader

    from lrattn_lightning.core.files import check_yaml_limits

    original = get_loader("yaml")
    if getattr(original, "bounded", False):  # a second CLI in this process
        return

    def load(text: str, path: str = "") -> Any:
        check_yaml_limits(text, path or f"the command-line value {text[:40]!r}")
        return original(text)

    load.bounded = True  # type: ignore[attr-defined]
    set_loader("yaml", load, (yaml.YAMLError,))


def run_lightning(argv: list[str]) -> LRAttnCLI:
    # From the console script the arguments are sys.argv itself, which DDP re-executes in each child.
    args = None if argv == sys.argv[1:] else argv
    quiet_lightning()
    bound_yaml_values()
    keep_freed_memory()  # each step's large arrays reuse the last step's pages (core/malloc.py)
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



def run_subcommand(argv: list[str]) -> int:
    """fit / validate / test with Lightning's own failures as one line and exit codes: 3 for a non-finite
    loss, 128 + the signal's number for SIGTERM, SIGINT or SIGHUP (143, 130, 129: a checkpoint at the
    current step was saved); the run folder is released."""
    return run_with_stops(lambda: run_lightning(argv), fit=argv[:1] == ["fit"])


def run_with_stops(start: Callable[[], LRAttnCLI], *, fit: bool, prefix: str = "[lrattn fit]",
                   resume: str = "continue with --ckpt_path last", data_notes: bool = True) -> int:
    """Run `start()` (a LightningCLI run) and end as it ended: its summary lines (`prefix`, `data_notes`: fit_lines)
    and 0, or one line and 2 (bad input), 3 (a non-finite loss) or 128 + the stop signal's number, whose line names the signal, the
    step and checkpoint saved then and `resume` (how to continue). `lrattn demo` runs its fit through this too."""
    import contextlib

    from lrattn_lightning.core.errors import one_line

    try:
        with stop.stop_signals_noted() if fit else contextlib.nullcontext():
            cli = start()
            if cli.subcommand == "fit" and cli.trainer.is_global_zero:
                print("\n".join(fit_lines(cli, prefix, data_notes)))
            elif cli.subcommand in ("validate", "test") and cli.trainer.is_global_zero:
                print("\n".join(scoring_lines(cli)))
            late = stop.NOTED_SIGNAL if fit else 0
        if late:  # the run had ended (validated, FINISHED, checkpoint written): nothing was cut short
            print(f"[lrattn] {signal.Signals(late).name} came after the run finished; nothing was lost", file=sys.stderr)
        return 0
    except MisconfigurationException as err:
        print(f"lrattn: error: {one_line(err)}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        div = stop.LAST_DIVERGENCE
        print(f"lrattn: training stopped: {err}" + (f"; {div.describe()}" if div is not None and fit else ""),
              file=sys.stderr)
        return 3
    except SIGTERMException:  # also SIGINT and SIGHUP (LastCheckpoint)
        how = stop.LAST_STOP or stop.Stop(stop.NOTED_SIGNAL or signal.SIGTERM)
        where = f" at step {how.step}; checkpoint {how.path} holds it, {resume}" if how.path else "; nothing to save yet"
        if lock.launched_as_rank_zero():  # one line, not one per rank
            print(f"lrattn: stopped by {how.name}{where}", file=sys.stderr)
        return how.exit_code
    finally:
        stop.await_ranks()  # the ranks it launched and took out of Lightning's watch on a stop
        lock.release_run_locks()
