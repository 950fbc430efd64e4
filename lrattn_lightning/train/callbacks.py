"""Callbacks: what a run records beside the model's math (MLflow, checkpoint contents) and the step monitors.

    RunDescription      at fit start: every resolved size/ablation field, the optimiser and recipe settings
                        as MLflow params (a new run only: a resumed run keeps its own), and the tags ablation,
                        size, control, git_commit, registry_sha256, the recipe fingerprint and its parts
                        (lrattn.recipe, lrattn.recipe_parts: train/fingerprint.py) and lrattn.method
    RoutingArtifacts    after each validation/test, at the step of the weights scored, for every routing kind
                        that records: routing/heatmap.png and routing/weights.json (train/diagnostics.py),
                        routing/sites.json for softmax reads (the gated residual: also routing/gates.png,
                        routing/gates.json); the mean diagnostics are the module's metrics
    CheckpointContents  plain values in every checkpoint: the tokenizer spec (a file-backed tokenizer's text
                        under `content`), the data folder and the MLflow run (what `lrattn eval` rebuilds from)
    training_monitors   Lightning's LearningRateMonitor (`train/lr/<group>`: train/lr/muon, train/lr/adamw),
                        MuonMomentumMonitor (`train/momentum/muon`, scheduled with the LR) and TokenThroughput,
                        Lightning's ThroughputMonitor counting tokens (`train/device/items_per_sec`: tokens/s
                        on one device; `train/items_per_sec` over all devices when there are several)

    StepProgressLog     a line per N optimizer steps (step, train loss, time, time left) where no progress
                        bar is drawn

`LRAttnModule.configure_callbacks` installs the first three, so a Trainer built in Python records what
`lrattn fit` records; `lrattn fit` adds the monitors and, without a progress bar, the progress lines
(cli/lightning.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lrattn_lightning.model.accounting import added_flops_percent, count_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.train import diagnostics
from lrattn_lightning.train import fingerprint as fingerprints
from lrattn_lightning.train.optim import muon_dtype_of

# the module's settings logged as `train_<name>` params
TRAIN_PARAMS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_variant", "muon_dtype",
                "muon_momentum",
                "muon_momentum_min", "muon_momentum_warmup_steps", "muon_momentum_cooldown_steps", "warmup_steps",
                "decay_fraction", "final_lr_fraction", "z_loss", "compile", "document_masking", "attention", "impl",
                "gate_freeze_steps", "gate_release_loss", "gate_grad_normalize")


def flat_run_params(cfg: ModelConfig) -> dict[str, Any]:
    """Every resolved size and ablation field as one flat, searchable dict (MLflow params)."""
    size, abl = cfg.to_dict()["size"], cfg.to_dict()["ablation"]
    params = {"size": size.pop("name"), "ablation": abl.pop("name")}
    params.update({k: v for k, v in size.items() if k != "doc"})
    params.update({k: ("null" if v is None else v) for k, v in abl.items() if k not in ("doc", "tags")})  # kind + options
    params["key_dim"] = cfg.kind.key_dim(cfg)
    params["block_ends"] = ",".join(map(str, cfg.block_ends())) or "full"
    params["params"] = count_params(cfg)
    pct = added_flops_percent(cfg)  # unknown for an external router that does not state its FLOPs
    params["added_flops_pct"] = "unknown" if pct is None else round(pct, 6)
    return params


def tokens_per_step(trainer: L.Trainer | None) -> int | None:
    """Tokens of one optimizer step over all devices, from the datamodule's batch_size and seq_len."""
    dm = trainer.datamodule if trainer is not None else None
    batch, seq = getattr(dm, "batch_size", None), getattr(dm, "seq_len", None)
    if not batch or not seq:
        return None
    return int(batch) * int(seq) * trainer.world_size * trainer.accumulate_grad_batches


def _mlflow(trainer: L.Trainer) -> MLFlowLogger | None:
    """The MLflow logger, on global rank zero outside the sanity check; None otherwise."""
    logger = trainer.logger
    if not isinstance(logger, MLFlowLogger) or trainer.sanity_checking or not trainer.is_global_zero:
        return None
    return logger


