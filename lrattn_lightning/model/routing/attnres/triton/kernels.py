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
walks the row in chunks of CH columns (per source the key's columns for alpha and then for dk, loaded once
where they fit a chunk, else twice; the value's once, <g, v> and dv from the same tiles), so no tile in it is
wider than BLOCK_N x CH at any width.
Accumulation (ACC) in float32, or float64 for float64 models. BLOCK_N, CH and num_warps (launch.geometry)
keep a tile at 4 elements per thread (8 in the 4096-element tiles), and every launch passes maxnreg = 128:
the register budget of docs/benchmarks.md, checked by tests/tools/test_triton_compile.py. Token counts, head
counts, loop bounds and the runtime flags (N, heads, S_t, G, key_norm, write_alpha, ...) are not constexprs
and the counts are not specialised on (a value of 1 or a multiple of 16 would otherwise compile a kernel of
its own: decoding's N = 1, the first block's S_t = 1); widths and strides are.

meta layout (S_t table sources, S = S_t + 1 slots: embedding 0, table 1..S_t, the partial last when present):
    [0, S_t) value pointers  [S_t, 2S_t) value row strides  [2S_t, 3S_t) key pointers  [3S_t, 4S_t) key strides
    [4S_t, 4S_t + S) priors  [4S_t + S, 4S_t + 2S) eps
    backward also: the table's dv pointers [S_t], dk pointers [S_t], then every slot's flags, dv's [S] and dk's
    [S]: 1 where that buffer already holds the later reads' gradient of the source (the kernel adds its share
    to it: ops.py's gradient chain), 0 where it is new (written)

Sections below: the shared helpers (a source's tiles, its key's 1 / RMS and logit, a program's layout) and the
torch dtype -> Triton dtype table (DTYPES); one depth read (read_fwd, read_bwd); the two-phase block reads
(group_fwd / group_bwd, merge_fwd / merge_bwd). This module imports only triton (tools/kernels/compile_check.py
loads it by path, without torch); ops.py launches `kernels.<name>` through launch.launch_kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---- shared by every kernel: a source's tiles, its key's 1 / RMS, its logit; a program's layout ----------
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
def _flagged(mask, flag):
    """`mask` where `flag` (an int64 the kernel loaded from its table) is not 0, else nothing (as a vector:
    Triton's interpreter refuses a vector mask and-ed with a loaded scalar's comparison)."""
    return mask & ((mask.to(tl.int64) * 0 + flag) != 0)


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


# ---- one depth read: the online softmax over a read's sources (read_fwd) and its gradients (read_bwd) -----
@triton.jit
def _online(m_i, l_i, acc, logit, v):
    """One source into the running softmax (max m, sum l, weighted sum acc)."""
    m_new = tl.maximum(m_i, logit)
    corr = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * corr + p, acc * corr[:, None] + p[:, None] * v


@triton.jit
def _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale, key_norm,
                  KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr):
    """Source `s` of the pointer table: its value and raw logit (_source)."""
    vp = tl.load(meta + s).to(tl.pointer_type(VDT))
    kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
    eps = tl.load(fmeta + EP + 1 + s).to(ACC)
    v, _, lraw, _ = _source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), eps, rows, rmask,
                            vcols, emask, kcols, kmask, qt, K, scale, key_norm, KEY_MODE, ACC)
    return v, lraw


