"""The AttnRes routing kind (`routing: attnres`): its options, their checks, accounting and backends (docs/method.md §2-4).

    read  = sum_{j=1..2L} |S_j| (2 k + 2 d)      added forward FLOPs per token; k = d for AttnRes, r for LR
    proj  = KeySource.flops()                    forming the keys (keys.py): P-LR's key rows, value_projected's
          + 2 L r (d + h) + 2L 2r                gated dynamic query: the query rows, the gating
Elementwise work per source is outside docs/method.md §4's count, as the key norm is: block_summary rms adds about
2L 4 d of it (RMS(o_i): squares 2d, scaling d; the normalised running sum d), 0.03 % of paper-0.5b's core.
Parameters: the 2L pseudo-queries, what the key source declares (KeySource.num_params: with key_gain MHAR's
gains, 2L r), the dynamic query's rows and gates. depth_head_norm full costs what the per-head norm does,
and key_gain none per token (gamma_j q_j is formed once per step). AdamW takes the pseudo-queries, query
gates and key gains ([2L, r], [2L, m], [2L, r]: one vector per site, not a matrix to orthogonalise). The
paper's code's flags and weight names: tools/fidelity/interface.py.
"""

from __future__ import annotations

import math

from torch import nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.attnres import backends
from lrattn_lightning.model.routing.attnres.keys import key_source
from lrattn_lightning.model.routing.attnres.options import AttnResOptions, key_dim
from lrattn_lightning.model.routing.kind import RoutingKind


class AttnResKind(RoutingKind):
    name = "attnres"
    Options = AttnResOptions
    takes_impl = True

    # ---- configuration ---------------------------------------------------------------------------
    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        s, a = cfg.size, cfg.options
        d, m = s.d_model, s.n_sublayers
        if a.rank is not None and a.rank > d:
            raise a.error(where, "rank", f"rank={a.rank} exceeds d_model={d}; choose rank <= {d}")
        if d % a.depth_heads:
            raise a.error(where, "depth_heads", f"d_model={d} is not divisible by depth_heads={a.depth_heads}")
        if a.blocks is not None and a.blocks > m:
            raise a.error(where, "blocks", f"blocks={a.blocks} exceeds the {m} sublayers (2L); choose blocks <= {m}")
        if a.block_size is not None and a.block_size > m:
            raise a.error(where, "block_size", f"block_size={a.block_size} exceeds the {m} sublayers (2L)")

    def extra_out(self, cfg: ModelConfig) -> int:
        """r key rows (P-LR), then r query rows (gated dynamic query)."""
        a = cfg.options
        return (a.rank if a.key_source == "projected" else 0) + (a.rank if a.query == "gated_dynamic" else 0)

    def key_dim(self, cfg: ModelConfig) -> int:
        return key_dim(cfg)

    def block_ends(self, cfg: ModelConfig) -> list[int]:
        a, m = cfg.options, cfg.size.n_sublayers
        if a.blocks is not None:
            return [math.ceil(m * b / a.blocks) for b in range(1, a.blocks + 1)]
        if a.block_size is not None:
            return [min(e, m) for e in range(a.block_size, m + a.block_size, a.block_size)]
        return []

    # ---- the router ------------------------------------------------------------------------------
    def resolve_impl(self, cfg: ModelConfig, requested: str, compiled: bool = False) -> str:
        """The one resolution of `--model.impl` (backends.resolve_impl): `auto` takes `compiled` for per-token
        queries (`fast` has no write-time logits for them), else `fast`; `fast` named for them is one line."""
        return backends.resolve_impl(requested, compiled, per_token_queries=cfg.options.query == "gated_dynamic")

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        """By backend (backends.py, `impl` as resolve_impl returned it): how AttnRes is computed, never what."""
        return backends.router_class(impl)(cfg)

    def adamw_names(self, router: nn.Module) -> set[str]:
        return {n for n, _ in router.named_parameters() if n in ("queries", "query_gates", "key_gain")}

    # ---- accounting ------------------------------------------------------------------------------
    def routing_params(self, cfg: ModelConfig) -> int:
        s, a = cfg.size, cfg.options
        r = key_dim(cfg)
        n = s.n_sublayers * r + key_source(cfg).num_params()  # the pseudo-queries, one per site j = 1..2L; the keys'
        if a.query == "gated_dynamic":
            n += s.n_layers * r * (s.d_model + s.d_mlp) + s.n_sublayers * a.depth_heads  # the query rows, the gates
        return n

    def added_flops(self, cfg: ModelConfig) -> int:
        from lrattn_lightning.model.accounting import sources_per_site
        s, a = cfg.size, cfg.options
        r, d = key_dim(cfg), s.d_model
        read = sum(sources_per_site(cfg)) * (2 * r + 2 * d)
        proj = key_source(cfg).flops()
        if a.query == "gated_dynamic":
            proj += 2 * s.n_layers * r * (d + s.d_mlp) + s.n_sublayers * 2 * r  # the query rows; q_j + g_j q_dyn
        return read + proj

    def code_paths(self, options: AttnResOptions) -> list[str]:
        return []


KIND = AttnResKind()