class RunDescription(Callback):
    """The run's params and tags at fit start (see module doc)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logger = _mlflow(trainer)
        if logger is None:
            return
        client, run_id, hp, cfg = logger.experiment, logger.run_id, pl_module.hparams, pl_module.cfg
        run = client.get_run(run_id)  # None when the store is unreachable (the logger drops the calls)
        if run is not None and "ablation" not in run.data.params:  # a resumed run keeps its original params
            logger.log_hyperparams({
                **flat_run_params(cfg),
                "registry_sha256": hp.registry_sha256,
                **{f"train_{k}": v for k, v in hp.items() if k in TRAIN_PARAMS},
                "train_muon_dtype_resolved": muon_dtype_of(trainer.optimizers) or "none",  # what `auto` became here
                **recipe_params(trainer),
                "train_schedule_steps": schedule_steps(trainer, hp),
                **getattr(pl_module, "init_from_params", {}),  # upcycling: the source checkpoint (lrattn fit --init_from)
            })
        elif run is not None:  # a resume that trains longer (--model.schedule_steps) or stretches the schedule
            # (--model.allow_schedule_change): params cannot change, so a new length is a param of its own
            step = getattr(pl_module, "_loaded_step", None) or trainer.global_step  # restored after on_fit_start
            now = {"train_max_steps": trainer.max_steps, "train_schedule_steps": schedule_steps(trainer, hp)}
            logger.log_hyperparams({f"{key}_from_step_{step}": value for key, value in now.items()
                                    if latest(run.data.params, key) not in (None, str(value))})
        tags = {"ablation": cfg.ablation.name, "size": cfg.size.name, "control": cfg.ablation.control or "none",
                "git_commit": hp.git_commit, "registry_sha256": hp.registry_sha256,
                "lrattn_version": package_version(),  # an installed wheel has no git commit to tag
                **recipe_tags(trainer, pl_module, run.data.params if run is not None else {})}
        if run is not None and "mlflow.note.content" not in run.data.tags:  # the UI's description; the user may edit it
            tags["mlflow.note.content"] = run_description(trainer, pl_module)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        experiment = client.get_experiment(logger.experiment_id)
        if experiment is not None and EXPERIMENT_KIND not in experiment.tags:
            # MLflow 3 opens an experiment without this tag in its GenAI view (traces, evaluations)
            client.set_experiment_tag(logger.experiment_id, EXPERIMENT_KIND, "custom_model_development")


EXPERIMENT_KIND = "mlflow.experimentKind"


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
    method = {k: hp.get(k) for k in pl_module.cfg.kind.training_options}
    return {fingerprints.FINGERPRINT_TAG: fingerprints.fingerprint(parts),
            fingerprints.PARTS_TAG: json.dumps(parts, sort_keys=True, default=str),
            fingerprints.METHOD_TAG: json.dumps(method, sort_keys=True)}


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
    steps = schedule_steps(trainer, hp)
    span = (f" (the learning-rate schedule spans {steps} of them, the rest at its final values)"
            if steps < recipe["train_max_steps"] else f" (of a {steps}-step learning-rate schedule)"
            if steps != recipe["train_max_steps"] else "")
    lines = [
        f"**{cfg.ablation.name}** at size **{size.name}**: {' '.join((cfg.ablation.doc or '').split())}",
        "",
        f"Control: `{cfg.ablation.control or 'none'}`. {count_params(cfg):,} parameters. Added FLOPs of this "
        f"run: {'unknown' if pct is None else f'{pct:.3f} %'} of its core (size {size.name}: L={size.n_layers}, "
        f"d={size.d_model}).{paper_flops(cfg, hp.get('registry'), pct)}",
        "",
        f"Recipe: {recipe['train_max_steps']} steps of {recipe['train_tokens_per_step']} tokens{span} "
        f"(batch {recipe['train_batch_size']} x seq {recipe['train_seq_len']}), optimizer {hp.get('optimizer')} "
        f"(lr {hp.get('lr')}, Muon lr {hp.get('muon_lr')}), precision {recipe['train_precision']}, "
        f"{recipe['train_devices']} device(s) x {recipe['train_num_nodes']} node(s), data {recipe['train_data_dir']}.",
    ]
    return "\n".join(lines)


PAPER_SIZE = "paper-0.5b"


def paper_flops(cfg: ModelConfig, registry: str | None, this_run: float | None) -> str:
    """The entry's added FLOPs at the paper's model, the number its doc and the paper's table quote; '' at that
    size, or where the registry has no such size or the cost is unknown."""
    from lrattn_lightning.model.registry import load_registry

    if cfg.size.name == PAPER_SIZE:
        return " This is the paper's model size: the figure compares with the paper's table."
    try:
        paper = load_registry(registry).size(PAPER_SIZE)
        pct = added_flops_percent(paper, cfg.ablation)
    except (ValueError, OSError):  # a user's registry without the paper's size
        return ""
    if pct is None or this_run is None:
        return ""
    return (f" The paper's figure for this entry is {pct:.3f} % (at its model, size {PAPER_SIZE}: L={paper.n_layers}, "
            f"d={paper.d_model}); the routing's share of the core depends on the size, so this run's figure is "
            f"{'larger' if this_run > pct else 'smaller' if this_run < pct else 'the same'}.")


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
               if k.startswith(f"{key}_from_step_") and k.rsplit("_", 1)[1].isdigit()}
    if changed:
        return changed[max(changed)]
    if key == "train_schedule_steps" and key not in params:
        return params.get("train_max_steps")
    return params.get(key)


def recipe_params(trainer: L.Trainer) -> dict[str, Any]:
    """The training settings that decide a result, as flat params (also in config.yaml)."""
    dm = trainer.datamodule
    meta = getattr(dm, "meta", None) if dm is not None else None
    tokenizer = meta.get("tokenizer", {}) if isinstance(meta, dict) else {}
    return {
        "train_max_steps": trainer.max_steps,
        "train_batch_size": getattr(dm, "batch_size", None),
        "train_seq_len": getattr(dm, "seq_len", None),
        "train_tokens_per_step": tokens_per_step(trainer),
        "train_seed": os.environ.get("PL_GLOBAL_SEED"),
        "train_data_dir": str(getattr(dm, "data_dir", None)),
        "train_tokenizer": tokenizer.get("kind", "unknown") + (f":{tokenizer['vocab_size']}" if "vocab_size" in tokenizer else ""),
        "train_precision": str(trainer.precision),
        "train_devices": trainer.num_devices,
        "train_num_nodes": trainer.num_nodes,
        "train_strategy": strategy_name(trainer),
        "train_accumulate_grad_batches": trainer.accumulate_grad_batches,
        "train_gradient_clip_val": trainer.gradient_clip_val,
    }


class RoutingArtifacts(Callback):
    """The routing of the first validation batch as MLflow artifacts (see module doc), for every kind that
    records (RoutingKind.diagnostics). Runs before the module's own epoch-end hook, which reports the mean
    diagnostics and clears `routing_weights`."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights, logger = getattr(pl_module, "routing_weights", None), _mlflow(trainer)
        if weights is None or logger is None or (isinstance(weights, list | tuple) and not weights):
            return
        import matplotlib.pyplot as plt

        cfg, step = pl_module.cfg, pl_module.report_step
        title = f"{cfg.ablation.name} @ {cfg.size.name}, step {step}"
        client, run_id = logger.experiment, logger.run_id
        try:
            table = diagnostics.weights_table(cfg, weights)
        except (RuntimeError, TypeError, ValueError, AttributeError) as err:  # an own router's odd `weights`
            if not getattr(self, "_warned", False):
                self._warned = True
                print(f"[lrattn] routing diagnostics skipped: the router's state.weights are not a list of "
                      f"[S, B, T(, m)] tensors ({type(err).__name__}: {err})", flush=True)
            return
        fig = diagnostics.heatmap_figure(table, title)
        client.log_figure(run_id, fig, "routing/heatmap.png")
        plt.close(fig)
        client.log_dict(run_id, {"step": step, **table}, "routing/weights.json")
        if cfg.kind.diagnostics == "depth_weights":  # per read site: one table per validation, not 4 x 2L metrics
            stats = diagnostics.site_stats(weights, cfg.kind.diagnostic_axes(cfg)["embedding_column"])
            client.log_dict(run_id, {"step": step, "sites": [{"site": label, **row} for label, row in
                                                             zip(_site_labels(table), stats, strict=True)]},
                            "routing/sites.json")
        elif cfg.kind.diagnostics == "gates":
            stats = diagnostics.gate_stats(weights)
            alphas = [r["alpha"] for r in stats]
            fig = diagnostics.gate_figure({cfg.ablation.name: alphas}, title, initial=cfg.kind.initial_gates(cfg))
            client.log_figure(run_id, fig, "routing/gates.png")
            plt.close(fig)
            client.log_dict(run_id, {"step": step, "held": pl_module.model.router.gates_held, "alpha": alphas,
                                     "saturated": [r["saturated"] for r in stats]}, "routing/gates.json")

    on_test_epoch_end = on_validation_epoch_end


