"""A run's progress where it is shown: a line per N optimizer steps where no progress bar is drawn
(StepProgressLog), and Lightning's rich bar counting the run's optimizer steps (step_progress_bar)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lrattn_lightning.train.schema import Metric


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
        loss = trainer.callback_metrics.get(Metric.TRAIN_LOSS)
        line = f"[lrattn fit] step {step}" + (f"/{total} ({100 * step // total} %)" if total > 0 else "")
        line += f": {Metric.TRAIN_LOSS} {float(loss):.4f}" if loss is not None else ":"
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
