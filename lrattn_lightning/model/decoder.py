"""The decoder: embedding -> L x (attention, MLP) with pluggable depth routing -> final norm -> head.

docs/method.md §5: pre-norm, parameter-free RMSNorm, multi-head attention with QK-norm and interleaved RoPE,
SwiGLU MLP, no biases, untied head, N(0, 0.02) init. What normally is `h = h + sublayer(norm(h))`
becomes `router.write(i, sublayer(norm(router.read(i-1))))`; with `routing: residual` it is exactly
the standard residual stream.

    config      ModelConfig (model/config.py): the size and the ablation, whose routing kind builds the router
    Layer       attention sublayer 2i+1 and MLP sublayer 2i+2, each reading from the router and writing to it
    Decoder     the embedding, the layers and their router (routing/router.py), the head; KV-cache decoding
The token attention, its masks (document masking) and KV caches: attention.py; RoPE: rope.py.

Shape legend: B batch, T tokens, D = d_model, H heads, hd = D / H.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.attention import (
    ATTENTIONS,
    AttentionPass,
    CausalSelfAttention,
    KVCache,
    StaticKVCache,
    attention_pass,
    ready_flex_outside,
)
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig
from lrattn_lightning.model.routing._math import rms_norm
from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL
from lrattn_lightning.model.routing.attnres.backends import check_impl
from lrattn_lightning.model.routing.router import Router


class SwiGLU(nn.Module):
    def __init__(self, size: SizeConfig, extra_out: int):
        super().__init__()
        self.fc1 = nn.Linear(size.d_model, 2 * size.d_mlp, bias=False)
        self.fc2 = nn.Linear(size.d_mlp, size.d_model + extra_out, bias=False)  # h -> d + r for P-LR

    def forward(self, x_BTD: Tensor) -> Tensor:
        x, gate = self.fc1(x_BTD).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * x)


class Layer(nn.Module):
    def __init__(self, size: SizeConfig, extra_out: int):
        super().__init__()
        self.attn = CausalSelfAttention(size, extra_out)
        self.mlp = SwiGLU(size, extra_out)

    def forward(self, router: Router, state: Any, i: int, attention: AttentionPass) -> None:
        """Layer i's two sublayers, 2i+1 and 2i+2, each reading from the router through the pre-norm and writing
        its output to the router."""
        h_q, h_k, h_v = router.read_attention(state, 2 * i)  # one stream, h_q = h_k = h_v, but for MUDDFormer
        router.write(state, 2 * i + 1, self.attn(*pre_norm(h_q, h_k, h_v), attention, i))
        router.write(state, 2 * i + 2, self.mlp(rms_norm(router.read(state, 2 * i + 1))))


def pre_norm(h_q: Tensor, h_k: Tensor, h_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The parameter-free pre-norm of the attention's inputs, once per distinct stream (one stream stays one
    tensor, which the attention projects fused)."""
    x_q = rms_norm(h_q)
    return x_q, x_q if h_k is h_q else rms_norm(h_k), x_q if h_v is h_q else rms_norm(h_v)


