"""What `lrattn fit|validate|test` checks before any work, as plain functions of the parsed config: numbers Lightning
would take apart with a traceback (or accept with a meaning nobody wants), a train split smaller than one batch, the
architecture's names, a checkpoint's architecture, data and schedule against this run, --init_from, FlexAttention on
CPU, jsonargparse's errors as one line, FSDP's strategy.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import UsageError
from lrattn_lightning.core.names import with_closest
from lrattn_lightning.train.checkpoint.load import read_checkpoint_file
from lrattn_lightning.train.settings import OptimiserSettings, bad_setting


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


def check_numbers(subcommand: str, cfg) -> None:
    """Values Lightning would take apart with a traceback, or accept with a meaning nobody wants."""
    trainer, data = cfg.trainer, cfg.data
    if subcommand == "fit" and (not isinstance(trainer.max_steps, int) or trainer.max_steps == 0 or trainer.max_steps < -1):
        raise UsageError(f"--trainer.max_steps {trainer.max_steps}: give a positive number of optimizer steps "
                         "(or -1 to let --trainer.max_epochs decide)")
    if subcommand == "fit" and cfg.checkpoint_every < 1:
        raise UsageError(f"--checkpoint_every {cfg.checkpoint_every}: give a positive number of steps between saves")
    for name, value, least in (("--data.batch_size", data.batch_size, 1), ("--data.num_workers", data.num_workers, 0)):
        if value is not None and value < least:
            raise UsageError(f"{name} {value}: must be an integer >= {least}")
    check_training_numbers(subcommand, cfg)
    for name in ("limit_val_batches", "limit_test_batches"):
        value = trainer.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value == 1:
            print(f"[lrattn] warning: --trainer.{name} 1 means ONE batch in Lightning (an integer counts batches); "
                  f"pass 1.0 for the whole validation split", file=sys.stderr)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_training_numbers(subcommand: str, cfg, groups: tuple[type, ...] | None = None) -> None:
    """The optimiser's, schedule's and trainer's numbers, checked before a run folder or MLflow run exists (torch,
    Lightning and the scheduler would refuse some only at the first step, after the run was created, and take
    others, such as a negative warmup, with a meaning nobody wants). The settings' ranges are their fields' own
    (train/settings.py bad_setting, over `groups`: its SETTING_GROUPS unless given); the trainer's are Lightning's
    arguments, listed here."""
    if subcommand != "fit":
        return
    m, trainer = cfg.model, cfg.trainer
    if (line := bad_setting(m, groups)) is not None:
        raise UsageError(line)
    rules = [  # (flag, value, ok, what it must be)
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


def devices_in_world(trainer) -> int:
    """Processes that split the training windows (devices x nodes); 1 where the count is left to Lightning."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    count = len(devices) if isinstance(devices, list | tuple) else devices if isinstance(devices, int) and devices > 0 else 1
    return count * (nodes if isinstance(nodes, int) and nodes > 0 else 1)


def check_one_batch(cfg) -> None:
    """A train split with fewer windows than one batch on every device trains nothing (0 steps) and would still
    end 'finished': one line instead, before any work."""
    from lrattn_lightning.data.shards import check_shards, count_windows

    windows = count_windows(check_shards(cfg.data.data_dir, "train"), cfg.data.seq_len + 1)
    world, batch = devices_in_world(cfg.trainer), cfg.data.batch_size
    if windows < batch * world:
        per = f"{batch} windows per device x {world} devices" if world > 1 else f"--data.batch_size {batch} windows"
        raise UsageError(f"the train split of {cfg.data.data_dir} has {windows} windows of seq_len + 1 = "
                         f"{cfg.data.seq_len + 1} tokens, and one batch needs {per}; use a smaller --data.batch_size "
                         "or --data.seq_len, or prepare more data")


