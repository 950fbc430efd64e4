"""The LightningModule's optimiser (a mixin of LRAttnModule): one optimiser with a Muon and an AdamW group
(optim.py) and one scheduler for warmup-stable-decay learning rates and Muon's momentum."""

from __future__ import annotations

import torch

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.train.optim import build_optimizer
from lrattn_lightning.train.schedule import WarmupStableDecay


class Optimization:
    """The module holds `model`, `hparams` and `momentum_schedule`."""

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimiser of `configure_optimizers`, without its schedule (`lrattn bench`'s train step)."""
        hp = self.hparams
        return build_optimizer(
            self.model, kind=hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
            muon_lr=hp.muon_lr, muon_weight_decay=hp.muon_weight_decay, muon_momentum=hp.muon_momentum,
            muon_variant=hp.muon_variant, muon_dtype=hp.muon_dtype,
        )

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        if hp.optimizer == "muon_adamw" and "FSDP" in type(self.trainer.strategy).__name__:
            raise InputError("model.optimizer: Muon under Lightning's FSDPStrategy (FSDP1) is not supported; use "
                             "--trainer.strategy fsdp (FSDP2, which Muon gathers whole matrices under), or ddp")
        opt = self.make_optimizer()
        total = schedule_length(hp.get("schedule_steps"), self.trainer)
        # one scheduler: the learning rate of every group and the momentum of the Muon group, per step;
        # its name is LearningRateMonitor's metric prefix: train/lr/muon, train/lr/adamw
        schedule = WarmupStableDecay(opt, total, hp.warmup_steps, hp.decay_fraction, hp.final_lr_fraction,
                                     self.momentum_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step", "name": "train/lr"}}


def schedule_length(schedule_steps: int | None, trainer) -> int:
    """The steps the learning-rate and momentum schedule spans: --model.schedule_steps, else the run's
    --trainer.max_steps (its epochs' steps without one). Steps after it run at the schedule's final values."""
    if schedule_steps:
        return int(schedule_steps)
    return trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
