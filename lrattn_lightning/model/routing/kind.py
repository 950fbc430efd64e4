"""The routing-kind protocol: what defines one way of routing across depth (model/routing/kinds.py lists the
built-in ones). A registry entry's `routing: NAME` names a kind; the model reads the entry through it:

    name, Options         its name and its options, a frozen dataclass (`KindOptions`, model/options.py: checked from
                          their annotations, `rules` for the rest; `clipped_to(size)` for tests at a tiny size): a
                          registry entry nests them under the kind's name (`laurel: {rank: 8}`), checkpoints and
                          MLflow params store them flat (`laurel_rank`)
    validate_model(cfg, where)     the checks of its options that need the size
    takes_impl            whether the AttnRes backends (`--model.impl`) apply; resolve_impl(cfg, impl, compiled) the
                          one resolution of `--model.impl` (AttnRes: its backends; the others: as given, unused)
    build(cfg, impl)      its router module (the Router protocol of router.py), impl as resolve_impl returned it
    extra_out, key_dim, block_ends   what the decoder and accounting read of its shape
    routing_params, added_flops      the analytic parameter count and forward FLOPs per token it adds
                                     (added_flops None: unknown, an external router that does not say)
    adamw_names(router)   its router's parameter names that AdamW takes under muon_adamw (None: all of them)
    code_paths(options)   the user's code it imports (an external router's class; trust.py: the registry's word)

Every member is stated by every kind: the class is abstract and kinds.py refuses a kind that leaves one out, so a
forgotten count is an error at import, never a 0. A kind with one implementation and none of AttnRes's keys or blocks
states those five members (takes_impl, resolve_impl, extra_out, key_dim, block_ends) by deriving from UnkeyedKind.
What one outer layer does with a kind lives in that layer, in a table keyed by the kind's name (docs/extending.md
lists them): its training-time controls (train/controls.py), its diagnostics' axes (train/routing_axes.py), its
traffic model (tools/bench/roofline.py), the paper's code's flags for it (tools/fidelity/interface.py), how an error
names what it owns (kinds.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lrattn_lightning.model.options import KindOptions

if TYPE_CHECKING:
    from torch import nn

    from lrattn_lightning.model.config import ModelConfig

ATTRIBUTES = ("name", "Options", "takes_impl")  # the class attributes every kind sets (kinds.py checks them)


@dataclass(frozen=True)
class NoOptions(KindOptions):
    """A kind without options."""


class RoutingKind(ABC):
    """One way of routing across depth: every member below is stated by the kind itself (module docstring)."""

    name: str
    Options: type[KindOptions]
    takes_impl: bool

    @abstractmethod
    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """The checks of its options that need the size (one line naming the option); a kind with none says so."""

    @abstractmethod
    def resolve_impl(self, cfg: ModelConfig, requested: str, compiled: bool = False) -> str:
        """The backend that runs for `--model.impl` (`requested`) in this kind, under torch.compile if `compiled`;
        a kind without backends (takes_impl False) returns it as given and ignores it."""

    @abstractmethod
    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        """Its router (router.py's protocol), `impl` as resolve_impl returned it."""

    @abstractmethod
    def extra_out(self, cfg: ModelConfig) -> int:
        """Extra output rows of each sublayer's output projection (beyond d)."""

    @abstractmethod
    def key_dim(self, cfg: ModelConfig) -> int:
        """The routing key width recorded as the `key_dim` param (0: no keys)."""

    @abstractmethod
    def block_ends(self, cfg: ModelConfig) -> list[int]:
        """Sublayer indices (1-based) after which a block ends; [] for no blocks."""

    @abstractmethod
    def routing_params(self, cfg: ModelConfig) -> int:
        """The parameters its routing adds, analytically (tests check it against the built router)."""

    @abstractmethod
    def added_flops(self, cfg: ModelConfig) -> int | None:
        """The forward FLOPs per token its routing adds over the core's (None: unknown)."""

    @abstractmethod
    def adamw_names(self, router: nn.Module) -> set[str] | None:
        """The router's own parameter names AdamW takes under muon_adamw; the rest by the usual rule (matrices to
        Muon). None: every parameter of the router."""

    @abstractmethod
    def code_paths(self, options: Any) -> list[str]:
        """Import paths of the user's code the entry names (trust.py: the registry's word that they may run)."""


class UnkeyedKind(RoutingKind):
    """A kind with one implementation (`--model.impl` is not read) and none of AttnRes's shape: each sublayer's output
    is d wide, no routing keys, no block summaries. A kind states these five members by deriving from it; what
    defines it (validate_model, build, routing_params, added_flops, adamw_names, code_paths) it states itself."""

    takes_impl = False

    def resolve_impl(self, cfg: ModelConfig, requested: str, compiled: bool = False) -> str:
        return requested  # one implementation: as given, unused

    def extra_out(self, cfg: ModelConfig) -> int:
        return 0

    def key_dim(self, cfg: ModelConfig) -> int:
        return 0

    def block_ends(self, cfg: ModelConfig) -> list[int]:
        return []


def missing_members(kind: RoutingKind) -> list[str]:
    """The members `kind` leaves unstated: class attributes it never sets, abstract methods it never defines."""
    unset = [name for name in ATTRIBUTES if not hasattr(kind, name)]
    return unset + sorted(getattr(type(kind), "__abstractmethods__", ()))
