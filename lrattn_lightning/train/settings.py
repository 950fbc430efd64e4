"""LRAttnModule's settings as typed groups, and the flat names they keep on the command line and in checkpoints.

    ModelConfig        the architecture (model/config.py): `lrattn fit|validate|test` resolves (--size, --ablation)
                       through the registry once and hands the module the result as plain values (Provenance)
    OptimiserSettings  what shapes the optimiser's steps: the optimiser, its learning rates, weight decays and Muon
                       settings (train/optim.py), the warmup-stable-decay schedule (train/schedule.py), the z-loss
    RuntimeSettings    how the model is computed and scored: compile, impl, attention, document masking, diagnostics
    routing options    the flags of the routing kinds' training-time controls (train/controls.py: the keyword
                       parameters of each control's class, the gated residual's gate_*), collected here from every
                       control; the module applies them through controls.control_for without naming a kind
    Provenance         where a run comes from: its ModelConfig as a dict, the registry's sha256, the git commit

Flat names, kept on purpose: every setting is still `--model.NAME` (`--model.lr`, `--model.impl`,
`--model.gate_freeze_steps`), a key of a checkpoint's hyper_parameters and a `train_NAME` MLflow param, exactly as
before the groups; so recipes, sweep files, checkpoints and MLflow queries of older runs mean what they meant.
`module_settings(**flat)` is the one place flat names become the groups: LRAttnModule hands it its keyword
arguments, and LightningCLI (jsonargparse follows `**settings` into the call) makes its flags from the signature
generated below from the groups' fields and the kinds' options.

What each setting is to the three readers that must name every one is marked on its field (`setting(...)`), and
their lists are derived from the marks, never written by hand (tests/train/test_setting_marks.py holds every field
of SETTING_GROUPS to a mark or a reason):

    recipe  the recipe fingerprint (train/fingerprint.py): "optimizer" (a key of its optimizer part, as given),
            "derived" (a part recipe_parts builds itself: the resolved Muon dtype, the schedule's length, document
            masking), or Not(why it does not change the numbers)
    resume  what a resumed fit compares with its checkpoint: "checkpoint" (checkpoint/compat.py: the optimizer state
            would restore the checkpoint's value over the flag's), "optimizer state" (MuonWithAuxAdamW.load_state_dict
            compares it, train/optim.py), "schedule" (cli/checks.py check_schedule), or Not(why a resume may change it)
    check   the setting's range: Check(ok, what it must be), or Typed (its annotation's: a Literal's values, a
            bool), checked in one place (bad_setting) for `lrattn fit` before any work (cli/checks.py) and for every
            group as it is built; or Not(who else refuses a bad value, or why none can be given)

Every reader takes the groups it derives from (`groups`, SETTING_GROUPS unless given): a field added to a group
reaches the fingerprint, a resume's comparison and the checks with no edit to any of them
(tests/train/test_setting_marks.py grows a group to show it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import subprocess
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import PACKAGE_ROOT
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.options import fits
from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL
from lrattn_lightning.train import controls
from lrattn_lightning.train.muon import MuonDtype
from lrattn_lightning.train.optim import MuonVariant
from lrattn_lightning.train.schedule import MomentumSchedule


# ---- the marks ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Not:
    """A reader leaves the setting out, for this reason."""

    why: str


@dataclass(frozen=True)
class Check:
    """What `lrattn fit` checks of a setting before any work: ok(value), and what it must be (cli/checks.py)."""

    ok: Callable[[Any], bool]
    what: str


@dataclass(frozen=True)
class Typed:
    """The setting's range is its type: a Literal's values or a bool. checks() derives its Check from the field's
    annotation (jsonargparse refuses another value on the command line; a group built in code is checked by it)."""


def type_check(annotation: Any) -> Check:
    """The Check a Typed setting's annotation gives: one of a Literal's values (of their own type), or a bool; the
    value checked as the kinds' options are (model/options.py fits)."""
    if typing.get_origin(annotation) is Literal:
        what = f"one of {', '.join(str(x) for x in typing.get_args(annotation))}"
    elif annotation is bool:
        what = "true or false"
    else:
        raise TypeError(f"a Typed setting must be a Literal or a bool, not {annotation!r}")
    return Check(lambda v: fits(v, annotation), what)


