"""The router protocol the decoder drives, and `build_router`: the config's routing kind builds it.

A forward pass is `state = router.start(o_0)`, then for each sublayer i = 1..2L `h = router.read(state, i-1)`,
the sublayer computes o_i from RMSNorm(h), `router.write(state, i, o_i)`; finally `router.read(state, 2L)`.
Each router has its own state type (what one pass has written) and, for KV-cache decoding, may keep its own
cache object across passes (`new_cache`; the decoder's KVCache holds it without looking inside).

Two optional extensions (a router that has neither method is driven exactly as above; an own router may use them):
    read_attention(state, j) -> (h_q, h_k, h_v)   the attention sublayer j + 1 takes separate inputs for its
        queries, keys and values (each through the decoder's parameter-free pre-norm, then the same `qkv`
        weight's rows); used instead of `read` at the attention's read sites j = 0, 2, ..., 2L - 2 (MUDDFormer)
    mix_values(state, layer, v_BTHd) -> v         the attention of `layer` (0-based) hands the router its new
        tokens' values [B, T, H, hd] and uses (and caches) what it returns: routing state beyond the residual
        stream (value residual learning keeps layer 0's values in `state`) Which kinds
exist: kinds.py; how AttnRes is computed (`impl`): attnres/backends.py. Other kinds have one implementation
each and ignore `impl`.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL, resolve_impl


class Router(Protocol):
    """What the decoder calls (every router is also an nn.Module holding its parameters)."""

    def reset_parameters(self) -> None: ...

    def new_cache(self) -> Any:
        """A cache for incremental decoding kept across passes, or None when the router needs none."""

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: Any = None,
              segments: Tensor | None = None) -> Any:
        """Begin a pass at the embedding o_0 [B, T, D]; record: keep the routing weights (state.weights);
        segments: document masking's segment id per position [B, T] (None without it). Routing that is per
        token (residual, AttnRes) ignores it; the gated residual's running means restart at each document."""

    def write(self, state: Any, i: int, out_BTE: Tensor) -> None:
        """Sublayer i's raw output ([B, T, D], or [B, T, D + extra rows] for P-LR / dynamic query)."""

    def read(self, state: Any, j: int) -> Tensor:
        """The hidden state at read site j (0..2L) -> [B, T, D]."""

    # optional (module docstring): read_attention(state, j) -> (h_q, h_k, h_v); mix_values(state, layer, v) -> v


def build_router(cfg: ModelConfig, impl: str = DEFAULT_IMPL) -> nn.Module:
    """The router of `cfg`'s routing kind; for AttnRes computed by backend `impl` (attnres/backends.py)."""
    resolve_impl(impl)  # an unknown name is one line, whatever the kind
    return cfg.kind.build(cfg, impl)
