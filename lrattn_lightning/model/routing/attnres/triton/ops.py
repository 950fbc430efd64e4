"""The `triton` backend's torch custom ops: `lrattn::attnres_read` (one depth read) and its backward.

Registered with torch.library (custom_op + register_fake + register_autograd), so autograd calls the
hand-written backward kernel and torch.compile keeps each read whole (an opaque node, no graph break).
The kernels (kernels.py) are imported when an op first runs: importing this module, and the
package, never needs triton.

A read's sources: the embedding (emb_v, its carried key emb_k or None), the completed block summaries
(values, their carried keys; empty for key-in-value sources), the partial block (part_v, part_k or None).
Keys that are None are read from the value: columns key_offset.. (sliced) or all of them (value keys).
consts: the len(values) + 2 slots' priors then eps (embedding, summaries, partial; the partial's slot
is present even without a partial). The kernels see the embedding and a table of the other sources (the
summaries, then the partial block when there is one: one dtype). Shapes: values [B, T, D], keys [B, T, r], query [r] (static) or
[B, T, r] (per token) -> out [B, T, D], lse [N, m] (compute dtype), alpha [S_used, N, m] when `record`
(else empty).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from lrattn_lightning.core.errors import InputError

# Where launches go: None, the kernels (kernels.py); or a recorder that keeps each launch's arguments and
# runs nothing (specs.recorded_launches: which specialisations the model launches, for compile checks)
_launch_target = None


def set_launch_target(target) -> None:
    """Send every kernel launch to `target` (its attributes stand for the kernels) instead; None: the kernels."""
    global _launch_target
    _launch_target = target


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1 must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def availability_error(device_type: str | None = None) -> str | None:
    """Why the triton backend cannot run here (None: it can). device_type None: only the machine."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "model.impl 'triton' needs the triton package (pip install triton); or use impl 'fast'"
    if interpreting() or _launch_target is not None:  # (a recorder runs nothing: any device)
        return None
    if device_type is None and torch.cuda.is_available():
        return None
    if device_type == "cuda":
        return None
    return ("model.impl 'triton' needs a CUDA GPU, or TRITON_INTERPRET=1 in the environment (Triton's CPU "
            "interpreter, slow: for tests); on this machine use impl 'fast'")


def _kernels():
    if _launch_target is not None:
        return _launch_target
    from lrattn_lightning.model.routing.attnres.triton import kernels as triton_kernels

    return triton_kernels


