"""Where the `triton` backend's kernels run and how they are launched: whether they can run here
(availability_error), where launches go (the kernels, or a recorder: set_launch_target), the launch geometry
under the register budget, and `ReadLaunch`, what every kernel needs of one read (rows, key mode, the pointer
table, the geometry), and the helpers the custom ops share (launch_kernels, as_rows, out_dtype, source_grads,
fold_keys). A launch's table reaches the device without blocking the host: device_table (float_words packs its
float64 entries). The custom ops that launch: ops.py.
Importing this module never needs triton: the kernels (kernels.py) are imported when a launch first asks.
"""

from __future__ import annotations

import os
import struct

import torch
from torch import Tensor

from lrattn_lightning.core.errors import InputError

# Where launches go: None, the kernels (kernels.py); or a recorder that keeps each launch's arguments and
# runs nothing (tools/kernels/specs.py, recorded_launches: which specialisations the model launches)
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


def launch_kernels():
    """What a launch goes to: the kernels (kernels.py, imported on the first launch) or the recorder set."""
    if _launch_target is not None:
        return _launch_target
    from lrattn_lightning.model.routing.attnres.triton import kernels as triton_kernels

    return triton_kernels


def as_rows(x: Tensor) -> tuple[Tensor, int]:
    """x as [N, C] rows with unit column stride (a view where possible) and its row stride."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, (x2.stride(0) if x2.shape[0] > 1 else x2.shape[-1])


def float_words(xs: list[float]) -> list[int]:
    """Float64 values as int64 words (their bits): the table's priors and eps (the kernels read them as float64)."""
    return list(struct.unpack(f"<{len(xs)}q", struct.pack(f"<{len(xs)}d", *xs)))


