"""`lrattn eval`: lm-eval tasks and the validation loss of a checkpoint, launched by Fabric, logged to MLflow.

    lrattn eval --checkpoint runs/.../last.ckpt --tasks local [--num-fewshot K] [--limit N]
                [--batch-size B] [--include-path DIR] [--devices N --num-nodes M] [--val-loss]

The model is `LRAttnLM` (eval/lm.py), the tasks come from eval/tasks.py. Scaling: each Fabric rank
evaluates lm-eval's shard of the documents (lm-eval shards by the LM's `rank`/`world_size` and pads
request counts); per-sample metrics are gathered exactly to rank 0, which alone logs. The same
launcher computes the exact token-weighted validation loss over the whole validation split
(`--val-loss`) with the training module's own loss (`token_losses`): each rank sums the
cross-entropy of its windows, the sums are all-reduced in float64.

MLflow: metrics `eval/<task>/<metric>` (lm-eval's `acc,none` -> `acc`, `acc_stderr,none` ->
`acc_stderr`) at the checkpoint's global step, on the training run recorded in the checkpoint, plus
the results JSON as an artifact `eval/results-stepNNNNNN-<time>-<id>.json`. Without a training run (none
recorded, or not in this tracking store) a new run tagged with the checkpoint is created.
`EvalCallback` (eval/callback.py) runs the same evaluation at the end of `lrattn fit` on the in-memory model.
"""

from __future__ import annotations

import argparse
import math
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lrattn_lightning.core.errors import UsageError
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.data.remote import is_remote
from lrattn_lightning.data.shards import check_split
from lrattn_lightning.eval.evaluate import (  # noqa: F401 (also imported from here)
    _param,
    eval_metrics,
    log_eval,
    run_lm_eval,
    validation_loss,
)
from lrattn_lightning.eval.tasks import (
    LOCAL_TASKS,
    PRESETS,
    expand_tasks,
    write_tasks,
)
from lrattn_lightning.train.checkpoint import stop
from lrattn_lightning.train.checkpoint.load import (
    LoadedCheckpoint,
    add_trust_flags,
    check_data_dir,
    load_checkpoint,
    trust_routers,
)
from lrattn_lightning.train.runs_view import ensure_view
from lrattn_lightning.train.schema import Param, Tag
from lrattn_lightning.train.summary import ui_pointer

if TYPE_CHECKING:
    pass


# ---- running lm-eval ----------------------------------------------------------------------------
def open_eval_run(ckpt: LoadedCheckpoint, tracking_uri: str, experiment: str = "lrattn") -> tuple[Any, str, bool]:
    """(client, run id, created): the checkpoint's training run if this store has it, else a new run."""
    from mlflow.exceptions import MlflowException

    from lrattn_lightning.train.artifacts import LinkSafeClient
    from lrattn_lightning.train.callbacks import flat_run_params
    from lrattn_lightning.train.store import artifact_location

    client = LinkSafeClient(tracking_uri)
    run_id = (ckpt.mlflow or {}).get("run_id")
    cfg = ckpt.cfg
    if run_id:
        why = f"is not in {tracking_uri}"
        try:
            run = client.get_run(str(run_id))
            params = run.data.params
            if run.info.lifecycle_stage != "active":
                why = f"is deleted in {tracking_uri}"
            elif (params.get(Param.SIZE), params.get(Param.ABLATION)) != (cfg.size.name, cfg.ablation.name):
                why = (f"in {tracking_uri} trained {params.get(Param.SIZE)}/{params.get(Param.ABLATION)}, not "
                       f"{cfg.size.name}/{cfg.ablation.name}")  # a checkpoint names no other run to write into
            else:
                return client, run.info.run_id, False
        except MlflowException:
            pass
        print(f"[lrattn eval] training run {str(run_id)[:64]} of {ckpt.path} {why}; logging to a new run",
              file=sys.stderr)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, artifact_location(tracking_uri))
    ensure_view(client, exp_id, exp.tags if exp else {})  # the runs-table link ui_pointer prints opens this view
    run = client.create_run(exp_id, run_name=f"eval-{cfg.size.name}-{cfg.ablation.name}", tags={
        Tag.CHECKPOINT: str(ckpt.path.resolve()), Tag.EVAL_ONLY: "true", Tag.ABLATION: cfg.ablation.name,
        Tag.SIZE: cfg.size.name, Tag.TRAINING_RUN: run_id or "none", Tag.GLOBAL_STEP: str(ckpt.global_step)})
    client.log_batch(run.info.run_id, params=[_param(k, v) for k, v in flat_run_params(cfg).items()])
    return client, run.info.run_id, True


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
                        help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db (the checkpoint's training run is "
                             "used when it is in that store)")
    parser.add_argument("--experiment", default="lrattn", help="experiment of a new run (no training run found)")
    parser.add_argument("--bootstrap-iters", type=int, default=100_000, help="lm-eval bootstrap for stderr (0: none)")
    parser.add_argument("--no-log", action="store_true", help="print the results only")
    parser.add_argument("--write-tasks", metavar="DIR", default=None,
                        help="write the local tasks for this checkpoint (cloze contexts cut to its trained window) "
                             "into DIR for `lm_eval --include_path DIR`, print that command, and exit")
    add_trust_flags(parser)
    args = parser.parse_args(argv)
    check_eval_numbers(args)
    return args


