"""The evaluation itself, shared by `lrattn eval` (eval/run.py) and the end of `lrattn fit` (eval/callback.py): lm-eval
on an LRAttnLM, the exact validation loss, and the MLflow record of both."""

from __future__ import annotations

import json
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lrattn_lightning.data.shards import bits_per_byte, check_shards, count_windows, read_meta, verify_split
from lrattn_lightning.eval.tasks import (
    MLFLOW_UNSAFE,
    PRESETS,
    TaskError,
    build_task_manager,
    config_tags,
    expand_tasks,
    load_tasks,
    materialise_local_tasks,
)
from lrattn_lightning.model.decoder import Decoder
from lrattn_lightning.train.losses import token_losses
from lrattn_lightning.train.schema import Artifact, Metric

if TYPE_CHECKING:
    from lrattn_lightning.eval.lm import LRAttnLM



def run_lm_eval(lm: LRAttnLM, tasks: str | list[str], *, data_dir: str | Path | None = None,
                include_paths: list[str | Path] = (), num_fewshot: int | None = None, limit: int | float | None = None,
                bootstrap_iters: int = 100_000) -> dict[str, Any] | None:
    """Evaluate `lm` on task names/presets; the results dict on rank 0, None on other ranks.

    `num_fewshot` None: the few-shot count of a named preset (paper: 5), else each task's default.
    """
    from lm_eval.evaluator import evaluate

    names, preset_shots = expand_tasks(tasks)
    if not names:
        raise TaskError(f"no tasks given; name lm-eval tasks or a preset ({', '.join(PRESETS)})")
    shots = num_fewshot if num_fewshot is not None else preset_shots
    with tempfile.TemporaryDirectory(prefix="lrattn-tasks-") as tmp:
        local = materialise_local_tasks(names, data_dir, Path(tmp), window=lm.max_length, encode=lm.tok_encode)
        manager, resolved = build_task_manager(names, ([tmp] if local else []) + list(include_paths))
        loaded = manager.load(load_tasks(manager, resolved))
        random.seed(0)  # lm-eval's default seeds (simple_evaluate's, without its slow environment report)
        np.random.seed(1234)
        torch.manual_seed(1234)
        for task in loaded["tasks"].values():
            if shots is not None and task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=shots)
            elif task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=1234)
        start = time.time()
        results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False)
    if results is not None:
        results["config"] = {"model": "lrattn", "model_args": lm.get_model_info(), "tasks": resolved,
                             "num_fewshot": shots, "limit": limit, "batch_size": lm.batch_size,
                             "world_size": lm.world_size, "bootstrap_iters": bootstrap_iters}
        results["date"] = start
        results["total_evaluation_time_seconds"] = str(time.time() - start)
    return results


@torch.no_grad()
def validation_loss(model: Decoder, data_dir: str | Path, *, batch_size: int = 16, rank: int = 0, world_size: int = 1,
                    all_reduce: Any = None, seq_len: int | None = None) -> dict[str, float]:
    """Exact token-weighted cross-entropy over every validation window (the training windows of seq_len + 1).

    Each batch is scored as the module's validation_step scores it (`token_losses`). Rank r scores
    windows r, r + W, ...; `all_reduce` (sum) combines the float64 sums across ranks.
    """
    from lrattn_lightning.data.datamodule import collate_windows, split_dataset

    seq_len = seq_len or model.cfg.size.seq_len
    meta = read_meta(data_dir)
    n_windows = count_windows(check_shards(data_dir, "val"), seq_len + 1)
    verify_split(data_dir, "val", meta)  # a chunk changed since prepare is one line, not a crash mid-run
    dataset = split_dataset(data_dir, "val", seq_len + 1, shuffle=False, drop_last=True)
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, tokens)
    mine = list(range(rank, n_windows, world_size))
    for first in range(0, len(mine), batch_size):
        windows = collate_windows([dataset[i] for i in mine[first:first + batch_size]]).to(device)  # (B, T + 1)
        targets = windows[:, 1:]
        ce, _ = token_losses(model(windows[:, :-1]), targets)  # mean over the batch's tokens, as in validation_step
        sums[0] += ce.double() * targets.numel()
        sums[1] += targets.numel()
    if all_reduce is not None and world_size > 1:
        sums = all_reduce(sums)
    loss = float(sums[0] / sums[1])
    bytes_per_token = float(meta["splits"]["val"].get("bytes_per_token") or 0.0)
    out = {"loss": loss, "tokens": float(sums[1]), "windows": float(n_windows)}
    if bytes_per_token:
        out["bpb"] = bits_per_byte(loss, bytes_per_token)
    return out


# ---- MLflow -------------------------------------------------------------------------------------
def eval_metrics(results: dict[str, Any] | None, val: dict[str, float] | None = None) -> dict[str, float]:
    """lm-eval results -> {'eval/<task>/<metric>': value}; 'acc,none' -> 'acc', 'acc,flt' -> 'acc_flt'."""
    out: dict[str, float] = {}
    for task, row in ((results or {}).get("results") or {}).items():
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or key == "alias":
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[MLFLOW_UNSAFE.sub("_", f"{Metric.EVAL}{task}/{name}")] = float(value)
    for key, value in (val or {}).items():
        out[f"{Metric.EVAL_VAL}{key}"] = float(value)
    return out


def _param(key: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(key, str(value))


def log_eval(client: Any, run_id: str, step: int, results: dict[str, Any] | None,
             val: dict[str, float] | None = None, data_dir: str | Path | None = None) -> dict[str, float]:
    """Log eval/<task>/<metric> at `step`, each task's configuration (tag lrattn.eval_config/<task>, JSON: limit,
    few-shot, data folder; eval/tasks.py `config_tags`) and the results JSON; returns the logged metrics."""
    from lm_eval.utils import handle_non_serializable
    from mlflow.entities import Metric, RunTag

    metrics = eval_metrics(results, val)
    now = int(time.time() * 1000)
    tags = [RunTag(k, v) for k, v in config_tags(results, val, data_dir).items()]
    client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], tags=tags)
    payload = {k: v for k, v in (results or {}).items() if k != "samples"}
    if val:
        payload["validation"] = val
    text = json.dumps(payload, indent=2, default=handle_non_serializable, ensure_ascii=False)
    # two evaluations of one checkpoint within a second must not overwrite each other's file
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    client.log_text(run_id, text, f"{Artifact.EVAL_RESULTS}step{step:06d}-{stamp}.json")
    return metrics


# ---- `lrattn eval`: the Fabric launcher ---------------------------------------------------------
