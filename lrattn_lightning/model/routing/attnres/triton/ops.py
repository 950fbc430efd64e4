"""The `triton` backend's torch custom ops: `lrattn::attnres_read` (one depth read) and its backward; the
two-phase block reads' ops live in group_ops.py and the launch plumbing in launch.py, both named here too
(`ops.attnres_group`, `ops.availability_error`, ... as before the split).

Registered with torch.library (custom_op + register_fake + register_autograd), so autograd calls the
hand-written backward kernel and torch.compile keeps each read whole (an opaque node, no graph break).
The kernels (kernels.py) are imported when an op first runs: importing this module, and the
package, never needs triton.

A read's sources: the embedding (emb_v, its carried key emb_k or None), the completed block summaries
(values, their carried keys; empty for key-in-value sources), the partial block (part_v, part_k or None).
Keys that are None are read from the value: columns key_offset.. (sliced) or all of them (value keys).
consts: the len(values) + 2 slots' priors then eps (embedding, summaries, partial; the partial's slot
is present even without a partial). The kernels see the embedding and a table of the other sources (the
summaries, then the partial block when there is one: one dtype). Shapes: values [B, T, D], keys [B, T, r],
query [r] (static) or [B, T, r] (per token) -> out [B, T, D], lse [N, m] (compute dtype), alpha
[S_used, N, m] when `record` (else empty).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lrattn_lightning.model.routing.attnres.triton.group_ops import (
    attnres_group,
    attnres_group_bwd,
    attnres_merge,
    attnres_merge_bwd,
)
from lrattn_lightning.model.routing.attnres.triton.launch import (
    GROUP_TILE_MAX,
    REG_BUDGET,
    ReadLaunch,
    as_rows,
    availability_error,
    check_device,
    fold_keys,
    geometry,
    group_limit,
    interpreting,
    launch_kernels,
    out_dtype,
    set_launch_target,
    source_grads,
)

__all__ = ["GROUP_TILE_MAX", "REG_BUDGET", "attnres_group", "attnres_group_bwd", "attnres_merge",
           "attnres_merge_bwd", "attnres_read", "attnres_read_bwd", "availability_error", "check_device",
           "geometry", "group_limit", "interpreting", "set_launch_target"]


def _n_used(values: list[Tensor], part_v: Tensor | None) -> int:
    return 1 + len(values) + int(part_v is not None)


@torch.library.custom_op("lrattn::attnres_read", mutates_args=())
def attnres_read(emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor],
                 part_v: Tensor | None, part_k: Tensor | None, query: Tensor, consts: list[float], scale: float,
                 heads: int, key_norm: bool, key_offset: int, record: bool) -> tuple[Tensor, Tensor, Tensor]:
    rd = ReadLaunch(emb_v, emb_k, values, keys, part_v, part_k, query, consts, heads, key_offset)
    out = torch.empty(emb_v.shape, dtype=out_dtype(emb_v, values, part_v), device=emb_v.device)
    lse = torch.empty(rd.N, heads, dtype=rd.cdtype, device=emb_v.device)
    alpha = torch.empty((_n_used(values, part_v), rd.N, heads) if record else (0,), dtype=rd.cdtype,
                        device=emb_v.device)
    launch_kernels().read_fwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(), rd.query, rd.R if rd.query_per_token else 0, out, lse,
        alpha if record else lse, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, scale, key_norm, record,
        **rd.constexprs())
    return out, lse, alpha


@attnres_read.register_fake
def _(emb_v, emb_k, values, keys, part_v, part_k, query, consts, scale, heads, key_norm, key_offset, record):
    cdtype = torch.promote_types(emb_v.dtype, torch.float32)
    N = emb_v.numel() // emb_v.shape[-1]
    out = emb_v.new_empty(emb_v.shape, dtype=out_dtype(emb_v, values, part_v))
    alpha = emb_v.new_empty((_n_used(values, part_v), N, heads) if record else (0,), dtype=cdtype)
    return out, emb_v.new_empty((N, heads), dtype=cdtype), alpha


def _grad_layout(emb_v, emb_k, values, keys, part_v, part_k, query) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each gradient the backward returns: values, carried keys, the query."""
    vals = [emb_v, *values, *([part_v] if part_v is not None else [])]
    ks = [emb_k, *keys, *([part_k] if part_k is not None else [])] if emb_k is not None else []
    return [(tuple(t.shape), t.dtype) for t in vals + ks] + [(tuple(query.shape), query.dtype)]


