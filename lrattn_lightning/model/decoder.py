"""The decoder: embedding -> L x (attention, MLP) with pluggable depth routing -> final norm -> head.

docs/method.md §5: pre-norm, parameter-free RMSNorm, multi-head attention with QK-norm and interleaved RoPE,
SwiGLU MLP, no biases, untied head, N(0, 0.02) init. What normally is `h = h + sublayer(norm(h))`
becomes `router.write(i, sublayer(norm(router.read(i-1))))`; with `routing: residual` it is exactly
the standard residual stream.

Document masking (the paper's recipe, `use_doc_masking`): with `Decoder.doc_separator` set to the
tokenizer's EOS id, a token attends only to earlier tokens of its own document. As in the paper's
code, every separator token starts a new segment (so it belongs to the document after it) and RoPE
positions run over the whole packed window. Training, validation, evaluation and KV-cache decoding all
go through this forward, so all mask alike. AttnRes depth routing is per token and needs no mask; the
gated residual's running means restart at every document (the router gets the segment ids).

How the document mask reaches the token attention is a runtime choice (`Decoder.attention`, the module's
`--model.attention`), never what is computed:
    sdpa  a dense boolean [B, 1, T, T] mask to SDPA (any device; on a GPU it keeps SDPA off its flash
          kernel: O(T^2) memory per head)
    flex  FlexAttention with a block mask built from the segment ids (torch.nn.attention.flex_attention):
          blocks that cross documents are skipped; compiled on CUDA, the unfused reference on CPU, which has
          no FlexAttention backward (training with flex needs CUDA)
Windows of one document per row, and KV-cache decoding (a few new tokens), take the causal / dense SDPA path
under both.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig
from lrattn_lightning.model.routing._math import rms_norm
from lrattn_lightning.model.routing.attnres import DEFAULT_IMPL
from lrattn_lightning.model.routing.router import build_router

ATTENTIONS = ("sdpa", "flex")  # how document masking's mask reaches the attention (module docstring)


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [T, head_dim/2] (float32) for interleaved-pair RoPE.

    Computed in float32 exactly as the paper's code builds its tables, inv_freq_i = 1 / theta^(2i/hd)
    and angle = position * inv_freq, so a float64 model rotates by the same (float32-rounded) angles.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device) / head_dim  # float32
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def positions_rope(start: int, length: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """rope_tables of positions start..start+length-1. Compiled, through the opaque op `lrattn::rope_tables`: traced
    inline, Inductor fused the angles' cos and sin into every rotation that reads them, computing them again for
    every element of every layer forward and backward (140 ms of a 1.6 s step at `small` on an AVX2 CPU); as an op
    they are computed once a forward, with the same code."""
    if torch.compiler.is_compiling():
        return _rope_tables_op(start, length, head_dim, theta, device)
    return _positions_tables(start, length, head_dim, theta, device)


def _positions_tables(start: int, length: int, head_dim: int, theta: float, device: torch.device
                      ) -> tuple[Tensor, Tensor]:
    return rope_tables(*rope_angles(torch.arange(start, start + length, device=device), head_dim, theta))


_rope_tables_op = torch.library.custom_op("lrattn::rope_tables", _positions_tables, mutates_args=())


@_rope_tables_op.register_fake
def _(start, length, head_dim, theta, device):
    return torch.empty(length, head_dim, device=device), torch.empty(length, head_dim, device=device)


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The [T, head_dim/2] tables of rope_angles laid out per element [T, head_dim]: cos_i repeated for both
    members of pair i, and sin_i signed (-sin_i for the pair's first member, +sin_i for its second)."""
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def apply_rope(x_BTHd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles, in promote_types(dtype, float32).

    x: [B, T, ..., hd]; cos, sin: rope_angles' [T, hd/2] tables or rope_tables' [T, hd] ones (the decoder builds
    those once per forward). As x * cos + swap(x) * sin with swap exchanging each pair's members: the same
    products and sums, bit for bit, as (x0 cos - x1 sin, x0 sin + x1 cos), in three elementwise kernels and one
    copy instead of seven.
    """
    cdtype = torch.promote_types(x_BTHd.dtype, torch.float32)
    shape = (1, cos.shape[0]) + (1,) * (x_BTHd.dim() - 3) + (-1,)  # the tables broadcast over batch and heads
    if torch.compiler.is_compiling():  # Inductor fuses the pair form better (a compiled step 0.89x the swap form's)
        if cos.shape[-1] == x_BTHd.shape[-1]:
            cos, sin = cos[..., ::2], sin[..., 1::2]
        x0, x1 = x_BTHd.to(cdtype).unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos.to(cdtype).view(shape), sin.to(cdtype).view(shape)
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x_BTHd.dtype)
    if 2 * cos.shape[-1] == x_BTHd.shape[-1]:
        cos, sin = rope_tables(cos, sin)
    x = x_BTHd.to(cdtype)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    cos, sin = cos.to(cdtype).view(shape), sin.to(cdtype).view(shape)
    return (x * cos + swapped * sin).to(x_BTHd.dtype)


@dataclass
class KVCache:
    """Per-layer keys and values of the token attention, for incremental decoding.

    Depth routing is per token, so mostly only the token attention needs a cache: the routing of a new
    token reads that token's own sublayer outputs, which the forward pass recomputes. A router that
    needs more (the gated residual's causal means) keeps its own cache object in `routing`.
    """

    keys: list[Tensor | None]
    values: list[Tensor | None]
    # the router's own decoding cache (`router.new_cache()`, created on the first pass), opaque here
    routing: Any = None
    # document masking: the segment id of every cached position [B, T_cached]
    segments: Tensor | None = None

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls([None] * n_layers, [None] * n_layers)

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]


class StaticKVCache:
    """KV cache of fixed shape for a compiled / CUDA-graph decode step (model/generate.py, `cache="static"`).

    keys, values: per layer [B, H, max_len, hd], preallocated and written in place at the current positions;
    `position` a long tensor [1] (not a Python int, so one compiled graph serves every step, and a CUDA graph
    replays with it) advanced in place by each forward. The attention reads the whole buffer under `mask(T)`,
    [B or 1, 1, T, max_len] bool (valid, causal and, with document masking, same document), so no shape changes
    from step to step. Only for routers that keep no decoding state of their own (`new_cache()` None): depth
    routing is per token. Every tensor is marked a static address, so a CUDA graph writes into it in place.
    """

    def __init__(self, n_layers: int, batch: int, n_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (batch, n_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.segments = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # document masking
        self.routing = None
        self.max_len = max_len
        if not torch.compiler.is_compiling():
            for t in (*self.keys, *self.values, self.position, self.segments):
                torch._dynamo.mark_static_address(t)

    @classmethod
    def for_model(cls, model: Decoder, batch: int, device: torch.device | str, dtype: torch.dtype) -> StaticKVCache:
        size = model.cfg.size
        return cls(size.n_layers, batch, size.n_heads, size.seq_len, size.d_model // size.n_heads, device, dtype)

    def reset(self) -> None:
        """Forget every position (the buffers' old contents stay, masked out)."""
        self.position.zero_()

    def positions(self, t_new: int) -> Tensor:
        return self.position + torch.arange(t_new, device=self.position.device)  # (T,)

    def update(self, layer: int, k_BHTd: Tensor, v_BHTd: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new tokens' keys and values at their positions; -> the whole buffers [B, H, max_len, hd]."""
        at = self.positions(k_BHTd.shape[2])
        self.keys[layer].index_copy_(2, at, k_BHTd.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, at, v_BHTd.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]

    def mask(self, t_new: int, seg_BT: Tensor | None = None) -> Tensor:
        """[1, 1, T, max_len] (or [B, 1, T, max_len] with segment ids): new token i sees cached positions up to
        its own, and (document masking) only those of its own segment."""
        keys_at = torch.arange(self.max_len, device=self.position.device)
        mask = (keys_at[None, :] <= self.positions(t_new)[:, None])[None, None]
        if seg_BT is None:
            return mask
        return mask & (seg_BT[:, :, None] == self.segments[:, None, :]).unsqueeze(1)

    def write_segments(self, idx_BT: Tensor, separator: int) -> Tensor:
        """Document masking: the new positions' segment ids [B, T], continuing the cached ones, stored in place."""
        last = self.segments.index_select(1, (self.position - 1).clamp(min=0)) * (self.position > 0)  # (B, 1)
        seg = (idx_BT == separator).cumsum(dim=1) + last
        self.segments.index_copy_(1, self.positions(idx_BT.shape[1]), seg)
        return seg

    def advance(self, t_new: int) -> None:
        self.position.add_(t_new)


class CausalSelfAttention(nn.Module):
    def __init__(self, size: SizeConfig, extra_out: int):
        super().__init__()
        self.n_heads = size.n_heads
        self.head_dim = size.d_model // size.n_heads
        self.qkv = nn.Linear(size.d_model, 3 * size.d_model, bias=False)
        self.proj = nn.Linear(size.d_model, size.d_model + extra_out, bias=False)  # d -> d + r for P-LR

    def forward(self, x_BTD: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, layer: int = 0,
                same_doc: Any = None, *, kv_inputs: tuple[Tensor, Tensor] | None = None,
                values: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """same_doc: [B, 1, T, T_all] bool, which positions share a document (document masking), a FlexAttention
        BlockMask of the same (`attention: flex`), or None. A router's extensions (routing/router.py):
        kv_inputs, the (normed) inputs of the keys and values when they differ from the queries' x_BTD (the
        same `qkv` weight, its key and value rows applied to them); values, what the new tokens' values
        [B, T, H, hd] become before the cache stores them and the attention uses them."""
        B, T, D = x_BTD.shape
        if kv_inputs is None:
            qkv = self.qkv(x_BTD).view(B, T, 3, self.n_heads, self.head_dim)
            # QK-norm then RoPE, on q and k together (B, T, 2, H, hd): the same rows, half the kernels
            q, k = apply_rope(rms_norm(qkv[:, :, :2]), cos, sin).unbind(2)  # (B, T, H, hd)
            v = qkv[:, :, 2]
        else:
            w_q, w_k, w_v = self.qkv.weight.chunk(3, dim=0)
            q, k, v = (F.linear(x, w).view(B, T, self.n_heads, self.head_dim)
                       for x, w in zip((x_BTD, *kv_inputs), (w_q, w_k, w_v), strict=True))
            q, k = apply_rope(rms_norm(q), cos, sin), apply_rope(rms_norm(k), cos, sin)  # QK-norm then RoPE
        if values is not None:
            v = values(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        if isinstance(cache, StaticKVCache):  # written in place; same_doc is the cache's mask (Decoder.forward)
            k, v = cache.update(layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc)
            return self.proj(y.transpose(1, 2).reshape(B, T, D))
        if cache is not None:
            past = cache.keys[layer]
            if past is not None:
                k = torch.cat((past, k), dim=2)
                v = torch.cat((cache.values[layer], v), dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        if cache is None and same_doc is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif not isinstance(same_doc, Tensor | None):  # a BlockMask (causal and same document)
            y = _flex_attention(q, k, v, same_doc)
        else:
            mask = _prefix_causal_mask(T, k.shape[2], q.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if same_doc is None else mask & same_doc)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


_COMPILED_FLEX: list[Any] = []


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    """FlexAttention: on CUDA through one torch.compile of flex_attention (its fused kernel), on CPU the unfused
    reference (no warning per call). Inside a compiled region (--model.compile true) the call is its own
    frame (`_flex_outside`): traced inline, Dynamo (torch 2.13) drops the routers' state mutations that
    follow it (a dataclass attribute set after a flex_attention call keeps its old value: wrong results,
    silently; tests/model/test_doc_masking.py), so it costs a graph break per attention instead."""
    if torch.compiler.is_compiling():
        return _flex_outside(q, k, v, block_mask)
    return _flex_eager(q, k, v, block_mask)


def _flex_eager(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cuda":
        if not _COMPILED_FLEX:
            _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
        return _COMPILED_FLEX[0](q, k, v, block_mask=block_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask)


_FLEX_OUTSIDE: list[Callable[..., Tensor]] = []


def ready_flex_outside() -> None:
    """Make _flex_eager's Dynamo-disabled twin (not traced into the caller's graph; what it calls, the compiled
    flex_attention on CUDA, still compiles). Made by a Decoder with `attention: flex`, outside any trace, and not at
    import: torch.compiler.disable imports Dynamo, ~1 s for every command that never uses it."""
    if not _FLEX_OUTSIDE:
        _FLEX_OUTSIDE.append(torch.compiler.disable(_flex_eager, recursive=False))


def _flex_outside(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    return _FLEX_OUTSIDE[0](q, k, v, block_mask)


def document_block_mask(seg_BT: Tensor) -> Any:
    """FlexAttention's block mask of document masking: query i sees key t <= i of its own segment."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = seg_BT.shape

    def same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (seg_BT[b, q_idx] == seg_BT[b, kv_idx])

    return create_block_mask(same_document, B, None, T, T, device=seg_BT.device,
                             _compile=seg_BT.device.type == "cuda" and not torch.compiler.is_compiling())


def _prefix_causal_mask(t_new: int, t_all: int, device: torch.device) -> Tensor:
    """Boolean mask letting new token i (at absolute position t_all - t_new + i) see positions <= its own."""
    q_pos = torch.arange(t_all - t_new, t_all, device=device)[:, None]
    return torch.arange(t_all, device=device)[None, :] <= q_pos


def document_segments(idx_BT: Tensor, separator: int, before: Tensor | None = None) -> Tensor:
    """Segment id per position [B, T]: every separator starts a new segment (the paper's boundaries).

    before: the segment ids of earlier (cached) positions [B, T_cached], continued from their last id.
    """
    seg = (idx_BT == separator).cumsum(dim=1)
    if before is not None and before.shape[1]:
        seg = seg + before[:, -1:]
    return seg


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


@dataclass
class DecoderOutput:
    logits: Tensor  # [B, T, vocab]
    routing: list[Tensor] | None  # per read site j = 1..2L: alpha [S_j, B, T, M] (attnres only)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, impl: str = DEFAULT_IMPL, attention: str = "sdpa"):
        """impl: the AttnRes backend, `fast`, `reference`, `compiled` or `triton` (routing/attnres/backends.py): how routing
        is computed, not what; the same parameters and results. Residual and gated routing ignore it.
        attention: how document masking reaches the token attention, `sdpa` or `flex` (module docstring)."""
        super().__init__()
        if attention not in ATTENTIONS:
            raise InputError(f"attention must be one of {list(ATTENTIONS)}, got {attention!r}")
        self.attention = attention
        if attention == "flex":
            ready_flex_outside()
        self.cfg, self.impl = cfg, impl
        size = cfg.size
        self.embed = nn.Embedding(size.vocab_size, size.d_model)
        self.layers = nn.ModuleList(Layer(size, cfg.extra_out) for _ in range(size.n_layers))
        self.router = build_router(cfg, impl)
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
        self, idx: Tensor, *, return_routing: bool = False, cache: KVCache | StaticKVCache | None = None,
        head: bool = True
    ) -> Tensor | DecoderOutput:
        """idx [B, T] int64 -> logits [B, T, vocab] (a DecoderOutput when return_routing).

        With a KVCache, idx holds only the new tokens; they are placed after the cached ones. head=False: the
        head's input instead, the final read normalised [B, T, D] (a loss that applies the head itself:
        train/losses.py head_token_losses).
        """
        if isinstance(cache, StaticKVCache):
            return self._forward_static(idx, cache, return_routing, head)
        B, T = idx.shape
        size = self.cfg.size
        start = 0 if cache is None else cache.length
        if start + T > size.seq_len:
            raise InputError(f"sequence of {start + T} tokens exceeds seq_len={size.seq_len} of size '{size.name}'")
        cos, sin = positions_rope(start, T, size.d_model // size.n_heads, size.rope_theta, idx.device)
        same_doc, segments = self._documents(idx, cache)
        x = self.embed(idx)  # (B, T, D)
        routing_cache = None
        if cache is not None:
            if cache.routing is None and callable(new_cache := getattr(self.router, "new_cache", None)):
                cache.routing = new_cache()  # (optional for an external router: None, it needs no cache)
            routing_cache = cache.routing
        state = self.router.start(x, record=return_routing, cache=routing_cache, segments=segments)
        state = self._layers(state, cos, sin, cache, same_doc)
        return self._finish(state, return_routing, head)

    def _layers(self, state: Any, cos: Tensor, sin: Tensor, cache: Any, same_doc: Any) -> Any:
        read_attention = getattr(self.router, "read_attention", None)  # the protocol's optional extensions
        mix_values = getattr(self.router, "mix_values", None)
        for layer_index, layer in enumerate(self.layers):
            j = 2 * layer_index
            kv_inputs, values = None, None
            if read_attention is None:
                x = rms_norm(self.router.read(state, j))
            else:
                h_q, h_k, h_v = read_attention(state, j)
                x = rms_norm(h_q)
                if h_k is not h_q or h_v is not h_q:  # (one stream for all three: the fused projection)
                    kv_inputs = (rms_norm(h_k), rms_norm(h_v))
            if mix_values is not None:
                values = functools.partial(mix_values, state, layer_index)
            self.router.write(state, j + 1, layer.attn(x, cos, sin, cache, layer_index, same_doc,
                                                       kv_inputs=kv_inputs, values=values))
            h = self.router.read(state, j + 1)
            self.router.write(state, j + 2, layer.mlp(rms_norm(h)))
        return state

    def _finish(self, state: Any, return_routing: bool, head: bool) -> Tensor | DecoderOutput:
        h = self.router.read(state, self.cfg.size.n_sublayers)  # the final read
        logits = self.head(rms_norm(h)) if head else rms_norm(h)
        if return_routing:
            return DecoderOutput(logits, getattr(state, "weights", None))  # (an external router may keep none)
        return logits

    def _forward_static(self, idx: Tensor, cache: StaticKVCache, return_routing: bool, head: bool
                        ) -> Tensor | DecoderOutput:
        """forward with a StaticKVCache: no host read of the position (the caller checks the window), RoPE from
        the position tensor, the cache's mask over its whole buffer, the position advanced in place. Traces
        into one graph whatever the position (model/generate.py compiles it)."""
        T = idx.shape[1]
        size = self.cfg.size
        if callable(new_cache := getattr(self.router, "new_cache", None)) and new_cache() is not None:
            raise InputError(f"routing '{self.cfg.ablation.routing}' keeps a decoding cache of its own; "
                             "the static KV cache serves routers without one (use the dynamic cache)")
        cos, sin = rope_tables(*rope_angles(cache.positions(T), size.d_model // size.n_heads, size.rope_theta))
        segments = None if self.doc_separator is None else cache.write_segments(idx, self.doc_separator)
        same_doc = cache.mask(T, segments)
        x = self.embed(idx)  # (B, T, D)
        state = self.router.start(x, record=return_routing, cache=None, segments=segments)
        state = self._layers(state, cos, sin, cache, same_doc)
        cache.advance(T)
        return self._finish(state, return_routing, head)

    def _documents(self, idx: Tensor, cache: KVCache | None) -> tuple[Any, Tensor | None]:
        """Document masking: the attention mask [B, 1, T, T_all] bool or, with `attention: flex` and no cache,
        its FlexAttention BlockMask (None where every position shares one document) and the new positions' segment ids [B, T]; (None, None) without document masking."""
        if self.doc_separator is None:
            return None, None
        before = cache.segments if cache is not None else None
        seg = document_segments(idx, self.doc_separator, before)
        seg_all = seg if before is None else torch.cat((before, seg), dim=1)
        if cache is not None:
            cache.segments = seg_all
        # one document per row: the causal mask suffices (a data-dependent shortcut: eager only, no graph break)
        if not torch.compiler.is_compiling() and bool((seg_all[:, -1] == seg_all[:, 0]).all()):
            return None, seg
        if self.attention == "flex" and cache is None:
            return document_block_mask(seg), seg
        return (seg[:, :, None] == seg_all[:, None, :]).unsqueeze(1), seg


def build_decoder(
    size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None, *, impl: str = DEFAULT_IMPL,
    attention: str = "sdpa",
) -> Decoder:
    """Build the decoder for a (size, ablation) pair; works under `torch.device("meta")`.

    impl (the AttnRes backend) and attention (document masking's path) are runtime choices, not part of the
    architecture: the same parameters and results.
    """
    cfg = size if isinstance(size, ModelConfig) else ModelConfig(size, ablation)
    return Decoder(cfg, impl, attention)
