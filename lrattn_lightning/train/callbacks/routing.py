"""RoutingArtifacts: the routing of the first validation batch as MLflow artifacts (paths: train/schema.py Artifact).

After each validation/test, at the step of the weights scored, for every routing kind that records
(train/routing_axes.py): routing/heatmap.png and routing/weights.json (train/diagnostics.py), routing/sites.json
for softmax reads (the gated residual: routing/gates.png and routing/gates.json instead); the mean diagnostics are
the module's metrics (routing/mean/<stat>, train/validation.py).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from lrattn_lightning.train import diagnostics, routing_axes
from lrattn_lightning.train.callbacks.run_params import mlflow_logger
from lrattn_lightning.train.schema import Artifact


class RoutingArtifacts(Callback):
    """The routing of the first validation batch as MLflow artifacts (see module doc), for every kind that
    records (train/routing_axes.py). Runs before the module's own epoch-end hook, which reports the mean
    diagnostics and clears `routing_weights`."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights, logger = getattr(pl_module, "routing_weights", None), mlflow_logger(trainer)
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
        client.log_figure(run_id, fig, Artifact.ROUTING_HEATMAP)
        plt.close(fig)
        client.log_dict(run_id, {"step": step, **table}, Artifact.ROUTING_WEIGHTS)
        recorded = routing_axes.recorded(cfg)
        if recorded == "depth_weights":  # per read site: one table per validation, not 4 x 2L metrics
            stats = diagnostics.site_stats(weights, routing_axes.axes(cfg)["embedding_column"])
            client.log_dict(run_id, {"step": step, "sites": [{"site": label, **row} for label, row in
                                                             zip(_site_labels(table), stats, strict=True)]},
                            Artifact.ROUTING_SITES)
        elif recorded == "gates":
            stats = diagnostics.gate_stats(weights)
            alphas = [r["alpha"] for r in stats]
            fig = diagnostics.gate_figure({cfg.ablation.name: alphas}, title, initial=pl_module.model.router.gate_alpha0)
            client.log_figure(run_id, fig, Artifact.GATES)
            plt.close(fig)
            client.log_dict(run_id, {"step": step, "held": pl_module.model.router.gates_held, "alpha": alphas,
                                     "saturated": [r["saturated"] for r in stats]}, Artifact.GATES_JSON)

    on_test_epoch_end = on_validation_epoch_end


def _site_labels(table: dict) -> list:
    """The sites of a weights table as routing/sites.json names them: their labels, else 1, 2, ..."""
    labels = table.get("site_labels")
    return [int(x) if str(x).isdigit() else x for x in labels] if labels else list(range(1, len(table["sites_by_sources"]) + 1))
