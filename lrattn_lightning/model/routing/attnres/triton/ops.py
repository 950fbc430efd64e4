"""The `triton` backend's torch custom ops, each with its backward op and fakes: `lrattn::attnres_read` (one
depth read: kernels.py's read_fwd / read_bwd) and the two-phase block reads, `lrattn::attnres_group` (phase 1:
a group's G static queries over its completed sources at once; group_fwd / group_bwd) and `lrattn::attnres_merge`
(phase 2: one site's merge with its partial block; merge_fwd / merge_bwd). launch.py holds what they share: the
launch geometry, the pointer table (ReadLaunch) and where launches go.

Registered with torch.library (custom_op + register_fake), so torch.compile keeps each read whole (an opaque
node, no graph break). The merge's autograd is register_autograd; the reads' is an autograd.Function (`read`,
`group`: the gradient chain). The kernels (kernels.py) are imported when an op first runs: importing this
module, and the package, never needs triton.

The gradient chain. The completed sources (the embedding, the block summaries, their carried keys) are read by
every later read of the forward. Each read hands them on as views, and the next read takes those: autograd sees
each source taken by one read, so nothing sums a source's gradients. Backward runs the reads last to first; a
read receives the gradient its later reads gave the sources it handed on and its backward kernel adds its own
share into that buffer (read-modify-write in the tile it writes anyway, instead of a gradient of its own and
autograd's add over [N, D] afterwards), then returns it: one buffer per source, however many reads take it
(tests/model/routing/attnres/triton/test_triton_grad_chain.py). Under torch.compile the backward op is
functional (attnres_read_bwd copies the incoming gradient into a new buffer and adds there: dynamo refuses an
in-place add into an incoming gradient, "Output 1 of ApplyTemplate is a view ... modified inplace", also through
a mutating custom op), so compiled it moves the bytes autograd's add did. The kernel adds into the buffer it
writes rather than from a second pointer: a separate pointer to the incoming gradient took read_bwd from
112-113 to 126-128 registers on sm_90 and spilled on sm_80 (triton 3.9).

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
    accumulated_flags,
    as_rows,
    device_table,
    float_words,
    fold_keys,
    launch_kernels,
    out_dtype,
    source_grads,
    split_acc,
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


def _read_grads(grad: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor],
                keys: list[Tensor], part_v: Tensor | None, part_k: Tensor | None, query: Tensor,
                acc: list[Tensor | None], consts: list[float], scale: float, heads: int, key_norm: bool,
                key_offset: int, in_place: bool) -> list[Tensor]:
    """read_bwd's gradients, added to the later reads' `acc` (launch.split_acc); in place: into `acc` itself."""
    rd = ReadLaunch(emb_v, emb_k, values, keys, part_v, part_k, query, consts, heads, key_offset)
    sources = [emb_v, *values, *([part_v] if rd.has_partial else [])]
    carried_keys = [emb_k, *keys, *([part_k] if rd.has_partial else [])] if rd.carried else []
    acc_v, acc_k = split_acc(rd, acc, sources, carried_keys, in_place)
    dvs, dks = source_grads(rd, sources, carried_keys, acc_v, acc_k)
    # key mode 0: the key's gradient is the value's on its columns, written through views of dv there
    dkv = [d[..., key_offset:] for d in dvs] if rd.key_mode == 0 else dks
    extra = [d.data_ptr() for d in dvs[1:]] + [d.data_ptr() for d in dkv[1:]] + accumulated_flags(rd, acc_v, acc_k)
    tiles = rd.bwd_grid[0]
    dq = torch.empty((rd.N, rd.R) if rd.query_per_token else (tiles, rd.R), dtype=rd.cdtype, device=emb_v.device)
    g, _ = as_rows(grad.contiguous())
    in_value = rd.key_mode == 0
    launch_kernels().read_bwd[rd.bwd_grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(extra), rd.query, rd.R if rd.query_per_token else 0, out, lse, g,
        dvs[0], dkv[0], rd.D if in_value else rd.R, dq, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.E,
        rd.E - rd.K if in_value else rd.E, rd.K, scale, key_norm, in_value, rd.query_per_token,
        **rd.dtypes(), BLOCK_N=rd.bwd_block_n, CH=rd.CH, KEY_ONE=rd.K <= rd.CH, **rd.options(rd.bwd_warps))
    dks = fold_keys(rd, dvs, dks, key_offset)
    dq = dq.view(query.shape) if rd.query_per_token else dq.sum(0)
    return [*dvs, *dks, dq.to(query.dtype)]


@torch.library.custom_op("lrattn::attnres_read_bwd", mutates_args=())
def attnres_read_bwd(grad: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor, emb_k: Tensor | None,
                     values: list[Tensor], keys: list[Tensor], part_v: Tensor | None, part_k: Tensor | None,
                     query: Tensor, acc: list[Tensor | None], consts: list[float], scale: float, heads: int,
                     key_norm: bool, key_offset: int) -> list[Tensor]:
    """[d emb_v, d values..., d part_v?] + [d emb_k, d keys..., d part_k?] (carried keys) + [d query], each
    source's with `acc` (the gradient the later reads gave it: [emb_v, values...] + [emb_k, keys...], None
    where none) added: `acc` copied to new tensors first (the compiled path; eager adds in place: _read_grads)."""
    return _read_grads(grad, out, lse, emb_v, emb_k, values, keys, part_v, part_k, query, acc, consts, scale,
                       heads, key_norm, key_offset, in_place=False)


@attnres_read_bwd.register_fake
def _(grad, out, lse, emb_v, emb_k, values, keys, part_v, part_k, query, acc, consts, scale, heads, key_norm,
      key_offset):
    return [emb_v.new_empty(s, dtype=d) for s, d in _grad_layout(emb_v, emb_k, values, keys, part_v, part_k, query)]


class _Read(torch.autograd.Function):
    """One read whose sources' gradients accumulate along the chain of reads (module docstring, `read`)."""

    @staticmethod
    def forward(ctx, spec, *tensors):
        layout, consts, scale, heads, key_norm, key_offset, record = spec
        emb_v, emb_k, values, keys, part_v, part_k, query = _unflatten(layout, tensors)
        out, lse, alpha = attnres_read(emb_v, emb_k, values, keys, part_v, part_k, query, list(consts), scale,
                                       heads, key_norm, key_offset, record)
        ctx.save_for_backward(*tensors, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(lse, alpha)
        ctx.set_materialize_grads(False)
        return (out, lse, alpha, *_hand_on(layout, tensors))

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_alpha, *grad_handed):
        *tensors, out, lse = ctx.saved_tensors
        layout, consts, scale, heads, key_norm, key_offset, _ = ctx.spec
        emb_v, emb_k, values, keys, part_v, part_k, query = _unflatten(layout, tensors)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        args = (grad_out, out, lse, emb_v, emb_k, values, keys, part_v, part_k, query,
                _acc_order(layout, grad_handed), list(consts), scale, heads, key_norm, key_offset)
        grads = attnres_read_bwd(*args) if torch.compiler.is_compiling() else _read_grads(*args, in_place=True)
        return (None, *_input_order(layout, grads))


