"""Downstream evaluation: an lm-eval model over our Decoder, launched by Fabric, logged to MLflow.

    lrattn eval --checkpoint runs/.../last.ckpt --tasks local [--num-fewshot K] [--limit N]
                [--batch-size B] [--include-path DIR] [--devices N --num-nodes M] [--val-loss]

`LRAttnLM` (registered in lm-eval as `lrattn`) scores requests with the Decoder's own forward, the
one training uses. loglikelihood: requests sorted by length, right-padded into batches (causal, so
padding never reaches a scored position), contexts left-truncated to seq_len; a continuation longer
than seq_len is scored in consecutive windows. loglikelihood_rolling: lm-eval's disjoint windows of
seq_len predictions, batched. generate_until: greedy or sampled, KV cache (generate.py), stop strings.

Scaling: each Fabric rank evaluates lm-eval's shard of the documents (lm-eval shards by the LM's
`rank`/`world_size` and pads request counts); per-sample metrics are gathered exactly to rank 0,
which alone logs. The same launcher computes the exact token-weighted validation loss over the
whole validation split (`--val-loss`): each rank sums the cross-entropy of its windows, the sums
are all-reduced in float64.

MLflow: metrics `eval/<task>/<metric>` (lm-eval's `acc,none` -> `acc`, `acc_stderr,none` ->
`acc_stderr`) at the checkpoint's global step, on the training run recorded in the checkpoint, plus
the results JSON as an artifact `eval/results-stepNNNNNN-<time>-<id>.json`. Without a training run (none
recorded, or not in this tracking store) a new run tagged with the checkpoint is created.
`EvalCallback` runs the same evaluation at the end of `lrattn fit` on the in-memory model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lrattn_lightning.data.tokenizer import Tokenizer
from lrattn_lightning.errors import Parser
from lrattn_lightning.eval.tasks import (
    LOCAL_TASKS,
    PRESETS,
    TaskError,
    build_task_manager,
    expand_tasks,
    load_tasks,
    materialise_local_tasks,
)
from lrattn_lightning.model.decoder import Decoder
from lrattn_lightning.model.generate import generate
from lrattn_lightning.train.checkpoints import EvalError, LoadedCheckpoint, check_data_dir, load_checkpoint


# ---- the lm-eval model --------------------------------------------------------------------------
class _Progress:
    """One line on stderr, rewritten at most every 2 s: how many requests are scored, of how many."""

    def __init__(self, what: str, total: int, quiet: bool = False) -> None:
        self.what, self.total, self.quiet = what, total, quiet or total == 0
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.quiet and now - self.last >= 2.0:
            self.last = now
            print(f"[lrattn eval] {done:,}/{self.total:,} {self.what} scored ({now - self.start:.0f} s)",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        if not self.quiet:
            print(f"[lrattn eval] {self.total:,}/{self.total:,} {self.what} scored "
                  f"({time.monotonic() - self.start:.0f} s)", file=sys.stderr, flush=True)


@register_model("lrattn")
class LRAttnLM(TemplateLM):
    """lm-eval model over a Decoder. `LRAttnLM(checkpoint=PATH)` or `LRAttnLM(model=..., tokenizer=...)`.

    `collectives` (a Fabric or a Lightning Strategy: global_rank, world_size, all_gather, barrier)
    makes it one rank of a data-parallel evaluation.
    """

    def __init__(self, checkpoint: str | None = None, *, model: Decoder | None = None, tokenizer: Tokenizer | None = None,
                 batch_size: int | str = 16, max_gen_toks: int = 256, device: str | torch.device | None = None,
                 seed: int = 1234, collectives: Any = None, **_ignored: Any):
        super().__init__()
        self.checkpoint = None
        if checkpoint is not None:
            self.checkpoint = load_checkpoint(checkpoint)
            model, tokenizer = self.checkpoint.model, self.checkpoint.tokenizer
        if model is None or tokenizer is None:
            raise EvalError("LRAttnLM needs checkpoint=PATH, or model= and tokenizer=")
        self.model, self.tok = model, tokenizer
        self._device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self._device)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = seed
        self._coll = collectives
        self._warned: set[str] = set()

    # ---- identity and tokens --------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.size.seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(list(tokens))

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.model.cfg
        info = {"size": cfg.size.name, "ablation": cfg.ablation.name, "tokenizer": self.tok.spec().get("kind")}
        if self.checkpoint is not None:
            info["checkpoint"] = str(self.checkpoint.path)
        return info

    # ---- data parallel: lm-eval calls these when world_size > 1 ---------------------------------
    @property
    def rank(self) -> int:
        return self._coll.global_rank if self._coll is not None else 0

    @property
    def world_size(self) -> int:
        return self._coll.world_size if self._coll is not None else 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        gathered = self._coll.all_gather(tensor)  # (world, *shape)
        return gathered if tensor.dim() == 0 else gathered.flatten(0, 1)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            self._coll.barrier()

    # ---- scoring --------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids) -> (sum log p, greedy?) each."""
        pieces = []  # (request index, input ids, continuation ids); long continuations become windows
        for i, (_, context, continuation) in enumerate(requests):
            for start in range(0, len(continuation), self.max_length):
                cont = continuation[start:start + self.max_length]
                whole = (list(context) + list(continuation[:start + len(cont)]))[-(self.max_length + 1):]
                pieces.append((i, whole[:-1], cont))
        totals = [0.0] * len(requests)
        greedy = [True] * len(requests)
        order = sorted(range(len(pieces)), key=lambda k: (-len(pieces[k][1]), pieces[k][1]))
        progress = _Progress("loglikelihood requests", len(requests), quiet=disable_tqdm or self.rank != 0)
        with torch.no_grad():
            for first in range(0, len(order), self.batch_size):
                progress.update(len({pieces[k][0] for k in order[:first + self.batch_size]}))
                batch = [pieces[k] for k in order[first:first + self.batch_size]]
                width = len(batch[0][1])  # longest first
                ids = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
                for row, (_, inp, _) in enumerate(batch):
                    ids[row, :len(inp)] = torch.tensor(inp, dtype=torch.long)
                logits = self.model(ids.to(self._device))  # (B, T, V)
                for row, (i, inp, cont) in enumerate(batch):
                    n, c = len(inp), len(cont)
                    scored = F.log_softmax(logits[row, n - c:n].float(), dim=-1)  # the positions predicting cont
                    target = torch.tensor(cont, dtype=torch.long, device=scored.device)
                    totals[i] += float(scored.gather(-1, target[:, None]).sum())
                    greedy[i] = greedy[i] and bool((scored.argmax(-1) == target).all())
        progress.done()
        results = list(zip(totals, greedy, strict=True))
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in lm-eval's disjoint windows of seq_len predictions."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation -----------------------------------------------------------------------------
    def _gen_settings(self, gen_kwargs: dict[str, Any] | None) -> tuple:
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None)
        until = tuple(s for s in ([until] if isinstance(until, str) else (until or [])) if s)
        max_new = min(int(kw.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        do_sample, temperature = kw.pop("do_sample", None), kw.pop("temperature", None)
        if do_sample is None:
            do_sample = bool(temperature and float(temperature) > 0)
        temperature = (float(temperature) if temperature else 1.0) if do_sample else 0.0
        top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
        for key in kw:
            if key not in self._warned:
                self._warned.add(key)
                print(f"[lrattn eval] generation setting {key}={kw[key]!r} is not supported; ignored", file=sys.stderr)
        return until, max_new, temperature, top_k, top_p

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuation until a stop string, EOS or max_gen_toks; equal-length prompts batch."""
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            settings = self._gen_settings(gen_kwargs)
            ids = self.tok_encode(context)[-(self.max_length - settings[1]):] or [self.eot_token_id]
            groups[(len(ids), settings)].append((i, ids))
        out: list[str] = [""] * len(requests)
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        for (_, (until, max_new, temperature, top_k, top_p)), items in sorted(groups.items(), key=lambda g: -g[0][0]):
            for first in range(0, len(items), self.batch_size):
                batch = items[first:first + self.batch_size]
                prompt = torch.tensor([ids for _, ids in batch], dtype=torch.long, device=self._device)
                stop = None
                if until:
                    def stop(new_BN: torch.Tensor, until: tuple = until) -> torch.Tensor:
                        return torch.tensor([any(s in self.tok_decode(row.tolist()) for s in until) for row in new_BN],
                                            device=new_BN.device)
                new = generate(self.model, prompt, max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=generator, eos_id=self.eot_token_id, should_stop=stop)
                for (i, _), row in zip(batch, new.tolist(), strict=True):
                    if self.eot_token_id in row:
                        row = row[:row.index(self.eot_token_id)]
                    text = self.tok_decode(row)
                    for s in until:
                        text = text.split(s)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


# ---- running lm-eval ----------------------------------------------------------------------------
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
        local = materialise_local_tasks(names, data_dir, Path(tmp))
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

    Rank r scores windows r, r + W, ...; `all_reduce` (sum) combines the float64 sums across ranks.
    """
    from litdata import StreamingDataset, TokensLoader

    from lrattn_lightning.data.datamodule import check_shards, count_windows, read_meta

    seq_len = seq_len or model.cfg.size.seq_len
    meta = read_meta(data_dir)
    n_windows = count_windows(check_shards(data_dir, "val"), seq_len + 1)
    dataset = StreamingDataset(str(Path(data_dir) / "val"), item_loader=TokensLoader(block_size=seq_len + 1),
                               shuffle=False, drop_last=True)
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, tokens)
    mine = list(range(rank, n_windows, world_size))
    for first in range(0, len(mine), batch_size):
        batch = torch.stack([torch.as_tensor(np.asarray(dataset[i]).astype(np.int64))
                             for i in mine[first:first + batch_size]]).to(device)
        logits = model(batch[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        sums += torch.stack((loss.double(), torch.tensor(batch[:, 1:].numel(), dtype=torch.float64, device=device)))
    if all_reduce is not None and world_size > 1:
        sums = all_reduce(sums)
    loss = float(sums[0] / sums[1])
    bytes_per_token = float(meta["splits"]["val"].get("bytes_per_token") or 0.0)
    out = {"loss": loss, "tokens": float(sums[1]), "windows": float(n_windows)}
    if bytes_per_token:
        out["bpb"] = loss / math.log(2) / bytes_per_token
    return out


# ---- MLflow -------------------------------------------------------------------------------------
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def eval_metrics(results: dict[str, Any] | None, val: dict[str, float] | None = None) -> dict[str, float]:
    """lm-eval results -> {'eval/<task>/<metric>': value}; 'acc,none' -> 'acc', 'acc,flt' -> 'acc_flt'."""
    out: dict[str, float] = {}
    for task, row in ((results or {}).get("results") or {}).items():
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or key == "alias":
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[_MLFLOW_UNSAFE.sub("_", f"eval/{task}/{name}")] = float(value)
    for key, value in (val or {}).items():
        out[f"eval/val/{key}"] = float(value)
    return out


def open_eval_run(ckpt: LoadedCheckpoint, tracking_uri: str, experiment: str = "lrattn") -> tuple[Any, str, bool]:
    """(client, run id, created): the checkpoint's training run if this store has it, else a new run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from lrattn_lightning.train.callbacks import flat_run_params
    from lrattn_lightning.train.tracking import artifact_location

    client = MlflowClient(tracking_uri)
    run_id = (ckpt.mlflow or {}).get("run_id")
    if run_id:
        try:
            if client.get_run(run_id).info.lifecycle_stage == "active":
                return client, run_id, False
        except MlflowException:
            pass
        print(f"[lrattn eval] training run {run_id} of {ckpt.path} is not in {tracking_uri}; "
              "logging to a new run", file=sys.stderr)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, artifact_location(tracking_uri))
    cfg = ckpt.cfg
    run = client.create_run(exp_id, run_name=f"eval-{cfg.size.name}-{cfg.ablation.name}", tags={
        "checkpoint": str(ckpt.path.resolve()), "eval_only": "true", "ablation": cfg.ablation.name,
        "size": cfg.size.name, "training_run_id": run_id or "none", "global_step": str(ckpt.global_step)})
    client.log_batch(run.info.run_id, params=[_param(k, v) for k, v in flat_run_params(cfg).items()])
    return client, run.info.run_id, True


def _param(key: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(key, str(value))


def log_eval(client: Any, run_id: str, step: int, results: dict[str, Any] | None,
             val: dict[str, float] | None = None) -> dict[str, float]:
    """Log eval/<task>/<metric> at `step` and the results JSON; returns the logged metrics."""
    from lm_eval.utils import handle_non_serializable
    from mlflow.entities import Metric

    metrics = eval_metrics(results, val)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
    payload = {k: v for k, v in (results or {}).items() if k != "samples"}
    if val:
        payload["validation"] = val
    text = json.dumps(payload, indent=2, default=handle_non_serializable, ensure_ascii=False)
    # two evaluations of one checkpoint within a second must not overwrite each other's file
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    client.log_text(run_id, text, f"eval/results-step{step:06d}-{stamp}.json")
    return metrics


# ---- `lrattn eval`: the Fabric launcher ---------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="lrattn eval", description="Evaluate a checkpoint with lm-eval; log to MLflow.")
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by `lrattn fit`")
    parser.add_argument("--tasks", default="local",
                        help="comma-separated lm-eval tasks/groups and presets: " +
                             "; ".join(f"{k} = {','.join(p.tasks)}" for k, p in PRESETS.items()))
    parser.add_argument("--num-fewshot", type=int, default=None, help="default: the preset's (paper: 5) or the task's")
    parser.add_argument("--limit", type=_number, default=None, help="documents per task (a float < 1: a fraction)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--include-path", action="append", default=[], help="folder of extra task YAMLs (repeatable)")
    parser.add_argument("--data-dir", default=None, help="prepared folder for the local tasks (default: the checkpoint's)")
    parser.add_argument("--val-loss", action="store_true", help="also the exact validation loss over the whole val split")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="auto", help="cpu | gpu | auto")
    parser.add_argument("--tracking-uri", default=None,
                        help="default: the checkpoint's training store, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="lrattn", help="experiment of a new run (no training run found)")
    parser.add_argument("--bootstrap-iters", type=int, default=100_000, help="lm-eval bootstrap for stderr (0: none)")
    parser.add_argument("--no-log", action="store_true", help="print the results only")
    return parser.parse_args(argv)


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value >= 1 and value.is_integer() else value


def main(argv: list[str] | None = None) -> int:
    """`lrattn eval`: checks first, then Fabric launches the ranks; rank 0 prints and logs."""
    from lightning.fabric import Fabric

    own_argv = argv is None or list(argv) == sys.argv[2:]  # the console script: ranks can re-execute it
    args = parse_args(sys.argv[2:] if argv is None else list(argv))
    ckpt = load_checkpoint(args.checkpoint)  # fail fast, before any process starts
    data_dir = args.data_dir or ckpt.data_dir
    names, _ = expand_tasks(args.tasks)
    if data_dir is not None and (args.val_loss or any(n in LOCAL_TASKS for n in names)):
        check_data_dir(ckpt, data_dir)
    elif args.val_loss:
        raise EvalError(f"--val-loss needs the prepared data: checkpoint {ckpt.path} records no data_dir; pass --data-dir")
    if not names and not args.val_loss:
        raise EvalError(f"nothing to evaluate: --tasks is empty; name tasks or presets ({', '.join(PRESETS)}) "
                        "or pass --val-loss")
    if not args.no_log:
        from lrattn_lightning.train.tracking import resolve_tracking_uri

        recorded = (ckpt.mlflow or {}).get("tracking_uri")
        if recorded and recorded.startswith("sqlite:///") and not Path(recorded[len("sqlite:///"):]).is_file():
            recorded = None  # a checkpoint copied from another machine: its store is not here
        args.tracking_uri = resolve_tracking_uri(args.tracking_uri or recorded, False)
    world = args.devices * args.num_nodes
    strategy = "auto" if world == 1 else ("ddp" if own_argv else "ddp_spawn")
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    _LOADED[args.checkpoint] = ckpt  # rank 0 of a subprocess launch reuses it; spawned ranks load their own
    fabric.launch(_evaluate, args, data_dir)
    return 0


_LOADED: dict[str, LoadedCheckpoint] = {}


def _evaluate(fabric: Any, args: argparse.Namespace, data_dir: str | None) -> dict[str, float] | None:
    ckpt = _LOADED.pop(args.checkpoint, None) or load_checkpoint(args.checkpoint)
    model = ckpt.model.to(fabric.device)
    lm = LRAttnLM(model=model, tokenizer=ckpt.tokenizer, batch_size=args.batch_size, device=fabric.device,
                  collectives=fabric if fabric.world_size > 1 else None)
    lm.checkpoint = ckpt
    names, _ = expand_tasks(args.tasks)
    results = None
    if names:
        results = run_lm_eval(lm, args.tasks, data_dir=data_dir, include_paths=args.include_path,
                              num_fewshot=args.num_fewshot, limit=args.limit, bootstrap_iters=args.bootstrap_iters)
    val = None
    if args.val_loss:
        val = validation_loss(model, data_dir, batch_size=args.batch_size, rank=fabric.global_rank,
                              world_size=fabric.world_size, all_reduce=lambda t: fabric.all_reduce(t, reduce_op="sum"))
    if fabric.global_rank != 0:
        return None
    return report(ckpt, results, val, args)


def report(ckpt: LoadedCheckpoint, results: dict[str, Any] | None, val: dict[str, float] | None,
           args: argparse.Namespace) -> dict[str, float]:
    """Rank 0: print the table and log to MLflow (unless --no-log)."""
    from lm_eval.utils import make_table

    if results is not None:
        print(make_table(results))
    if val is not None:
        print(f"validation: loss {val['loss']:.6f} over {int(val['tokens'])} tokens"
              + (f", bpb {val['bpb']:.4f}" if "bpb" in val else ""))
    if args.no_log:
        return eval_metrics(results, val)
    uri = args.tracking_uri  # resolved (and a server probed) before any evaluation started
    client, run_id, created = open_eval_run(ckpt, uri, args.experiment)
    metrics = log_eval(client, run_id, ckpt.global_step, results, val)
    if created:
        client.set_terminated(run_id)
    print(f"[lrattn eval] logged {len(metrics)} metrics at step {ckpt.global_step} to "
          f"{'new' if created else 'training'} run {run_id} in {uri}")
    print(f"[lrattn eval] open the UI:  mlflow ui --backend-store-uri {uri}")
    return metrics


# ---- at the end of `lrattn fit` -----------------------------------------------------------------
class EvalCallback(Callback):
    """Evaluate the in-memory model when training ends and log to the training's MLflow run.

        lrattn fit ... --trainer.callbacks+=lrattn_lightning.eval.run.EvalCallback --trainer.callbacks.tasks=local

    Every rank evaluates its shard (through the trainer's strategy); rank 0 logs.
    """

    def __init__(self, tasks: str = "local", limit: float | None = None, num_fewshot: int | None = None,
                 batch_size: int = 16, include_path: str | None = None, val_loss: bool = False,
                 bootstrap_iters: int = 100_000):
        self.tasks, self.limit, self.num_fewshot = tasks, limit, num_fewshot
        self.batch_size, self.include_path, self.val_loss = batch_size, include_path, val_loss
        self.bootstrap_iters = bootstrap_iters
        self.metrics: dict[str, float] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from lightning.pytorch.loggers import MLFlowLogger

        datamodule = trainer.datamodule
        model: Decoder = pl_module.model
        was_training = model.training
        model.eval()
        strategy = trainer.strategy if trainer.world_size > 1 else None
        lm = LRAttnLM(model=model, tokenizer=datamodule.tokenizer(), batch_size=self.batch_size,
                      device=pl_module.device, collectives=strategy)
        limit = int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit
        try:
            results = run_lm_eval(lm, self.tasks, data_dir=datamodule.data_dir,
                                  include_paths=[self.include_path] if self.include_path else [],
                                  num_fewshot=self.num_fewshot, limit=limit, bootstrap_iters=self.bootstrap_iters)
            val = None
            if self.val_loss:
                val = validation_loss(model, datamodule.data_dir, batch_size=self.batch_size,
                                      rank=trainer.global_rank, world_size=trainer.world_size,
                                      all_reduce=lambda t: trainer.strategy.reduce(t, reduce_op="sum"))
        finally:
            model.train(was_training)
        if not trainer.is_global_zero:
            return
        self.metrics = eval_metrics(results, val)
        logger = trainer.logger
        if isinstance(logger, MLFlowLogger):
            self.metrics = log_eval(logger.experiment, logger.run_id, trainer.global_step, results, val)
        print("[lrattn eval] " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(self.metrics.items())))
