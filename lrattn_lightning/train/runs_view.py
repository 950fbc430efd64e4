"""The runs table a link opens in MLflow 3.17's UI: a saved view on the experiment, and the link that opens it.

MLflow keeps no server-side default columns (mlflow#4713, #12764): the runs table shows the columns the browser
stored (local storage), else Source, Models and Dataset. What its UI does honour, read from its bundle
(mlflow/server/js/build/static/js, 3.17.2):

    ?viewStateShareKey=KEY   loads the experiment tag `mlflow.sharedViewState.KEY`: a saved view's envelope
                             {name, createdAt, updatedAt, state}, `state` the JSON of the page's search facets and
                             UI state (selectedColumns, columnWidths, ...); the "Saved views" menu lists them.
                             Ignored where the URL also carries a search facet (searchFilter, orderByKey, ...)
    ?workflowType=machine_learning  the "Model training" view; without it the UI takes the browser's stored choice,
                             else GenAI's (Overview / Traces): with workflow navigation on (always, in 3.17) the
                             experiment's `mlflow.experimentKind` tag does not choose the view
    ?compareRunsMode=TABLE   the runs table, not the charts beside a narrow run list

A column is `metrics.`KEY``, `params.`KEY``, `tags.`KEY`` or `attributes.`Run Name``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from lrattn_lightning.train.schema import ExperimentTag, Metric, Param

VIEW_TAG = ExperimentTag.RUNS_VIEW  # the saved view every experiment of ours carries
VIEW_KEY = VIEW_TAG.removeprefix("mlflow.sharedViewState.")
TRAINING_KIND = "custom_model_development"
RUN_NAME = "attributes.`Run Name`"


def column(kind: str, key: str) -> str:
    return f"{kind}.`{key}`"


# what a researcher reads of every training run without clicking
TRAINING_COLUMNS = (column("metrics", Metric.VAL_LOSS), column("metrics", Metric.VAL_BPB),
                    column("params", Param.ABLATION), column("params", Param.SIZE), column("params", Param.SEED))


# pixels, so that the five fit beside the run name and Created in a 1600-pixel window with MLflow's assistant
# panel open (as a fresh browser has it); a metric shows 5 digits, an ablation's name 17 letters, a size's 10
# (ladder-xs, paper-0.5b: at 70 the size read "ladder..."), a sweep's run name (size-ablation-seedN) 34
WIDTHS = {column("metrics", Metric.VAL_LOSS): 90, column("metrics", Metric.VAL_BPB): 90,
          column("params", Param.ABLATION): 130, column("params", Param.SIZE): 95, column("params", Param.SEED): 80}
NAME_WIDTH = 230


def view_state(name: str, columns: tuple[str, ...] | list[str], now_ms: int | None = None) -> str:
    """The tag value of a saved view showing `columns` right after the run name, each wide enough to read."""
    widths = {RUN_NAME: NAME_WIDTH, **{c: WIDTHS.get(c, 110) for c in columns}}
    state = {"selectedColumns": list(columns), "columnWidths": widths, "columnOrder": list(widths),  # widths apply
             "runListHidden": False, "viewMaximized": False}  # only to ordered columns: the figures come first
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)})


def ensure_view(client: Any, experiment_id: str, tags: dict[str, str], name: str = "lrattn: val loss, bpb, ablation, size, seed",
                columns: tuple[str, ...] | list[str] | None = TRAINING_COLUMNS) -> None:
    """Tag the experiment with the training kind and our saved view (none for `columns` None), each where it has
    none (a user's edit stays)."""
    if ExperimentTag.KIND not in tags:
        client.set_experiment_tag(experiment_id, ExperimentTag.KIND, TRAINING_KIND)
    if columns is not None and VIEW_TAG not in tags:
        client.set_experiment_tag(experiment_id, VIEW_TAG, view_state(name, columns))


def runs_table(base: str, experiment_id: str) -> str:
    """The experiment's runs table with our saved view's columns, in the training view."""
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&compareRunsMode=TABLE&viewStateShareKey={VIEW_KEY}")
