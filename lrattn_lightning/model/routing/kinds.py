"""Routing kinds: everything one way of routing across depth is, in one object per kind.

A registry entry's `routing: NAME` names a kind. Kind NAME lives in `lrattn_lightning/model/routing/NAME.py`,
which defines `KIND = SomeKind()` (a `RoutingKind`); nothing else in the package names a kind. Adding a
built-in kind is that module plus registry entries. A kind states:

    fields                AblationConfig fields only it reads (set on another kind: one-line error)
    options               options it declares itself (name -> default): a registry entry writes them as
                          fields, AblationConfig keeps them in `options` (all of them, defaults filled in)
    training_options      the LightningModule's flags only it reads (`--model.gate_freeze_steps` ...)
    validate(a, where)    checks of its fields that need no size; validate_model(cfg, where) the rest
    build(cfg, impl)      its router module (the Router protocol of base.py)
    extra_out, key_dim, block_ends, initial_gates   what the decoder and accounting read from it
    routing_params, added_flops    the analytic parameter count and forward FLOPs per token it adds
                                   (added_flops None: unknown)
    adamw_names(router)   its router's parameter names that AdamW takes under muon_adamw (None: all of them)
    diagnostics           what `state.weights` hold when a pass records, one tensor [S, B, T, m] per row of
                          the heatmap (S sources; B, T, m may be 1): "depth_weights" (a softmax over sources per
                          read site: entropy, top-1 ... apply), "gates" (the gated residual's [alpha, 1 - alpha]
                          per sublayer), "mixing" (any real mixing weights: DenseFormer's alpha, the
                          hyper-connections' coefficients, an own router's), or None (nothing recorded)
    diagnostic_axes(cfg)  what the rows and columns of those weights are: labels and axis titles of
                          routing/weights.json and the heatmaps (train/diagnostics.py)
    user_code             whether it imports the user's code (an own router): a sweep imports it before its runs
    takes_impl            whether the AttnRes backends (`--model.impl`) apply
    depth_attention       softmax attention over depth sources: the roofline's traffic model applies
    reference_flags(cfg)  the paper's code's flags for it (NotExpressible where it has none) and
    reference_weights(ref, cfg)    the reference's router weights under our names

Kinds are found by module name, so `kind_of` imports only the kind asked for; `known_kinds` reads the
folder's file names and their `KIND =` line without importing them.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lrattn_lightning.errors import InputError

if TYPE_CHECKING:
    from torch import nn

    from lrattn_lightning.model.config import AblationConfig, ModelConfig

_FOLDER = Path(__file__).resolve().parent
_KIND_LINE = re.compile(r"^KIND = ", re.MULTILINE)


class NotExpressible(InputError):
    """The entry has no equivalent in the reference's flags (said why)."""


class RoutingKind:
    """The defaults: a kind with no parameters, no extra output rows, no diagnostics, unknown to the reference."""

    name = ""
    fields: tuple[str, ...] = ()
    options: dict[str, Any] = {}  # its own options (name -> default), stored in AblationConfig.options
    training_options: tuple[str, ...] = ()
    owner_phrase = ""  # how an error says a foreign field belongs here, e.g. "only AttnRes routing (...) reads it"
    diagnostics: str | None = None
    user_code = False
    takes_impl = False
    depth_attention = False

    def validate(self, a: AblationConfig, where: str) -> None:
        """Checks of this kind's fields that need no size (the defaults of the others are checked already)."""

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """Checks that need the size."""

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

    def reference_weights(self, ref: dict[str, Any], cfg: ModelConfig, stack) -> tuple[str, dict[str, Any]]:
        """(suffix of the reference's output-projection weight names, its router weights under our names)."""
        return ".weight", {}


def _module_name(name: str) -> str:
    return f"lrattn_lightning.model.routing.{name}"


@cache
def known_kinds() -> tuple[str, ...]:
    """The kinds of this folder: modules with a `KIND = ` line (read as text, not imported)."""
    return tuple(sorted(p.stem for p in _FOLDER.glob("*.py")
                        if not p.stem.startswith("_") and _KIND_LINE.search(p.read_text(encoding="utf-8"))))


def kind_of(name: Any, where: str = "ablation") -> RoutingKind:
    """The kind `routing: name` names; unknown names list the closest ones."""
    if not isinstance(name, str) or name not in known_kinds():
        from lrattn_lightning.model.registry import closest_names

        hint = ", ".join(closest_names(str(name), list(known_kinds())))
        raise InputError(f"{where}: field 'routing': unknown routing kind {name!r}; closest: {hint} (all: "
                         f"{', '.join(known_kinds())})")
    return _load(name)


@cache
def _load(name: str) -> RoutingKind:
    kind = importlib.import_module(_module_name(name)).KIND
    if kind.name != name:
        raise InputError(f"routing kind module {name}.py defines KIND named {kind.name!r}")
    return kind


def field_owner(field: str) -> RoutingKind | None:
    """The kind that owns AblationConfig field `field` (None: a field every kind has)."""
    return next((k for k in map(_load, known_kinds()) if field in k.fields), None)


def check_foreign_fields(a: AblationConfig, kind: RoutingKind, where: str) -> None:
    """A field another kind owns, set on this entry, would be silently ignored: one line instead."""
    from lrattn_lightning.model.config import config_error

    for f in dataclasses.fields(a):
        if f.name in kind.fields or getattr(a, f.name) == f.default:
            continue
        owner = field_owner(f.name)
        if owner is not None:
            default = "null" if f.default is None else repr(f.default)
            raise config_error(where, f.name, f"{owner.owner_phrase}; routing is '{a.routing}': remove it (over an "
                               f"`extends`, reset it to {default})")


def check_training_options(cfg: ModelConfig, given: dict[str, bool]) -> None:
    """Module flags (`--model.NAME`) set for a kind that does not read them: one line."""
    kind = cfg.kind
    for option, is_set in given.items():
        if is_set and option not in kind.training_options:
            owner = next((k for k in map(_load, known_kinds()) if option in k.training_options), None)
            phrase = owner.owner_phrase if owner is not None else "no routing kind reads it"
            raise InputError(f"model.{option}: {phrase}; ablation '{cfg.ablation.name}' has routing "
                             f"'{cfg.ablation.routing}'")
