"""The momentum schedule's phases at their boundary steps, a zero-length cooldown included, and a scheduler
stepped past the end of its schedule (a finished run trained on with --model.schedule_steps)."""

from __future__ import annotations

import pytest
import torch

from lrattn_lightning.train.optim import MuonWithAuxAdamW
from lrattn_lightning.train.schedule import MomentumSchedule, WarmupStableDecay


@pytest.mark.parametrize("cooldown", [0, 1, 3])
def test_momentum_phases_at_their_boundaries(cooldown):
    """T = 10, W = 4: warmup 0-3 (s / W), peak, cooldown over the last C steps ending at `low` at step T and
    holding it past T; C = 0 is no cooldown: the peak holds at T and past it (it divided by zero past T)."""
    m, T = MomentumSchedule(peak=0.95, low=0.85, warmup_steps=4, cooldown_steps=cooldown), 10
    assert [m(s, T) for s in range(4)] == pytest.approx([0.85, 0.875, 0.9, 0.925])
    assert m(4, T) == 0.95 and m(T - cooldown, T) == 0.95  # the cooldown's first step still at the peak
    if cooldown:
        assert m(T - cooldown + 1, T) == pytest.approx(0.95 - 0.1 / cooldown)
        assert m(T, T) == m(T + 1, T) == m(10 * T, T) == pytest.approx(0.85)
    else:
        assert m(T - 1, T) == m(T, T) == m(T + 1, T) == m(10 * T, T) == 0.95


def test_no_warmup_and_no_cooldown_is_the_peak_at_every_step_past_the_end_too():
    m = MomentumSchedule(warmup_steps=0, cooldown_steps=0)
    assert {m(s, 5) for s in range(16)} == {0.95}
    assert {m(s, 0) for s in range(3)} == {0.95}  # a zero-length schedule


def test_a_scheduler_steps_past_its_schedule_at_its_final_values():
    """Schedule 5 steps, run 15 (how a finished run is extended): the learning rate holds x final_lr_fraction and
    the momentum its last value; with cooldown 0 the 7th step raised ZeroDivisionError."""
    param = torch.nn.Parameter(torch.randn(4, 4))
    opt = MuonWithAuxAdamW([{"params": [param], "use_muon": True, "name": "muon", "lr": 0.1}])
    sched = WarmupStableDecay(opt, 5, 1, 0.4, 0.1, MomentumSchedule(warmup_steps=0, cooldown_steps=0))
    seen = []
    for _ in range(15):
        param.grad = torch.ones_like(param)
        opt.step()
        sched.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
    assert all(lr == pytest.approx(0.01) and momentum == 0.95 for lr, momentum in seen[4:]), seen
