"""Triton kernels of the `triton` AttnRes backend (router.py), forward and backward: one depth read
(read_fwd / read_bwd), and two-phase block reads (group_fwd / merge_fwd and their backward, further down).

For every token n and depth head h, over the sources s of the read (the embedding, the completed block
summaries, the partial block if any):

    rstd_s  = 1 / sqrt(mean_k x_s^2 + eps_s)              x_s the raw key slice of head h (key norm on)
    l_s     = scale * rstd_s * <x_s, q> + b_s              b_s = beta log c_s (the count prior)
    h       = sum_s softmax_s(l) v_s  (value slice of h)   online softmax in float32, lse saved

Backward (flash-attention style: delta = <grad h, h> replaces a pass over the sources):

    dalpha_s = <g, v_s>     dl_s = alpha_s (dalpha_s - delta)      dv_s = alpha_s g
    dx_s     = scale rstd_s dl_s q - dl_s (l_s - b_s) rstd_s^2 x_s / k          dq += scale rstd_s dl_s x_s

Sources are not stacked: the embedding comes as a plain argument (its dtype may differ from the others'
under autocast); the completed summaries and then the partial block, if any (one dtype: the router casts),
are reached through a table of pointers and row strides (`meta`, int64, built by the caller). Priors and eps
are float64 entries of the same table (`fmeta`: `meta` seen as float64).

Key modes (forward kernels): KEY_MODE 0, the key is part of the value tile the program already holds (value
keys, and sliced keys with one depth head: the columns >= KOFF of the value), so keys cost no extra load and
their gradient is added to the value's in registers; KEY_MODE 1, the key is loaded through its own pointer
(carried keys, and sliced keys whose head slices straddle value heads), as a tile as wide as the value's.

The forward kernels hold a head's whole row per token (BLOCK_E >= e, masked: any D and r); the backward read
walks the row in chunks of CH columns (two passes per source: the row's reductions, then the gradients), so
no tile in it is wider than BLOCK_N x CH at any width. Accumulation (ACC) in float32, or float64 for float64
models. BLOCK_N, CH and num_warps (launch.geometry) keep a tile at 4 elements per thread (8 in the
4096-element tiles), and every launch passes maxnreg = 128: the register budget of docs/benchmarks.md,
checked by tests/tools/test_triton_compile.py. Token counts, head counts, loop bounds and the runtime flags (N,
heads, S_t, G, key_norm, write_alpha, ...) are not constexprs and the counts are not specialised on (a value
of 1 or a multiple of 16 would otherwise compile a kernel of its own: decoding's N = 1, the first block's
S_t = 1); widths and strides are.

meta layout (S_t table sources, S = S_t + 1 slots: embedding 0, table 1..S_t, the partial last when present):
    [0, S_t) value pointers  [S_t, 2S_t) value row strides  [2S_t, 3S_t) key pointers  [3S_t, 4S_t) key strides
    [4S_t, 4S_t + S) priors  [4S_t + S, 4S_t + 2S) eps       (backward also: dv pointers, then dk pointers)

The kernels live in three files that import only triton and kernel_parts.py (tools/kernels/compile_check.py
loads them by path, without torch): kernel_parts.py (the shared helpers, DTYPES), read_kernels.py (read_fwd,
read_bwd), group_kernels.py (group_fwd, group_bwd, merge_fwd, merge_bwd). This module names them all:
ops.py and group_ops.py launch `kernels.<name>`.
"""

from __future__ import annotations

from lrattn_lightning.model.routing.attnres.triton.group_kernels import (
    group_bwd,
    group_fwd,
    merge_bwd,
    merge_fwd,
)
from lrattn_lightning.model.routing.attnres.triton.kernel_parts import DTYPES
from lrattn_lightning.model.routing.attnres.triton.read_kernels import read_bwd, read_fwd

__all__ = ["DTYPES", "group_bwd", "group_fwd", "merge_bwd", "merge_fwd", "read_bwd", "read_fwd"]
