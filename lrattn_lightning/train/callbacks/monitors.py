"""The step monitors `lrattn fit` installs (metric names: train/schema.py Metric).

    LearningRateMonitor   Lightning's: `train/lr/<group>` (train/lr/muon, train/lr/adamw)
    MuonMomentumMonitor   `train/momentum/<group>`, scheduled with the learning rate
    TokenThroughput       Lightning's ThroughputMonitor counting tokens: `train/device/items_per_sec` (tokens/s on
                          one device; `train/items_per_sec` over all devices when there are several), FLOP/s, MFU
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lrattn_lightning.train.schema import Metric


class MuonMomentumMonitor(Callback):
    """`train/momentum/<group>` of each Muon group at each logged step, beside LearningRateMonitor's
    `train/lr/<group>`: the momentum the scheduler (train/schedule.py WarmupStableDecay) set for that step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:  # the live groups, also after a resume
                if group.get("use_muon"):
                    pl_module.log(f"{Metric.MOMENTUM}{group.get('name', 'muon')}", group["momentum"])


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