def read(emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], part_v: Tensor | None,
         part_k: Tensor | None, query: Tensor, consts: list[float], scale: float, heads: int, key_norm: bool,
         key_offset: int, record: bool) -> tuple[Tensor, Tensor, tuple]:
    """One depth read -> (out [B, T, D], alpha, the sources handed on: (emb_v, emb_k, values, keys)), which the
    next read of these sources takes in their place (module docstring: the gradient chain)."""
    layout, tensors = _flatten(emb_v, emb_k, values, keys, part_v, part_k, query)
    out, _, alpha, *handed = _Read.apply((layout, tuple(consts), scale, heads, key_norm, key_offset, record),
                                         *tensors)
    return out, alpha, _sources(layout, handed)


# ---- the gradient chain: how a read's tensors are laid out for autograd.Function ------------------------
# layout: (embedding key carried, len(values), len(keys), partial value given, partial key given); tensors:
# emb_v, emb_k?, values..., keys..., part_v?, part_k?, query(ies). The first 1 + carried + len(values) +
# len(keys) of them (the completed sources) are handed on as views; their gradients come back as `acc`.
def _flatten(emb_v, emb_k, values, keys, part_v, part_k, query) -> tuple[tuple, list[Tensor]]:
    layout = (emb_k is not None, len(values), len(keys), part_v is not None, part_k is not None)
    tensors = [emb_v, *([emb_k] if emb_k is not None else []), *values, *keys,
               *([part_v] if part_v is not None else []), *([part_k] if part_k is not None else []), query]
    return layout, tensors


