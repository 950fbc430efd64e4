"""The AttnRes routing kind (`routing: attnres`, KIND in attnres.py): its fields' checks, accounting,
backends, optimiser split and the paper's code's flags (SPEC §2-4).

    read  = sum_{j=1..2L} |S_j| (2 k + 2 d)      added forward FLOPs per token; k = d for AttnRes, r for LR
    proj  = KeySource.flops()                    forming the keys (keys.py): P-LR's key rows, value_projected's
          + 2 L r (d + h) + 2L 2r                gated dynamic query: the query rows, the gating
Parameters: the 2L pseudo-queries, what the key source declares (KeySource.num_params), the dynamic
query's rows and gates. AdamW takes the pseudo-queries and query gates ([2L, r] and [2L, m]: one vector per
site, not a matrix to orthogonalise).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from lrattn_lightning.model.config import (
    _ATTNRES_FIELDS,
    _EMBEDDING_KEYS_FOR,
    BlockSummary,
    EmbeddingKey,
    KeyNorm,
    KeySource,
    LogitScaleName,
    ModelConfig,
    QueryInit,
    QueryKind,
    _check_literal,
    _finite_number,
    config_error,
)
from lrattn_lightning.model.routing.kinds import NotExpressible, RoutingKind

# Our key source / embedding key -> the reference flag that selects it (set to True).
KEY_SOURCE_FLAGS = {"sliced": "lrid_key_from_output_tail", "value_projected": "lrid_key_from_value",
                    "value_projected_shared": "lrid_key_from_value_shared"}
EMBEDDING_KEY_FLAGS = {"static": "lrid_static_embedding_key", "projected_plus_static": "lrid_add_static_embedding_key"}


class AttnResKind(RoutingKind):
    name = "attnres"
    fields = _ATTNRES_FIELDS
    owner_phrase = "only AttnRes routing (routing: attnres) reads it"
    diagnostics = "depth_weights"
    takes_impl = True
    depth_attention = True

    # ---- configuration ---------------------------------------------------------------------------
    def validate(self, a, where: str) -> None:
        for field, literal in (("key_source", KeySource), ("key_norm", KeyNorm), ("query_init", QueryInit),
                               ("block_summary", BlockSummary), ("embedding_key", EmbeddingKey), ("query", QueryKind)):
            _check_literal(where, field, getattr(a, field), literal)
        if not isinstance(a.query_norm, bool):
            raise config_error(where, "query_norm", f"must be true or false, got {a.query_norm!r}")
        if isinstance(a.logit_scale, str):
            _check_literal(where, "logit_scale", a.logit_scale, LogitScaleName)
        elif not _finite_number(a.logit_scale) or a.logit_scale <= 0:
            raise config_error(where, "logit_scale", f"must be 'none', 'inv_sqrt_head_dim' or a positive number, "
                               f"got {a.logit_scale!r}")
        for field in ("rank", "blocks", "block_size"):
            value = getattr(a, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise config_error(where, field, f"must be a positive integer or null, got {value!r}")
        if isinstance(a.depth_heads, bool) or not isinstance(a.depth_heads, int) or a.depth_heads < 1:
            raise config_error(where, "depth_heads", f"must be a positive integer, got {a.depth_heads!r}")
        if not _finite_number(a.count_prior):
            raise config_error(where, "count_prior", f"must be a finite number, got {a.count_prior!r}")
        if a.blocks is not None and a.block_size is not None:
            raise config_error(where, "blocks", "give either 'blocks' (a count) or 'block_size' (sublayers per block), not both")
        if a.key_source == "value":
            if a.rank is not None:
                raise config_error(where, "rank", "key_source 'value' uses the full width d as key; leave rank null")
            if a.logit_scale != "none":
                raise config_error(where, "logit_scale", f"standard AttnRes (key_source 'value') has no logit scale "
                                   f"(s = 1, SPEC §2), got {a.logit_scale!r}; set logit_scale: none")
            if a.query != "static":
                raise config_error(where, "query", "the gated dynamic query needs low-rank keys; use key_source "
                                   "projected, sliced or value_projected, or set query: static")
        elif a.rank is None:
            raise config_error(where, "rank", f"key_source '{a.key_source}' needs a rank r")
        if a.rank is not None and a.rank % a.depth_heads:
            raise config_error(where, "rank", f"rank={a.rank} is not divisible by depth_heads={a.depth_heads}")
        allowed = _EMBEDDING_KEYS_FOR[a.key_source]
        if a.embedding_key not in allowed:
            raise config_error(where, "embedding_key", f"key_source '{a.key_source}' needs embedding_key in "
                               f"{list(allowed)}, got '{a.embedding_key}'")

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        s, a = cfg.size, cfg.ablation
        d, m = s.d_model, s.n_sublayers
        if a.rank is not None and a.rank > d:
            raise config_error(where, "rank", f"rank={a.rank} exceeds d_model={d}; choose rank <= {d}")
        if d % a.depth_heads:
            raise config_error(where, "depth_heads", f"d_model={d} is not divisible by depth_heads={a.depth_heads}")
        if a.blocks is not None and a.blocks > m:
            raise config_error(where, "blocks", f"blocks={a.blocks} exceeds the {m} sublayers (2L); choose blocks <= {m}")
        if a.block_size is not None and a.block_size > m:
            raise config_error(where, "block_size", f"block_size={a.block_size} exceeds the {m} sublayers (2L)")

    def extra_out(self, cfg: ModelConfig) -> int:
        """r key rows (P-LR), then r query rows (gated dynamic query)."""
        a = cfg.ablation
        return (a.rank if a.key_source == "projected" else 0) + (a.rank if a.query == "gated_dynamic" else 0)

    def key_dim(self, cfg: ModelConfig) -> int:
        return cfg.key_dim

    def block_ends(self, cfg: ModelConfig) -> list[int]:
        a, m = cfg.ablation, cfg.size.n_sublayers
        if a.blocks is not None:
            return [math.ceil(m * b / a.blocks) for b in range(1, a.blocks + 1)]
        if a.block_size is not None:
            return [min(e, m) for e in range(a.block_size, m + a.block_size, a.block_size)]
        return []

    # ---- the router ------------------------------------------------------------------------------
    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        """By backend: how AttnRes is computed, never what (base.py)."""
        from lrattn_lightning.model.routing.base import ATTNRES_BACKENDS

        if impl == "fast" and cfg.ablation.query == "gated_dynamic":
            impl = "compiled"  # per-token queries: no write-time logits, the premise of the buffered backend
        if impl == "triton":
            from lrattn_lightning.model.routing.attnres_triton import TritonAttnRes

            return TritonAttnRes(cfg)
        return ATTNRES_BACKENDS[impl](cfg)

    def adamw_names(self, router: nn.Module) -> set[str]:
        return {n for n, _ in router.named_parameters() if n in ("queries", "query_gates")}

    # ---- accounting ------------------------------------------------------------------------------
    def routing_params(self, cfg: ModelConfig) -> int:
        from lrattn_lightning.model.routing.keys import key_source

        s, a = cfg.size, cfg.ablation
        r = cfg.key_dim
        n = s.n_sublayers * r + key_source(cfg).num_params()  # the pseudo-queries, one per site j = 1..2L; the keys'
        if a.query == "gated_dynamic":
            n += s.n_layers * r * (s.d_model + s.d_mlp) + s.n_sublayers * a.depth_heads  # the query rows, the gates
        return n

    def added_flops(self, cfg: ModelConfig) -> int:
        from lrattn_lightning.model.accounting import sources_per_site
        from lrattn_lightning.model.routing.keys import key_source

        s, a = cfg.size, cfg.ablation
        r, d = cfg.key_dim, s.d_model
        read = sum(sources_per_site(cfg)) * (2 * r + 2 * d)
        proj = key_source(cfg).flops()
        if a.query == "gated_dynamic":
            proj += 2 * s.n_layers * r * (d + s.d_mlp) + s.n_sublayers * 2 * r  # the query rows; q_j + g_j q_dyn
        return read + proj

    # ---- the paper's code ------------------------------------------------------------------------
    def reference_flags(self, cfg: ModelConfig) -> dict[str, Any]:
        a = cfg.ablation
        flags: dict[str, Any] = {"use_attnres": True, "attnres_key_norm": a.key_norm == "rms",
                                 "attn_res_query_norm": a.query_norm, "attn_res_query_init": a.query_init}
        flags.update(self._block_flags(cfg))
        if a.key_source == "value":
            return flags
        flags.update(use_lrid=True, lrid_rank=a.rank, lrid_num_heads=a.depth_heads)
        if a.logit_scale == "none":
            flags["lrid_use_logit_scale"] = False
        elif a.logit_scale == "inv_sqrt_head_dim":
            flags["lrid_use_logit_scale"] = True
        else:
            flags.update(lrid_use_logit_scale=True, lrid_logit_scale=float(a.logit_scale))
        for flag in (KEY_SOURCE_FLAGS.get(a.key_source), EMBEDDING_KEY_FLAGS.get(a.embedding_key)):
            if flag is not None:
                flags[flag] = True
        if a.query == "gated_dynamic":
            flags["lrid_input_dependent_query"] = True
        return flags

    @staticmethod
    def _block_flags(cfg: ModelConfig) -> dict[str, Any]:
        a, m = cfg.ablation, cfg.size.n_sublayers
        ends = cfg.block_ends()
        if not ends:
            return {"attnres_type": "full"}
        n = len(ends)
        if [math.ceil(m * b / n) for b in range(1, n + 1)] != ends:
            raise NotExpressible(f"block ends {ends} are not the reference's ceil(2L b / N) layout for any N")
        flags: dict[str, Any] = {"attnres_type": "block", "attnres_num_blocks": n}
        if a.block_summary == "sum":
            flags["attnres_block_average"] = False
        else:
            flags.update(attnres_block_average=True,
                         attnres_block_average_mode="count" if a.block_summary == "mean" else "sqrt")
        if a.count_prior in (0.0, 1.0):
            flags["attnres_block_count_prior"] = a.count_prior == 1.0
        else:
            flags.update(attnres_block_count_prior=True, attnres_block_beta=float(a.count_prior))
        return flags

    def reference_weights(self, ref: dict[str, Any], cfg: ModelConfig, stack) -> tuple[str, dict[str, Any]]:
        """The reference's router weights under our names; LR keys wrap its output projections (`.proj`)."""
        a, L = cfg.ablation, cfg.size.n_layers
        J, out = 2 * L, {}
        if a.key_source == "value":
            out["router.queries"] = stack([ref[f"transformer.attn_residuals.{j}.query"] for j in range(J)])
            return ".weight", out
        out["router.queries"] = stack([ref[f"transformer.lrid_queries.{j}"].reshape(-1) for j in range(J)])
        if a.query == "gated_dynamic":
            out["router.query_gates"] = stack([ref[f"transformer.lrid_query_gates.{j}"] for j in range(J)])
        emb_projected = a.embedding_key in ("projected", "projected_plus_static")
        if a.embedding_key in ("static", "projected_plus_static"):
            out["router.embedding_key_static"] = ref["transformer.lrid_static_embedding_key.key"]
        embedding_proj = "transformer.lrid_embedding_key.proj.weight"
        if a.key_source == "projected" and emb_projected:
            out["router.embedding_key_proj.weight"] = ref[embedding_proj]
        elif a.key_source == "value_projected_shared" or (a.key_source == "value_projected" and emb_projected):
            out["router.value_key_proj.0.weight"] = ref[embedding_proj]  # the shared projection, or the embedding's own
        if a.key_source == "value_projected":
            first = 0 if emb_projected else 1
            for layer in range(L):
                for i, part in ((2 * layer + 1, "attn.c_proj"), (2 * layer + 2, "mlp.fc2")):
                    out[f"router.value_key_proj.{i - first}.weight"] = ref[
                        f"transformer.layers.{layer}.{part}.value_key_proj.weight"]
        return ".proj.weight", out