RECIPE_MARKS = ("optimizer", "derived")
RESUME_MARKS = ("checkpoint", "optimizer state", "schedule")


def setting(default: Any, *, recipe: str | Not, resume: str | Not, check: Check | Typed | Not) -> Any:
    """A settings field with its three marks (the module docstring says what each reader does with them)."""
    return field(default=default, metadata={"recipe": recipe, "resume": resume, "check": check})


def marked(reader: str, mark: str, groups: tuple[type, ...] | None = None) -> tuple[str, ...]:
    """The settings whose `reader` mark (recipe, resume) is `mark`, in field order: the lists the readers use.
    `groups`: SETTING_GROUPS unless given (a reader hands on what it was given)."""
    return tuple(f.name for group in groups or SETTING_GROUPS for f in dataclasses.fields(group)
                 if f.metadata[reader] == mark)


@functools.cache
def _group_checks(group: type) -> tuple[tuple[str, Check], ...]:
    """(setting, its Check) for the fields of one group that have one; a Typed setting's from its annotation (made
    once a group: every group built checks itself)."""
    hints = typing.get_type_hints(group)
    return tuple((f.name, type_check(hints[f.name]) if isinstance(f.metadata["check"], Typed) else f.metadata["check"])
                 for f in dataclasses.fields(group) if isinstance(f.metadata["check"], Check | Typed))


def checks(groups: tuple[type, ...] | None = None) -> list[tuple[str, Check]]:
    """(setting, its Check) for every setting that has one, in field order (`groups`: SETTING_GROUPS unless given)."""
    return [pair for group in groups or SETTING_GROUPS for pair in _group_checks(group)]


def bad_setting(values: Any, groups: tuple[type, ...] | None = None) -> str | None:
    """The one check of the settings' ranges: the line for the first setting (field order) whose value in `values`
    (a mapping or a namespace with .get: flat names) fails its Check, or None. `lrattn fit` asks it before any work
    (cli/checks.py) and every group as it is built (its __post_init__), so the two cannot disagree."""
    for name, check in checks(groups):
        value = values.get(name)
        if not check.ok(value):
            return f"--model.{name} {value}: must be {check.what}"
    return None