def check_eval_numbers(args: argparse.Namespace) -> None:
    """Counts lm-eval would take apart with a traceback, or accept with a meaning nobody wants."""
    for flag, value, least in (("--batch_size", args.batch_size, 1), ("--devices", args.devices, 1),
                               ("--num_nodes", args.num_nodes, 1), ("--num_fewshot", args.num_fewshot, 0),
                               ("--bootstrap_iters", args.bootstrap_iters, 0)):
        if value is not None and value < least:
            raise UsageError(f"{flag} {value}: must be an integer >= {least}")
    limit = args.limit
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        raise UsageError(f"--limit {limit}: give a number of documents per task (>= 1) or a fraction in (0, 1); "
                        "leave it out for every document")


def _number(text: str) -> int | float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return int(value) if value >= 1 and value.is_integer() else value


def main(argv: list[str] | None = None) -> int:
    """`lrattn eval`: checks first, then Fabric launches the ranks; rank 0 prints and logs."""
    own_argv = argv is None or list(argv) == sys.argv[2:]  # the console script: ranks can re-execute it
    args = parse_args(sys.argv[2:] if argv is None else list(argv))
    trust_routers(args)  # the router classes the user names, before a checkpoint names one
    ckpt = load_checkpoint(args.checkpoint)  # fail fast, before any process starts
    data_dir = args.data_dir or ckpt.data_dir
    names, _ = expand_tasks(args.tasks)
    if data_dir is not None and (args.val_loss or any(n in LOCAL_TASKS for n in names)):
        if not args.data_dir and is_remote(data_dir):  # object storage is contacted on the user's word only
            raise UsageError(f"checkpoint {ckpt.path} trained on {data_dir}; pass --data-dir {data_dir} to read it "
                             "from object storage (a checkpoint's field alone does not)")
        meta = check_data_dir(ckpt, data_dir)
        if args.val_loss:  # the val split whole and fit for the model before any task runs (they take minutes)
            check_split(data_dir, meta, "val", ckpt.cfg.size, ckpt.seq_len)
    elif args.val_loss:
        raise UsageError(f"--val-loss needs the prepared data: checkpoint {ckpt.path} records no data_dir; pass --data-dir")
    if args.write_tasks is not None:  # no evaluation: the task folder for lm_eval's own command line
        print(write_tasks(names, data_dir, Path(args.write_tasks), window=ckpt.seq_len, encode=ckpt.tokenizer.encode))
        return 0
    if not names and not args.val_loss:
        raise UsageError(f"nothing to evaluate: --tasks is empty; name tasks or presets ({', '.join(PRESETS)}) "
                        "or pass --val-loss")
    if not args.no_log:
        args.tracking_uri = eval_store(args.tracking_uri, ckpt)
    from lightning.fabric import Fabric  # (after the checks: seconds to import)

    world = args.devices * args.num_nodes
    strategy = "auto" if world == 1 else ("ddp" if own_argv else "ddp_spawn")
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    _LOADED[args.checkpoint] = ckpt  # rank 0 of a subprocess launch reuses it; spawned ranks load their own
    launcher = getattr(fabric.strategy, "launcher", None)
    if getattr(launcher, "procs", None) is not None:  # a stop signal to this process goes on to the ranks it started,
        stop.PASS_ON.append(lambda signum: _pass_on(launcher, signum))  # which it then awaits (stop.adopt_ranks)
    fabric.launch(_evaluate, args, data_dir)
    if stop.HELD_SIGNAL and fabric.global_rank == 0:  # it came while the results were being logged: they are whole
        print(f"[lrattn eval] {signal.Signals(stop.HELD_SIGNAL).name} came after the results were logged; nothing "
              "was lost", file=sys.stderr)
    return 0


