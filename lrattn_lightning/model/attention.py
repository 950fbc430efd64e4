"""The token attention: causal multi-head self-attention with QK-norm and RoPE, the keys and values it caches for
decoding, and the masks it reads (docs/method.md §5).

A forward pass opens one `AttentionPass` (`attention_pass`): RoPE's tables of its positions, which earlier
positions each new token may see, and the KV cache, if any; every layer's attention reads it.

Document masking (the paper's recipe, `use_doc_masking`): with the decoder's `doc_separator` set to the
tokenizer's EOS id, a token attends only to earlier tokens of its own document. As in the paper's code, every
separator token starts a new segment (so it belongs to the document after it) and RoPE positions run over the
whole packed window. Training, validation, evaluation and KV-cache decoding all go through the decoder's forward,
so all mask alike.

How the document mask reaches the attention is a runtime choice (`Decoder.attention`, the module's
`--model.attention`), never what is computed:
    sdpa  a dense boolean [B, 1, T, T] mask to SDPA (any device; on a GPU it keeps SDPA off its flash
          kernel: O(T^2) memory per head)
    flex  FlexAttention with a block mask built from the segment ids (torch.nn.attention.flex_attention):
          blocks that cross documents are skipped; compiled on CUDA, the unfused reference on CPU, which has
          no FlexAttention backward (training with flex needs CUDA)
Windows of one document per row, and KV-cache decoding (a few new tokens), take the causal / dense SDPA path
under both.

Shape legend: B batch, T new tokens, T_all cached and new, H heads, hd = d_model / n_heads, D = d_model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.model.config import SizeConfig
from lrattn_lightning.model.rope import apply_rope, positions_rope, rope_angles, rope_tables
from lrattn_lightning.model.routing._math import rms_norm

if TYPE_CHECKING:
    from lrattn_lightning.model.decoder import Decoder

ATTENTIONS = ("sdpa", "flex")  # how document masking's mask reaches the attention (module docstring)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with QK-norm and RoPE, no biases; its output d wide (+ r rows for P-LR)."""

    def __init__(self, size: SizeConfig, extra_out: int):
        super().__init__()
        self.n_heads = size.n_heads
        self.head_dim = size.d_model // size.n_heads
        self.qkv = nn.Linear(size.d_model, 3 * size.d_model, bias=False)
        self.proj = nn.Linear(size.d_model, size.d_model + extra_out, bias=False)  # d -> d + r for P-LR

    def forward(self, x_q: Tensor, x_k: Tensor, x_v: Tensor, attention: AttentionPass, layer: int) -> Tensor:
        """The (normed) inputs of the queries, keys and values [B, T, D] -> the output [B, T, D (+ r)]; `layer`
        indexes the cache and the pass's `mix_values`."""
        q, k, v = self.heads(x_q, x_k, x_v, attention.cos, attention.sin)  # (B, T, H, hd)
        v = attention.mix_values(layer, v)
        B, T, H, hd = q.shape
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        y = attention.attend(q, k, v, layer)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def heads(
        self, x_q: Tensor, x_k: Tensor, x_v: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, T, H, hd]: QK-norm then RoPE on q and k. One input for all three (x_q is x_k is x_v): the
        fused projection; otherwise the `qkv` weight's query, key and value rows, each on its own input."""
        B, T, _ = x_q.shape
        if x_k is x_q and x_v is x_q:
            qkv = self.qkv(x_q).view(B, T, 3, self.n_heads, self.head_dim)
            # QK-norm then RoPE, on q and k together (B, T, 2, H, hd): the same rows, half the kernels
            q, k = apply_rope(rms_norm(qkv[:, :, :2]), cos, sin).unbind(2)  # (B, T, H, hd)
            return q, k, qkv[:, :, 2]
        w_q, w_k, w_v = self.qkv.weight.chunk(3, dim=0)
        q, k, v = (
            F.linear(x, w).view(B, T, self.n_heads, self.head_dim)
            for x, w in zip((x_q, x_k, x_v), (w_q, w_k, w_v), strict=True)
        )
        return apply_rope(rms_norm(q), cos, sin), apply_rope(rms_norm(k), cos, sin), v


def values_unchanged(layer: int, v_BTHd: Tensor) -> Tensor:
    return v_BTHd


