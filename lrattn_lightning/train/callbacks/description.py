"""RunDescription: what a training run is, as MLflow params and tags at fit start (names: train/schema.py).

    params   every resolved size/ablation field and the optimiser and recipe settings (run_params.py), on a new
             run only: a resumed run keeps its own, and what a resume changes (max_steps, the schedule's length)
             becomes a param of its own, `KEY_from_step_N`
    tags     ablation, size, control, git_commit, registry_sha256, lrattn_version, the recipe fingerprint and its
             parts (lrattn.recipe, lrattn.recipe_parts: train/fingerprint.py), lrattn.method, and the run page's
             description (mlflow.note.content: what the entry is, against what, at which size and recipe)
"""

from __future__ import annotations

import json
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lrattn_lightning.model.accounting import added_flops_percent, count_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.train import controls
from lrattn_lightning.train import fingerprint as fingerprints
from lrattn_lightning.train.callbacks.run_params import (
    TRAIN_PARAMS,
    flat_run_params,
    latest,
    mlflow_logger,
    recipe_params,
    schedule_steps,
    tokens_per_step,
)
from lrattn_lightning.train.optim import muon_dtype_of
from lrattn_lightning.train.runs_view import ensure_view
from lrattn_lightning.train.schema import ExperimentTag, Param, Tag

EXPERIMENT_KIND = ExperimentTag.KIND
PAPER_SIZE = "paper-0.5b"


