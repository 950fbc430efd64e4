"""What training does for a routing kind besides the loss: its training-time controls, keyed by the kind's name.

    CONTROLS     {kind: the control's class}; a kind not listed has none (the deliberate default, written once:
                 `control_for` returns None, `options_of` no flags). A control is built as Class(router, **flags):
                 its keyword parameters after `router` are the module's flags (`--model.NAME`, typed and
                 defaulted by their annotations and defaults: train/settings.py), which train/schema.py declares
                 as `train_NAME` params (Param.ROUTING_SETTINGS; tests/train/test_schema.py checks they match);
                 the LightningModule calls before_step(step, last_loss) each step, logs log_values() (metric names
                 from train/schema.py) and hands it the last training cross-entropy where wants_loss
    GateHold     the gated residual's (routing: gated, model/routing/gated.py; docs/gated-residual.md)
"""

from __future__ import annotations

import inspect
import typing
from typing import Annotated, Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.options import Range, complaint
from lrattn_lightning.model.routing.gated import GatedRouter
from lrattn_lightning.model.routing.kinds import KINDS, owner_phrase
from lrattn_lightning.train.schema import Metric

FREEZE_STEPS = Annotated[int, Range(0, note="steps with alpha held at 0.5")]
RELEASE_LOSS = Annotated[float, Range(0, open_low=True, note="a training loss in nats")] | None


class GateHold:
    """The gated residual's training-time controls (`--model.gate_freeze_steps`, `gate_release_loss`,
    `gate_grad_normalize`; docs/gated-residual.md): every gate is held at alpha = 0.5 for the first N optimiser
    steps and/or until a step's training cross-entropy (mean over ranks) is <= X; the release is for good and the
    hold travels in checkpoints (the router's gate_hold buffer). gate_grad_normalize replaces the gradient reaching
    each sublayer's gate tensor alpha by G / (||G|| + 1e-6), clipped to |.| < 1. The LightningModule calls it."""

    def __init__(self, router: GatedRouter, gate_freeze_steps: int = 0, gate_release_loss: float | None = None,
                 gate_grad_normalize: bool = False):
        steps, loss = gate_freeze_steps, gate_release_loss
        for flag, value, hint in (("gate_freeze_steps", steps, FREEZE_STEPS), ("gate_release_loss", loss, RELEASE_LOSS),
                                  ("gate_grad_normalize", gate_grad_normalize, bool)):
            wrong = complaint(value, hint)
            if wrong is not None:
                raise InputError(f"model.{flag}: {wrong}")
        self.router, self.freeze_steps, self.release_loss = router, steps, loss
        self.active = steps > 0 or loss is not None
        router.gate_grad_normalize = gate_grad_normalize
        router.set_gate_hold(self.active)  # a checkpoint's stored hold replaces this on load

    @property
    def wants_loss(self) -> bool:
        return self.active and self.release_loss is not None and self.router.gates_held

    def before_step(self, step: int, last_loss: float | None) -> None:
        """Release held gates once the step count and the loss allow it (for good: a release is not undone)."""
        if not self.active or not self.router.gates_held or step < self.freeze_steps:
            return
        if self.release_loss is not None and (last_loss is None or last_loss > self.release_loss):
            return
        self.router.set_gate_hold(False)

    def log_values(self) -> dict[str, float]:
        return {Metric.GATES_HELD: float(self.router.gates_held)} if self.active else {}


CONTROLS: dict[str, type] = {"gated": GateHold}


def options_of(kind: str) -> tuple[str, ...]:
    """The module flags the control of `kind` takes (its keyword parameters after `router`); () without one."""
    if kind not in CONTROLS:
        return ()
    return tuple(name for name in inspect.signature(CONTROLS[kind]).parameters if name != "router")


def option_names() -> tuple[str, ...]:
    """Every control's flags, in KINDS order, each once."""
    return tuple(dict.fromkeys(name for kind in KINDS for name in options_of(kind)))


def parameters() -> dict[str, inspect.Parameter]:
    """Every control's flags as keyword parameters with their types and defaults (train/settings.py's flags)."""
    found: dict[str, inspect.Parameter] = {}
    for kind in KINDS:
        if kind not in CONTROLS:
            continue
        params = inspect.signature(CONTROLS[kind]).parameters
        hints = typing.get_type_hints(CONTROLS[kind].__init__)
        for name in options_of(kind):
            found.setdefault(name, params[name].replace(kind=inspect.Parameter.KEYWORD_ONLY,
                                                        annotation=hints.get(name, Any)))
    return found


def check_options(cfg: ModelConfig, given: dict[str, bool]) -> None:
    """Module flags (`--model.NAME`) set for a kind whose control does not take them: one line."""
    mine = options_of(cfg.kind.name)
    for option, is_set in given.items():
        if is_set and option not in mine:
            owner = next((kind for kind in KINDS if option in options_of(kind)), None)
            phrase = owner_phrase(owner) if owner is not None else "no routing kind reads it"
            raise InputError(f"model.{option}: {phrase}; ablation '{cfg.ablation.name}' has routing "
                             f"'{cfg.ablation.routing}'")


def control_for(cfg: ModelConfig, router: Any, flags: dict[str, Any]) -> Any:
    """The control of cfg's kind built on its router with its flags (the values of options_of), or None."""
    control = CONTROLS.get(cfg.kind.name)
    return None if control is None else control(router, **{k: flags[k] for k in options_of(cfg.kind.name)})