def _site_labels(table: dict) -> list:
    """The sites of a weights table as routing/sites.json names them: their labels, else 1, 2, ..."""
    labels = table.get("site_labels")
    return [int(x) if str(x).isdigit() else x for x in labels] if labels else list(range(1, len(table["sites_by_sources"]) + 1))


class CheckpointContents(Callback):
    """The tokenizer, the data folder, the trained window (`--data.seq_len`) and the MLflow run in every
    checkpoint, as plain values."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        datamodule = trainer.datamodule
        meta = getattr(datamodule, "meta", None)
        if isinstance(meta, dict):  # what evaluation needs to rebuild the tokenizer
            spec = dict(meta["tokenizer"])
            if "file" in spec:  # file-backed tokenizers travel inside the checkpoint
                spec["content"] = datamodule.local_file(spec["file"]).read_text(encoding="utf-8")  # (s3:// fetched)
            checkpoint["tokenizer"] = spec
            checkpoint["data"] = {"data_dir": datamodule.location(), "source": meta.get("source"),
                                  "seq_len": getattr(datamodule, "seq_len", None)}  # the trained window
        schedules = [c.scheduler for c in trainer.lr_scheduler_configs if hasattr(c.scheduler, "total_steps")]
        if schedules:  # the length the learning-rate schedule was built for: a resume must keep it (or say so)
            checkpoint["schedule"] = {"total_steps": int(schedules[0].total_steps)}
        if isinstance(trainer.logger, MLFlowLogger):
            checkpoint["mlflow"] = {
                "run_id": trainer.logger.run_id,
                "experiment_id": trainer.logger.experiment_id,
                "tracking_uri": trainer.logger._tracking_uri,
            }


# ---- step monitors: `lrattn fit` installs them -----------------------------------------------------------
class MuonMomentumMonitor(Callback):
    """`train/momentum/<group>` of each Muon group at each logged step, beside LearningRateMonitor's
    `train/lr/<group>`: the momentum the scheduler (train/schedule.py WarmupStableDecay) set for that step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:  # the live groups, also after a resume
                if group.get("use_muon"):
                    pl_module.log(f"train/momentum/{group.get('name', 'muon')}", group["momentum"])


