"""The paper's optimiser split and learning-rate schedule (SPEC §5).

Muon for the >= 2-D hidden matrices (attention, MLP, key projections, gates); AdamW for the
embedding, the LM head, the pseudo-queries and every 1-D parameter. Both live in one
`MuonAdamW` so Lightning's automatic optimisation (gradient clipping, accumulation, bf16-mixed,
checkpointing, LR monitoring) treats them as a single optimiser.

Schedule (warmup-stable-decay): linear warmup over `warmup_steps`, constant, then linear decay over
the last `decay_fraction` of the run to `final_lr_fraction` x the peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# Parameters that stay with AdamW even though they are 2-D.
ADAMW_ONLY = ("embed.", "head.", "router.queries")


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(muon, adamw) parameter lists."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and not any(tag in name for tag in ADAMW_ONLY):
            muon.append(p)
        else:
            adamw.append(p)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Steps a list of optimisers as one. `param_groups` are the children's own group dicts,
    so a scheduler or LR monitor acting on this optimiser acts on the children."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        groups = [g for opt in self.optimizers for g in opt.param_groups]
        # Optimizer.__init__ would copy the groups; keep the children's dicts instead.
        self.defaults = {}
        self.param_groups = groups
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#MuonAdamW.zero_grad"

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged: dict = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value: dict) -> None:  # Optimizer internals may assign; children own the state
        pass

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        children = state_dict["optimizers"]
        if len(children) != len(self.optimizers):
            raise ValueError(f"optimizer state has {len(children)} parts, this optimiser {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, children, strict=True):
            opt.load_state_dict(sd)


def build_optimizer(
    model: nn.Module,
    *,
    kind: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    muon_lr: float,
    muon_weight_decay: float,
    muon_momentum: float = 0.95,
    muon_adjust_lr: str = "match_rms_adamw",
) -> torch.optim.Optimizer:
    muon_params, adamw_params = split_parameters(model)
    if kind == "adamw":
        return torch.optim.AdamW(
            [{"params": adamw_params + muon_params, "name": "adamw"}], lr=lr, betas=betas, weight_decay=weight_decay
        )
    if kind != "muon_adamw":
        raise ValueError(f"optimizer: unknown kind '{kind}'; use 'muon_adamw' or 'adamw'")
    adamw = torch.optim.AdamW([{"params": adamw_params, "name": "adamw"}], lr=lr, betas=betas, weight_decay=weight_decay)
    muon = torch.optim.Muon(
        [{"params": muon_params, "name": "muon"}],
        lr=muon_lr, weight_decay=muon_weight_decay, momentum=muon_momentum, adjust_lr_fn=muon_adjust_lr,
    )
    return MuonAdamW([muon, adamw])


def wsd_lambda(total_steps: int, warmup_steps: int, decay_fraction: float, final_lr_fraction: float) -> Callable[[int], float]:
    """LR multiplier for step s: warmup, stable at 1, linear decay to final_lr_fraction."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    decay_start = int(total_steps * (1.0 - decay_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step >= decay_start and total_steps > decay_start:
            progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
            return 1.0 - (1.0 - final_lr_fraction) * progress
        return 1.0

    return factor