@triton.jit(do_not_specialize=["N", "heads", "S_t"])
def read_fwd(ev, sev, ek, sek, meta, fmeta, q, sq, out, lse, alpha, N, D, R, KOFF, heads, S_t, scale, key_norm,
             write_alpha, KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """out = sum_s softmax_s(logit) v_s and lse per (token, head); alpha [S, N, heads] when write_alpha."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E, KEY_MODE)
    S = S_t + 1
    PR = 4 * S_t  # slot i's prior at fmeta[PR + i], its eps at fmeta[EP + i]
    EP = PR + S
    # the routing weights (diagnostics): each slot's logit kept in alpha as it is computed, turned into
    # exp(logit - lse) at the end (masked off unless write_alpha: a runtime flag, one kernel for both)
    NH = N * heads
    a_ptr = alpha + rows * heads + h
    amask = rmask & write_alpha
    qt = tl.load(q + rows[:, None] * sq + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32).to(ACC)
    l_i = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32).to(ACC)
    # one online softmax over the embedding, then the table (completed summaries, the partial block last)
    v, x, lraw, _ = _source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                            kmask, qt, K, scale, key_norm, KEY_MODE, ACC)
    logit = lraw + tl.load(fmeta + PR).to(ACC)
    tl.store(a_ptr, logit, mask=amask)
    m_i, l_i, acc = _online(m_i, l_i, acc, logit, v)
    for s in range(S_t):
        v, lraw = _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
                                key_norm, KEY_MODE, VDT, KDT, ACC)
        logit = lraw + tl.load(fmeta + PR + 1 + s).to(ACC)
        tl.store(a_ptr + (1 + s) * NH, logit, mask=amask)
        m_i, l_i, acc = _online(m_i, l_i, acc, logit, v)
    lse_n = m_i + tl.log(l_i)
    tl.store(out + rows[:, None] * D + vcols[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    tl.store(lse + rows * heads + h, lse_n, mask=rmask)
    tl.debug_barrier()  # (the logits are read back, possibly by other threads)
    for s in range(S * write_alpha):
        tl.store(a_ptr + s * NH, tl.exp(tl.load(a_ptr + s * NH, mask=rmask, other=0.0) - lse_n), mask=rmask)


# ---- the backward read, in chunks of CH columns: no tensor wider than a [BLOCK_N, CH] tile ----------------
# Per source, three passes, no tile wider than [BLOCK_N, CH]: the key's columns (<x, q>, <x, x>, and <g, x> where
# the key is part of the value: alpha needs only the key), then the value's own columns once (<g, v> summed and
# dv = alpha g written from the same tiles), then the key's columns again (dk = scale rstd dl q - dl (l - b)
# rstd^2 x / k, plus alpha g where the key lies in the value: there dk is the value's gradient on those
# columns; dl needs all of <g, v>). The value's columns (all E for a key of its own) and the output gradient on
# them are read once; the key's k columns too where they fit one chunk (KEY_ONE: k <= CH, the key's, the query's
# and the output gradient's tiles held across the value's columns: P-LR and S-LR keys, value keys with e <= 256),
# else twice (value keys wider than a chunk: their whole row). The query's gradient accumulates across sources
# in its output, read back by the program that wrote it.


@triton.jit
def _tile(p, stride, rows, rmask, cols, cmask, ACC: tl.constexpr):
    """[BLOCK_N, CH] of rows `rows` and columns `cols` of a row-major tensor, in ACC (masked: 0)."""
    return tl.load(p + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                   other=0.0).to(ACC)


@triton.jit
def _key_grad(x, qt, gk, a, c1, c2, dkp, sdk, hak, rows, rmask, kc, cm, dq, pid_n, R, query_per_token,
              FIRST: tl.constexpr, ACC: tl.constexpr):
    """A chunk of the key's gradient (written, added to what dkp holds where hak) and of the query's
    (added to dq), from the chunk's key x, query qt and output gradient gk on the key's columns (0 unless the
    key lies in the value)."""
    dx = c1[:, None] * qt - c2[:, None] * x + a[:, None] * gk + _tile(dkp, sdk, rows, rmask, kc, _flagged(cm, hak), ACC)
    tl.store(dkp + rows[:, None] * sdk + kc[None, :], dx.to(dkp.dtype.element_ty), mask=rmask[:, None] & cm[None, :])
    dqx = c1[:, None] * x
    if query_per_token:
        dq_p = dq + rows[:, None] * R + kc[None, :]
        dq_m = rmask[:, None] & cm[None, :]
        if not FIRST:
            dqx += tl.load(dq_p, mask=dq_m, other=0.0)
        tl.store(dq_p, dqx, mask=dq_m)
    else:
        dqs = tl.sum(dqx, 0)
        if not FIRST:
            dqs += tl.load(dq + pid_n * R + kc, mask=cm, other=0.0)
        tl.store(dq + pid_n * R + kc, dqs, mask=cm)


@triton.jit
def _bwd_source(vp, sv, kp, sk, dvp, dkp, sdk, hav, hak, prior, eps, rows, rmask, pid_n, h, E, VE, K, KOFF,
                D, R, q, sq, gout, dq, lse_n, delta, scale, key_norm, key_in_value, query_per_token,
                FIRST: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                KEY_ONE: tl.constexpr):
    """One source's value and key gradients (written; added to what dvp / dkp hold where hav / hak: the later
    reads' gradient of the source) and its share of the query's gradient (added to dq). KEY_ONE: the key's columns fit one chunk, so its
    tiles (key, query, output gradient) are loaded once and held across the value's columns."""
    cc = tl.arange(0, CH)
    # the key's columns: <x, q>, <x, x>, and <g, x> where the key is part of the value
    if KEY_ONE:
        km = cc < K
        kc1 = h * K + cc
        x1 = _tile(kp, sk, rows, rmask, kc1, km, ACC)
        q1 = _tile(q, sq, rows, rmask, kc1, km, ACC)
        g1 = _tile(gout, D, rows, rmask, KOFF + kc1, km & key_in_value, ACC)
        xq = tl.sum(x1 * q1, 1)
        xx = tl.sum(x1 * x1, 1)
        gv = tl.sum(g1 * x1, 1)
    else:
        gv = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
        xq = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
        xx = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
        for c0 in range(0, K, CH):
            cm = c0 + cc < K
            x = _tile(kp, sk, rows, rmask, h * K + c0 + cc, cm, ACC)
            xq += tl.sum(x * _tile(q, sq, rows, rmask, h * K + c0 + cc, cm, ACC), 1)
            xx += tl.sum(x * x, 1)
            gv += tl.sum(_tile(gout, D, rows, rmask, KOFF + h * K + c0 + cc, cm & key_in_value, ACC) * x, 1)
    rstd = _rstd(xx, K, eps, key_norm)
    lraw = scale * rstd * xq
    a = tl.exp(lraw + prior - lse_n)
    # the value's own columns [0, VE) (all E, or those left of a key lying in the value), once: <g, v> and dv
    for c0 in range(0, VE, CH):
        cm = c0 + cc < VE
        g = _tile(gout, D, rows, rmask, h * E + c0 + cc, cm, ACC)
        gv += tl.sum(g * _tile(vp, sv, rows, rmask, h * E + c0 + cc, cm, ACC), 1)
        dv = a[:, None] * g + _tile(dvp, D, rows, rmask, h * E + c0 + cc, _flagged(cm, hav), ACC)
        tl.store(dvp + rows[:, None] * D + (h * E + c0 + cc)[None, :], dv.to(dvp.dtype.element_ty),
                 mask=rmask[:, None] & cm[None, :])
    dl = a * (gv - delta)  # d loss / d logit
    c1 = scale * rstd * dl
    c2 = tl.where(key_norm, dl * lraw * rstd * rstd / K, 0.0)  # through rstd: d rstd / dx = -rstd^3 x / k
    # the key's columns again (KEY_ONE: the tiles held): its gradient, and the query's share
    if KEY_ONE:
        _key_grad(x1, q1, g1, a, c1, c2, dkp, sdk, hak, rows, rmask, kc1, km, dq, pid_n, R, query_per_token,
                  FIRST, ACC)
    else:
        for c0 in range(0, K, CH):
            cm = c0 + cc < K
            kc = h * K + c0 + cc
            x = _tile(kp, sk, rows, rmask, kc, cm, ACC)
            gk = _tile(gout, D, rows, rmask, KOFF + kc, cm & key_in_value, ACC)  # 0 for a key of its own
            _key_grad(x, _tile(q, sq, rows, rmask, kc, cm, ACC), gk, a, c1, c2, dkp, sdk, hak, rows, rmask, kc, cm,
                      dq, pid_n, R, query_per_token, FIRST, ACC)
    tl.debug_barrier()  # (the next source reads dq back, possibly in other threads)


@triton.jit(do_not_specialize=["N", "heads", "S_t", "E", "VE", "K"])
def read_bwd(ev, sev, ek, sek, meta, fmeta, q, sq, out, lse, gout, dev, dek, sdk, dq,
             N, D, R, KOFF, heads, S_t, E, VE, K, scale, key_norm, key_in_value, query_per_token,
             VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
             KEY_ONE: tl.constexpr):
    """Gradients of one read: dv (and dk) of every source; dq per token, or per tile (the caller sums tiles).
    E, K: a head's value and key widths; VE: the value's columns left of its key (E - K when the key lies in
    the value, key_in_value: KOFF its first column, and dk points into dv) or E. A slot's dv / dk that already
    holds the later reads' gradient of its source (the table's flags: module docstring) is added to."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    S = S_t + 1
    PR = 4 * S_t
    EP = PR + S
    DV = EP + S  # the table's dv pointers, then its dk pointers, then every slot's flags (dv's, dk's)
    DK = DV + S_t
    HV = DK + S_t
    HK = HV + S
    cc = tl.arange(0, CH)
    delta = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)  # <g, h> = sum_s alpha_s <g, v_s>
    for c0 in range(0, E, CH):
        cm = c0 + cc < E
        delta += tl.sum(_tile(gout, D, rows, rmask, h * E + c0 + cc, cm, ACC)
                        * _tile(out, D, rows, rmask, h * E + c0 + cc, cm, ACC), 1)
    lse_n = tl.load(lse + rows * heads + h, mask=rmask, other=0.0)
    _bwd_source(ev, sev, ek, sek, dev, dek, sdk, tl.load(meta + HV), tl.load(meta + HK),
                tl.load(fmeta + PR).to(ACC), tl.load(fmeta + EP).to(ACC), rows, rmask, pid_n, h, E, VE, K, KOFF, D,
                R, q, sq, gout, dq, lse_n, delta, scale, key_norm, key_in_value, query_per_token, True, ACC, BLOCK_N,
                CH, KEY_ONE)
    for s in range(S_t):
        vp = tl.load(meta + s).to(tl.pointer_type(VDT))
        kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
        dvp = tl.load(meta + DV + s).to(tl.pointer_type(VDT))
        dkp = tl.load(meta + DK + s).to(tl.pointer_type(KDT))
        _bwd_source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), dvp, dkp, sdk,
                    tl.load(meta + HV + 1 + s), tl.load(meta + HK + 1 + s),
                    tl.load(fmeta + PR + 1 + s).to(ACC), tl.load(fmeta + EP + 1 + s).to(ACC), rows, rmask, pid_n,
                    h, E, VE, K, KOFF, D, R, q, sq, gout, dq, lse_n, delta, scale, key_norm, key_in_value,
                    query_per_token, False, ACC, BLOCK_N, CH, KEY_ONE)


# ---- two-phase block reads: the completed sources once for all G sites of a block (a group) -----------
# Phase 1 (group_fwd): the G static queries of a group's sites against the completed sources C (embedding +
# finished summaries), one online softmax per site, the sources read once:
#     out_g = sum_{s in C} softmax_s(l_gs) v_s        lse_g = logsumexp_{s in C} l_gs      (per depth head)
# Phase 2 (merge_fwd), at each site g whose block has a partial p: the online-softmax step over C + {p}
#     w = sigmoid(l_p - lse_g)        h = out_g + w (v_p - out_g)
# Backward of phase 2: d out_g = (1 - w) gh, dv_p = w gh, dl_p = <gh, v_p - out_g> w (1 - w), d lse_g = -dl_p.
# Backward of phase 1, with d out_g = g_g and d lse_g = gl_g from phase 2:
#     dl_gs = alpha_gs (<g_g, v_s> - <g_g, out_g> + gl_g)     dv_s = sum_g alpha_gs g_g
# and the key and query gradients of the single read, summed over g. Every tile holds the G sites at once
# ([BLOCK_N, BLOCK_G, BLOCK_E]; BLOCK_G >= G, masked), so each source is loaded once per group.


@triton.jit
def _group_source(vp, sv, kp, sk, eps, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale, key_norm,
                  KEY_MODE: tl.constexpr, ACC: tl.constexpr):
    """_source for the G queries Qt [BLOCK_G, W] at once: value, key, raw logits [BLOCK_N, BLOCK_G], rstd."""
    v, x = _load(vp, sv, kp, sk, rows, rmask, vcols, emask, kcols, kmask, KEY_MODE, ACC)
    rstd = _rstd(tl.sum(x * x, 1), K, eps, key_norm)
    return v, x, scale * rstd[:, None] * tl.sum(x[:, None, :] * Qt[None, :, :], 2), rstd


@triton.jit
def _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale, key_norm,
                 KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr):
    """Completed summary `s` of the pointer table against the G queries (_group_source)."""
    EP = 5 * S_t + 1
    vp = tl.load(meta + s).to(tl.pointer_type(VDT))
    kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
    eps = tl.load(fmeta + EP + 1 + s).to(ACC)
    return _group_source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), eps, rows, rmask, vcols,
                         emask, kcols, kmask, Qt, K, scale, key_norm, KEY_MODE, ACC)


@triton.jit
def _group_online(m_i, l_i, acc, logit, v):
    m_new = tl.maximum(m_i, logit)
    corr = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * corr + p, acc * corr[:, :, None] + p[:, :, None] * v[:, None, :]


@triton.jit(do_not_specialize=["N", "heads", "S_t", "G"])
def group_fwd(ev, sev, ek, sek, meta, fmeta, q, out, lse, alpha, N, D, R, KOFF, heads, S_t, G, scale, key_norm,
              write_alpha, KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """Phase 1: out [G, N, D] and lse [G, N, heads] of the G sites q [G, R]; alpha [S_t + 1, N, heads, G]."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E, KEY_MODE)
    PR = 4 * S_t
    EP = PR + S_t + 1
    gs = tl.arange(0, BLOCK_G)
    gmask = gs < G
    ng = rmask[:, None] & gmask[None, :]
    NHG = N * heads * G  # the weights as in read_fwd: logits kept, exp(logit - lse) at the end
    a_ptr = alpha + (rows[:, None] * heads + h) * G + gs[None, :]
    amask = ng & write_alpha
    Qt = tl.load(q + gs[:, None] * R + kcols[None, :], mask=gmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    m_i = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32).to(ACC)
    l_i = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_E], dtype=tl.float32).to(ACC)
    v, _, lraw, _ = _group_source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                                  kmask, Qt, K, scale, key_norm, KEY_MODE, ACC)
    logit = lraw + tl.load(fmeta + PR).to(ACC)
    tl.store(a_ptr, logit, mask=amask)
    m_i, l_i, acc = _group_online(m_i, l_i, acc, logit, v)
    for s in range(S_t):
        v, _, lraw, _ = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                     key_norm, KEY_MODE, VDT, KDT, ACC)
        logit = lraw + tl.load(fmeta + PR + 1 + s).to(ACC)
        tl.store(a_ptr + (1 + s) * NHG, logit, mask=amask)
        m_i, l_i, acc = _group_online(m_i, l_i, acc, logit, v)
    lse_ng = m_i + tl.log(l_i)
    o_ptr = out + gs[None, :, None] * N * D + rows[:, None, None] * D + vcols[None, None, :]
    tl.store(o_ptr, (acc / l_i[:, :, None]).to(out.dtype.element_ty), mask=ng[:, :, None] & emask[None, None, :])
    tl.store(lse + gs[None, :] * N * heads + rows[:, None] * heads + h, lse_ng, mask=ng)
    tl.debug_barrier()
    for s in range((S_t + 1) * write_alpha):
        tl.store(a_ptr + s * NHG, tl.exp(tl.load(a_ptr + s * NHG, mask=ng, other=0.0) - lse_ng), mask=ng)


