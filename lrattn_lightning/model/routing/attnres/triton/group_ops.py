"""The `triton` backend's two-phase block reads as torch custom ops (kernels: group_kernels.py): phase 1,
`lrattn::attnres_group`, a group's G static queries over its completed sources at once; phase 2,
`lrattn::attnres_merge`, one site's merge with its partial block; each with its backward op, fakes and
autograd, as ops.py's single read (launch.py: the launch geometry and the pointer table).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lrattn_lightning.model.routing.attnres.triton.launch import (
    ReadLaunch,
    as_rows,
    fold_keys,
    launch_kernels,
    out_dtype,
    source_grads,
)


# ---- phase 1: a group's sites over its completed sources (group_kernels.py: group_fwd, group_bwd) ----
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


# ---- phase 2: a site's merge with its partial block (group_kernels.py: merge_fwd, merge_bwd) --------
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
    fmeta = torch.tensor([prior, eps], dtype=torch.float64).to(part_v.device)
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
    fmeta = torch.tensor([prior, eps], dtype=torch.float64).to(part_v.device)
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