def _unflatten(layout: tuple, tensors) -> tuple:
    has_ek, nv, nk, has_pv, has_pk = layout
    it = iter(tensors)
    emb_v = next(it)
    emb_k = next(it) if has_ek else None
    values, keys = [next(it) for _ in range(nv)], [next(it) for _ in range(nk)]
    part_v = next(it) if has_pv else None
    part_k = next(it) if has_pk else None
    return emb_v, emb_k, values, keys, part_v, part_k, next(it)


def _n_handed(layout: tuple) -> int:
    return 1 + int(layout[0]) + layout[1] + layout[2]


def _hand_on(layout: tuple, tensors) -> list[Tensor]:
    """The completed sources as views (the next read takes them: its gradient of them reaches this read)."""
    return [t.view_as(t) for t in tensors[: _n_handed(layout)]]


def _sources(layout: tuple, handed: list[Tensor]) -> tuple:
    emb_v, emb_k, values, keys, *_ = _unflatten((*layout[:3], False, False), [*handed, None])
    return emb_v, emb_k, values, keys


def _acc_order(layout: tuple, grad_handed) -> list[Tensor | None]:
    """The handed-on sources' gradients in the backward ops' order: [emb_v, values...] + [emb_k, keys...]."""
    emb_v, emb_k, values, keys, *_ = _unflatten((*layout[:3], False, False), [*grad_handed, None])
    return [emb_v, *values, *([emb_k, *keys] if layout[0] else [])]


def _input_order(layout: tuple, grads: list[Tensor]) -> list[Tensor]:
    """The backward ops' gradients ([d values..., d partial?] + [d keys..., d partial key?] + [d query]) in the
    order of the flattened inputs."""
    has_ek, nv, nk, has_pv, has_pk = layout
    n_src = 1 + nv + int(has_pv)
    dvs, dks, dq = grads[:n_src], grads[n_src:-1], grads[-1]
    emb_k = [dks[0]] if has_ek else []
    part_v = [dvs[-1]] if has_pv else []
    part_k = [dks[-1]] if has_pk else []
    return [dvs[0], *emb_k, *dvs[1 : 1 + nv], *dks[1 : 1 + nk], *part_v, *part_k, dq]


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