@dataclass
class DecoderOutput:
    logits: Tensor  # [B, T, vocab]
    routing: list[Tensor] | None  # per read site j = 1..2L: alpha [S_j, B, T, M] (attnres only)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, impl: str = DEFAULT_IMPL, attention: str = "sdpa", compiled: bool = False):
        """impl: the AttnRes backend, `auto`, `fast`, `reference`, `compiled` or `triton` (routing/attnres/backends.py):
        how routing is computed, not what; the same parameters and results. Residual and gated routing ignore it.
        The kind resolves it once (`self.impl`: the backend that runs; compiled: the one torch.compile traces).
        attention: how document masking reaches the token attention, `sdpa` or `flex` (attention.py)."""
        super().__init__()
        if attention not in ATTENTIONS:
            raise InputError(f"attention must be one of {list(ATTENTIONS)}, got {attention!r}")
        self.attention = attention
        if attention == "flex":
            ready_flex_outside()
        check_impl(impl)  # an unknown name is one line, whatever the kind
        self.cfg, self.impl = cfg, cfg.kind.resolve_impl(cfg, impl, compiled)
        size = cfg.size
        self.embed = nn.Embedding(size.vocab_size, size.d_model)
        self.layers = nn.ModuleList(Layer(size, cfg.extra_out) for _ in range(size.n_layers))
        self.router = cfg.kind.build(cfg, self.impl)
        self.head = nn.Linear(size.d_model, size.vocab_size, bias=False)
        # document masking: the separator (EOS) id, or None to attend across documents (set by the
        # training recipe, stored in checkpoints); not part of the architecture, which has no weights for it
        self.doc_separator: int | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.size.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        self.router.reset_parameters()

    def forward(
        self,
        idx: Tensor,
        *,
        return_routing: bool = False,
        cache: KVCache | StaticKVCache | None = None,
        head: bool = True,
    ) -> Tensor | DecoderOutput:
        """idx [B, T] int64 -> logits [B, T, vocab] (a DecoderOutput when return_routing).

        With a KVCache, idx holds only the new tokens; they are placed after the cached ones. A StaticKVCache
        (model/generate.py) is read and written in place at its position tensor, which the pass advances; it
        traces into one graph whatever the position (the caller checks the window). head=False: the head's
        input instead, the final read normalised [B, T, D] (a loss that applies the head itself:
        train/losses.py head_token_losses).
        """
        self._check_window(idx, cache)
        attention, segments = attention_pass(idx, cache, self.cfg.size, self.doc_separator, self.attention)
        x = self.embed(idx)  # (B, T, D)
        routing_cache = self._routing_cache(cache)
        state = self.router.start(x, record=return_routing, cache=routing_cache, segments=segments)
        attention.mix_values = functools.partial(self.router.mix_values, state)  # (value residual learning)
        for i, layer in enumerate(self.layers):
            layer(self.router, state, i, attention)
        if isinstance(cache, StaticKVCache):
            cache.advance(idx.shape[1])
        h = rms_norm(self.router.read(state, self.cfg.size.n_sublayers))  # the final read, normalised
        logits = self.head(h) if head else h
        return DecoderOutput(logits, self.router.recorded_weights(state)) if return_routing else logits

    def _check_window(self, idx: Tensor, cache: KVCache | StaticKVCache | None) -> None:
        """A pass past seq_len (the dynamic cache's length read on the host), or a static cache for a router that
        keeps its own decoding cache, is one line."""
        size = self.cfg.size
        if isinstance(cache, StaticKVCache):
            if self.router.new_cache() is not None:
                raise InputError(
                    f"routing '{self.cfg.ablation.routing}' keeps a decoding cache of its own; "
                    "the static KV cache serves routers without one (use the dynamic cache)"
                )
        elif (start := 0 if cache is None else cache.length) + idx.shape[1] > size.seq_len:
            raise InputError(
                f"sequence of {start + idx.shape[1]} tokens exceeds seq_len={size.seq_len} of size "
                f"'{size.name}'"
            )

    def _routing_cache(self, cache: KVCache | StaticKVCache | None) -> Any:
        """The router's own decoding cache, kept in the KVCache (made on its first pass); None without a cache and
        with the static one (its routers keep none)."""
        if cache is None or isinstance(cache, StaticKVCache):
            return None
        if cache.routing is None:
            cache.routing = self.router.new_cache()
        return cache.routing


def build_decoder(
    size: SizeConfig | ModelConfig,
    ablation: AblationConfig | None = None,
    *,
    impl: str = DEFAULT_IMPL,
    attention: str = "sdpa",
    compiled: bool = False,
) -> Decoder:
    """Build the decoder for a (size, ablation) pair; works under `torch.device("meta")`.

    impl (the AttnRes backend) and attention (document masking's path) are runtime choices, not part of the
    architecture: the same parameters and results; compiled: the backend torch.compile traces (the kind's choice).
    """
    cfg = size if isinstance(size, ModelConfig) else ModelConfig(size, ablation)
    return Decoder(cfg, impl, attention, compiled)


def build_router(cfg: ModelConfig, impl: str = DEFAULT_IMPL) -> Router:
    """The router of `cfg`'s routing kind; for AttnRes computed by backend `impl` (attnres/backends.py) as the kind
    resolves it."""
    check_impl(impl)  # an unknown name is one line, whatever the kind
    return cfg.kind.build(cfg, cfg.kind.resolve_impl(cfg, impl))
