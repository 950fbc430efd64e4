"""Callbacks: what a run records beside the model's math (MLflow, checkpoint contents) and the step monitors.
Every name of an MLflow tag, param, metric or artifact they write is in train/schema.py.

    description.py  RunDescription: at fit start, every resolved size/ablation field, the optimiser and recipe
                    settings as MLflow params (run_params.py; a new run only: a resumed run keeps its own), and
                    the tags that say what the run is (entry, size, control, commit, recipe fingerprint, method)
    routing.py      RoutingArtifacts: after each validation/test, the routing of its first batch as artifacts
    contents.py     CheckpointContents: the tokenizer, data folder, schedule length and MLflow run in every checkpoint
    monitors.py     training_monitors: learning rate, Muon momentum and tokens/s (TokenThroughput) per step
    progress.py     StepProgressLog (a line per N optimizer steps where no bar is drawn), step_progress_bar

`LRAttnModule.configure_callbacks` installs the first three, so a Trainer built in Python records what
`lrattn fit` records; `lrattn fit` adds the monitors and, without a progress bar, the progress lines
(cli/lightning.py). Every name above is importable from here.
"""

from lrattn_lightning.train.callbacks.contents import CheckpointContents
from lrattn_lightning.train.callbacks.description import (
    EXPERIMENT_KIND,
    PAPER_SIZE,
    RunDescription,
    package_version,
    paper_flops,
    recipe_tags,
    run_description,
)
from lrattn_lightning.train.callbacks.monitors import (
    MuonMomentumMonitor,
    TokenThroughput,
    sequences_in,
    tokens_in,
    training_monitors,
)
from lrattn_lightning.train.callbacks.progress import StepProgressLog, step_progress_bar
from lrattn_lightning.train.callbacks.routing import RoutingArtifacts
from lrattn_lightning.train.callbacks.run_params import (
    TRAIN_PARAMS,
    flat_run_params,
    latest,
    mlflow_logger,
    recipe_params,
    schedule_steps,
    strategy_name,
    tokens_per_step,
)

__all__ = [
    "EXPERIMENT_KIND", "PAPER_SIZE", "TRAIN_PARAMS", "CheckpointContents", "MuonMomentumMonitor", "RoutingArtifacts",
    "RunDescription", "StepProgressLog", "TokenThroughput", "flat_run_params", "latest", "mlflow_logger",
    "package_version", "paper_flops", "recipe_params", "recipe_tags", "run_description", "schedule_steps",
    "sequences_in", "step_progress_bar", "strategy_name", "tokens_in", "tokens_per_step", "training_monitors",
]
