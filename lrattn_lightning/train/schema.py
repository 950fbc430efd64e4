"""The MLflow schema: every tag, param and metric name the platform writes, each with what it holds.

Writers (train/callbacks/, train/tracking.py, the LightningModule, eval/, `lrattn compare`, a sweep's run tags) and
readers (`lrattn compare`, `lrattn sweep`, `lrattn eval`) take their names from here; tests/train/test_schema.py checks
that a real store written by a fit, its validation, an evaluation and compare holds no key this module does not
declare, and that compare and sweep read no other. The strings are the ones existing stores hold: changing one
orphans every run logged before it (compare would no longer read them).

    Tag, ExperimentTag   run and experiment tags
    Param                run params: the resolved size and ablation (`model_param_keys`), training settings
                         (`train_*`: `train_settings`), the upcycling source (`init_*`)
    Metric               metric names: train/*, val/*, routing/mean/*, eval/<task>/<metric>, throughput rates
    Artifact             artifact paths of a run
    declared / undeclared  whether a key is one of the above (names, or a family's pattern)

A family is a prefix plus a part the run decides (a task, an optimizer group, a statistic): each class lists its
families as regular expressions in PATTERNS. Not declared here: a user's own `--run_tags` keys (their names),
`lrattn bench`'s runs in their own experiment (`bench/<mode>/<ablation>/<stat>` metrics, the report's meta as
params: tools/bench/bench.py), and what an external router's training control logs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable


class Tag:
    """Run tags."""

    # what the run is (RunDescription, at every fit start; an eval-only run: the first two)
    ABLATION = "ablation"  # the registry entry trained (also a param)
    SIZE = "size"  # the registry size (also a param)
    CONTROL = "control"  # the entry this one is compared against, `none` without one
    GIT_COMMIT = "git_commit"  # the commit of the code that trained (empty in an installed wheel)
    REGISTRY_SHA = "registry_sha256"  # the hash of the registry the entry came from (also a param)
    VERSION = "lrattn_version"  # the installed package's version
    NOTE = "mlflow.note.content"  # MLflow's run description (markdown): the run's summary; compare's table
    RECIPE = "lrattn.recipe"  # the recipe fingerprint, 12 hex (train/fingerprint.py)
    RECIPE_PARTS = "lrattn.recipe_parts"  # the recipe's parts, sorted JSON
    METHOD = "lrattn.method"  # the routing kind's own training options, sorted JSON (`{}` for most kinds)
    # how the run went (the logger, train/tracking.py and train/store.py)
    RUN_DIR = "lrattn.run_dir"  # HOST:FOLDER of the fit's run folder, set when the run is created
    LAST_STEP = "lrattn.last_step"  # the last step the fit logged, set when it ends
    DIVERGED = "lrattn.diverged"  # where the loss turned non-finite (the run is FAILED)
    TRACKING_GAP = "lrattn.tracking_gap"  # which steps a store outage spanned and what it could not recover
    KILLED_REASON = "lrattn.killed_reason"  # why a run left RUNNING by a killed fit was marked KILLED
    # a sweep's runs (tools/sweep/file.py passes them as --run_tags; finished_runs reads them back)
    SWEEP = "sweep"  # the sweep's name (`lrattn compare --sweep` selects by it)
    SEED = "seed"  # the run's seed (compare prefers it over the train_seed param)
    VARIANT = "variant"  # a sweep variant's label: its training flags; compare rows it as `ablation+variant`
    # a run `lrattn eval` creates when the checkpoint's training run is not in the store (eval/run.py)
    CHECKPOINT = "checkpoint"  # the checkpoint's absolute path
    EVAL_ONLY = "eval_only"  # `true`
    TRAINING_RUN = "training_run_id"  # the checkpoint's own MLflow run id, `none` without one
    GLOBAL_STEP = "global_step"  # the checkpoint's step
    # evaluation: + task, as in its metrics' names; JSON (limit, num_fewshot, data, tasks, items): the configuration
    # of the run's latest eval/<task>/* (eval/tasks.py config_tags); compare pools only agreeing ones
    EVAL_CONFIG = "lrattn.eval_config/"
    # compare's report run (in EXPERIMENT-reports, never a training run)
    SUMMARY = "lrattn.summary"  # `true`
    REPORT_OF = "lrattn.report_of"  # the experiment compared (also an experiment tag of EXPERIMENT-reports)
    SWEEP_SUMMARY = "sweep_summary"  # the sweep compared (--sweep)
    RUN_NAME = "mlflow.runName"  # MLflow's run name: `compare-NAME`; a fit's run name (the logger sets it)
    # MLflow's own, set when a run is created (not by us): who and what started it
    MLFLOW_OWN = ("mlflow.user", "mlflow.source.name", "mlflow.source.type", "mlflow.source.git.commit")

    PATTERNS = (re.escape(EVAL_CONFIG) + r".+",)


class ExperimentTag:
    """Experiment tags."""

    KIND = "mlflow.experimentKind"  # `custom_model_development`: MLflow 3 opens the training view, not GenAI's
    REPORT_OF = Tag.REPORT_OF  # on EXPERIMENT-reports: the experiment whose reports it holds
    RUNS_VIEW = "mlflow.sharedViewState.lrattn-runs"  # the saved view the printed runs-table link opens (runs_view.py)

    PATTERNS: tuple[str, ...] = ()


class Param:
    """Run params (written once: a resumed run keeps its own; what a resume changes gets a param of its own)."""

    # the model: every resolved size and ablation field (model_param_keys) and these
    SIZE = Tag.SIZE  # the registry size
    ABLATION = Tag.ABLATION  # the registry entry
    KEY_DIM = "key_dim"  # the routing keys' width (the kind's key_dim)
    BLOCK_ENDS = "block_ends"  # the sublayers after which a block ends, `1,2,...`, or `full`
    PARAMS = "params"  # the parameter count
    ADDED_FLOPS = "added_flops_pct"  # the routing's FLOPs over the core's, in %; `unknown` for a silent router
    REGISTRY_SHA = Tag.REGISTRY_SHA  # the registry's hash
    # the LightningModule's settings: TRAIN_PREFIX + each of train_settings() (the values given, e.g. muon_dtype
    # auto): these of its optimiser and runtime, and the flags of the routing kinds' training controls
    # (train/controls.py, whose option_names these must be: tests/train/test_schema.py)
    TRAIN_PREFIX = "train_"
    MODULE_SETTINGS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_variant", "muon_dtype",
                       "muon_momentum", "muon_momentum_min", "muon_momentum_warmup_steps",
                       "muon_momentum_cooldown_steps", "warmup_steps", "decay_fraction", "final_lr_fraction",
                       "z_loss", "compile", "document_masking", "attention", "impl")
    ROUTING_SETTINGS = ("gate_freeze_steps", "gate_release_loss", "gate_grad_normalize")  # the gated residual's
    MUON_DTYPE_RESOLVED = "train_muon_dtype_resolved"  # what muon_dtype `auto` became on this machine, `none`
    SCHEDULE_STEPS = "train_schedule_steps"  # the steps the learning-rate schedule spans
    # the recipe (train/callbacks/run_params.py recipe_params)
    MAX_STEPS = "train_max_steps"  # --trainer.max_steps
    BATCH_SIZE = "train_batch_size"  # sequences per device and micro-batch
    SEQ_LEN = "train_seq_len"  # the training window
    TOKENS_PER_STEP = "train_tokens_per_step"  # batch x seq_len x devices x nodes x accumulation
    SEED = "train_seed"  # the seed Lightning set (PL_GLOBAL_SEED)
    DATA_DIR = "train_data_dir"  # the data folder
    TOKENIZER = "train_tokenizer"  # KIND[:VOCAB] of the data's tokenizer
    PRECISION = "train_precision"  # Lightning's precision
    DEVICES = "train_devices"  # devices per node
    NUM_NODES = "train_num_nodes"  # nodes
    STRATEGY = "train_strategy"  # single, ddp, fsdp or the strategy's class name
    ACCUMULATE = "train_accumulate_grad_batches"  # gradient accumulation
    GRADIENT_CLIP = "train_gradient_clip_val"  # gradient clipping
    # a resume that changes them: KEY + FROM_STEP + the step it resumed at (train/callbacks/run_params.py latest)
    FROM_STEP = "_from_step_"
    RESUMABLE = (MAX_STEPS, SCHEDULE_STEPS)
    # upcycling (`lrattn fit --init_from`, cli/lightning.py before_fit)
    INIT_FROM = "init_from"  # the source checkpoint's absolute path
    INIT_FROM_STEP = "init_from_step"  # its step
    INIT_FROM_SOURCE = "init_from_source"  # its size/ablation in words
    INIT_FROM_RUN = "init_from_run"  # its MLflow run id, `none`
    INIT_FROM_NEW = "init_from_new_tensors"  # how many of this model's tensors it did not have
    # compare's summary run (tools/compare/summary_run.py): what it compared
    REPORT_EXPERIMENT = "report_experiment"  # the experiment compared
    REPORT_REFERENCE = "report_reference"  # the ablation every Δ is taken against (--reference)
    REPORT_SIZES = "report_sizes"  # the sizes compared, comma-separated
    REPORT_METHODS = "report_methods"  # how many ablations (a variant its own) the table compares, at any size
    REPORT_SEEDS = "report_seeds"  # the seeds per row, `2` or `2/3`
    REPORT_RUNS = "report_runs"  # how many finished runs the report is made from

    PATTERNS = ("(" + "|".join(map(re.escape, RESUMABLE)) + ")" + re.escape(FROM_STEP) + r"\d+",)


class Metric:
    """Metric names (STYLE: train/loss, val/loss, eval/<task>/<metric>, routing/<site>/<stat>)."""

    # each optimizer step (the LightningModule)
    TRAIN_LOSS = "train/loss"  # the global batch's loss (cross-entropy + z-loss term)
    TRAIN_CE = "train/ce"  # its cross-entropy
    TOKENS_SEEN = "train/tokens_seen"  # tokens trained on once the step is taken
    GRAD_NORM = "train/grad_norm"  # the gradient's norm before clipping
    GATES_HELD = "train/gates_held"  # the gated residual's gates held (train/controls.py GateHold; 1 while held)
    LR = "train/lr/"  # + optimizer group (muon, adamw): LearningRateMonitor
    MOMENTUM = "train/momentum/"  # + Muon group: the momentum the schedule set
    EPOCH = "epoch"  # Lightning's epoch counter (only with --log_counters true)
    # each validation, at the step of the weights scored; `lrattn validate` / `test` of a checkpoint prefix
    # REPORT_PREFIXES (`validate/val/loss`), never over the fit's own
    VAL = "val/"  # + loss, bpb: a validation's results
    VAL_LOSS = "val/loss"  # token-weighted validation loss
    VAL_BPB = "val/bpb"  # bits per byte
    ROUTING_MEAN = "routing/mean/"  # + statistic: the routing's mean over read sites (train/diagnostics.py)
    REPORT_PREFIXES = ("validate/", "test/")
    # evaluation (eval/evaluate.py eval_metrics)
    EVAL = "eval/"  # + task + / + lm-eval's metric (`acc`, `acc_norm`, `acc_flt`, ...)
    EVAL_VAL = "eval/val/"  # + loss, bpb, tokens, windows: the exact validation loss over the whole split
    # throughput (train/callbacks/monitors.py TokenThroughput): STAGE/ + DEVICE + rate, STAGE/ + rate over devices
    THROUGHPUT_STAGES = ("train", "validate", "test")
    DEVICE = "device/"
    RATES = ("batches_per_sec", "samples_per_sec", "items_per_sec", "flops_per_sec", "mfu")
    COUNTERS = ("time", "batches", "samples", "lengths", "flops")  # only with --log_counters true
    TOKENS_PER_SEC = "train/device/items_per_sec"  # tokens/s on one device (compare's tokens/s)
    # compare's summary run (tools/compare/summary_run.py): its headline numbers
    DELTA = "delta/"  # + size/row: the row's mean val loss minus the reference's (nats/token)
    MULTIPLIER = "multiplier/"  # + method: its compute multiplier against the reference over a size ladder
    MULTIPLIER_LO = "multiplier_lo/"  # + method: the multiplier interval's low end
    MULTIPLIER_HI = "multiplier_hi/"  # + method: its high end

    _stage = "(" + "|".join(THROUGHPUT_STAGES) + ")/"
    _report = "(" + "|".join(map(re.escape, REPORT_PREFIXES)) + ")?"
    PATTERNS = (
        re.escape(LR) + r"[^/]+", re.escape(MOMENTUM) + r"[^/]+",
        _report + "(" + "|".join(map(re.escape, (VAL_LOSS, VAL_BPB))) + ")",
        _report + re.escape(ROUTING_MEAN) + r"\w+",
        re.escape(EVAL) + r"[^/]+/[^/]+",  # (eval/val/<key> too)
        _stage + "(" + re.escape(DEVICE) + ")?(" + "|".join(RATES) + ")",
        _stage + "(" + "|".join(COUNTERS) + ")",
        re.escape(DELTA) + r"[^/]+/.+", "(" + "|".join(map(re.escape, (MULTIPLIER, MULTIPLIER_LO, MULTIPLIER_HI))) + ").+",
    )


class Artifact:
    """Artifact paths of a run."""

    CONFIG = "config.yaml"  # the resolved LightningCLI config of the fit
    ROUTING_HEATMAP = "routing/heatmap.png"  # the routing weights of the last validation's first batch
    ROUTING_WEIGHTS = "routing/weights.json"  # its numbers, with the step (compare's heatmaps)
    ROUTING_SITES = "routing/sites.json"  # per read site statistics (softmax reads)
    GATES = "routing/gates.png"  # the gated residual's gates
    GATES_JSON = "routing/gates.json"  # their numbers (compare's gate figure)
    EVAL_RESULTS = "eval/results-"  # + step + time stamp + .json: lm-eval's results of one evaluation
    COMPARE = "compare/"  # + file: compare's report files (table.md, figures) in its report run

    PATTERNS = (re.escape(EVAL_RESULTS) + r"step\d+-[\w-]+\.json", re.escape(COMPARE) + r".+")


KINDS = {"tag": Tag, "experiment_tag": ExperimentTag, "param": Param, "metric": Metric, "artifact": Artifact}


@functools.cache
def names(kind: str) -> frozenset[str]:
    """Every name `kind` declares outright, not its families (a str ending in / or _ is a family's prefix)."""
    holder = KINDS[kind]
    out = {v for a, v in vars(holder).items() if a.isupper() and isinstance(v, str) and not v.endswith(("/", "_"))}
    if holder is Tag:
        out.update(Tag.MLFLOW_OWN)
    if holder is Param:
        out.update(Param.TRAIN_PREFIX + s for s in train_settings())
        out.update(model_param_keys())
    return frozenset(out)


def train_settings() -> tuple[str, ...]:
    """The LightningModule's settings logged as `train_<name>` params: those of its optimiser and runtime, then the
    flags of the routing kinds' training controls."""
    return Param.MODULE_SETTINGS + Param.ROUTING_SETTINGS


def model_param_keys() -> frozenset[str]:
    """The params of the resolved size and ablation: every field of the size, of an ablation and of every routing
    kind's options (train/callbacks/run_params.py flat_run_params). Imported here, not at the top: the store and a
    sweep file read this module's names without building the model's classes (torch)."""
    import dataclasses

    from lrattn_lightning.model.config import SizeConfig
    from lrattn_lightning.model.routing.kinds import kind_of, known_kinds

    size = {f.name for f in dataclasses.fields(SizeConfig)} - {"name", "doc"}
    ablation = {"control", "routing"}  # AblationConfig.to_dict without name, doc and tags
    options = {f.name for k in known_kinds() for f in dataclasses.fields(kind_of(k).Options)}
    return frozenset(size | ablation | options)


def declared(kind: str, key: str) -> bool:
    """Whether `key` is a name or matches a family of `kind` (tag, experiment_tag, param, metric, artifact)."""
    return key in names(kind) or any(re.fullmatch(p, key) for p in KINDS[kind].PATTERNS)


def undeclared(kind: str, keys: Iterable[str]) -> list[str]:
    """The keys of `kind` this module does not declare, sorted."""
    return sorted({k for k in keys if not declared(kind, k)})