class RunDescription(Callback):
    """The run's params and tags at fit start (see module doc)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logger = mlflow_logger(trainer)
        if logger is None:
            return
        client, run_id, hp, cfg = logger.experiment, logger.run_id, pl_module.hparams, pl_module.cfg
        run = client.get_run(run_id)  # None when the store is unreachable (the logger drops the calls)
        if run is not None and Param.ABLATION not in run.data.params:  # a resumed run keeps its original params
            logger.log_hyperparams({
                **flat_run_params(cfg),
                Param.REGISTRY_SHA: hp.registry_sha256,
                **{Param.TRAIN_PREFIX + k: v for k, v in hp.items() if k in TRAIN_PARAMS},
                Param.MUON_DTYPE_RESOLVED: muon_dtype_of(trainer.optimizers) or "none",  # what `auto` became here
                **recipe_params(trainer),
                Param.SCHEDULE_STEPS: schedule_steps(trainer, hp),
                **getattr(pl_module, "init_from_params", {}),  # upcycling: the source checkpoint (lrattn fit --init_from)
            })
        elif run is not None:  # a resume that trains longer (--model.schedule_steps) or stretches the schedule
            # (--model.allow_schedule_change): params cannot change, so a new length is a param of its own
            step = getattr(pl_module, "_loaded_step", None) or trainer.global_step  # restored after on_fit_start
            now = {Param.MAX_STEPS: trainer.max_steps, Param.SCHEDULE_STEPS: schedule_steps(trainer, hp)}
            logger.log_hyperparams({f"{key}{Param.FROM_STEP}{step}": value for key, value in now.items()
                                    if latest(run.data.params, key) not in (None, str(value))})
        tags = {Tag.ABLATION: cfg.ablation.name, Tag.SIZE: cfg.size.name, Tag.CONTROL: cfg.ablation.control or "none",
                Tag.GIT_COMMIT: hp.git_commit, Tag.REGISTRY_SHA: hp.registry_sha256,
                Tag.VERSION: package_version(),  # an installed wheel has no git commit to tag
                **recipe_tags(trainer, pl_module, run.data.params if run is not None else {})}
        if run is not None and Tag.NOTE not in run.data.tags:  # the UI's description; the user may edit it
            tags[Tag.NOTE] = run_description(trainer, pl_module)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        experiment = client.get_experiment(logger.experiment_id)
        if experiment is not None:  # the training kind and the saved view the printed runs-table link opens
            ensure_view(client, logger.experiment_id, experiment.tags)


def recipe_tags(trainer: L.Trainer, pl_module: L.LightningModule, stored: dict[str, str]) -> dict[str, str]:
    """The recipe fingerprint and its parts (train/fingerprint.py), and the routing kind's own training options,
    as tags; set at every fit start, so a resume that changes the schedule's length updates them. `stored`: the
    run's params (a resumed run's source of upcycling: --init_from is not applied again on a resume)."""
    hp, dm = pl_module.hparams, trainer.datamodule
    init = getattr(pl_module, "init_from_params", None) or stored
    parts = fingerprints.recipe_parts(
        size=pl_module.cfg.size.name, max_steps=trainer.max_steps, schedule_steps=schedule_steps(trainer, hp),
        tokens_per_step=tokens_per_step(trainer),
        seq_len=getattr(dm, "seq_len", None),
        data=fingerprints.data_checksum(getattr(dm, "data_dir", ""), getattr(dm, "meta", None)),
        settings=dict(hp), muon_dtype=muon_dtype_of(trainer.optimizers),
        gradient_clip_val=trainer.gradient_clip_val, precision=str(trainer.precision),
        init_from=fingerprints.init_from_part(init))
    method = {k: hp.get(k) for k in controls.options_of(pl_module.cfg.kind.name)}
    return {Tag.RECIPE: fingerprints.fingerprint(parts),
            Tag.RECIPE_PARTS: json.dumps(parts, sort_keys=True, default=str),
            Tag.METHOD: json.dumps(method, sort_keys=True)}


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lrattn-lightning")
    except PackageNotFoundError:
        return "unknown"


def run_description(trainer: L.Trainer, pl_module: L.LightningModule) -> str:
    """Markdown for the run page: what the ablation is, against what, at which size, with which recipe."""
    cfg, hp, size = pl_module.cfg, pl_module.hparams, pl_module.cfg.size
    recipe = recipe_params(trainer)
    pct = added_flops_percent(cfg)
    steps, max_steps = schedule_steps(trainer, hp), recipe[Param.MAX_STEPS]
    span = (f" (the learning-rate schedule spans {steps} of them, the rest at its final values)"
            if steps < max_steps else f" (of a {steps}-step learning-rate schedule)" if steps != max_steps else "")
    lines = [
        f"**{cfg.ablation.name}** at size **{size.name}**: {' '.join((cfg.ablation.doc or '').split())}",
        "",
        f"Control: `{cfg.ablation.control or 'none'}`. {count_params(cfg):,} parameters. Added FLOPs of this "
        f"run: {'unknown' if pct is None else f'{pct:.3f} %'} of its core (size {size.name}: L={size.n_layers}, "
        f"d={size.d_model}).{paper_flops(cfg, getattr(pl_module, 'resolved_from', None) or hp.get('registry'), pct)}",
        "",
        f"Recipe: {max_steps} steps of {recipe[Param.TOKENS_PER_STEP]} tokens{span} "
        f"(batch {recipe[Param.BATCH_SIZE]} x seq {recipe[Param.SEQ_LEN]}), optimizer {hp.get('optimizer')} "
        f"(lr {hp.get('lr')}, Muon lr {hp.get('muon_lr')}), precision {recipe[Param.PRECISION]}, "
        f"{recipe[Param.DEVICES]} device(s) x {recipe[Param.NUM_NODES]} node(s), data {recipe[Param.DATA_DIR]}.",
    ]
    return "\n".join(lines)


def paper_flops(cfg: ModelConfig, registry: Any, this_run: float | None) -> str:
    """The entry's added FLOPs at the paper's model, the number its doc and the paper's table quote; '' at that
    size, or where the registry has no such size or the cost is unknown. registry: the Registry the run was resolved
    in (read by `lrattn fit`), else its path."""
    from lrattn_lightning.model.registry import Registry, load_registry

    if cfg.size.name == PAPER_SIZE:
        return " This is the paper's model size: the figure compares with the paper's table."
    try:
        paper = (registry if isinstance(registry, Registry) else load_registry(registry)).size(PAPER_SIZE)
        pct = added_flops_percent(paper, cfg.ablation)
    except (ValueError, OSError):  # a user's registry without the paper's size
        return ""
    if pct is None or this_run is None:
        return ""
    return (f" The paper's figure for this entry is {pct:.3f} % (at its model, size {PAPER_SIZE}: L={paper.n_layers}, "
            f"d={paper.d_model}); the routing's share of the core depends on the size, so this run's figure is "
            f"{'larger' if this_run > pct else 'smaller' if this_run < pct else 'the same'}.")