@dataclass
class AttentionPass:
    """What every layer's attention shares in one forward pass."""

    cos: Tensor  # RoPE tables of the new positions, [T, hd] (rope_tables)
    sin: Tensor
    # which positions a new token may see besides the causal rule: None (all earlier ones), document masking's
    # same-document mask [B, 1, T, T_all] bool, its FlexAttention BlockMask, or a StaticKVCache's whole mask
    mask: Any = None
    cache: KVCache | StaticKVCache | None = None
    # (layer, v [B, T, H, hd]) -> the values the attention uses and caches: the router's (Router.mix_values)
    mix_values: Callable[[int, Tensor], Tensor] = values_unchanged

    def attend(self, q_BHTd: Tensor, k_BHTd: Tensor, v_BHTd: Tensor, layer: int) -> Tensor:
        """Softmax attention of the new queries over the cached and new keys -> [B, H, T, hd]."""
        q, k, v = q_BHTd, k_BHTd, v_BHTd
        # a static cache is written in place and read whole, under its own mask (attention_pass)
        if isinstance(self.cache, StaticKVCache):
            k, v = self.cache.update(layer, k, v)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        if self.cache is not None:
            k, v = self.cache.update(layer, k, v)
        elif self.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if not isinstance(self.mask, Tensor | None):  # a BlockMask (causal and same document)
            return _flex_attention(q, k, v, self.mask)
        causal = _prefix_causal_mask(q.shape[2], k.shape[2], q.device)
        mask = causal if self.mask is None else causal & self.mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_pass(
    idx_BT: Tensor,
    cache: KVCache | StaticKVCache | None,
    size: SizeConfig,
    separator: int | None,
    attention: str,
) -> tuple[AttentionPass, Tensor | None]:
    """The pass of the new tokens idx [B, T], placed after the cache's: its AttentionPass and document masking's
    segment ids of the new positions [B, T] (None without document masking, `separator` None)."""
    T, head_dim = idx_BT.shape[1], size.d_model // size.n_heads
    if isinstance(cache, StaticKVCache):  # RoPE from the position tensor, the mask over the whole buffer
        cos, sin = rope_tables(*rope_angles(cache.positions(T), head_dim, size.rope_theta))
        segments = None if separator is None else cache.write_segments(idx_BT, separator)
        return AttentionPass(cos, sin, cache.mask(T, segments), cache), segments
    start = 0 if cache is None else cache.length
    cos, sin = positions_rope(start, T, head_dim, size.rope_theta, idx_BT.device)
    mask, segments = document_mask(idx_BT, cache, separator, attention)
    return AttentionPass(cos, sin, mask, cache), segments


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

    def update(self, layer: int, k_BHTd: Tensor, v_BHTd: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' keys and values; -> all of them, cached and new [B, H, T_all, hd]."""
        past = self.keys[layer]
        if past is not None:
            k_BHTd = torch.cat((past, k_BHTd), dim=2)
            v_BHTd = torch.cat((self.values[layer], v_BHTd), dim=2)
        self.keys[layer], self.values[layer] = k_BHTd, v_BHTd
        return k_BHTd, v_BHTd


class StaticKVCache:
    """KV cache of fixed shape for a compiled / CUDA-graph decode step (model/generate.py, `cache="static"`).

    keys, values: per layer [B, H, max_len, hd], preallocated and written in place at the current positions;
    `position` a long tensor [1] (not a Python int, so one compiled graph serves every step, and a CUDA graph
    replays with it) advanced in place by each forward. The attention reads the whole buffer under `mask(T)`,
    [B or 1, 1, T, max_len] bool (valid, causal and, with document masking, same document), so no shape changes
    from step to step. Only for routers that keep no decoding state of their own (`new_cache()` None): depth
    routing is per token. Every tensor is marked a static address, so a CUDA graph writes into it in place.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
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
    def for_model(
        cls, model: Decoder, batch: int, device: torch.device | str, dtype: torch.dtype
    ) -> StaticKVCache:
        size = model.cfg.size
        return cls(
            size.n_layers, batch, size.n_heads, size.seq_len, size.d_model // size.n_heads, device, dtype
        )

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


def document_segments(idx_BT: Tensor, separator: int, before: Tensor | None = None) -> Tensor:
    """Segment id per position [B, T]: every separator starts a new segment (the paper's boundaries).

    before: the segment ids of earlier (cached) positions [B, T_cached], continued from their last id.
    """
    seg = (idx_BT == separator).cumsum(dim=1)
    if before is not None and before.shape[1]:
        seg = seg + before[:, -1:]
    return seg


def document_mask(
    idx_BT: Tensor, cache: KVCache | None, separator: int | None, attention: str
) -> tuple[Any, Tensor | None]:
    """Document masking: the attention mask [B, 1, T, T_all] bool or, with `attention: flex` and no cache, its
    FlexAttention BlockMask (None where every position shares one document), and the new positions' segment ids
    [B, T] (the cache's grow by them); (None, None) without document masking (`separator` None)."""
    if separator is None:
        return None, None
    before = cache.segments if cache is not None else None
    seg = document_segments(idx_BT, separator, before)
    seg_all = seg if before is None else torch.cat((before, seg), dim=1)
    if cache is not None:
        cache.segments = seg_all
    # one document per row: the causal mask suffices (a data-dependent shortcut: eager only, no graph break)
    if not torch.compiler.is_compiling() and bool((seg_all[:, -1] == seg_all[:, 0]).all()):
        return None, seg
    if attention == "flex" and cache is None:
        return document_block_mask(seg), seg
    return (seg[:, :, None] == seg_all[:, None, :]).unsqueeze(1), seg


def document_block_mask(seg_BT: Tensor) -> Any:
    """FlexAttention's block mask of document masking: query i sees key t <= i of its own segment."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = seg_BT.shape

    def same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (seg_BT[b, q_idx] == seg_BT[b, kv_idx])

    return create_block_mask(
        same_document,
        B,
        None,
        T,
        T,
        device=seg_BT.device,
        _compile=seg_BT.device.type == "cuda" and not torch.compiler.is_compiling(),
    )


def _prefix_causal_mask(t_new: int, t_all: int, device: torch.device) -> Tensor:
    """Boolean mask letting new token i (at absolute position t_all - t_new + i) see positions <= its own."""
    q_pos = torch.arange(t_all - t_new, t_all, device=device)[:, None]
    return torch.arange(t_all, device=device)[None, :] <= q_pos


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
