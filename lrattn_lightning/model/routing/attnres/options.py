"""AttnRes's options (docs/method.md §2-3): what a registry entry with `routing: attnres` chooses, checked, and the two
numbers derived from them that every backend reads (the key width r and the logit scale s)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lrattn_lightning.model.options import FiniteFloat, KindOptions, PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from lrattn_lightning.model.config import ModelConfig, SizeConfig

# Where a source's routing key comes from (docs/method.md §3):
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
# A completed block's summary value over its c outputs o_i:
#   sum | mean | sqrt_mean   (sum_i o_i) / c^a, a = 0, 1, 1/2
#   rms                      sum_i RMS(o_i) (RMS Block AttnRes, summary.py); the partial block stays the raw sum
BlockSummary = Literal["sum", "mean", "sqrt_mean", "rms"]
KeyNorm = Literal["rms", "none"]
# What one RMSNorm of a key spans with depth heads m > 1 (m = 1: the same):
#   per_head  each head's r/m slice on its own (the paper's code)
#   full      the whole r-wide key once per source (MHAR, hyper-connection-factory's depth_attention.py)
DepthHeadNorm = Literal["per_head", "full"]
QueryInit = Literal["zero", "normal"]
LogitScaleName = Literal["none", "inv_sqrt_head_dim"]
# The pseudo-query of a read site (docs/method.md §3):
#   static          a learned vector q_j per site (the paper's recipe)
#   gated_dynamic   q_j + g_j * q_dyn: q_dyn is emitted as r extra output rows by the most recent
#                   sublayer (the one just written before site j), g_j a zero-initialised gate per
#                   depth head (the reference's input-dependent query; documented there as unstable)
QueryKind = Literal["static", "gated_dynamic"]
SUMMARY_EXPONENT = {"sum": 0.0, "mean": 1.0, "sqrt_mean": 0.5, "rms": 0.0}  # rms: of the raw partial block
_EMBEDDING_KEYS_FOR = {
    "value": ("value",),
    "sliced": ("sliced",),
    "projected": ("projected", "static", "projected_plus_static"),
    "value_projected": ("projected", "static", "projected_plus_static"),
    "value_projected_shared": ("projected", "static", "projected_plus_static"),
}




@dataclass(frozen=True)
class AttnResOptions(KindOptions):
    """What an AttnRes entry chooses (docs/method.md §2-3): `attnres: {key_source: sliced, rank: 64, ...}` in the registry."""

    key_source: KeySource = "value"
    rank: PositiveInt | None = None  # key width r; None means d (only for key_source=value)
    depth_heads: PositiveInt = 1  # m
    depth_head_norm: DepthHeadNorm = "per_head"
    key_norm: KeyNorm = "rms"
    key_gain: bool = False  # a learned gain gamma_j (init 1) on site j's normalised keys: <q_j, gamma_j * k>
    query_norm: bool = False
    query_init: QueryInit = "zero"
    query: QueryKind = "static"
    logit_scale: PositiveFloat | LogitScaleName = "none"
    blocks: PositiveInt | None = None  # block count N; None with block_size None means full routing
    block_size: PositiveInt | None = None  # sublayers per block, the alternative to `blocks`
    block_summary: BlockSummary = "sum"
    count_prior: FiniteFloat = 0.0  # beta in b = beta * log(count)
    embedding_key: EmbeddingKey = "value"

    @property
    def is_block(self) -> bool:
        return self.blocks is not None or self.block_size is not None

    @property
    def summary_exponent(self) -> float:
        return SUMMARY_EXPONENT[self.block_summary]

    @property
    def norm_groups(self) -> int:
        """The slices of a key that the key norm normalises separately."""
        return self.depth_heads if self.depth_head_norm == "per_head" else 1

    def clipped_to(self, size: SizeConfig) -> dict[str, int]:
        """rank and the block counts clipped to what `size` has."""
        changes = {"rank": size.d_model} if self.rank is not None and self.rank > size.d_model else {}
        for field in ("blocks", "block_size"):
            if getattr(self, field) is not None and getattr(self, field) > size.n_sublayers:
                changes[field] = size.n_sublayers
        return changes

    def rules(self, where: str) -> None:
        a = self
        if a.blocks is not None and a.block_size is not None:
            raise a.error(where, "blocks", "give either 'blocks' (a count) or 'block_size' (sublayers per block), not both")
        if a.block_summary == "rms" and not a.is_block:
            raise a.error(where, "block_summary", "'rms' normalises the outputs of completed blocks: give blocks "
                          "or block_size, or use block_summary sum for full routing")
        if a.key_norm == "none":
            for field, value, default in (("depth_head_norm", "full", "per_head"), ("key_gain", True, "false")):
                if getattr(a, field) == value:
                    raise a.error(where, field, f"{str(value).lower()} shapes the key norm, but key_norm is none; "
                                  f"set key_norm: rms or {field}: {default}")
        if a.key_source == "value":
            if a.rank is not None:
                raise a.error(where, "rank", "key_source 'value' uses the full width d as key; leave rank null")
            if a.logit_scale != "none":
                raise a.error(where, "logit_scale", f"standard AttnRes (key_source 'value') has no logit scale "
                              f"(s = 1, docs/method.md §2), got {a.logit_scale!r}; set logit_scale: none")
            if a.query != "static":
                raise a.error(where, "query", "the gated dynamic query needs low-rank keys; use key_source "
                              "projected, sliced or value_projected, or set query: static")
        elif a.rank is None:
            raise a.error(where, "rank", f"key_source '{a.key_source}' needs a rank r")
        if a.rank is not None and a.rank % a.depth_heads:
            raise a.error(where, "rank", f"rank={a.rank} is not divisible by depth_heads={a.depth_heads}")
        allowed = _EMBEDDING_KEYS_FOR[a.key_source]
        if a.embedding_key not in allowed:
            raise a.error(where, "embedding_key", f"key_source '{a.key_source}' needs embedding_key in "
                          f"{list(allowed)}, got '{a.embedding_key}'")


def key_dim(cfg: ModelConfig) -> int:
    """r: the routing key width (d for key_source=value)."""
    rank = cfg.options.rank
    return cfg.size.d_model if rank is None else rank


def logit_scale(cfg: ModelConfig) -> float:
    """s of the logits s <q_j, k_i> (docs/method.md §3)."""
    s = cfg.options.logit_scale
    if s == "none":
        return 1.0
    if s == "inv_sqrt_head_dim":
        return 1.0 / math.sqrt(key_dim(cfg) // cfg.options.depth_heads)
    return float(s)
