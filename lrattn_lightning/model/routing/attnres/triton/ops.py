"""The `triton` backend's torch custom ops, each with its backward op, fakes and hand-written autograd:
`lrattn::attnres_read` (one depth read: kernels.py's read_fwd / read_bwd) and the two-phase block reads,
`lrattn::attnres_group` (phase 1: a group's G static queries over its completed sources at once; group_fwd /
group_bwd) and `lrattn::attnres_merge` (phase 2: one site's merge with its partial block; merge_fwd / merge_bwd).
launch.py holds what they share: the launch geometry, the pointer table (ReadLaunch) and where launches go.

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

from lrattn_lightning.model.routing.attnres.triton.launch import (
    ReadLaunch,
    as_rows,
    device_table,
    float_words,
    fold_keys,
    launch_kernels,
    out_dtype,
    source_grads,
)


# ---- one depth read (kernels.py: read_fwd, read_bwd) -------------------------------------------------------
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


# ---- phase 1: a group's sites over its completed sources (kernels.py: group_fwd, group_bwd) ----
@torch.library.custom_op("lrattn::attnres_group", mutates_args=())
def attnres_group(emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], queries: Tensor,
                  consts: list[float], scale: float, heads: int, key_norm: bool, key_offset: int,
                  record: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Phase 1 of a group: its G static queries [G, r] over the completed sources -> out [G, N, D],
    lse [G, N, m] (compute dtype), alpha [1 + len(values), N, m, G] when `record` (else empty)."""
    rd = ReadLaunch(emb_v, emb_k, values, keys, None, None, queries, consts, heads, key_offset, group=True)
    out = torch.empty((rd.G, rd.N, rd.D), dtype=out_dtype(emb_v, values, None), device=emb_v.device)
    lse = torch.empty(rd.G, rd.N, heads, dtype=rd.cdtype, device=emb_v.device)
    alpha = torch.empty((1 + rd.S_t, rd.N, heads, rd.G) if record else (0,), dtype=rd.cdtype, device=emb_v.device)
    launch_kernels().group_fwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(), rd.query, out, lse, alpha if record else lse,
        rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.G, scale, key_norm, record,
        BLOCK_G=rd.BLOCK_G, **rd.constexprs())
    return out, lse, alpha


@attnres_group.register_fake
def _(emb_v, emb_k, values, keys, queries, consts, scale, heads, key_norm, key_offset, record):
    cdtype = torch.promote_types(emb_v.dtype, torch.float32)
    N, D, G = emb_v.numel() // emb_v.shape[-1], emb_v.shape[-1], queries.shape[0]
    alpha = emb_v.new_empty((1 + len(values), N, heads, G) if record else (0,), dtype=cdtype)
    return (emb_v.new_empty((G, N, D), dtype=out_dtype(emb_v, values, None)),
            emb_v.new_empty((G, N, heads), dtype=cdtype), alpha)


@torch.library.custom_op("lrattn::attnres_group_bwd", mutates_args=())
def attnres_group_bwd(grad_out: Tensor, grad_lse: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor,
                      emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], queries: Tensor,
                      consts: list[float], scale: float, heads: int, key_norm: bool,
                      key_offset: int) -> list[Tensor]:
    """[d emb_v, d values...] + [d emb_k, d keys...] (carried keys) + [d queries]."""
    rd = ReadLaunch(emb_v, emb_k, values, keys, None, None, queries, consts, heads, key_offset, group=True)
    dvs, dks = source_grads(rd, [emb_v, *values], [emb_k, *keys] if rd.carried else [])
    extra = [d.data_ptr() for d in dvs[1:]] + [d.data_ptr() for d in dks[1:]]
    dq = torch.empty((rd.grid[0], rd.G, rd.R), dtype=rd.cdtype, device=emb_v.device)
    launch_kernels().group_bwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(extra), rd.query, out, lse, grad_out.contiguous(),
        grad_lse.contiguous(), dvs[0], dks[0], dq, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.G, scale,
        key_norm, BLOCK_G=rd.BLOCK_G, **rd.constexprs())
    dks = fold_keys(rd, dvs, dks, key_offset)
    return [*dvs, *dks, dq.sum(0).to(queries.dtype)]


@attnres_group_bwd.register_fake
def _(grad_out, grad_lse, out, lse, emb_v, emb_k, values, keys, queries, consts, scale, heads, key_norm,
      key_offset):
    vals = [emb_v, *values]
    ks = [emb_k, *keys] if emb_k is not None else []
    return [t.new_empty(t.shape, dtype=t.dtype) for t in vals + ks] + [queries.new_empty(queries.shape)]


def _group_setup(ctx, inputs, output):
    emb_v, emb_k, values, keys, queries, consts, scale, heads, key_norm, key_offset, _ = inputs
    out, lse, _ = output
    ctx.save_for_backward(emb_v, emb_k, queries, out, lse, *values, *keys)
    ctx.n_values = len(values)
    ctx.args = (consts, scale, heads, key_norm, key_offset)


def _group_backward(ctx, grad_out, grad_lse, _grad_alpha):
    emb_v, emb_k, queries, out, lse, *rest = ctx.saved_tensors
    values, keys = rest[: ctx.n_values], rest[ctx.n_values :]
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grads = attnres_group_bwd(grad_out, grad_lse, out, lse, emb_v, emb_k, list(values), list(keys), queries,
                              *ctx.args)
    n_src = 1 + ctx.n_values
    dvs, dks, dq = grads[:n_src], grads[n_src:-1], grads[-1]
    d_emb_k, d_keys = (dks[0], list(dks[1:])) if emb_k is not None else (None, [None] * len(keys))
    return dvs[0], d_emb_k, list(dvs[1:]), d_keys, dq, None, None, None, None, None, None


