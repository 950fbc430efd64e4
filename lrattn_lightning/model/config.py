"""Frozen configuration records for a model: its size and its depth-routing ablation.

Importing this module needs no torch. `registry.py` builds these from `registry.yaml`; everything else
(decoder, accounting, training) reads them. A `ModelConfig` is one validated (size, ablation) pair.
Validation and everything that depends on the routing kind ask that kind (`AblationConfig.kind`,
model/routing/kinds.py), whose module is imported then.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lrattn_lightning.errors import InputError

# `routing` names a routing kind: model/routing/NAME.py holds everything about it (model/routing/kinds.py);
# the built-in kinds are residual, attnres, gated and external (a user's class named by `router`).
# Where a source's routing key comes from (SPEC §3):
#   value                  the value itself (standard AttnRes, k = d)
#   projected              P-LR: extra r output rows of each sublayer's output projection
#   sliced                 S-LR: the last r dimensions of the value
#   value_projected        Linear(d, r) of RMSNorm(value), one projection per sublayer
#   value_projected_shared the same with one projection shared by all sources
KeySource = Literal["value", "projected", "sliced", "value_projected", "value_projected_shared"]
# Key of the embedding source o_0:
#   value | sliced          as the key source says (required for those key sources)
#   projected               Linear(d, r)(o_0)
#   static                  a learned r-vector, independent of the token
#   projected_plus_static   the sum of both
EmbeddingKey = Literal["value", "sliced", "projected", "static", "projected_plus_static"]
BlockSummary = Literal["sum", "mean", "sqrt_mean"]
KeyNorm = Literal["rms", "none"]
QueryInit = Literal["zero", "normal"]
LogitScaleName = Literal["none", "inv_sqrt_head_dim"]
# The pseudo-query of a read site (SPEC §3):
#   static          a learned vector q_j per site (the paper's recipe)
#   gated_dynamic   q_j + g_j * q_dyn: q_dyn is emitted as r extra output rows by the most recent
#                   sublayer (the one just written before site j), g_j a zero-initialised gate per
#                   depth head (the reference's input-dependent query; documented there as unstable)
QueryKind = Literal["static", "gated_dynamic"]
# The gated residual's learned per-sublayer gate bias b_i (SPEC §7, docs/gated-residual.md):
#   g_i = sigmoid(<W_q cummean(x), W_k cummean(F(x))> / sqrt(d) + b_i), with b_i initialised to logit(alpha0_i)
#   none          no bias parameter: alpha starts at sigmoid(~0) = 0.5 everywhere (the blog seed's formula)
#   constant      every sublayer starts at alpha0 = gate_alpha
#   last_layer    the last layer's two sublayers start at gate_alpha, the others at 0.5 (b = 0)
#   running_mean  sublayer i starts at alpha0_i = i / (i + 1) (b_i = log i): the stream starts as the mean
#                 of the embedding and the i outputs, i.e. the plain residual stream / (i + 1)
GateBias = Literal["none", "constant", "last_layer", "running_mean"]

# How AttnRes is computed (a runtime choice, never part of the architecture: model/routing/base.py)
IMPLS = ("fast", "reference", "compiled")  # run on any machine
ALL_IMPLS = (*IMPLS, "triton")  # triton: CUDA or TRITON_INTERPRET=1 (attnres_triton.py)

SUMMARY_EXPONENT = {"sum": 0.0, "mean": 1.0, "sqrt_mean": 0.5}
_EMBEDDING_KEYS_FOR = {
    "value": ("value",),
    "sliced": ("sliced",),
    "projected": ("projected", "static", "projected_plus_static"),
    "value_projected": ("projected", "static", "projected_plus_static"),
    "value_projected_shared": ("projected", "static", "projected_plus_static"),
}


_ATTNRES_FIELDS = ("key_source", "rank", "depth_heads", "key_norm", "query_norm", "query_init", "query",
                   "logit_scale", "blocks", "block_size", "block_summary", "count_prior", "embedding_key")


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def config_error(entry: str, field: str, message: str) -> InputError:
    """The one error format for bad configuration: the entry, the field, what is wrong and the fix."""
    return InputError(f"{entry}: field '{field}': {message}")


@dataclass(frozen=True)
class SizeConfig:
    """Transformer core dimensions (SPEC §5)."""

    name: str
    doc: str
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 500000.0
    init_std: float = 0.02

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    def validate(self) -> SizeConfig:
        where = f"sizes.{self.name}"
        for field in ("n_layers", "d_model", "n_heads", "d_mlp", "vocab_size", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise config_error(where, field, f"must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise config_error(where, "n_heads", f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise config_error(where, "n_heads", "the attention head size d_model/n_heads must be even for RoPE")
        for field in ("rope_theta", "init_std"):
            value = getattr(self, field)
            if not _finite_number(value) or value <= 0:
                raise config_error(where, field, f"must be a positive number, got {value!r}")
        return self


@dataclass(frozen=True)
class AblationConfig:
    """How the residual stream is replaced: one named, fully explicit depth-routing variant."""

    name: str
    doc: str
    control: str | None
    routing: str = "residual"
    key_source: KeySource = "value"
    rank: int | None = None  # key width r; None means d (only for key_source=value)
    depth_heads: int = 1  # m
    key_norm: KeyNorm = "rms"
    query_norm: bool = False
    query_init: QueryInit = "zero"
    query: QueryKind = "static"
    logit_scale: float | LogitScaleName = "none"
    blocks: int | None = None  # block count N; None with block_size None means full routing
    block_size: int | None = None  # sublayers per block, the alternative to `blocks`
    block_summary: BlockSummary = "sum"
    count_prior: float = 0.0  # beta in b = beta * log(count)
    embedding_key: EmbeddingKey = "value"
    gate_bias: GateBias = "none"  # routing gated only
    gate_alpha: float | None = None  # alpha0 of gate_bias constant / last_layer
    router: str | None = None  # routing external: "package.module:Class", imported when the model is built
    router_options: dict[str, Any] | None = None  # routing external: keyword arguments of that class
    # the options a routing kind declares in its own module (RoutingKind.options: name -> default), e.g.
    # `dilation` of denseformer; the registry writes them as plain fields, read as attributes (a.dilation)
    options: dict[str, Any] | None = None
    tags: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields: the kind's options
        if not name.startswith("__"):
            options = self.__dict__.get("options") or {}
            if name in options:
                return options[name]
        raise AttributeError(f"{type(self).__name__} has no field or option {name!r}")

    @property
    def is_block(self) -> bool:
        return self.blocks is not None or self.block_size is not None

    @property
    def summary_exponent(self) -> float:
        return SUMMARY_EXPONENT[self.block_summary]

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
        from lrattn_lightning.model.routing.kinds import check_foreign_fields, kind_of

        kind = kind_of(self.routing, where)
        check_foreign_fields(self, kind, where)  # a field of another kind would be silently ignored
        if self.options is not None:
            if not isinstance(self.options, dict):
                raise config_error(where, "options", f"must be a mapping of the kind's options, got {self.options!r}")
            for option in self.options:
                if option not in kind.options:
                    raise config_error(where, option, f"routing {kind.name} has no option {option!r}; its options: "
                                       f"{', '.join(kind.options) or 'none'}")
        kind.validate(self, where)
        return self

    @property
    def kind(self):
        """The routing kind (model/routing/kinds.py): everything about `routing` lives there."""
        from lrattn_lightning.model.routing.kinds import kind_of

        return kind_of(self.routing, f"ablations.{self.name}")


@dataclass(frozen=True)
class ModelConfig:
    """A validated (size, ablation) pair: what the decoder is built from."""

    size: SizeConfig
    ablation: AblationConfig

    def __post_init__(self) -> None:
        self.validate()

    @property
    def key_dim(self) -> int:
        """r: the routing key width (d for key_source=value)."""
        a = self.ablation
        return self.size.d_model if a.rank is None else a.rank

    @property
    def kind(self):
        """The routing kind of the ablation (model/routing/kinds.py)."""
        return self.ablation.kind

    @property
    def extra_out(self) -> int:
        """Extra output rows of each sublayer's output projection (P-LR's key rows, the dynamic query's rows)."""
        return self.kind.extra_out(self)

    @property
    def logit_scale(self) -> float:
        s = self.ablation.logit_scale
        if s == "none":
            return 1.0
        if s == "inv_sqrt_head_dim":
            return 1.0 / math.sqrt(self.key_dim // self.ablation.depth_heads)
        return float(s)

    def block_ends(self) -> list[int]:
        """Sublayer indices (1-based) after which a block ends; [] for full routing (SPEC §2)."""
        return self.kind.block_ends(self)

    def validate(self) -> ModelConfig:
        self.kind.validate_model(self, f"ablations.{self.ablation.name} at size {self.size.name}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"size": dataclasses.asdict(self.size), "ablation": dataclasses.asdict(self.ablation)}

    @staticmethod
    def with_defaults(data: dict[str, Any]) -> dict[str, Any]:
        """A stored to_dict() with the fields it predates filled in with their defaults (older checkpoints)."""
        out = {}
        for part, cls in (("size", SizeConfig), ("ablation", AblationConfig)):
            defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
            out[part] = {**defaults, **data[part]}
        return out

    @staticmethod
    def from_dict(data: dict[str, Any], where: str = "model_config") -> ModelConfig:
        """A stored to_dict() (a checkpoint's, an exported config.json's), checked as strictly as a registry entry:
        an unknown, missing or mistyped field is one line naming `where`, the part and the field."""
        if not isinstance(data, dict) or not all(isinstance(data.get(p), dict) for p in ("size", "ablation")):
            raise InputError(f"{where}: must hold the mappings 'size' and 'ablation', got {type(data).__name__}")
        parts: dict[str, Any] = {}
        for part, cls in (("size", SizeConfig), ("ablation", AblationConfig)):
            fields = {f.name: f for f in dataclasses.fields(cls)}
            given = dict(data[part])
            unknown = sorted(str(k) for k in given if k not in fields)
            if unknown:
                raise config_error(f"{where}.{part}", unknown[0], "unknown field: not written by this version of "
                                   "lrattn_lightning (an edited or foreign file); remove it or use the lrattn that wrote it")
            missing = [n for n, f in fields.items() if n not in given and f.default is dataclasses.MISSING]
            if missing:
                raise config_error(f"{where}.{part}", missing[0], "required field is missing")
            if part == "ablation":
                given["tags"] = tuple(given.get("tags") or ())
            parts[part] = given
        try:
            return ModelConfig(SizeConfig(**parts["size"]).validate(), AblationConfig(**parts["ablation"]).validate())
        except InputError as err:
            raise InputError(f"{where}: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as err:  # a value of the wrong type
            raise InputError(f"{where}: not a valid model config ({type(err).__name__}: {err})") from None


def fit_to_size(ablation: AblationConfig, size: SizeConfig) -> AblationConfig:
    """A copy of `ablation` with rank and block count clipped so it builds at `size`.

    For smoke tests of every registry entry at a tiny size only; the name records the change.
    Training never clips: a mismatched pair is an error there.
    """
    changes: dict[str, Any] = {}
    if ablation.rank is not None and ablation.rank > size.d_model:
        changes["rank"] = size.d_model
    if ablation.blocks is not None and ablation.blocks > size.n_sublayers:
        changes["blocks"] = size.n_sublayers
    if ablation.block_size is not None and ablation.block_size > size.n_sublayers:
        changes["block_size"] = size.n_sublayers
    if not changes:
        return ablation
    return dataclasses.replace(ablation, name=f"{ablation.name}@fit-{size.name}", **changes)


def _check_literal(where: str, field: str, value: Any, literal: Any) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise config_error(where, field, f"{value!r} is not one of {list(choices)}")