def device_table(words: list[int], device: torch.device) -> Tensor:
    """The int64 table `words` (pointers, strides, float64 bits) on `device`, without blocking the host.

    A launch's table holds the data pointers of its sources and, in backward, of the gradient buffers it
    writes: the partial block and those buffers exist only at that launch, so the table is built there, on
    the host (data_ptr() is a host value). torch.tensor(words).to(cuda) copies from pageable memory, which
    PyTorch does with cudaMemcpyAsync and then a stream synchronisation: the host waited at every launch
    for the kernels queued before it, so no launch overlapped the GPU's work. Here the host tensor is pinned
    and copied with non_blocking=True: the copy is queued on the stream like a kernel, ahead of the kernel
    that reads it, and the host goes on; PyTorch's caching host allocator records an event at the copy and
    reuses the pinned block only after it, so the host tensor may be dropped at once. Not chosen: caching
    tables by content (pointers change whenever the allocator hands out other buffers, and a cached device
    table outliving a stream's use is a hazard), and one table per step (its entries do not exist until
    their launch). On CPU (Triton's interpreter) the host tensor is the table: no copy at all."""
    host = torch.tensor(words, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _dtype_name(dtypes: list[torch.dtype]) -> str:
    """The one dtype of the table's tensors, by name (the kernels map it to Triton's)."""
    if len(set(dtypes)) > 1:
        raise RuntimeError(f"attnres_read: the block summaries must share one dtype, got {sorted(map(str, dtypes))}")
    return str(dtypes[0]).removeprefix("torch.") if dtypes else "float32"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


# Launch geometry (the register budget: <= 128 registers per thread, no spills; tests/tools/test_triton_compile.py,
# docs/benchmarks.md). A forward program holds a tile of BLOCK_N tokens x BLOCK_G sites x one head's row
# (the online softmax's accumulator); rows are whole (any D, r: masked), so BLOCK_N is what shrinks:
# PROGRAM_TILE elements (one token where a row is wider) at 4 elements per thread, num_warps = tile / 128
# from 4 up to 16 (8 elements per thread in the 4096-element tiles of d = 4096 and of two-phase groups).
# The backward read walks a row in chunks of at most BWD_CHUNK columns (tile BLOCK_N x CH, bwd_geometry:
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


def bwd_geometry(n_tokens: int, chunk: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the backward read, whose tile is [BLOCK_N, chunk]: as many tokens as geometry
    gives a BWD_CHUNK-wide row (4 at PROGRAM_TILE 1024), at ELEMENTS_PER_THREAD of the tile a thread. A
    narrower chunk (e < 256) takes fewer threads, not more tokens: [8, 128] tiles at 8 warps sat at the
    128-register cap (sm_90) and spilled 8 bytes once the kernel added into the gradient chain's buffer (ops.py);
    [4, 128] at 4 warps: 104-110 registers."""
    block_n, _ = geometry(n_tokens, BWD_CHUNK)
    return block_n, max(1, min(MAX_WARPS, block_n * chunk // (32 * ELEMENTS_PER_THREAD)))


class ReadLaunch:
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
        self.ev, self.sev = as_rows(emb_v)
        self.ek, self.sek = as_rows(ek)
        vt = [as_rows(v) for v in values]
        kt = [as_rows(k) for k in key_of]
        self.vdtype = _dtype_name([v.dtype for v, _ in vt])
        self.kdtype = _dtype_name([k.dtype for k, _ in kt])
        self.values, self.keys = [v for v, _ in vt], [k for k, _ in kt]
        self.ints = ([v.data_ptr() for v, _ in vt] + [s for _, s in vt] + [k.data_ptr() for k, _ in kt]
                     + [s for _, s in kt])
        self.consts = float_words(consts)
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
        self.bwd_block_n, self.bwd_warps = bwd_geometry(self.N, self.CH)
        self.bwd_grid = (triton_cdiv(self.N, self.bwd_block_n), heads)

    def meta(self, extra: list[int] = ()) -> tuple[Tensor, Tensor]:
        """The table on the device (device_table: one copy per launch, queued, not waited on), as int64 and
        as float64."""
        meta = device_table(self.ints + self.consts + list(extra), self.ev.device)
        return meta, meta.view(torch.float64)

    def dtypes(self) -> dict:
        dtypes = launch_kernels().DTYPES
        return dict(VDT=dtypes[self.vdtype], KDT=dtypes[self.kdtype], ACC=dtypes[str(self.cdtype).removeprefix("torch.")])

    def constexprs(self) -> dict:
        return dict(KEY_MODE=self.key_mode, **self.dtypes(), BLOCK_N=self.BLOCK_N, BLOCK_E=self.BLOCK_E,
                    **self.options())

    def options(self, num_warps: int | None = None) -> dict:
        return dict(num_warps=num_warps or self.num_warps, num_stages=1, maxnreg=REG_BUDGET)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def out_dtype(emb_v: Tensor, values: list[Tensor], part_v: Tensor | None) -> torch.dtype:
    """A read's output dtype: its sources' promoted."""
    dtype = emb_v.dtype
    for v in [*values, *([part_v] if part_v is not None else [])]:
        dtype = torch.promote_types(dtype, v.dtype)
    return dtype


def split_acc(rd: ReadLaunch, acc: list[Tensor | None], sources: list[Tensor], carried_keys: list[Tensor],
              in_place: bool) -> tuple[list, list]:
    """The gradients the later reads gave a read's completed sources (`acc`: [emb_v, values...] + [emb_k,
    keys...] for carried keys), per slot of `sources` / `carried_keys` (None where none; the partial block has
    none), dense in the source's dtype: the buffers the kernels add this read's share to. In place, the
    gradients themselves (eager); else copies (torch.compile: an incoming gradient is not mutated)."""
    n = len(sources) - int(rd.has_partial)
    pad = [None] * int(rd.has_partial)

    def buffer(a: Tensor | None, t: Tensor) -> Tensor | None:
        if a is None:
            return None
        a = a.to(t.dtype)
        return a.contiguous() if in_place else a.clone(memory_format=torch.contiguous_format)

    acc_v = [buffer(a, t) for a, t in zip([*acc[:n], *pad], sources, strict=True)]
    acc_k = [buffer(a, t) for a, t in zip([*acc[n:], *pad], carried_keys, strict=True)] if rd.carried else []
    return acc_v, acc_k


def source_grads(rd: ReadLaunch, sources: list[Tensor], carried_keys: list[Tensor], acc_v: list = (),
                 acc_k: list = ()) -> tuple[list, list]:
    """Value gradients of `sources` and key gradients (carried keys; key mode 1's own buffers; key mode 0: the
    value gradients themselves, the kernels add the key's share there): the buffer of `acc_v` / `acc_k` where
    one is given (split_acc: the kernels add to it, accumulated_flags), else a new one (written)."""
    acc_v = list(acc_v) or [None] * len(sources)
    dvs = [a if a is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
           for t, a in zip(sources, acc_v, strict=True)]
    if rd.carried:
        acc_k = list(acc_k) or [None] * len(carried_keys)
        dks = [a if a is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
               for t, a in zip(carried_keys, acc_k, strict=True)]
    elif rd.key_mode == 1:
        dks = [t.new_empty(*t.shape[:-1], rd.R) for t in dvs]
    else:
        dks = dvs
    return dvs, dks


def accumulated_flags(rd: ReadLaunch, acc_v: list, acc_k: list) -> list[int]:
    """The backward table's flags, every slot's dv's then dk's: 1 where the buffer holds the later reads'
    gradient (the kernel adds to it), 0 where it is new. Key mode 0: the key's buffer is the value's; key mode 1
    without carried keys: always new (fold_keys adds the key's gradient to the value's afterwards)."""
    hv = [int(a is not None) for a in acc_v]
    if rd.carried:
        return hv + [int(a is not None) for a in acc_k]
    return hv + (hv if rd.key_mode == 0 else [0] * len(hv))


def fold_keys(rd: ReadLaunch, dvs: list[Tensor], dks: list[Tensor], key_offset: int) -> list[Tensor]:
    """Key-in-value sources: key mode 1's key gradients added to their value columns; [] then (none apart)."""
    if rd.carried:
        return dks
    if rd.key_mode == 1:
        for dv, dk in zip(dvs, dks, strict=True):
            dv[..., key_offset:] += dk
    return []


def check_device(device: torch.device) -> None:
    """Raise (one line) when tensors on `device` cannot run the kernels."""
    error = availability_error(device.type)
    if error is not None:
        raise InputError(error)
