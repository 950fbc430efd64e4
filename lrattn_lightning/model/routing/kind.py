"""The routing-kind protocol: what one way of routing across depth states about itself (model/routing/kinds.py lists
the built-in ones). A registry entry's `routing: NAME` names a kind; everything else reads the entry through it:

    Options               its options, a frozen dataclass (`KindOptions`, model/options.py: checked from their
                          annotations, `rules` for the rest): a registry entry nests them under the kind's name
                          (`laurel: {rank: 8}`), checkpoints and MLflow params store them flat (`laurel_rank`)
    training_options      the LightningModule's flags only it reads (`--model.gate_freeze_steps` ...), typed by
    training_class        the control's class, whose keyword parameters give their types and defaults, and
    training_control(router, flags)  what training does with them (the gated residual's gate hold)
    validate(options, where)  checks of its options that need no size; validate_model(cfg, where) the rest
    resolve_impl(cfg, impl, compiled)  the one resolution of `--model.impl` (AttnRes: its backends; others: as given)
    build(cfg, impl)      its router module (the Router protocol of router.py), impl as resolve_impl returned it
    extra_out, key_dim, block_ends, initial_gates   what the decoder and accounting read from it
    routing_params, added_flops    the analytic parameter count and forward FLOPs per token it adds
                                   (added_flops None: unknown)
    adamw_names(router)   its router's parameter names that AdamW takes under muon_adamw (None: all of them)
    diagnostics           what `state.weights` hold when a pass records: "depth_weights" (alpha [S_j, B, T, m]
                          per read site), "gates" (alpha per sublayer), "mixing" (any real mixing weights:
                          DenseFormer's alpha, the hyper-connections' coefficients, an own router's), or None
    diagnostic_axes(cfg)  what the rows and columns of those weights are (train/diagnostics.py)
    user_code             whether it imports the user's code (an own router); code_paths(options) names it
    takes_impl            whether the AttnRes backends (`--model.impl`) apply
    depth_attention       softmax attention over depth sources: the roofline's traffic model applies
    clipped_to(options, size)      option changes that make it build at a tiny size (tests)
    reference_flags(cfg)  the paper's code's flags for it (NotExpressible where it has none) and
    reference_weights(ref, cfg)    the reference's router weights under our names
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.options import KindOptions

if TYPE_CHECKING:
    from torch import nn

    from lrattn_lightning.model.config import ModelConfig, SizeConfig


class NotExpressible(InputError):
    """The entry has no equivalent in the reference's flags (said why)."""


@dataclass(frozen=True)
class NoOptions(KindOptions):
    """A kind without options."""


class TrainingControl(Protocol):
    """What a kind does during training besides the loss, called by the LightningModule at every step."""

    wants_loss: bool  # whether before_step needs the last step's training cross-entropy (mean over ranks)

    def before_step(self, step: int, last_loss: float | None) -> None: ...

    def log_values(self) -> dict[str, float]:
        """Values to log at this step (`train/...`)."""


class RoutingKind:
    """The defaults: a kind with no parameters, no extra output rows, no diagnostics, unknown to the reference."""

    name = ""
    Options: type[KindOptions] = NoOptions  # its options, a frozen dataclass (model/options.py)
    training_options: tuple[str, ...] = ()  # the LightningModule's flags only it reads (`--model.gate_*`)
    training_class: type | None = None  # what training_control builds, (router, **options): its keyword
    # parameters named in training_options give their types and defaults (the module's flags: train/settings.py)
    owner_phrase = ""  # how an error says a foreign field belongs here (default: "only routing NAME reads it")
    diagnostics: str | None = None
    user_code = False
    takes_impl = False
    depth_attention = False

    def __init__(self) -> None:
        if not self.owner_phrase:
            self.owner_phrase = f"only routing {self.name} reads it"

    def validate(self, options: Any, where: str) -> None:
        """Checks of its options that need no size: their annotations, then their `rules` (KindOptions.validate)."""
        options.validate(where)

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """Checks that need the size."""

    def resolve_impl(self, cfg: ModelConfig, requested: str, compiled: bool = False) -> str:
        """The backend that runs for `--model.impl` (`requested`) in this kind, under torch.compile if `compiled`:
        a kind without backends (takes_impl False) takes it as given and ignores it."""
        return requested

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        raise NotImplementedError

    def extra_out(self, cfg: ModelConfig) -> int:
        """Extra output rows of each sublayer's output projection (beyond d)."""
        return 0

    def key_dim(self, cfg: ModelConfig) -> int:
        """The routing key width recorded as the `key_dim` param (0: no keys)."""
        return 0

    def block_ends(self, cfg: ModelConfig) -> list[int]:
        """Sublayer indices (1-based) after which a block ends; [] for no blocks."""
        return []

    def initial_gates(self, cfg: ModelConfig) -> list[float] | None:
        return None

    def routing_params(self, cfg: ModelConfig) -> int:
        return 0

    def added_flops(self, cfg: ModelConfig) -> int | None:
        return 0

    def adamw_names(self, router: nn.Module) -> set[str] | None:
        """The router's own parameter names AdamW takes; the rest by the usual rule (matrices to Muon).
        None: every parameter of the router."""
        return set()

    def diagnostic_axes(self, cfg: ModelConfig) -> dict[str, Any]:
        """Rows and columns of the recorded weights: `site_labels` (one per row; None: 1, 2, ...),
        `source_labels` (one per column; None: 0, 1, ...), `site_axis`, `source_axis`, `value` (what a cell is)
        and `embedding_column` (the embedding's column, for the `embedding` statistic of a softmax read)."""
        return {"site_labels": None, "source_labels": None, "site_axis": "read site j (feeds sublayer j + 1; 2L: the head)",
                "source_axis": "source (0 = embedding, then the later outputs or block summaries)",
                "value": "mean routing weight", "embedding_column": 0}

    def reference_flags(self, cfg: ModelConfig) -> dict[str, Any]:
        """The reference's routing flags for cfg ({} for its plain residual stream)."""
        raise NotExpressible(f"routing {self.name} is not part of the reference")

    def clipped_to(self, options: Any, size: SizeConfig) -> dict[str, Any]:
        """Option changes that make an entry build at a small `size` (tests' `fit_to_size`); {}: none needed."""
        return {}

    def code_paths(self, options: Any) -> list[str]:
        """Import paths of the user's code the entry names (trust.py: the registry's word that they may run)."""
        return []

    def training_control(self, router: nn.Module, flags: dict[str, Any]) -> TrainingControl | None:
        """What training does for this kind beyond the loss (the gated residual's gate hold), given the values of
        its `training_options` (default: its training_class built with them); None: nothing."""
        return None if self.training_class is None else self.training_class(router, **flags)

    def reference_weights(self, ref: dict[str, Any], cfg: ModelConfig, stack) -> tuple[str, dict[str, Any]]:
        """(suffix of the reference's output-projection weight names, its router weights under our names)."""
        return ".weight", {}