@triton.jit
def _group_bwd_source(v, x, lraw, rstd, prior, dvp, dkp, hav, hak, rows, rmask, vcols, emask, kcols, kmask,
                      K, D, R, Qt, g3, delta, lse_ng, glse, scale, dQt, key_norm, KEY_MODE: tl.constexpr,
                      ACC: tl.constexpr):
    """One completed source's value and key gradients over the G sites (written; added to what dvp / dkp hold
    where hav / hak); the queries' share added."""
    a = tl.exp(lraw + prior - lse_ng)  # [BLOCK_N, BLOCK_G]
    dl = a * (tl.sum(g3 * v[:, None, :], 2) - delta + glse)
    dv = tl.sum(a[:, :, None] * g3, 1)
    c1 = scale * rstd[:, None] * dl
    dx = tl.sum(c1[:, :, None] * Qt[None, :, :], 1)
    dx = dx - tl.where(key_norm, tl.sum(dl * lraw, 1) * rstd * rstd / K, 0.0)[:, None] * x  # (as in read_bwd)
    if KEY_MODE == 0:
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        dx += tl.load(dkp + rows[:, None] * R + kcols[None, :], mask=rmask[:, None] & _flagged(kmask, hak)[None, :],
                      other=0.0).to(ACC)
        tl.store(dkp + rows[:, None] * R + kcols[None, :], dx.to(dkp.dtype.element_ty),
                 mask=rmask[:, None] & kmask[None, :])
    dv += tl.load(dvp + rows[:, None] * D + vcols[None, :], mask=rmask[:, None] & _flagged(emask, hav)[None, :],
                  other=0.0).to(ACC)
    tl.store(dvp + rows[:, None] * D + vcols[None, :], dv.to(dvp.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    return dQt + tl.sum(c1[:, :, None] * x[:, None, :], 0)


@triton.jit(do_not_specialize=["N", "heads", "S_t", "G"])
def group_bwd(ev, sev, ek, sek, meta, fmeta, q, out, lse, gout, glse, dev, dek, dq, N, D, R, KOFF, heads, S_t, G,
              scale, key_norm, KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr,
              ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_G: tl.constexpr):
    """Phase 1's gradients: dv (and dk) of every completed source; dq [tiles, G, R] per tile (summed outside)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         KEY_MODE)
    PR = 4 * S_t
    EP = PR + S_t + 1
    DV = EP + S_t + 1
    DK = DV + S_t
    HV = DK + S_t
    HK = HV + S_t + 1
    gs = tl.arange(0, BLOCK_G)
    gmask = gs < G
    ng = rmask[:, None] & gmask[None, :]
    m3 = ng[:, :, None] & emask[None, None, :]
    o_off = gs[None, :, None] * N * D + rows[:, None, None] * D + vcols[None, None, :]
    g3 = tl.load(gout + o_off, mask=m3, other=0.0).to(ACC)
    delta = tl.sum(g3 * tl.load(out + o_off, mask=m3, other=0.0).to(ACC), 2)  # <g_g, out_g>
    l_off = gs[None, :] * N * heads + rows[:, None] * heads + h
    lse_ng = tl.load(lse + l_off, mask=ng, other=0.0)
    gl = tl.load(glse + l_off, mask=ng, other=0.0).to(ACC)
    qmask = gmask[:, None] & kmask[None, :]
    Qt = tl.load(q + gs[:, None] * R + kcols[None, :], mask=qmask, other=0.0).to(ACC)
    dQt = tl.zeros_like(Qt)
    v, x, lraw, rstd = _group_source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask,
                                     kcols, kmask, Qt, K, scale, key_norm, KEY_MODE, ACC)
    dQt = _group_bwd_source(v, x, lraw, rstd, tl.load(fmeta + PR).to(ACC), dev, dek, tl.load(meta + HV),
                            tl.load(meta + HK), rows, rmask, vcols, emask, kcols, kmask, K, D, R, Qt, g3, delta,
                            lse_ng, gl, scale, dQt, key_norm, KEY_MODE, ACC)
    for s in range(S_t):
        v, x, lraw, rstd = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                        key_norm, KEY_MODE, VDT, KDT, ACC)
        dvp = tl.load(meta + DV + s).to(tl.pointer_type(VDT))
        dkp = tl.load(meta + DK + s).to(tl.pointer_type(KDT))
        dQt = _group_bwd_source(v, x, lraw, rstd, tl.load(fmeta + PR + 1 + s).to(ACC), dvp, dkp,
                                tl.load(meta + HV + 1 + s), tl.load(meta + HK + 1 + s), rows, rmask, vcols,
                                emask, kcols, kmask, K, D, R, Qt, g3, delta, lse_ng, gl, scale, dQt, key_norm,
                                KEY_MODE, ACC)
    tl.store(dq + pid_n * G * R + gs[:, None] * R + kcols[None, :], dQt, mask=qmask)


@triton.jit(do_not_specialize=["N", "heads"], do_not_specialize_on_alignment=["lsec"])
def merge_fwd(pv, spv, pk, spk, fmeta, q, outc, lsec, out, w, N, D, R, KOFF, heads, scale, key_norm,
              KEY_MODE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """Phase 2 at one site: h = out_c + w (v_p - out_c), w = sigmoid(l_p - lse_c); w [N, heads] kept."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         KEY_MODE)
    qt = tl.load(q + rows[:, None] * 0 + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    v, _, lraw, _ = _source(pv, spv, pk, spk, tl.load(fmeta + 1).to(ACC), rows, rmask, vcols, emask, kcols, kmask,
                            qt, K, scale, key_norm, KEY_MODE, ACC)
    omask = rmask[:, None] & emask[None, :]
    o = tl.load(outc + rows[:, None] * D + vcols[None, :], mask=omask, other=0.0).to(ACC)
    lse_n = tl.load(lsec + rows * heads + h, mask=rmask, other=0.0)
    wp = 1.0 / (1.0 + tl.exp(lse_n - (lraw + tl.load(fmeta).to(ACC))))
    tl.store(out + rows[:, None] * D + vcols[None, :], (o + wp[:, None] * (v - o)).to(out.dtype.element_ty),
             mask=omask)
    tl.store(w + rows * heads + h, wp, mask=rmask)


@triton.jit(do_not_specialize=["N", "heads"])
def merge_bwd(pv, spv, pk, spk, fmeta, q, outc, w, gout, doutc, dlsec, dpv, dpk, dq, N, D, R, KOFF, heads, scale,
              key_norm, KEY_MODE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """Phase 2's gradients: d out_c, d lse_c, the partial's dv (and dk); dq [tiles, R] per tile."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         KEY_MODE)
    qmask = rmask[:, None] & kmask[None, :]
    qt = tl.load(q + rows[:, None] * 0 + kcols[None, :], mask=qmask, other=0.0).to(ACC)
    v, x, lraw, rstd = _source(pv, spv, pk, spk, tl.load(fmeta + 1).to(ACC), rows, rmask, vcols, emask, kcols,
                               kmask, qt, K, scale, key_norm, KEY_MODE, ACC)
    omask = rmask[:, None] & emask[None, :]
    o_off = rows[:, None] * D + vcols[None, :]
    o = tl.load(outc + o_off, mask=omask, other=0.0).to(ACC)
    g = tl.load(gout + o_off, mask=omask, other=0.0).to(ACC)
    wp = tl.load(w + rows * heads + h, mask=rmask, other=0.0).to(ACC)
    dl = tl.sum(g * (v - o), 1) * wp * (1.0 - wp)  # d loss / d l_p
    tl.store(doutc + o_off, ((1.0 - wp)[:, None] * g).to(doutc.dtype.element_ty), mask=omask)
    tl.store(dlsec + rows * heads + h, -dl, mask=rmask)
    dv = wp[:, None] * g
    c1 = scale * rstd * dl
    dx = c1[:, None] * qt
    dx = dx - tl.where(key_norm, dl * lraw * rstd * rstd / K, 0.0)[:, None] * x  # (as in read_bwd)
    if KEY_MODE == 0:
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        tl.store(dpk + rows[:, None] * R + kcols[None, :], dx.to(dpk.dtype.element_ty), mask=qmask)
    tl.store(dpv + o_off, dv.to(dpv.dtype.element_ty), mask=omask)
    tl.store(dq + pid_n * R + kcols, tl.sum(c1[:, None] * x, 0), mask=kmask)
