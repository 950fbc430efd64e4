"""Validation in the LightningModule (a mixin of LRAttnModule): the token-weighted loss, bits per byte and the
routing statistics, each reported at the step of the weights it scored (in-fit, the fit's final validation, or a
checkpoint's `lrattn validate` / `test` under their own names). A non-finite loss is never logged as a result.
"""

from __future__ import annotations

from typing import Any

import torch

from lrattn_lightning.data.shards import bits_per_byte
from lrattn_lightning.train import diagnostics, routing_axes
from lrattn_lightning.train.checkpoint.stop import NonFiniteLossError
from lrattn_lightning.train.losses import token_losses
from lrattn_lightning.train.schema import Metric


class Validation:
    """validation_step / test_step and what ends a validation; the module holds `model`, `cfg`, `runtime`, `val_loss`,
    `routing_weights`, `_loaded_step` and `last_validated_step`."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        record = batch_idx == 0 and self.runtime.routing_diagnostics and routing_axes.recorded(self.cfg) is not None
        out = self.model(inputs, return_routing=record)
        logits = out.logits if record else out
        if record:
            self.routing_weights = out.routing
        ce, _ = token_losses(logits, targets)
        self.val_loss.update(ce, weight=targets.numel())

    @property
    def report_step(self) -> int:
        """The step results belong to: the training step while fitting, the checkpoint's step when a
        checkpoint is validated or tested (not 0), so curves and the heatmap sit at the right place."""
        if self._trainer is None or self.trainer.training or self.trainer.state.fn == "fit":
            return self.global_step
        return self._loaded_step if self._loaded_step is not None else self.global_step

    @property
    def report_prefix(self) -> str:
        """'' while fitting; 'validate/' or 'test/' for `lrattn validate` / `lrattn test` of a checkpoint: those
        may score other batches than the fit's validations (another --trainer.limit_val_batches), so their
        results sit beside the run's val/* under their own names, never over them."""
        fn = self.trainer.state.fn if self._trainer is not None else None  # (fit's final validation: loaded none)
        return f"{fn.value}/" if fn in ("validate", "test") and self._loaded_step is not None else ""

    def _report(self, name: str, value: Any, **kwargs: Any) -> None:
        """A validation result: self.log for the progress bar and callbacks, and to the logger at report_step
        (the number of optimizer steps behind the weights), so in-fit, final and checkpoint validations
        all sit at the step of the weights they scored."""
        name = self.report_prefix + name
        self.log(name, value, logger=False, **kwargs)
        if self.logger is not None and not self.trainer.sanity_checking and self.trainer.is_global_zero:
            self.logger.log_metrics({name: float(value)}, step=self.report_step)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        if not self.trainer.sanity_checking and not bool(torch.isfinite(loss)):  # never logged as a result
            whose = (f"of checkpoint step {self.report_step}" if self.report_prefix else f"at step {self.report_step}")
            raise NonFiniteLossError(f"non-finite validation loss ({float(loss)}) {whose}")
        if not self.trainer.sanity_checking:
            self.last_validated_step = self.report_step
        self._report(Metric.VAL_LOSS, loss, prog_bar=True, sync_dist=False)
        bytes_per_token = getattr(self.trainer.datamodule, "bytes_per_token", None) if self.trainer.datamodule else None
        if callable(bytes_per_token):
            bpt = bytes_per_token("val")
            if bpt:
                self._report(Metric.VAL_BPB, bits_per_byte(loss, bpt))
        if self.routing_weights is not None:  # RoutingArtifacts logged the figures before this hook
            self._report_routing(self.routing_weights)
            self.routing_weights = None

    def _report_routing(self, weights: list[torch.Tensor]) -> None:
        """The mean over read sites as metrics routing/mean/<stat> (the gated residual: over sublayers,
        routing/mean/alpha and saturated; mixing weights: none); per site they are artifacts (RoutingArtifacts)."""
        for stat, value in diagnostics.mean_stats(self.cfg, weights).items():
            self._report(Metric.ROUTING_MEAN + stat, value)

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end
