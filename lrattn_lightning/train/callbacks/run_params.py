"""A training run's MLflow params as plain values (names: train/schema.py Param), and the logger they go to.

    flat_run_params   every resolved size and ablation field, the key width, block ends, parameter count and
                      added FLOPs (also the params of an eval-only run: eval/run.py)
    recipe_params     the Trainer's and the data's settings that decide a result (train_max_steps, ...)
    latest            a run's newest value of a param a resume may change (`KEY_from_step_N`)
    mlflow_logger     the MLflow logger on global rank zero outside the sanity check, else None
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger

from lrattn_lightning.model.accounting import added_flops_percent, count_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.train.schema import Param, train_settings

# the module's settings logged as `train_<name>` params (the routing kinds' training options among them)
TRAIN_PARAMS = train_settings()


def flat_run_params(cfg: ModelConfig) -> dict[str, Any]:
    """Every resolved size and ablation field as one flat, searchable dict (MLflow params)."""
    size, abl = cfg.to_dict()["size"], cfg.to_dict()["ablation"]
    params = {Param.SIZE: size.pop("name"), Param.ABLATION: abl.pop("name")}
    params.update({k: v for k, v in size.items() if k != "doc"})
    params.update({k: ("null" if v is None else v) for k, v in abl.items() if k not in ("doc", "tags")})  # kind + options
    params[Param.KEY_DIM] = cfg.kind.key_dim(cfg)
    params[Param.BLOCK_ENDS] = ",".join(map(str, cfg.block_ends())) or "full"
    params[Param.PARAMS] = count_params(cfg)
    pct = added_flops_percent(cfg)  # unknown for an external router that does not state its FLOPs
    params[Param.ADDED_FLOPS] = "unknown" if pct is None else round(pct, 6)
    return params


def tokens_per_step(trainer: L.Trainer | None) -> int | None:
    """Tokens of one optimizer step over all devices, from the datamodule's batch_size and seq_len."""
    dm = trainer.datamodule if trainer is not None else None
    batch, seq = getattr(dm, "batch_size", None), getattr(dm, "seq_len", None)
    if not batch or not seq:
        return None
    return int(batch) * int(seq) * trainer.world_size * trainer.accumulate_grad_batches


def mlflow_logger(trainer: L.Trainer) -> MLFlowLogger | None:
    """The MLflow logger, on global rank zero outside the sanity check; None otherwise."""
    logger = trainer.logger
    if not isinstance(logger, MLFlowLogger) or trainer.sanity_checking or not trainer.is_global_zero:
        return None
    return logger


def strategy_name(trainer: L.Trainer) -> str:
    """How the run spreads over devices: single, ddp, fsdp (FSDP2: ModelParallelStrategy), or the class name."""
    name = type(trainer.strategy).__name__
    return {"SingleDeviceStrategy": "single", "DDPStrategy": "ddp", "ModelParallelStrategy": "fsdp"}.get(name, name)


def schedule_steps(trainer: L.Trainer, hp: Any) -> int:
    """The steps the learning-rate schedule spans: --model.schedule_steps, else --trainer.max_steps."""
    return int(hp.get("schedule_steps") or trainer.max_steps)


def latest(params: dict[str, str], key: str) -> str | None:
    """A run's newest value of `key`: the param of the latest resume that changed it (`KEY_from_step_N`), else the
    run's own (for train_schedule_steps, runs from before it: train_max_steps)."""
    changed = {int(k.rsplit("_", 1)[1]): v for k, v in params.items()
               if k.startswith(f"{key}{Param.FROM_STEP}") and k.rsplit("_", 1)[1].isdigit()}
    if changed:
        return changed[max(changed)]
    if key == Param.SCHEDULE_STEPS and key not in params:
        return params.get(Param.MAX_STEPS)
    return params.get(key)


def recipe_params(trainer: L.Trainer) -> dict[str, Any]:
    """The training settings that decide a result, as flat params (also in config.yaml)."""
    dm = trainer.datamodule
    meta = getattr(dm, "meta", None) if dm is not None else None
    tokenizer = meta.get("tokenizer", {}) if isinstance(meta, dict) else {}
    return {
        Param.MAX_STEPS: trainer.max_steps,
        Param.BATCH_SIZE: getattr(dm, "batch_size", None),
        Param.SEQ_LEN: getattr(dm, "seq_len", None),
        Param.TOKENS_PER_STEP: tokens_per_step(trainer),
        Param.SEED: os.environ.get("PL_GLOBAL_SEED"),
        Param.DATA_DIR: str(getattr(dm, "data_dir", None)),
        Param.TOKENIZER: tokenizer.get("kind", "unknown") + (f":{tokenizer['vocab_size']}" if "vocab_size" in tokenizer else ""),
        Param.PRECISION: str(trainer.precision),
        Param.DEVICES: trainer.num_devices,
        Param.NUM_NODES: trainer.num_nodes,
        Param.STRATEGY: strategy_name(trainer),
        Param.ACCUMULATE: trainer.accumulate_grad_batches,
        Param.GRADIENT_CLIP: trainer.gradient_clip_val,
    }