attnres_group.register_autograd(_group_backward, setup_context=_group_setup)


# ---- phase 2: a site's merge with its partial block (kernels.py: merge_fwd, merge_bwd) --------
def _merge_read(part_v, part_k, query, heads, key_offset) -> ReadLaunch:
    """The partial block as the only source of a ReadLaunch (its embedding slot)."""
    return ReadLaunch(part_v, part_k, [], [], None, None, query, [0.0] * 4, heads, key_offset)


@torch.library.custom_op("lrattn::attnres_merge", mutates_args=())
def attnres_merge(out_c: Tensor, lse_c: Tensor, part_v: Tensor, part_k: Tensor | None, query: Tensor,
                  prior: float, eps: float, scale: float, heads: int, key_norm: bool,
                  key_offset: int) -> tuple[Tensor, Tensor]:
    """Phase 2 at one site: the group's out_c [N, D] and lse_c [N, m] merged with the partial block
    (part_v [B, T, D], its carried key or None; the site's static query [r]) -> h [B, T, D], w [N, m]."""
    rd = _merge_read(part_v, part_k, query, heads, key_offset)
    out = torch.empty(part_v.shape, dtype=torch.promote_types(out_c.dtype, part_v.dtype), device=part_v.device)
    w = torch.empty(rd.N, heads, dtype=lse_c.dtype, device=part_v.device)
    fmeta = device_table(float_words([prior, eps]), part_v.device).view(torch.float64)
    cx = rd.constexprs()
    launch_kernels().merge_fwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, fmeta, rd.query, out_c.contiguous(), lse_c.contiguous(), out, w,
        rd.N, rd.D, rd.R, rd.key_offset, heads, scale, key_norm, KEY_MODE=cx["KEY_MODE"], ACC=cx["ACC"],
        BLOCK_N=rd.BLOCK_N, BLOCK_E=rd.BLOCK_E, **rd.options())
    return out, w


@attnres_merge.register_fake
def _(out_c, lse_c, part_v, part_k, query, prior, eps, scale, heads, key_norm, key_offset):
    N = part_v.numel() // part_v.shape[-1]
    return (part_v.new_empty(part_v.shape, dtype=torch.promote_types(out_c.dtype, part_v.dtype)),
            part_v.new_empty((N, heads), dtype=lse_c.dtype))


@torch.library.custom_op("lrattn::attnres_merge_bwd", mutates_args=())
def attnres_merge_bwd(grad: Tensor, out_c: Tensor, w: Tensor, part_v: Tensor, part_k: Tensor | None, query: Tensor,
                      prior: float, eps: float, scale: float, heads: int, key_norm: bool,
                      key_offset: int) -> list[Tensor]:
    """[d out_c, d lse_c, d part_v] + [d part_k] (carried keys) + [d query]."""
    rd = _merge_read(part_v, part_k, query, heads, key_offset)
    (dv,), (dk,) = source_grads(rd, [part_v], [part_k] if rd.carried else [])
    d_out = torch.empty(out_c.shape, dtype=out_c.dtype, device=out_c.device)
    d_lse = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    dq = torch.empty((rd.grid[0], rd.R), dtype=rd.cdtype, device=part_v.device)
    fmeta = device_table(float_words([prior, eps]), part_v.device).view(torch.float64)
    cx = rd.constexprs()
    g, _ = as_rows(grad.contiguous())
    launch_kernels().merge_bwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, fmeta, rd.query, out_c.contiguous(), w, g, d_out, d_lse, dv, dk, dq,
        rd.N, rd.D, rd.R, rd.key_offset, heads, scale, key_norm, KEY_MODE=cx["KEY_MODE"], ACC=cx["ACC"],
        BLOCK_N=rd.BLOCK_N, BLOCK_E=rd.BLOCK_E, **rd.options())
    dks = fold_keys(rd, [dv], [dk], key_offset)
    return [d_out, d_lse, dv, *dks, dq.sum(0).to(query.dtype)]


@attnres_merge_bwd.register_fake
def _(grad, out_c, w, part_v, part_k, query, prior, eps, scale, heads, key_norm, key_offset):
    keys = [part_k.new_empty(part_k.shape)] if part_k is not None else []
    return [out_c.new_empty(out_c.shape), w.new_empty(w.shape), part_v.new_empty(part_v.shape), *keys,
            query.new_empty(query.shape)]


def _merge_setup(ctx, inputs, output):
    out_c, _, part_v, part_k, query, *args = inputs
    ctx.save_for_backward(out_c, part_v, part_k, query, output[1])
    ctx.args = tuple(args)


def _merge_backward(ctx, grad_h, _grad_w):
    out_c, part_v, part_k, query, w = ctx.saved_tensors
    grads = attnres_merge_bwd(grad_h, out_c, w, part_v, part_k, query, *ctx.args)
    d_part_k = grads[3] if part_k is not None else None
    return grads[0], grads[1], grads[2], d_part_k, grads[-1], None, None, None, None, None, None


attnres_merge.register_autograd(_merge_backward, setup_context=_merge_setup)