def same_folder(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def check_checkpoint_data(subcommand: str, cfg, ckpt_path: str, stored: dict) -> None:
    """validate/test score with the checkpoint's tokenizer (another one's ids are other text to the model); a resume
    continues at its position in the data folder it trained on (litdata refuses another folder only after the
    model was restored)."""
    from lrattn_lightning.train.checkpoint.load import check_tokenizer

    if subcommand in ("validate", "test") and stored.get("tokenizer"):
        check_tokenizer(stored["tokenizer"], ckpt_path, cfg.data.data_dir, "--data.data_dir")
    trained_on = (stored.get("data") or {}).get("data_dir")
    if subcommand == "fit" and trained_on and not same_folder(str(cfg.data.data_dir), str(trained_on)):
        raise UsageError(f"--data.data_dir {cfg.data.data_dir}: checkpoint {ckpt_path} trained on {trained_on}, and a "
                         f"resume continues at its position in that folder; resume with --data.data_dir {trained_on} "
                         "(or start a new run, e.g. --init_from the checkpoint)")


def parse_error(message: str, parser, subcommand: str | None) -> str:
    """jsonargparse's error as one line; an unknown flag (command line) or key (--config file) with the closest."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and not o.endswith((".help", "+"))]
    help_ = f"`lrattn {subcommand or 'fit'} --help` lists them"
    unknown = re.findall(r"(?:^|\s)(--?[^\s=]+)", message.partition("unrecognized arguments:")[2])
    if unknown:
        return f"unknown flag{'s' if len(unknown) > 1 else ''} " + "; ".join(with_closest(f, flags) for f in unknown) + f"; {help_}"
    keys = re.findall(r"does not accept option '([^']+)'", message)
    if keys:
        keys_known = [f[2:] for f in flags]
        return (f"unknown key{'s' if len(keys) > 1 else ''} in a --config file: " +
                "; ".join(with_closest(k, keys_known) for k in keys) + f"; {help_}")
    linked = re.search(r"resolved_by_lrattn\(registry\) --> (model\.\w+)", message)
    if linked:  # a link target: provenance comes from the registry and git
        return f"--{linked.group(1)} is recorded by lrattn from the registry and git, not set by a flag; drop it"
    # e.g. 'Parser key "config": File does not exist: ...' -> '--config: File does not exist: ...'
    return re.sub(r'^Parser key "([^"]+)":\s*', r"--\1: ", " ".join(message.split()))


def check_schedule(cfg, stored: dict, ckpt_path: str) -> None:
    """A resume keeps the schedule's length (--model.schedule_steps, else --trainer.max_steps): another one would
    change the learning rate and momentum of steps already shaped by the old one (a longer run restarted the
    warm-down). Training past its end keeps it: `--trainer.max_steps N --model.schedule_steps OLD` runs the extra
    steps at its final values, as a run launched with those two flags would (how a finished run is extended).
    With --model.allow_schedule_change the new length is taken when the two schedules agree on every step so far:
    the run then equals one launched with the new length (extending the stable phase, decay at the new end)."""
    from lrattn_lightning.train.schedule import first_schedule_difference

    m, steps = cfg.model, cfg.trainer.max_steps
    old, step = stored["schedule"].get("total_steps"), stored.get("global_step") or 0
    new = m.get("schedule_steps") or steps
    if old is None or new < 0:
        return
    after = (f"steps {old} to {steps} at its final values: x{m.final_lr_fraction} of the peak learning rate, the "
             "last momentum")
    if new == old:
        if steps > max(old, step):
            print(f"[lrattn] training on to step {steps} with the {old}-step schedule this run followed "
                  f"(--model.schedule_steps {old}): {after}", file=sys.stderr)
        return
    tail = f" ({after})" if steps > old else ""
    given = f"--model.schedule_steps {m.schedule_steps}" if m.get("schedule_steps") else f"--trainer.max_steps {steps}"
    momentum = OptimiserSettings.of(m).momentum_schedule() if m.optimizer == "muon_adamw" else None
    differs = first_schedule_difference(old, new, step, m.warmup_steps, m.decay_fraction, m.final_lr_fraction, momentum)
    keep = f"keep that schedule with --model.schedule_steps {old}{tail}"
    if differs is not None:  # e.g. the warm-down has begun: no resume follows the new length
        asked = " with --model.allow_schedule_change" if m.allow_schedule_change else ""
        raise UsageError(f"{given}{asked}: checkpoint {ckpt_path} (step {step}) followed a {old}-step learning-rate "
                         f"schedule, which differs from a {new}-step one from step {differs} on, a step already taken; "
                         f"{keep}, or start a new run from these weights (--run_name NEW --init_from {ckpt_path}: a "
                         "fresh optimizer and schedule)")
    if not m.allow_schedule_change:
        raise UsageError(f"{given}: checkpoint {ckpt_path} (step {step}) follows a {old}-step learning-rate schedule; "
                         f"resuming with a {new}-step one changes the learning rate of a run in progress. Resume with "
                         f"--trainer.max_steps {old}; or {keep}; or pass --model.allow_schedule_change true to "
                         f"continue as a run launched with a {new}-step schedule (possible until the two differ)")
    print(f"[lrattn] schedule length {old} -> {new} steps at step {step} (--model.allow_schedule_change): the run "
          f"continues as one launched with {new} steps", file=sys.stderr)


def read_checkpoint_head(path: str) -> dict:
    """The plain-value head of a checkpoint: its model_config and MLflow run; one-line errors otherwise."""
    ckpt = read_checkpoint_file(path, mmap=True)  # tensors stay on disk: only the plain values are read
    stored = (ckpt.get("hyper_parameters") or {}).get("model_config")
    if not isinstance(stored, dict):
        raise UsageError(f"--ckpt_path {path}: not an lrattn_lightning checkpoint (no model_config hyper-parameter)")
    return {"model_config": stored, "mlflow": ckpt.get("mlflow") or {}, "schedule": ckpt.get("schedule") or {},
            "global_step": ckpt.get("global_step"), "data": ckpt.get("data") or {}, "tokenizer": ckpt.get("tokenizer")}


# ---- the architecture and the checkpoint of a run (LRAttnCLI.before_instantiate_classes) ------------------------

def name_architecture(subcommand: str, cfg, ckpt_head: dict | None) -> bool:
    """--size and --ablation are required; validate/test may take them (and the data folder) from their checkpoint.
    Returns whether the ablation's name came from the checkpoint."""
    if subcommand != "fit" and not cfg.get("ckpt_path"):
        raise UsageError(f"{subcommand} needs --ckpt_path: a checkpoint of `lrattn fit` (a file, or 'last' "
                         "with the run's --size/--ablation/--run_name); without one it would score random weights")
    from_ckpt = False
    if ckpt_head is not None and subcommand != "fit":
        import inspect

        from lrattn_lightning.data.datamodule import TokenDataModule

        from_ckpt = not cfg.ablation
        cfg.size = cfg.size or ckpt_head["model_config"]["size"]["name"]
        cfg.ablation = cfg.ablation or ckpt_head["model_config"]["ablation"]["name"]
        trained_on = ckpt_head["data"].get("data_dir")
        default = inspect.signature(TokenDataModule).parameters["data_dir"].default
        if trained_on and cfg.data.data_dir == default and Path(trained_on, "meta.json").is_file():
            cfg.data.data_dir = trained_on  # no --data.data_dir: the held-out split the checkpoint trained with
    missing = [f"--{k}" for k in ("size", "ablation") if not cfg.get(k)]
    if missing:
        raise UsageError(f"{subcommand} needs {' and '.join(missing)}: name the architecture from the registry "
                         "(`lrattn list` shows them), e.g. --size small --ablation s-lr-block-n8-r64")
    return from_ckpt


def check_attention(subcommand: str, cfg) -> None:
    """FlexAttention has no backward on CPU: a CPU fit with --model.attention flex would fail at its first step."""
    if subcommand != "fit" or cfg.model.get("attention") != "flex":
        return
    import torch

    accelerator = str(cfg.trainer.get("accelerator") or "auto")
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        raise UsageError(f"--model.attention flex: FlexAttention has no backward on CPU (torch {torch.__version__}); "
                         "train with --model.attention sdpa here (same results), flex on CUDA")


def check_init_from(subcommand: str, cfg, model_cfg):
    """--init_from: which tensors the source checkpoint gives (a shape conflict is one line, now); None without."""
    source = cfg.get("init_from")
    if source is None:
        return None
    if subcommand != "fit":
        raise UsageError(f"--init_from is for fit (upcycling a new run); {subcommand} reads --ckpt_path")
    if cfg.get("ckpt_path"):  # a resume: its checkpoint holds this run's weights already
        print(f"[lrattn fit] --init_from {source} is not applied: resuming from --ckpt_path {cfg.ckpt_path}",
              file=sys.stderr)
        return None
    from lrattn_lightning.train.checkpoint.load import init_weights_from

    return init_weights_from(source, model_cfg)  # its InputError is one line, as every bad input


def check_checkpoint(subcommand: str, cfg, model_cfg, run_dir: Path, ckpt_head: dict | None) -> str | None:
    """Resolve --ckpt_path (`last`), refuse another architecture; the MLflow run it trained, if any."""
    from lrattn_lightning.train.checkpoint import save
    from lrattn_lightning.train.checkpoint.compat import architecture_differences

    ckpt_dir = run_dir / "checkpoints"
    ckpt_path, stored = cfg.get("ckpt_path"), ckpt_head
    if subcommand == "fit" and ckpt_path is None and ckpt_dir.exists() and any(ckpt_dir.glob("*.ckpt")):
        raise UsageError(f"{ckpt_dir} already holds checkpoints of run '{cfg.run_name}'; resume with "
                         "--ckpt_path last, or start a new run with --run_name NAME")
    if ckpt_path == "last":
        newest = save.newest_last(ckpt_dir)
        if newest is None:
            raise UsageError(f"--ckpt_path last: no {ckpt_dir / 'last.ckpt'}; check --run_name/--experiment")
        if newest.name != "last.ckpt":
            print(f"[lrattn] --ckpt_path last: {newest} is newer than last.ckpt (a folder from before one "
                  "last.ckpt); resuming from it", file=sys.stderr)
        ckpt_path = cfg.ckpt_path = str(newest)
        stored = read_checkpoint_head(ckpt_path)
    if stored is None:
        return None
    config = stored["model_config"]  # against the architecture the registry resolves now
    diffs = architecture_differences(config, model_cfg)
    if diffs:
        raise UsageError(
            f"--ckpt_path {ckpt_path} was trained with a different architecture (size '{config['size']['name']}', "
            f"ablation '{config['ablation']['name']}'); pass those names. Differences: " + "; ".join(diffs[:6]))
    check_checkpoint_data(subcommand, cfg, ckpt_path, stored)
    if subcommand == "fit":
        check_schedule(cfg, stored, ckpt_path)
    return stored["mlflow"].get("run_id")  # validating, testing or resuming logs into the run that trained it
