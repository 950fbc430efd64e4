"""Frozen configuration records for a model: its size and its depth-routing ablation.

Importing this module needs no torch. A `ModelConfig` is one validated (size, ablation) pair. An `AblationConfig`
holds its routing kind (model/routing/kind.py: what defines one way of routing) and that
kind's typed options (`ablation.options`, a frozen dataclass the kind declares: model/options.py); model/routing/
kinds.py builds one from a registry entry (options nested under the kind, or flat) or a checkpoint's flat fields,
`to_dict` writes them back flat under their flat names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lrattn_lightning.core.errors import config_error
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.model.options import PositiveFloat, PositiveInt, check_fields

if TYPE_CHECKING:
    from lrattn_lightning.model.routing.kind import RoutingKind


@dataclass(frozen=True)
class SizeConfig:
    """Transformer core dimensions (docs/method.md §5)."""

    name: str
    doc: str
    n_layers: PositiveInt
    d_model: PositiveInt
    n_heads: PositiveInt
    d_mlp: PositiveInt
    vocab_size: PositiveInt
    seq_len: PositiveInt
    rope_theta: PositiveFloat = 500000.0
    init_std: PositiveFloat = 0.02

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    def validate(self) -> SizeConfig:
        where = f"sizes.{self.name}"
        check_fields(self, where, skip=("name", "doc"))
        if self.d_model % self.n_heads:
            raise config_error(where, "n_heads", f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise config_error(where, "n_heads", "the attention head size d_model/n_heads must be even for RoPE")
        return self


@dataclass(frozen=True)
class AblationConfig:
    """How the residual stream is replaced: one named, fully explicit depth-routing variant."""

    name: str
    doc: str
    control: str | None
    kind: RoutingKind = dataclasses.field(repr=False)  # `routing: NAME` (model/routing/kinds.py)
    options: Any  # the kind's options (kind.Options), e.g. AttnRes's key_source, rank, blocks, ...
    tags: tuple[str, ...] = ()

    @property
    def routing(self) -> str:
        return self.kind.name

    def validate(self) -> AblationConfig:
        """Checks that need no size. Size-dependent checks live in `ModelConfig.validate`."""
        where = f"ablations.{self.name}"
        if not isinstance(self.doc, str) or not self.doc.strip():
            raise config_error(where, "doc", f"must say in words what the entry tests, got {self.doc!r}")
        if self.control is not None and not isinstance(self.control, str):
            raise config_error(where, "control", f"must name one ablation or be null, got {self.control!r}")
        if self.control == self.name:
            raise config_error(where, "control", "an entry cannot be its own control; name the ablation it is "
                               "compared with, or null")
        if not isinstance(self.options, self.kind.Options):
            raise config_error(where, "options", f"routing {self.routing} takes {self.kind.Options.__name__}, got "
                               f"{type(self.options).__name__}")
        self.options.validate(where)
        return self

    def replace(self, **changes: Any) -> AblationConfig:
        """A validated copy with some fields changed: name, doc, control, tags, or the kind's options by their names
        (`rank`) or flat names (`laurel_rank`)."""
        own = {k: changes.pop(k) for k in list(changes) if k in ("name", "doc", "control", "tags")}
        names, labels = self.options.names(), {}
        by_flat = {self.options.flat(n): n for n in names}
        for key in list(changes):
            if key not in names and key in by_flat:
                changes[by_flat[key]] = changes.pop(key)
            if key in names or key in by_flat:
                labels[by_flat.get(key, key)] = key  # errors name an option as the change did (the others: flat)
            else:
                hint = ", ".join(closest_names(key, list(names), n=1))
                raise config_error(f"ablations.{self.name}", key, f"routing {self.routing} has no option {key!r}"
                                   f"{'; closest: ' + hint if hint else ''} (its options: {', '.join(names) or 'none'})")
        options = self.options
        if changes:
            options = type(options).written(options.nested() | changes, labels)
        return dataclasses.replace(self, options=options, **own).validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain values, the kind's options flat under their flat names (`laurel_rank`): what checkpoints, exports
        and MLflow params store, in the same form since before options nested in the registry."""
        return {"name": self.name, "doc": self.doc, "control": self.control, "routing": self.routing,
                **self.options.as_dict(), "tags": list(self.tags)}


@dataclass(frozen=True)
class ModelConfig:
    """A validated (size, ablation) pair: what the decoder is built from."""

    size: SizeConfig
    ablation: AblationConfig

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> RoutingKind:
        """The routing kind of the ablation (model/routing/kind.py)."""
        return self.ablation.kind

    @property
    def options(self) -> Any:
        """The routing kind's options (ablation.options)."""
        return self.ablation.options

    @property
    def extra_out(self) -> int:
        """Extra output rows of each sublayer's output projection (P-LR's key rows, the dynamic query's rows)."""
        return self.kind.extra_out(self)

    def block_ends(self) -> list[int]:
        """Sublayer indices (1-based) after which a block ends; [] for full routing (docs/method.md §2)."""
        return self.kind.block_ends(self)

    def validate(self) -> ModelConfig:
        self.kind.validate_model(self, f"ablations.{self.ablation.name} at size {self.size.name}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"size": dataclasses.asdict(self.size), "ablation": self.ablation.to_dict()}


def fit_to_size(ablation: AblationConfig, size: SizeConfig) -> AblationConfig:
    """A copy of `ablation` with what its kind clips (AttnRes: rank, block count) so it builds at `size`.

    For smoke tests of every registry entry at a tiny size only; the name records the change.
    Training never clips: a mismatched pair is an error there.
    """
    changes = ablation.options.clipped_to(size)
    if not changes:
        return ablation
    return ablation.replace(name=f"{ablation.name}@fit-{size.name}", **changes)