def _group_grads(grad_out: Tensor, grad_lse: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor, emb_k: Tensor | None,
                 values: list[Tensor], keys: list[Tensor], queries: Tensor, acc: list[Tensor | None],
                 consts: list[float], scale: float, heads: int, key_norm: bool, key_offset: int,
                 in_place: bool) -> list[Tensor]:
    """group_bwd's gradients, the later reads' `acc` added (as _read_grads)."""
    rd = ReadLaunch(emb_v, emb_k, values, keys, None, None, queries, consts, heads, key_offset, group=True)
    sources, carried_keys = [emb_v, *values], ([emb_k, *keys] if rd.carried else [])
    acc_v, acc_k = split_acc(rd, acc, sources, carried_keys, in_place)
    dvs, dks = source_grads(rd, sources, carried_keys, acc_v, acc_k)
    extra = [d.data_ptr() for d in dvs[1:]] + [d.data_ptr() for d in dks[1:]] + accumulated_flags(rd, acc_v, acc_k)
    dq = torch.empty((rd.grid[0], rd.G, rd.R), dtype=rd.cdtype, device=emb_v.device)
    launch_kernels().group_bwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(extra), rd.query, out, lse, grad_out.contiguous(),
        grad_lse.contiguous(), dvs[0], dks[0], dq, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.G,
        scale, key_norm, BLOCK_G=rd.BLOCK_G, **rd.constexprs())
    dks = fold_keys(rd, dvs, dks, key_offset)
    return [*dvs, *dks, dq.sum(0).to(queries.dtype)]


@torch.library.custom_op("lrattn::attnres_group_bwd", mutates_args=())
def attnres_group_bwd(grad_out: Tensor, grad_lse: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor,
                      emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], queries: Tensor,
                      acc: list[Tensor | None], consts: list[float], scale: float, heads: int, key_norm: bool,
                      key_offset: int) -> list[Tensor]:
    """[d emb_v, d values...] + [d emb_k, d keys...] (carried keys) + [d queries], `acc` added (as
    attnres_read_bwd)."""
    return _group_grads(grad_out, grad_lse, out, lse, emb_v, emb_k, values, keys, queries, acc, consts, scale,
                        heads, key_norm, key_offset, in_place=False)


@attnres_group_bwd.register_fake
def _(grad_out, grad_lse, out, lse, emb_v, emb_k, values, keys, queries, acc, consts, scale, heads, key_norm,
      key_offset):
    vals = [emb_v, *values]
    ks = [emb_k, *keys] if emb_k is not None else []
    return [t.new_empty(t.shape, dtype=t.dtype) for t in vals + ks] + [queries.new_empty(queries.shape)]


class _Group(torch.autograd.Function):
    """Phase 1 of a group, its sources' gradients accumulated along the chain of reads (as _Read)."""

    @staticmethod
    def forward(ctx, spec, *tensors):
        layout, consts, scale, heads, key_norm, key_offset, record = spec
        emb_v, emb_k, values, keys, _, _, queries = _unflatten(layout, tensors)
        out, lse, alpha = attnres_group(emb_v, emb_k, values, keys, queries, list(consts), scale, heads, key_norm,
                                        key_offset, record)
        ctx.save_for_backward(*tensors, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(alpha)
        ctx.set_materialize_grads(False)
        return (out, lse, alpha, *_hand_on(layout, tensors))

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_alpha, *grad_handed):
        *tensors, out, lse = ctx.saved_tensors
        layout, consts, scale, heads, key_norm, key_offset, _ = ctx.spec
        emb_v, emb_k, values, keys, _, _, queries = _unflatten(layout, tensors)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        args = (grad_out, grad_lse, out, lse, emb_v, emb_k, values, keys, queries, _acc_order(layout, grad_handed),
                list(consts), scale, heads, key_norm, key_offset)
        grads = attnres_group_bwd(*args) if torch.compiler.is_compiling() else _group_grads(*args, in_place=True)
        return (None, *_input_order(layout, grads))


def group(emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], queries: Tensor,
          consts: list[float], scale: float, heads: int, key_norm: bool, key_offset: int,
          record: bool) -> tuple[Tensor, Tensor, Tensor, tuple]:
    """Phase 1 of a group -> (out [G, N, D], lse [G, N, m], alpha, the sources handed on (as `read`))."""
    layout, tensors = _flatten(emb_v, emb_k, values, keys, None, None, queries)
    out, lse, alpha, *handed = _Group.apply((layout, tuple(consts), scale, heads, key_norm, key_offset, record),
                                            *tensors)
    return out, lse, alpha, _sources(layout, handed)


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
