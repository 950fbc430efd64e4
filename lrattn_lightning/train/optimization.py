"""The LightningModule's optimiser (a mixin of LRAttnModule): one optimiser with a Muon and an AdamW group
(optim.py) and one scheduler for warmup-stable-decay learning rates and Muon's momentum."""

from __future__ import annotations

import torch

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.train.optim import build_optimizer
from lrattn_lightning.train.schedule import WarmupStableDecay
from lrattn_lightning.train.schema import Metric


class Optimization:
    """The module holds `model`, `optimiser` (train/settings.py OptimiserSettings) and `momentum_schedule`."""

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimiser of `configure_optimizers`, without its schedule (`lrattn bench`'s train step)."""
        hp = self.optimiser
        return build_optimizer(
            self.model, kind=hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
            muon_lr=hp.muon_lr, muon_weight_decay=hp.muon_weight_decay, muon_momentum=hp.muon_momentum,
            muon_variant=hp.muon_variant, muon_dtype=hp.muon_dtype,
        )

    def configure_optimizers(self) -> dict:
        hp = self.optimiser
        if hp.optimizer == "muon_adamw" and "FSDP" in type(self.trainer.strategy).__name__:
            raise InputError("model.optimizer: Muon under Lightning's FSDPStrategy (FSDP1) is not supported; use "
                             "--trainer.strategy fsdp (FSDP2, which Muon gathers whole matrices under), or ddp")
        opt = self.make_optimizer()
        total = schedule_length(hp.schedule_steps, self.trainer)
        # one scheduler: the learning rate of every group and the momentum of the Muon group, per step;
        # its name is LearningRateMonitor's metric prefix: train/lr/muon, train/lr/adamw
        schedule = WarmupStableDecay(opt, total, hp.warmup_steps, hp.decay_fraction, hp.final_lr_fraction,
                                     self.momentum_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step",
                                                      "name": Metric.LR.removesuffix("/")}}

    def gradient_norm(self) -> torch.Tensor:
        """The total L2 norm of the model's gradients in one foreach pass, kept for clipping by norm (below)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        self._grad_norm = (norm, len(grads))
        return norm

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, except that clipping by norm scales by the norm just logged (gradient_norm, called
        by on_before_optimizer_step: the same gradients; torch's clip_grad_norm_ is that norm and this scaling)
        instead of computing it a second time."""
        computed, self._grad_norm = getattr(self, "_grad_norm", None), None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if (computed is None or len(params) != computed[1] or not gradient_clip_val
                or gradient_clip_algorithm not in (None, "norm")):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, computed[0], foreach=True)


def schedule_length(schedule_steps: int | None, trainer) -> int:
    """The steps the learning-rate and momentum schedule spans: --model.schedule_steps, else the run's
    --trainer.max_steps (its epochs' steps without one). Steps after it run at the schedule's final values."""
    if schedule_steps:
        return int(schedule_steps)
    return trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
