"""The @triton.jit helpers every kernel of the `triton` backend shares (kernels.py holds the math and the
table layout): a source's tiles (_load), its key's 1 / RMS (_rstd), its logit without the prior (_source),
a program's rows and a head's value and key columns (_layout); and the torch dtype -> Triton dtype table.
Imports only triton."""

from __future__ import annotations

import triton
import triton.language as tl

# torch dtype -> Triton dtype of pointers and accumulators (constexpr kernel arguments)
DTYPES = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16, "float64": tl.float64}


@triton.jit
def _load(vp, sv, kp, sk, rows, rmask, vcols, emask, kcols, kmask, KEY_MODE: tl.constexpr, ACC: tl.constexpr):
    """A source's value tile [BLOCK_N, BLOCK_E] and key tile (value-column or key-column space), in ACC."""
    v = tl.load(vp + rows[:, None] * sv + vcols[None, :], mask=rmask[:, None] & emask[None, :], other=0.0).to(ACC)
    if KEY_MODE == 0:
        x = tl.where(kmask[None, :], v, 0.0)
    else:
        x = tl.load(kp + rows[:, None] * sk + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(ACC)
    return v, x


@triton.jit
def _rstd(xx, K, eps, key_norm):
    """1 / RMS of each token's key from its sum of squares xx (1 without key norm: a runtime flag)."""
    return tl.where(key_norm, 1.0 / tl.sqrt(xx / K + eps), 1.0)


@triton.jit
def _source(vp, sv, kp, sk, eps, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale, key_norm,
            KEY_MODE: tl.constexpr, ACC: tl.constexpr):
    """A source's value tile, key tile, its logit without the prior scale * rstd * <x, q> and rstd, per
    token."""
    v, x = _load(vp, sv, kp, sk, rows, rmask, vcols, emask, kcols, kmask, KEY_MODE, ACC)
    rstd = _rstd(tl.sum(x * x, 1), K, eps, key_norm)
    return v, x, scale * rstd * tl.sum(x * qt, 1), rstd


@triton.jit
def _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, KEY_MODE: tl.constexpr):
    """Rows, the head's value columns, and its key columns (indices into the key / query) with their masks.
    A key of its own (KEY_MODE 1) is loaded as a tile as wide as the value's (BLOCK_E >= its width, masked):
    the same layout, so its per-token logits meet the value tile without layout conversions (a narrow key
    tile beside a 4096-wide value tile took triton 3.6 ~10 s to compile, with 17 KiB of shared memory)."""
    E = D // heads
    K = R // heads
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    ce = tl.arange(0, BLOCK_E)
    emask = ce < E
    vcols = h * E + ce
    if KEY_MODE == 0:  # key columns KOFF.. of the value, within this head's value columns
        kcols = vcols - KOFF
        kmask = emask & (vcols >= KOFF)
    else:
        kcols = h * K + ce
        kmask = ce < K
    return rows, rmask, vcols, emask, kcols, kmask, K