_LOADED: dict[str, LoadedCheckpoint] = {}


def _pass_on(launcher: Any, signum: int) -> None:
    for proc in launcher.procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    stop.adopt_ranks(launcher)


def eval_store(flag: str | None, ckpt: LoadedCheckpoint) -> str:
    """Where results go: --tracking_uri, else $MLFLOW_TRACKING_URI, else the local store; never the store a
    checkpoint names (a checkpoint is data from elsewhere). Said in one line when the checkpoint's training run was
    logged to another store, before anything connects to it."""
    from lrattn_lightning.train.store import absolute_sqlite, resolve_tracking_uri, uri_source

    uri = resolve_tracking_uri(flag, False)
    recorded = (ckpt.mlflow or {}).get("tracking_uri")
    if isinstance(recorded, str) and recorded and absolute_sqlite(recorded) != uri:
        there = shlex.quote(recorded) if recorded.isprintable() and len(recorded) <= 200 else "URI"
        print(f"[lrattn eval] results go to {uri} ({uri_source(flag)}), not to "
              f"{recorded[:200]!r} where {ckpt.path} says it was trained: a checkpoint does not choose the store; pass "
              f"--tracking_uri {there} to log into its training run there", file=sys.stderr)
    return uri


def _evaluate(fabric: Any, args: argparse.Namespace, data_dir: str | None) -> dict[str, float] | None:
    if args.checkpoint not in _LOADED:  # a spawned rank: a new process, told again which routers to trust
        trust_routers(args)
    ckpt = _LOADED.pop(args.checkpoint, None) or load_checkpoint(args.checkpoint)
    model = ckpt.model.to(fabric.device)
    from lrattn_lightning.eval.lm import LRAttnLM  # (lm-eval: imported once the arguments are good)

    lm = LRAttnLM(model=model, tokenizer=ckpt.tokenizer, batch_size=args.batch_size, device=fabric.device,
                  collectives=fabric if fabric.world_size > 1 else None, max_length=ckpt.seq_len)
    lm.checkpoint = ckpt
    names, _ = expand_tasks(args.tasks)
    results = None
    if names:
        results = run_lm_eval(lm, args.tasks, data_dir=data_dir, include_paths=args.include_path,
                              num_fewshot=args.num_fewshot, limit=args.limit, bootstrap_iters=args.bootstrap_iters)
    val = None
    if args.val_loss:
        val = validation_loss(model, data_dir, batch_size=args.batch_size, rank=fabric.global_rank,
                              world_size=fabric.world_size, all_reduce=lambda t: fabric.all_reduce(t, reduce_op="sum"),
                              seq_len=ckpt.seq_len)
    if fabric.global_rank != 0:
        return None
    return report(ckpt, results, val, args, data_dir)


def report(ckpt: LoadedCheckpoint, results: dict[str, Any] | None, val: dict[str, float] | None,
           args: argparse.Namespace, data_dir: str | None = None) -> dict[str, float]:
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
    with stop.held():  # a stop signal now waits: the results are logged whole, and a new run ends FINISHED
        client, run_id, created = open_eval_run(ckpt, uri, args.experiment)
        metrics = log_eval(client, run_id, ckpt.global_step, results, val, data_dir)
        if created:
            client.set_terminated(run_id)
    print(f"[lrattn eval] logged {len(metrics)} metrics at step {ckpt.global_step} to "
          f"{'new' if created else 'training'} run {run_id} in {uri}")
    experiment_id = client.get_run(run_id).info.experiment_id
    print("\n".join(f"[lrattn eval] {line}" for line in ui_pointer(uri, experiment_id, run_id)))
    return metrics
