"""RoPE: the token attention's rotary position embedding, interleaved pairs (docs/method.md §5).

Each head's query and key rotate pair (x[2i], x[2i+1]) by the angle position * theta^(-2i/hd). The tables are
built once per forward (`positions_rope`), in float32 exactly as the paper's code builds them, and every layer
rotates its q and k by them (`apply_rope`).

Shape legend: B batch, T tokens, H heads, hd = d_model / n_heads.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [T, head_dim/2] (float32) for interleaved-pair RoPE.

    Computed in float32 exactly as the paper's code builds its tables, inv_freq_i = 1 / theta^(2i/hd)
    and angle = position * inv_freq, so a float64 model rotates by the same (float32-rounded) angles.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device) / head_dim  # float32
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The [T, head_dim/2] tables of rope_angles laid out per element [T, head_dim]: cos_i repeated for both
    members of pair i, and sin_i signed (-sin_i for the pair's first member, +sin_i for its second)."""
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def positions_rope(
    start: int, length: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """rope_tables of positions start..start+length-1. Compiled, through the opaque op `lrattn::rope_tables`: traced
    inline, Inductor fused the angles' cos and sin into every rotation that reads them, computing them again for
    every element of every layer forward and backward (140 ms of a 1.6 s step at `small` on an AVX2 CPU); as an op
    they are computed once a forward, with the same code."""
    if torch.compiler.is_compiling():
        return _rope_tables_op(start, length, head_dim, theta, device)
    return _positions_tables(start, length, head_dim, theta, device)


def _positions_tables(
    start: int, length: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    return rope_tables(*rope_angles(torch.arange(start, start + length, device=device), head_dim, theta))


_rope_tables_op = torch.library.custom_op("lrattn::rope_tables", _positions_tables, mutates_args=())


@_rope_tables_op.register_fake
def _(start, length, head_dim, theta, device):
    return torch.empty(length, head_dim, device=device), torch.empty(length, head_dim, device=device)


def apply_rope(x_BTHd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles, in promote_types(dtype, float32).

    x: [B, T, ..., hd]; cos, sin: rope_angles' [T, hd/2] tables or rope_tables' [T, hd] ones (the decoder builds
    those once per forward). As x * cos + swap(x) * sin with swap exchanging each pair's members: the same
    products and sums, bit for bit, as (x0 cos - x1 sin, x0 sin + x1 cos), in three elementwise kernels and one
    copy instead of seven.
    """
    cdtype = torch.promote_types(x_BTHd.dtype, torch.float32)
    shape = (1, cos.shape[0]) + (1,) * (x_BTHd.dim() - 3) + (-1,)  # the tables broadcast over batch and heads
    if (
        torch.compiler.is_compiling()
    ):  # Inductor fuses the pair form better (a compiled step 0.89x the swap form's)
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