def _rows(x: Tensor) -> tuple[Tensor, int]:
    """x as [N, C] rows with unit column stride (a view where possible) and its row stride."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, (x2.stride(0) if x2.shape[0] > 1 else x2.shape[-1])


def _dtype_name(dtypes: list[torch.dtype]) -> str:
    """The one dtype of the table's tensors, by name (the kernels map it to Triton's)."""
    if len(set(dtypes)) > 1:
        raise RuntimeError(f"attnres_read: the block summaries must share one dtype, got {sorted(map(str, dtypes))}")
    return str(dtypes[0]).removeprefix("torch.") if dtypes else "float32"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


# Launch geometry (the register budget: <= 128 registers per thread, no spills; tests/test_compile_check.py,
# docs/benchmarks.md). A forward program holds a tile of BLOCK_N tokens x BLOCK_G sites x one head's row
# (the online softmax's accumulator); rows are whole (any D, r: masked), so BLOCK_N is what shrinks:
# PROGRAM_TILE elements (one token where a row is wider) at 4 elements per thread, num_warps = tile / 128
# from 4 up to 16 (8 elements per thread in the 4096-element tiles of d = 4096 and of two-phase groups).
# The backward read walks a row in chunks of at most BWD_CHUNK columns (tile BLOCK_N x CH = PROGRAM_TILE:
# 4 tokens x 256 at every width from e = 256 up, so d = 1024 and d = 4096 launch one kernel). Measured with
# Triton's compiler and ptxas: 16 elements per thread took up to 230 registers in the backward kernels at
# D = 1024; 32-warp programs made ptxas keep 32 or 64 registers and spill; whole 4096-wide rows in the
# backward read sat at 128 registers and spilled under triton 3.6. Every launch also passes maxnreg =
# REG_BUDGET (PTX .maxnreg): without it ptxas 12.9 (sm_80) trades a few bytes of spill for full occupancy
# in some kernels; and num_stages = 1: no tl.dot, so software pipelining has nothing to overlap (and its
# passes cost compile time).
PROGRAM_TILE = 1024
ELEMENTS_PER_THREAD = 4
MAX_WARPS = 16
REG_BUDGET = 128
BWD_CHUNK = 256
# A group's tile: BLOCK_G * width <= GROUP_TILE_MAX (16 warps at 8 elements per thread), at most
# GROUP_SITES_MAX sites; larger groups are split into sub-groups that fit (group_limit), each reading the
# completed sources once. Every group kernel of a width holds BLOCK_G = group_limit sites (masked): groups of
# 2 and of 3 or 4 sites launch one kernel.
GROUP_TILE_MAX = 4096
GROUP_SITES_MAX = 8


def group_limit(d_model: int, heads: int, key_width: int) -> int:
    """The most sites one two-phase kernel holds (its tile: pow2(G) x a head's row <= GROUP_TILE_MAX)."""
    width = max(_pow2(d_model // heads), _pow2(key_width // heads))
    return min(GROUP_SITES_MAX, _pow2_floor(max(1, GROUP_TILE_MAX // width)))


def geometry(n_tokens: int, row: int, sites: int = 1) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a launch over n_tokens whose tile holds `sites` x `row` elements per token. Few
    tokens cap BLOCK_N at 16 or more, so decoding (one token a sequence) launches the kernels training
    compiled. A source's tile [BLOCK_N, row] keeps one element per thread at least: fewer (a group tile of
    8 sites x 256 at 16 warps) made triton 3.6 replicate it across threads and spill kilobytes."""
    block_n = max(1, min(64, _pow2_floor(max(1, PROGRAM_TILE // (row * sites))), max(16, _pow2(n_tokens))))
    warps = min(MAX_WARPS, max(4, block_n * row * sites // (32 * ELEMENTS_PER_THREAD)))
    return block_n, max(1, min(warps, _pow2_floor(block_n * row // 32)))


class _Read:
    """What both kernels need of one read: rows, key mode, the table and the launch geometry."""

    def __init__(self, emb_v, emb_k, values, keys, part_v, part_k, query, consts, heads, key_offset, group=False):
        self.B_T, D = emb_v.shape[:-1], emb_v.shape[-1]
        R = query.shape[-1]
        self.has_partial = part_v is not None
        if self.has_partial:  # the partial block: the table's last source
            values, keys = [*values, part_v], ([*keys, part_k] if emb_k is not None else keys)
        else:  # no partial: its slot's prior and eps go
            half = len(consts) // 2
            consts = [*consts[: half - 1], *consts[half:-1]]
        self.N, self.D, self.R, self.heads, self.S_t = emb_v.numel() // D, D, R, heads, len(values)
        self.carried = emb_k is not None
        # key mode 0: the key lies in the head's value columns (value keys; sliced keys with one head)
        self.key_mode = 1 if self.carried or not (heads == 1 or R == D) else 0
        self.key_offset = 0 if self.carried else key_offset
        if self.carried:
            key_of = list(keys)
            ek = emb_k
        else:  # key-in-value: views of the values' key columns
            key_of = [v[..., key_offset:] for v in values]
            ek = emb_v[..., key_offset:]
        self.ev, self.sev = _rows(emb_v)
        self.ek, self.sek = _rows(ek)
        vt = [_rows(v) for v in values]
        kt = [_rows(k) for k in key_of]
        self.vdtype = _dtype_name([v.dtype for v, _ in vt])
        self.kdtype = _dtype_name([k.dtype for k, _ in kt])
        self.values, self.keys = [v for v, _ in vt], [k for k, _ in kt]
        self.ints = ([v.data_ptr() for v, _ in vt] + [s for _, s in vt] + [k.data_ptr() for k, _ in kt]
                     + [s for _, s in kt])
        self.consts = torch.tensor(consts, dtype=torch.float64).view(torch.int64).tolist()
        self.query, self.query_per_token = query.contiguous(), query.dim() > 1 and not group
        self.cdtype = torch.promote_types(emb_v.dtype, torch.float32)
        self.E, self.K = D // heads, R // heads
        self.BLOCK_E = _pow2(max(self.E, self.K))  # (a key of its own is loaded as wide as the value)
        # a group's tile holds its G sites at once: [BLOCK_N, BLOCK_G, BLOCK_E]
        self.G = query.shape[0] if group else 1
        self.BLOCK_G = max(_pow2(self.G), group_limit(D, heads, R)) if group else 1
        self.BLOCK_N, self.num_warps = geometry(self.N, self.BLOCK_E, self.BLOCK_G)
        self.grid = (triton_cdiv(self.N, self.BLOCK_N), heads)
        # the backward read: chunks of CH columns, BLOCK_N x CH tiles
        self.CH = min(BWD_CHUNK, _pow2(max(self.E, self.K)))
        self.bwd_block_n, self.bwd_warps = geometry(self.N, self.CH)
        self.bwd_grid = (triton_cdiv(self.N, self.bwd_block_n), heads)

    def meta(self, extra: list[int] = ()) -> tuple[Tensor, Tensor]:
        """The table on the device (one host-to-device copy per launch), as int64 and as float64."""
        meta = torch.tensor(self.ints + self.consts + list(extra), dtype=torch.int64).to(self.ev.device)
        return meta, meta.view(torch.float64)

    def dtypes(self) -> dict:
        dtypes = _kernels().DTYPES
        return dict(VDT=dtypes[self.vdtype], KDT=dtypes[self.kdtype], ACC=dtypes[str(self.cdtype).removeprefix("torch.")])

    def constexprs(self) -> dict:
        return dict(KEY_MODE=self.key_mode, **self.dtypes(), BLOCK_N=self.BLOCK_N, BLOCK_E=self.BLOCK_E,
                    **self.options())

    def options(self, num_warps: int | None = None) -> dict:
        return dict(num_warps=num_warps or self.num_warps, num_stages=1, maxnreg=REG_BUDGET)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _out_dtype(emb_v: Tensor, values: list[Tensor], part_v: Tensor | None) -> torch.dtype:
    dtype = emb_v.dtype
    for v in [*values, *([part_v] if part_v is not None else [])]:
        dtype = torch.promote_types(dtype, v.dtype)
    return dtype


def _n_used(values: list[Tensor], part_v: Tensor | None) -> int:
    return 1 + len(values) + int(part_v is not None)


@torch.library.custom_op("lrattn::attnres_read", mutates_args=())
def attnres_read(emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor],
                 part_v: Tensor | None, part_k: Tensor | None, query: Tensor, consts: list[float], scale: float,
                 heads: int, key_norm: bool, key_offset: int, record: bool) -> tuple[Tensor, Tensor, Tensor]:
    rd = _Read(emb_v, emb_k, values, keys, part_v, part_k, query, consts, heads, key_offset)
    out = torch.empty(emb_v.shape, dtype=_out_dtype(emb_v, values, part_v), device=emb_v.device)
    lse = torch.empty(rd.N, heads, dtype=rd.cdtype, device=emb_v.device)
    alpha = torch.empty((_n_used(values, part_v), rd.N, heads) if record else (0,), dtype=rd.cdtype,
                        device=emb_v.device)
    _kernels().read_fwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(), rd.query, rd.R if rd.query_per_token else 0, out, lse,
        alpha if record else lse, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, scale, key_norm, record,
        **rd.constexprs())
    return out, lse, alpha


@attnres_read.register_fake
def _(emb_v, emb_k, values, keys, part_v, part_k, query, consts, scale, heads, key_norm, key_offset, record):
    cdtype = torch.promote_types(emb_v.dtype, torch.float32)
    N = emb_v.numel() // emb_v.shape[-1]
    out = emb_v.new_empty(emb_v.shape, dtype=_out_dtype(emb_v, values, part_v))
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
    rd = _Read(emb_v, emb_k, values, keys, part_v, part_k, query, consts, heads, key_offset)
    partial = [part_v] if rd.has_partial else []
    dvs, dks = _source_grads(rd, [emb_v, *values, *partial],
                             [emb_k, *keys, *([part_k] if rd.has_partial else [])] if rd.carried else [])
    # key mode 0: the key's gradient is the value's on its columns, written through views of dv there
    dkv = [d[..., key_offset:] for d in dvs] if rd.key_mode == 0 else dks
    extra = [d.data_ptr() for d in dvs[1:]] + [d.data_ptr() for d in dkv[1:]]
    tiles = rd.bwd_grid[0]
    dq = torch.empty((rd.N, rd.R) if rd.query_per_token else (tiles, rd.R), dtype=rd.cdtype, device=emb_v.device)
    g, _ = _rows(grad.contiguous())
    in_value = rd.key_mode == 0
    _kernels().read_bwd[rd.bwd_grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(extra), rd.query, rd.R if rd.query_per_token else 0, out, lse, g,
        dvs[0], dkv[0], rd.D if in_value else rd.R, dq, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.E,
        rd.E - rd.K if in_value else rd.E, rd.K, scale, key_norm, in_value, rd.query_per_token,
        **rd.dtypes(), BLOCK_N=rd.bwd_block_n, CH=rd.CH, **rd.options(rd.bwd_warps))
    dks = _fold_keys(rd, dvs, dks, key_offset)
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


# ---- two-phase block reads (kernels.py: group_fwd / merge_fwd and their backward) ----------------
@torch.library.custom_op("lrattn::attnres_group", mutates_args=())
def attnres_group(emb_v: Tensor, emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], queries: Tensor,
                  consts: list[float], scale: float, heads: int, key_norm: bool, key_offset: int,
                  record: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Phase 1 of a group: its G static queries [G, r] over the completed sources -> out [G, N, D],
    lse [G, N, m] (compute dtype), alpha [1 + len(values), N, m, G] when `record` (else empty)."""
    rd = _Read(emb_v, emb_k, values, keys, None, None, queries, consts, heads, key_offset, group=True)
    out = torch.empty((rd.G, rd.N, rd.D), dtype=_out_dtype(emb_v, values, None), device=emb_v.device)
    lse = torch.empty(rd.G, rd.N, heads, dtype=rd.cdtype, device=emb_v.device)
    alpha = torch.empty((1 + rd.S_t, rd.N, heads, rd.G) if record else (0,), dtype=rd.cdtype, device=emb_v.device)
    _kernels().group_fwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(), rd.query, out, lse, alpha if record else lse,
        rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.G, scale, key_norm, record,
        BLOCK_G=rd.BLOCK_G, **rd.constexprs())
    return out, lse, alpha


@attnres_group.register_fake
def _(emb_v, emb_k, values, keys, queries, consts, scale, heads, key_norm, key_offset, record):
    cdtype = torch.promote_types(emb_v.dtype, torch.float32)
    N, D, G = emb_v.numel() // emb_v.shape[-1], emb_v.shape[-1], queries.shape[0]
    alpha = emb_v.new_empty((1 + len(values), N, heads, G) if record else (0,), dtype=cdtype)
    return (emb_v.new_empty((G, N, D), dtype=_out_dtype(emb_v, values, None)),
            emb_v.new_empty((G, N, heads), dtype=cdtype), alpha)


def _source_grads(rd: _Read, sources: list[Tensor], carried_keys: list[Tensor]) -> tuple[list, list]:
    """Empty value gradients of `sources` and key gradients (carried keys; key mode 1's own buffers; key
    mode 0: the value gradients themselves, the kernels add the key's share there)."""
    dvs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in sources]
    if rd.carried:
        dks = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in carried_keys]
    elif rd.key_mode == 1:
        dks = [t.new_empty(*t.shape[:-1], rd.R) for t in dvs]
    else:
        dks = dvs
    return dvs, dks


def _fold_keys(rd: _Read, dvs: list[Tensor], dks: list[Tensor], key_offset: int) -> list[Tensor]:
    """Key-in-value sources: key mode 1's key gradients added to their value columns; [] then (none apart)."""
    if rd.carried:
        return dks
    if rd.key_mode == 1:
        for dv, dk in zip(dvs, dks, strict=True):
            dv[..., key_offset:] += dk
    return []


@torch.library.custom_op("lrattn::attnres_group_bwd", mutates_args=())
def attnres_group_bwd(grad_out: Tensor, grad_lse: Tensor, out: Tensor, lse: Tensor, emb_v: Tensor,
                      emb_k: Tensor | None, values: list[Tensor], keys: list[Tensor], queries: Tensor,
                      consts: list[float], scale: float, heads: int, key_norm: bool,
                      key_offset: int) -> list[Tensor]:
    """[d emb_v, d values...] + [d emb_k, d keys...] (carried keys) + [d queries]."""
    rd = _Read(emb_v, emb_k, values, keys, None, None, queries, consts, heads, key_offset, group=True)
    dvs, dks = _source_grads(rd, [emb_v, *values], [emb_k, *keys] if rd.carried else [])
    extra = [d.data_ptr() for d in dvs[1:]] + [d.data_ptr() for d in dks[1:]]
    dq = torch.empty((rd.grid[0], rd.G, rd.R), dtype=rd.cdtype, device=emb_v.device)
    _kernels().group_bwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, *rd.meta(extra), rd.query, out, lse, grad_out.contiguous(),
        grad_lse.contiguous(), dvs[0], dks[0], dq, rd.N, rd.D, rd.R, rd.key_offset, heads, rd.S_t, rd.G, scale,
        key_norm, BLOCK_G=rd.BLOCK_G, **rd.constexprs())
    dks = _fold_keys(rd, dvs, dks, key_offset)
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


def _merge_read(part_v, part_k, query, heads, key_offset) -> _Read:
    """The partial block as the only source of a _Read (its embedding slot)."""
    return _Read(part_v, part_k, [], [], None, None, query, [0.0] * 4, heads, key_offset)


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
    _kernels().merge_fwd[rd.grid](
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
    (dv,), (dk,) = _source_grads(rd, [part_v], [part_k] if rd.carried else [])
    d_out = torch.empty(out_c.shape, dtype=out_c.dtype, device=out_c.device)
    d_lse = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    dq = torch.empty((rd.grid[0], rd.R), dtype=rd.cdtype, device=part_v.device)
    fmeta = torch.tensor([prior, eps], dtype=torch.float64).to(part_v.device)
    cx = rd.constexprs()
    g, _ = _rows(grad.contiguous())
    _kernels().merge_bwd[rd.grid](
        rd.ev, rd.sev, rd.ek, rd.sek, fmeta, rd.query, out_c.contiguous(), w, g, d_out, d_lse, dv, dk, dq,
        rd.N, rd.D, rd.R, rd.key_offset, heads, scale, key_norm, KEY_MODE=cx["KEY_MODE"], ACC=cx["ACC"],
        BLOCK_N=rd.BLOCK_N, BLOCK_E=rd.BLOCK_E, **rd.options())
    dks = _fold_keys(rd, [dv], [dk], key_offset)
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


def check_device(device: torch.device) -> None:
    """Raise (one line) when tensors on `device` cannot run the kernels."""
    error = availability_error(device.type)
    if error is not None:
        raise InputError(error)