def sequences_in(batch: torch.Tensor) -> int:
    return batch.shape[0]


def tokens_in(batch: torch.Tensor) -> int:
    """Predicted tokens of a batch of (B, T + 1) token windows: inputs are [:, :-1], targets [:, 1:]."""
    return batch.shape[0] * (batch.shape[1] - 1)


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor with samples = sequences and items = predicted tokens, and the module's
    `flops_per_batch` for FLOP/s (and MFU on a GPU Lightning knows). Each rate averages the steps since the
    previous log: the window spans log_every_n_steps optimizer steps.

    Only the rates are logged (`*_per_sec`, `*mfu`) unless `counters` is set: the running counts Lightning adds
    (`train/batches`, `train/samples`, `train/lengths`, `train/time`) bury the metrics a researcher reads.
    Validation and test rates are logged once per loop, at the training step of the weights scored (Lightning
    logs them at a validation-batch counter, which is no step of the run)."""

    RATES = ("_per_sec", "mfu")

    def __init__(self, counters: bool = False) -> None:
        super().__init__(batch_size_fn=sequences_in, length_fn=tokens_in)
        self.counters = counters

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.kwargs["window_size"] = max(2, trainer.log_every_n_steps * trainer.accumulate_grad_batches + 1)
        super().setup(trainer, pl_module, stage)

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        if trainer.state.stage == RunningStage.TRAINING:
            self._log(trainer, iter_num)  # evaluation loops log once, at their end

    def _log(self, trainer: L.Trainer, step: int | None) -> None:
        if trainer.state.stage == RunningStage.TRAINING and not trainer._logger_connector.should_update_logs:
            return
        throughput = self._throughputs[trainer.state.stage]
        if not throughput._time:  # nothing measured (an empty loop)
            return
        metrics = {k: v for k, v in throughput.compute().items() if self.counters or k.endswith(self.RATES)}
        if metrics:
            prefix = f"{trainer.state.stage.value}{throughput.separator}"
            trainer._logger_connector.log_metrics({prefix + k: v for k, v in metrics.items()}, step=step)

    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self._log(trainer, trainer.global_step)
        super().on_validation_end(trainer, *args)

    @rank_zero_only
    def on_test_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._log(trainer, trainer.global_step)


def training_monitors(counters: bool = False) -> list[Callback]:
    """The step monitors of `lrattn fit`: learning rate, Muon momentum, tokens/s (see module doc); `counters`
    adds Lightning's running counts (train/batches, train/samples, train/lengths, train/time)."""
    return [LearningRateMonitor(logging_interval="step"), MuonMomentumMonitor(), TokenThroughput(counters)]