class Checked:
    """A settings group that checks its fields' ranges (their Check marks) when it is built, before any work."""

    def __post_init__(self) -> None:
        line = bad_setting({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, (type(self),))
        if line is not None:
            raise InputError(line)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


AT_LEAST_0 = Check(lambda v: _number(v) and v >= 0, "a number >= 0")
STEPS = Check(lambda v: _integer(v) and v >= 0, "an integer >= 0")
FRACTION = Check(lambda v: _number(v) and 0 <= v <= 1, "a fraction in [0, 1]")
# the reasons most settings share
TYPED = Typed()
FROM_FLAGS = Not("the module reads it from the flags given at every start: a resume may change it")
SCHEDULE_SHAPE = Not("the schedule's shape comes from the flags a run is launched with (WarmupStableDecay's state "
                     "holds only its position): a resume may change it")
MOMENTUM = Not("MomentumSchedule refuses a value outside 0 <= muon_momentum_min <= muon_momentum < 1 when the "
               "settings are built, before any work")


@dataclass(frozen=True)
class OptimiserSettings(Checked):
    """The optimiser (muon_adamw: Muon for matrices, AdamW for the rest; adamw), its schedule and the z-loss weight.

    muon_variant: `reference` (the paper's code) or `torch` (torch.optim.Muon, match_rms_adamw); muon_dtype: the
    dtype Muon's orthogonaliser runs in (`auto`: bfloat16 where the device computes it natively, else float32). Muon's
    momentum rises from muon_momentum_min to muon_momentum over muon_momentum_warmup_steps and falls back over the
    last muon_momentum_cooldown_steps. The schedule spans schedule_steps (default --trainer.max_steps);
    allow_schedule_change lets a resume stretch it while every step so far stays the same (cli/checks.py)."""

    optimizer: Literal["muon_adamw", "adamw"] = setting("muon_adamw", recipe="optimizer", resume="checkpoint",
                                                        check=TYPED)
    lr: float = setting(3e-4, recipe="optimizer", resume="checkpoint",
                        check=Check(AT_LEAST_0.ok, "a number >= 0 (0: that group stays fixed)"))
    weight_decay: float = setting(0.0, recipe="optimizer", resume="checkpoint", check=AT_LEAST_0)
    betas: tuple[float, float] = setting((0.9, 0.95), recipe="optimizer", resume="checkpoint", check=Check(
        lambda v: isinstance(v, list | tuple) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
        "two numbers in [0, 1), e.g. [0.9, 0.95]"))
    muon_lr: float = setting(1e-3, recipe="optimizer", resume="checkpoint",
                             check=Check(AT_LEAST_0.ok, "a number >= 0 (0: that group stays fixed)"))
    muon_weight_decay: float = setting(0.1, recipe="optimizer", resume="checkpoint", check=AT_LEAST_0)
    muon_variant: MuonVariant = setting("reference", recipe="optimizer", resume="optimizer state", check=TYPED)
    muon_dtype: MuonDtype = setting("auto", recipe="derived", resume="optimizer state", check=TYPED)
    muon_momentum: float = setting(0.95, recipe="optimizer", check=MOMENTUM, resume=Not(
        "the schedule sets the Muon group's momentum from the flags given at every step"))
    muon_momentum_min: float = setting(0.85, recipe="optimizer", resume=SCHEDULE_SHAPE, check=MOMENTUM)
    muon_momentum_warmup_steps: int = setting(300, recipe="optimizer", resume=SCHEDULE_SHAPE, check=STEPS)
    muon_momentum_cooldown_steps: int = setting(100, recipe="optimizer", resume=SCHEDULE_SHAPE, check=STEPS)
    warmup_steps: int = setting(2000, recipe="optimizer", resume=SCHEDULE_SHAPE, check=STEPS)
    decay_fraction: float = setting(0.2, recipe="optimizer", resume=SCHEDULE_SHAPE, check=FRACTION)
    final_lr_fraction: float = setting(0.1, recipe="optimizer", resume=SCHEDULE_SHAPE, check=FRACTION)
    allow_schedule_change: bool = setting(False, check=TYPED, recipe=Not(
        "lets a resume change the schedule's length; the length itself is recipe (schedule_steps, max_steps)"),
        resume=Not("how check_schedule treats a resume, not a number of the run"))
    schedule_steps: int | None = setting(None, recipe="derived", resume="schedule", check=Check(
        lambda v: v is None or (_integer(v) and v >= 1), "an integer >= 1 (or null: --trainer.max_steps)"))
    z_loss: float = setting(1e-5, recipe="optimizer", resume=FROM_FLAGS, check=AT_LEAST_0)

    def __post_init__(self) -> None:  # checked when built, before any work
        super().__post_init__()
        self.momentum_schedule()

    @classmethod
    def of(cls, values: Any) -> OptimiserSettings:
        """The group from flat values (a mapping or namespace with .get, e.g. `lrattn fit`'s parsed --model.*)."""
        return cls(**{f.name: values.get(f.name, f.default) for f in dataclasses.fields(cls)})

    def momentum_schedule(self) -> MomentumSchedule:
        return MomentumSchedule(peak=self.muon_momentum, low=self.muon_momentum_min,
                                warmup_steps=self.muon_momentum_warmup_steps,
                                cooldown_steps=self.muon_momentum_cooldown_steps)


@dataclass(frozen=True)
class RuntimeSettings(Checked):
    """How the model runs, not what it is.

    impl: the AttnRes backend (model/routing/attnres); compile: torch.compile the decoder and loss (configure_model).
    document_masking: attend only within documents (the paper's recipe); the separator is the data's EOS id, found at
    fit time and kept as doc_separator so checkpoints mask alike in evaluation. attention: how that mask reaches the
    token attention, `sdpa` (a dense mask) or `flex` (FlexAttention's block mask, CUDA for training); the same
    results. loss_impl: the training loss from the logits (`logits`) or with the head fused in, its logits formed a chunk
    of rows at a time and never whole (`chunked`, train/losses.py head_token_losses: the same loss in less memory);
    `auto` chunks on a GPU in eager mode with unsharded weights, where the logits are largest. routing_diagnostics:
    record the routing weights of each validation's first batch."""

    compile: bool = setting(False, resume=FROM_FLAGS, check=TYPED, recipe=Not(
        "how the same computation runs: torch.compile traces the decoder and loss the eager run computes"))
    impl: str = setting(DEFAULT_IMPL, resume=FROM_FLAGS, recipe=Not(
        "the AttnRes backend: every backend computes the reference's numbers (its parity test)"), check=Not(
        "resolve_impl names the backends when the module is built, before any work (one line)"))
    document_masking: bool = setting(False, recipe="derived", resume=FROM_FLAGS, check=TYPED)
    attention: Literal["sdpa", "flex"] = setting("sdpa", resume=FROM_FLAGS, check=TYPED, recipe=Not(
        "how the document mask reaches the attention (a dense mask or FlexAttention's block mask): the same results"))
    loss_impl: Literal["auto", "logits", "chunked"] = setting("auto", resume=FROM_FLAGS, check=TYPED, recipe=Not(
        "how the same loss is computed: chunked forms the head's logits a chunk of rows at a time (losses.py)"))
    routing_diagnostics: bool = setting(True, resume=FROM_FLAGS, check=TYPED, recipe=Not(
        "records the routing weights of a validation batch; trains nothing"))
    doc_separator: int | None = setting(None, recipe=Not(
        "the data's EOS id, found at fit time: the recipe's `data` part names the data"), resume=Not(
        "taken from the data's meta.json at every start (the checkpoint's where the data names none)"), check=Not(
        "not a flag a user sets: the data's meta.json gives it"))


@dataclass(frozen=True)
class Provenance:
    """What `lrattn fit|validate|test` resolves once and hands the module as plain values (checkpoint hparams)."""

    model_config: dict[str, Any]
    registry_sha256: str | None
    git_commit: str | None

    @classmethod
    def of(cls, cfg: ModelConfig, registry_sha256: str | None, git_commit: str | None = None) -> Provenance:
        return cls(cfg.to_dict(), registry_sha256, git_commit)


def _fields(group: type) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(group)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
            for f in dataclasses.fields(group)]


SETTING_GROUPS = (OptimiserSettings, RuntimeSettings)  # every group whose fields are flags (`--model.NAME`)
ROUTING = controls.parameters()
FLAGS: dict[str, inspect.Parameter] = {p.name: p for p in (*(p for g in SETTING_GROUPS for p in _fields(g)),
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
        controls.check_options(cfg, {k: v != ROUTING[k].default for k, v in self.routing.items()})
        return controls.control_for(cfg, router, self.routing)


def module_settings(**flat: Any) -> ModuleSettings:
    """The groups from flat settings (`lr=...`, `impl=...`, `gate_freeze_steps=...`), defaults for the rest; an
    unknown name or a bad value is one line naming `model.NAME`."""
    for name in flat:
        if name not in FLAGS:
            raise InputError(f"model.{name}: unknown setting; closest: {', '.join(closest_names(name, list(FLAGS)))}")
    pick = {group: {f.name: flat[f.name] for f in dataclasses.fields(group) if f.name in flat}
            for group in SETTING_GROUPS}
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
