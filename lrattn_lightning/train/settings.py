"""LRAttnModule's settings as typed groups, and the flat names they keep on the command line and in checkpoints.

    ModelConfig        the architecture (model/config.py): `lrattn fit|validate|test` resolves (--size, --ablation)
                       through the registry once and hands the module the result as plain values (Provenance)
    OptimiserSettings  what shapes the optimiser's steps: the optimiser, its learning rates, weight decays and Muon
                       settings (train/optim.py), the warmup-stable-decay schedule (train/schedule.py), the z-loss
    RuntimeSettings    how the model is computed and scored: compile, impl, attention, document masking, diagnostics
    routing options    the training-time controls the routing kinds declare (RoutingKind.training_options, typed by
                       the keyword parameters of its training_class: the gated residual's gate_*), collected here
                       from every kind; the module applies them through the kind without naming one
    Provenance         where a run comes from: its ModelConfig as a dict, the registry's sha256, the git commit

Flat names, kept on purpose: every setting is still `--model.NAME` (`--model.lr`, `--model.impl`,
`--model.gate_freeze_steps`), a key of a checkpoint's hyper_parameters and a `train_NAME` MLflow param, exactly as
before the groups; so recipes, sweep files, checkpoints and MLflow queries of older runs mean what they meant.
`module_settings(**flat)` is the one place flat names become the groups: LRAttnModule hands it its keyword
arguments, and LightningCLI (jsonargparse follows `**settings` into the call) makes its flags from the signature
generated below from the groups' fields and the kinds' options.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import typing
from dataclasses import dataclass
from typing import Any, Literal

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import PACKAGE_ROOT
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL
from lrattn_lightning.model.routing.kinds import KINDS, check_training_options
from lrattn_lightning.train.muon import MuonDtype
from lrattn_lightning.train.optim import MUON_VARIANTS, MuonVariant
from lrattn_lightning.train.schedule import MomentumSchedule


@dataclass(frozen=True)
class OptimiserSettings:
    """The optimiser (muon_adamw: Muon for matrices, AdamW for the rest; adamw), its schedule and the z-loss weight.

    muon_variant: `reference` (the paper's code) or `torch` (torch.optim.Muon, match_rms_adamw); muon_dtype: the
    dtype Muon's orthogonaliser runs in (`auto`: bfloat16 where the device computes it natively, else float32). Muon's
    momentum rises from muon_momentum_min to muon_momentum over muon_momentum_warmup_steps and falls back over the
    last muon_momentum_cooldown_steps. The schedule spans schedule_steps (default --trainer.max_steps);
    allow_schedule_change lets a resume stretch it while every step so far stays the same (cli/checks.py)."""

    optimizer: Literal["muon_adamw", "adamw"] = "muon_adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    muon_lr: float = 1e-3
    muon_weight_decay: float = 0.1
    muon_variant: MuonVariant = "reference"
    muon_dtype: MuonDtype = "auto"
    muon_momentum: float = 0.95
    muon_momentum_min: float = 0.85
    muon_momentum_warmup_steps: int = 300
    muon_momentum_cooldown_steps: int = 100
    warmup_steps: int = 2000
    decay_fraction: float = 0.2
    final_lr_fraction: float = 0.1
    allow_schedule_change: bool = False
    schedule_steps: int | None = None
    z_loss: float = 1e-5

    def __post_init__(self) -> None:  # checked when built, before any work
        if self.muon_variant not in MUON_VARIANTS:
            raise InputError(f"model.muon_variant: unknown '{self.muon_variant}'; use one of {', '.join(MUON_VARIANTS)}")
        if self.muon_dtype not in typing.get_args(MuonDtype):
            raise InputError(f"model.muon_dtype: '{self.muon_dtype}' is not one of "
                             f"{', '.join(typing.get_args(MuonDtype))}")
        self.momentum_schedule()

    def momentum_schedule(self) -> MomentumSchedule:
        return MomentumSchedule(peak=self.muon_momentum, low=self.muon_momentum_min,
                                warmup_steps=self.muon_momentum_warmup_steps,
                                cooldown_steps=self.muon_momentum_cooldown_steps)


@dataclass(frozen=True)
class RuntimeSettings:
    """How the model runs, not what it is.

    impl: the AttnRes backend (model/routing/attnres); compile: torch.compile the decoder and loss (configure_model).
    document_masking: attend only within documents (the paper's recipe); the separator is the data's EOS id, found at
    fit time and kept as doc_separator so checkpoints mask alike in evaluation. attention: how that mask reaches the
    token attention, `sdpa` (a dense mask) or `flex` (FlexAttention's block mask, CUDA for training); the same
    results. routing_diagnostics: record the routing weights of each validation's first batch."""

    compile: bool = False
    impl: str = DEFAULT_IMPL
    document_masking: bool = False
    attention: Literal["sdpa", "flex"] = "sdpa"
    routing_diagnostics: bool = True
    doc_separator: int | None = None


@dataclass(frozen=True)
class Provenance:
    """What `lrattn fit|validate|test` resolves once and hands the module as plain values (checkpoint hparams)."""

    model_config: dict[str, Any]
    registry_sha256: str | None
    git_commit: str | None

    @classmethod
    def of(cls, cfg: ModelConfig, registry_sha256: str | None, git_commit: str | None = None) -> Provenance:
        return cls(cfg.to_dict(), registry_sha256, git_commit)


def routing_parameters() -> dict[str, inspect.Parameter]:
    """Every training-time option some routing kind declares, as a keyword parameter with its type and default
    (the keyword parameters of the kind's training_class named in its training_options)."""
    found: dict[str, inspect.Parameter] = {}
    for kind in KINDS.values():
        if kind.training_class is None:
            continue
        params = inspect.signature(kind.training_class).parameters
        hints = typing.get_type_hints(kind.training_class.__init__)
        for name in kind.training_options:
            found.setdefault(name, params[name].replace(kind=inspect.Parameter.KEYWORD_ONLY,
                                                        annotation=hints.get(name, Any)))
    return found


def _fields(group: type) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(group)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
            for f in dataclasses.fields(group)]


ROUTING = routing_parameters()
FLAGS: dict[str, inspect.Parameter] = {p.name: p for p in (*_fields(OptimiserSettings), *_fields(RuntimeSettings),
                                                              *ROUTING.values())}


@dataclass(frozen=True)
class ModuleSettings:
    """The groups of one module: its optimiser, its runtime, and every kind's training options by flag name."""

    optimiser: OptimiserSettings
    runtime: RuntimeSettings
    routing: dict[str, Any]

    def flat(self) -> dict[str, Any]:
        """Flag name -> value: the hyper-parameters as a checkpoint and the MLflow params store them."""
        groups = (self.optimiser, self.runtime)
        return {**{f.name: getattr(g, f.name) for g in groups for f in dataclasses.fields(g)}, **self.routing}

    def routing_control(self, cfg: ModelConfig, router: Any) -> Any:
        """The kind's training control (None: it has none); an option set for a kind that does not read it: one line."""
        check_training_options(cfg, {k: v != ROUTING[k].default for k, v in self.routing.items()})
        return cfg.kind.training_control(router, {k: self.routing[k] for k in cfg.kind.training_options})


def module_settings(**flat: Any) -> ModuleSettings:
    """The groups from flat settings (`lr=...`, `impl=...`, `gate_freeze_steps=...`), defaults for the rest; an
    unknown name or a bad value is one line naming `model.NAME`."""
    for name in flat:
        if name not in FLAGS:
            raise InputError(f"model.{name}: unknown setting; closest: {', '.join(closest_names(name, list(FLAGS)))}")
    pick = {group: {f.name: flat[f.name] for f in dataclasses.fields(group) if f.name in flat}
            for group in (OptimiserSettings, RuntimeSettings)}
    routing = {name: flat.get(name, p.default) for name, p in ROUTING.items()}
    return ModuleSettings(OptimiserSettings(**pick[OptimiserSettings]), RuntimeSettings(**pick[RuntimeSettings]), routing)


# LightningCLI's flags: jsonargparse reads this signature where LRAttnModule passes **settings to the function
module_settings.__signature__ = inspect.Signature(list(FLAGS.values()))  # type: ignore[attr-defined]


def current_git_commit() -> str:
    """HEAD of the checkout the package runs from (`-dirty` with uncommitted changes to tracked files); `unknown`
    outside a git checkout (an installed wheel)."""
    try:
        root = PACKAGE_ROOT
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