class StepProgressLog(Callback):
    """`[lrattn fit] step 40/200 (20 %): train/loss 3.2104, 52 s, ~3.5 min left` every `every` optimizer steps
    (and at the last), on rank zero: a run's progress where no progress bar is drawn (a recipe that turns it
    off, a log file, `lrattn sweep`'s terminal, which shows these lines)."""

    def __init__(self, every: int) -> None:
        self.every, self.start, self.first, self.shown = max(1, int(every)), 0.0, 0, -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import time

        self.start, self.first = time.monotonic(), trainer.global_step  # a resumed run starts its clock here

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        import time

        step, total = trainer.global_step, trainer.max_steps
        if not trainer.is_global_zero or step == self.shown or (step % self.every and step != total):
            return
        self.shown = step
        elapsed = time.monotonic() - self.start
        loss = trainer.callback_metrics.get("train/loss")
        line = f"[lrattn fit] step {step}" + (f"/{total} ({100 * step // total} %)" if total > 0 else "")
        line += f": train/loss {float(loss):.4f}" if loss is not None else ":"
        line += f", {elapsed:.0f} s"
        if total > 0 and step > self.first:
            left = elapsed / (step - self.first) * (total - step)
            line += f", ~{left / 60:.1f} min left" if left >= 90 else f", ~{left:.0f} s left"
        print(line, flush=True)


def step_progress_bar() -> Callback | None:
    """Lightning's rich progress bar counting optimizer steps of the whole run (a resumed run at 20 of 30
    shows 20/30, not 30/9 batches of an epoch), without `Epoch 0/-2` and the logger's `v_num`; None where
    rich is not installed (Lightning's tqdm bar then)."""
    try:
        from lightning.pytorch.callbacks import RichProgressBar
    except ImportError:  # pragma: no cover - rich is one of lightning's extras
        return None

    class StepProgressBar(RichProgressBar):
        def _by_steps(self) -> bool:
            return self.trainer.max_epochs == -1 and (self.trainer.max_steps or 0) > 0

        @property
        def total_train_batches(self) -> int | float:
            return self.trainer.max_steps if self._by_steps() else super().total_train_batches

        def _get_train_description(self, current_epoch: int) -> str:
            return "step" if self._by_steps() else super()._get_train_description(current_epoch)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self._by_steps():
                self._update(self.train_progress_bar_id, trainer.global_step)

        def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            return items

    return StepProgressBar()