@torch.library.custom_op("lrattn::attnres_read_bwd", mutates_args=())
def attnres_read_bwd(grad: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor, emb_k: Tensor | None,
                     values: list[Tensor], keys: list[Tensor], part_v: Tensor | None, part_k: Tensor | None,
                     query: Tensor, consts: list[float], scale: float, heads: int, key_norm: bool,
                     key_offset: int) -> list[Tensor]:
    """[d emb_v, d values..., d part_v?] + [d emb_k, d keys..., d part_k?] (carried keys) + [d query]."""
    rd = ReadLaunch(emb_v, emb_k, values, keys, part_v, part_k, query, consts, heads, key_offset)
    partial = [part_v] if rd.has_partial else []
    dvs, dks = source_grads(rd, [emb_v, *values, *partial],
                             [emb_k, *keys, *([part_k] if rd.has_partial else [])] if rd.carried else [])
    # key mode 0: the key's gradient is the value's on its columns, written through views of dv there
    dkv = [d[..., key_offset:] for d in dvs] if rd.key_mode == 0 else dks
    extra = [d.data_ptr() for d in dvs[1:]] + [d.data_ptr() for d in dkv[1:]]
    tiles = rd.bwd_grid[0]
    dq = torch.empty((rd.N, rd.R) if rd.query_per_token else (tiles, rd.R), dtype=rd.cdtype, device=emb_v.device)
    g, _ = as_rows(grad.contiguous())
    in_value = rd.key_mode == 0
    launch_kernels().read_bwd[rd.bwd_grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(extra), rd.query, rd.R if rd.query_per_token else 0, out, lse, g,
        dvs[0], dkv[0], rd.D if in_value else rd.R, dq, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.E,
        rd.E - rd.K if in_value else rd.E, rd.K, scale, key_norm, in_value, rd.query_per_token,
        **rd.dtypes(), BLOCK_N=rd.bwd_block_n, CH=rd.CH, **rd.options(rd.bwd_warps))
    dks = fold_keys(rd, dvs, dks, key_offset)
    dq = dq.view(query.shape) if rd.query_per_token else dq.sum(0)
    return [*dvs, *dks, dq.to(query.dtype)]


@attnres_read_bwd.register_fake
def _(grad, out, lse, emb_v, emb_k, values, keys, part_v, part_k, query, consts, scale, heads, key_norm, key_offset):
    return [emb_v.new_empty(s, dtype=d) for s, d in _grad_layout(emb_v, emb_k, values, keys, part_v, part_k, query)]


def _setup(ctx, inputs, output):
    emb_v, emb_k, values, keys, part_v, part_k, query, consts, scale, heads, key_norm, key_offset, _ = inputs
    out, lse, _ = output
    ctx.save_for_backward(emb_v, emb_k, part_v, part_k, query, out, lse, *values, *keys)
    ctx.n_values, ctx.n_keys = len(values), len(keys)
    ctx.args = (consts, scale, heads, key_norm, key_offset)


def _backward(ctx, grad_out, _grad_lse, _grad_alpha):
    emb_v, emb_k, part_v, part_k, query, out, lse, *rest = ctx.saved_tensors
    values, keys = rest[: ctx.n_values], rest[ctx.n_values :]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = attnres_read_bwd(grad_out, out, lse, emb_v, emb_k, list(values), list(keys), part_v, part_k, query,
                             *ctx.args)
    n_src = 1 + ctx.n_values + int(part_v is not None)
    dvs, dks, dq = grads[:n_src], grads[n_src:-1], grads[-1]
    d_part_v = dvs[-1] if part_v is not None else None
    d_emb_k = d_part_k = None
    d_keys: list[Tensor | None] = [None] * ctx.n_keys
    if emb_k is not None:
        d_emb_k, d_keys = dks[0], list(dks[1 : 1 + ctx.n_keys])
        d_part_k = dks[-1] if part_k is not None else None
    return (dvs[0], d_emb_k, list(dvs[1 : 1 + ctx.n_values]), d_keys, d_part_v, d_part_k, dq,
            None, None, None, None, None, None)


attnres_read.register_autograd(_backward, setup_context=_setup)
