"""The training schedule: one scheduler for every group's learning rate and the Muon group's momentum.

`WarmupStableDecay`, one scheduler, state in the checkpoint): the learning rate warms up
linearly over `warmup_steps`, stays, then decays linearly over the last `decay_fraction` of the run to
`final_lr_fraction` x the peak; the Muon momentum rises linearly from its minimum to its peak over the
first steps and falls back over the last ones (the reference: 0.85 -> 0.95 over 300, back over 100).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lrattn_lightning.core.errors import InputError


def wsd_lambda(total_steps: int, warmup_steps: int, decay_fraction: float, final_lr_fraction: float) -> Callable[[int], float]:
    """LR multiplier for step s: warmup, stable at 1, linear decay to final_lr_fraction over the last
    int(decay_fraction * T) steps (the reference's warmdown length, so its decay starts at the same step)."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    decay_start = total_steps - int(total_steps * decay_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step >= decay_start and total_steps > decay_start:
            progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
            return 1.0 - (1.0 - final_lr_fraction) * progress
        return 1.0

    return factor


@dataclass(frozen=True)
class MomentumSchedule:
    """Muon momentum at step s of T: low -> peak linearly over the first `warmup_steps` (s / W), peak,
    then peak -> low linearly over the last `cooldown_steps` ((s - (T - C)) / C); warmup wins if they meet.
    The reference: low 0.85, peak 0.95, W = 300, C = 100. W = C = 0 keeps the peak throughout, past T too:
    C = 0 is no cooldown (as decay_fraction 0 is no warm-down), so a constant-momentum run trained on past its
    schedule (--model.schedule_steps T < --trainer.max_steps) keeps its momentum; C > 0 holds `low` past T."""

    peak: float = 0.95
    low: float = 0.85
    warmup_steps: int = 300
    cooldown_steps: int = 100

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.peak < 1.0:
            raise InputError(f"muon_momentum_min: need 0 <= {self.low} <= muon_momentum ({self.peak}) < 1")
        for field in ("warmup_steps", "cooldown_steps"):
            if getattr(self, field) < 0:
                raise InputError(f"muon_momentum_{field}: {getattr(self, field)} must be >= 0")

    def __call__(self, step: int, total_steps: int) -> float:
        cooldown_start = total_steps - self.cooldown_steps
        if step < self.warmup_steps:
            return self.low + (step / self.warmup_steps) * (self.peak - self.low)
        if self.cooldown_steps and step > cooldown_start:
            return self.peak - min(1.0, (step - cooldown_start) / self.cooldown_steps) * (self.peak - self.low)
        return self.peak


class WarmupStableDecay(torch.optim.lr_scheduler.LRScheduler):
    """Per optimizer step s (= last_epoch): lr = base lr x wsd_lambda(s) for every group, and
    momentum = MomentumSchedule(s) for every Muon group. Set before step s runs, like the reference.

    state_dict holds the position (last_epoch, base lrs); the shape comes from the current arguments,
    as with LambdaLR, so a resumed run follows the schedule it is launched with."""

    _SHAPE = ("lr_factor", "momentum", "total_steps")

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, decay_fraction: float,
                 final_lr_fraction: float, momentum: MomentumSchedule | None = None, last_epoch: int = -1):
        self.lr_factor = wsd_lambda(total_steps, warmup_steps, decay_fraction, final_lr_fraction)
        self.momentum = momentum
        self.total_steps = total_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [base * self.lr_factor(self.last_epoch) for base in self.base_lrs]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.momentum is not None:
            for group in self.optimizer.param_groups:
                if group.get("use_muon"):
                    group["momentum"] = self.momentum(self.last_epoch, self.total_steps)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k not in self._SHAPE}


def first_schedule_difference(old_total: int, new_total: int, until: int, warmup_steps: int, decay_fraction: float,
                              final_lr_fraction: float, momentum: MomentumSchedule | None) -> int | None:
    """The first step s <= `until` where the schedules of `old_total` and `new_total` steps set another learning
    rate or Muon momentum, or None: a resume at global step `until` with the new length then equals a run
    launched with it from the start. `until` is included: its learning rate and momentum were set by the old
    schedule before the save and come back with the optimizer state."""
    old = wsd_lambda(old_total, warmup_steps, decay_fraction, final_lr_fraction)
    new = wsd_lambda(new_total, warmup_steps, decay_fraction, final_lr_fraction)
    for step in range(until + 1):
        if old(step) != new(step) or (momentum is not None and momentum(step, old_total) != momentum(step, new_total)):
            return step
    return None
