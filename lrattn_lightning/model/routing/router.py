"""The router the decoder drives: `Router`, the base of every router (the config's routing kind builds one:
decoder.build_router).

A forward pass is `state = router.start(o_0)`, then for each sublayer i = 1..2L `h = router.read(state, i-1)`,
the sublayer computes o_i from RMSNorm(h), `router.write(state, i, o_i)`; finally `router.read(state, 2L)`.
Each router has its own state type (what one pass has written). The attention sublayers read through
`read_attention` and hand their new values to `mix_values`, whose defaults are `read` and no change.

Required (a router defines them): reset_parameters, start, write, read. Optional, each with a default that
leaves the pass as above (a router overrides what it uses):
    new_cache()                          a decoding cache kept across KV-cache passes   default None: none
    read_attention(state, j) -> (h_q, h_k, h_v)   separate inputs of the attention's queries, keys and values
        (each through the decoder's parameter-free pre-norm, then the same `qkv` weight's rows) at its read
        sites j = 0, 2, ..., 2L - 2 (MUDDFormer)                      default (h, h, h), h = read(state, j)
    mix_values(state, layer, v_BTHd) -> v   the new tokens' values [B, T, H, hd] of the attention of `layer`
        (0-based) become what it uses and caches: routing state beyond the residual stream (value residual
        learning keeps layer 0's values in `state`)                   default v unchanged
    recorded_weights(state)              what a recording pass's state kept (DecoderOutput.routing)
                                                                      default state.weights, None without it
An external router (routing/external.py) may be a plain nn.Module with only the required part: it is given these
defaults. Which kinds exist: kinds.py; how AttnRes is computed (`impl`): attnres/backends.py. Other kinds have
one implementation each and ignore `impl`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

REQUIRED = ("start", "read", "write", "reset_parameters")  # what a router defines (the rest has defaults)
OPTIONAL = ("new_cache", "read_attention", "mix_values", "recorded_weights")


class Router(nn.Module):
    """What the decoder calls; a router is an nn.Module holding its parameters (module docstring)."""

    def reset_parameters(self) -> None:
        raise NotImplementedError

    def start(
        self, emb_BTD: Tensor, *, record: bool = False, cache: Any = None, segments: Tensor | None = None
    ) -> Any:
        """Begin a pass at the embedding o_0 [B, T, D]; record: keep the routing weights (recorded_weights);
        cache: new_cache()'s object on KV-cache passes (None otherwise); segments: document masking's segment id
        per position [B, T] (None without it). Routing that is per token (residual, AttnRes) ignores it; the gated
        residual's running means restart at each document."""
        raise NotImplementedError

    def write(self, state: Any, i: int, out_BTE: Tensor) -> None:
        """Sublayer i's raw output ([B, T, D], or [B, T, D + extra rows] for P-LR / dynamic query)."""
        raise NotImplementedError

    def read(self, state: Any, j: int) -> Tensor:
        """The hidden state at read site j (0..2L) -> [B, T, D]."""
        raise NotImplementedError

    def new_cache(self) -> Any:
        """A cache for incremental decoding kept across passes (the decoder's KVCache holds it without looking
        inside), or None when the router needs none (the static KV cache serves only those)."""
        return None

    def read_attention(self, state: Any, j: int) -> tuple[Tensor, Tensor, Tensor]:
        """The inputs of the attention's queries, keys and values at read site j; one stream, the same tensor
        thrice (the decoder's fused projection), unless the router separates them."""
        h = self.read(state, j)
        return h, h, h

    def mix_values(self, state: Any, layer: int, v_BTHd: Tensor) -> Tensor:
        """What the attention of `layer` uses (and caches) as its new tokens' values [B, T, H, hd]."""
        return v_BTHd

    def recorded_weights(self, state: Any) -> list[Tensor] | None:
        """What a recording pass kept: every built-in state's `weights`; an external router's state may have none."""
        return getattr(state, "weights", None)
