"""Triton kernels of the `triton` AttnRes backend (attnres_triton.py), forward and backward: one depth read
(read_fwd / read_bwd), and two-phase block reads (group_fwd / merge_fwd and their backward, further down).

For every token n and depth head h, over the sources s of the read (the embedding, the completed block
summaries, the partial block if any):

    rstd_s  = 1 / sqrt(mean_k x_s^2 + eps_s)              x_s the raw key slice of head h (key norm on)
    l_s     = scale * rstd_s * <x_s, q> + b_s              b_s = beta log c_s (the count prior)
    h       = sum_s softmax_s(l) v_s  (value slice of h)   online softmax in float32, lse saved

Backward (flash-attention style: delta = <grad h, h> replaces a pass over the sources):

    dalpha_s = <g, v_s>     dl_s = alpha_s (dalpha_s - delta)      dv_s = alpha_s g
    dx_s     = scale rstd_s dl_s q - dl_s (l_s - b_s) rstd_s^2 x_s / k          dq += scale rstd_s dl_s x_s

Sources are not stacked: the completed summaries are reached through a table of pointers and row strides
(`meta`, int64, built by the caller); the embedding and the partial block come as plain arguments (their
dtypes may differ from the summaries' under autocast). Priors and eps are float64 entries of the same table
(`fmeta`: `meta` seen as float64).

Key modes: KEY_MODE 0, the key is part of the value tile the program already holds (value keys, and sliced
keys with one depth head: the columns >= KOFF of the value), so keys cost no extra load and their gradient
is added to the value's in registers; KEY_MODE 1, the key is loaded through its own pointer (carried keys,
and sliced keys whose head slices straddle value heads) and its gradient written to its own output.

One program per (tile of BLOCK_N tokens, depth head); whole head rows in one tile (BLOCK_E >= e, BLOCK_K >= k,
masked: any D and r). Accumulation (ACC) in float32, or float64 for float64 models. BLOCK_N and num_warps
(triton_ops.geometry) keep a tile at 4 elements per thread (8 in the 4096-element tiles), and every launch
passes maxnreg = 128: the register budget of docs/benchmarks.md, checked by tests/test_triton_compile.py.
Token counts and loop bounds (N, S_t, G) are not specialised on (a value of 1 or a multiple of 16 would
otherwise compile a kernel of its own: decoding's N = 1, the first block's S_t = 1); widths and strides are.

meta layout (S_t table sources, S = S_t + 2 slots: embedding 0, table 1..S_t, partial S_t + 1):
    [0, S_t) value pointers  [S_t, 2S_t) value row strides  [2S_t, 3S_t) key pointers  [3S_t, 4S_t) key strides
    [4S_t, 4S_t + S) priors  [4S_t + S, 4S_t + 2S) eps       (backward also: dv pointers, then dk pointers)
"""

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
def _rstd(x, K, eps, KEY_NORM: tl.constexpr):
    """1 / RMS of each token's key (1 without key norm)."""
    if KEY_NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / K + eps)
    else:
        r = tl.full([x.shape[0]], 1.0, x.dtype)
    return r


@triton.jit
def _source(vp, sv, kp, sk, eps, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
            KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, ACC: tl.constexpr):
    """A source's value tile, key tile, its logit without the prior scale * rstd * <x, q> and rstd, per
    token."""
    v, x = _load(vp, sv, kp, sk, rows, rmask, vcols, emask, kcols, kmask, KEY_MODE, ACC)
    rstd = _rstd(x, K, eps, KEY_NORM)
    return v, x, scale * rstd * tl.sum(x * qt, 1), rstd


@triton.jit
def _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
            KEY_MODE: tl.constexpr):
    """Rows, the head's value columns, and its key columns (indices into the key / query, in the key tile's
    space) with their masks."""
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
        ck = tl.arange(0, BLOCK_K)
        kcols = h * K + ck
        kmask = ck < K
    return rows, rmask, vcols, emask, kcols, kmask, K


@triton.jit
def _online(m_i, l_i, acc, logit, v):
    """One source into the running softmax (max m, sum l, weighted sum acc)."""
    m_new = tl.maximum(m_i, logit)
    corr = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * corr + p, acc * corr[:, None] + p[:, None] * v


@triton.jit
def _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
                  KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr,
                  ACC: tl.constexpr):
    """Completed summary `s` of the pointer table: its value and raw logit (_source)."""
    vp = tl.load(meta + s).to(tl.pointer_type(VDT))
    kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
    eps = tl.load(fmeta + EP + 1 + s).to(ACC)
    v, _, lraw, _ = _source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), eps, rows, rmask,
                            vcols, emask, kcols, kmask, qt, K, scale, KEY_MODE, KEY_NORM, ACC)
    return v, lraw


@triton.jit(do_not_specialize=["N", "S_t"])
def read_fwd(ev, sev, ek, sek, pv, spv, pk, spk, meta, fmeta, q, sq, out, lse, alpha,
             N, D, R, KOFF, heads, S_t, scale,
             HAS_PARTIAL: tl.constexpr, WRITE_ALPHA: tl.constexpr, KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr,
             VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = sum_s softmax_s(logit) v_s and lse per (token, head); alpha [S, N, heads] when WRITE_ALPHA."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         BLOCK_K, KEY_MODE)
    S = S_t + 2
    PR = 4 * S_t  # slot i's prior at fmeta[PR + i], its eps at fmeta[EP + i]
    EP = PR + S
    qt = tl.load(q + rows[:, None] * sq + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32).to(ACC)
    l_i = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32).to(ACC)
    # one online softmax over the embedding, the completed summaries (through the table), the partial block
    v, x, lraw, _ = _source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                            kmask, qt, K, scale, KEY_MODE, KEY_NORM, ACC)
    m_i, l_i, acc = _online(m_i, l_i, acc, lraw + tl.load(fmeta + PR).to(ACC), v)
    for s in range(S_t):
        v, lraw = _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
                                KEY_MODE, KEY_NORM, VDT, KDT, ACC)
        m_i, l_i, acc = _online(m_i, l_i, acc, lraw + tl.load(fmeta + PR + 1 + s).to(ACC), v)
    if HAS_PARTIAL:
        v, x, lraw, _ = _source(pv, spv, pk, spk, tl.load(fmeta + EP + S - 1).to(ACC), rows, rmask, vcols, emask,
                                kcols, kmask, qt, K, scale, KEY_MODE, KEY_NORM, ACC)
        m_i, l_i, acc = _online(m_i, l_i, acc, lraw + tl.load(fmeta + PR + S - 1).to(ACC), v)
    lse_n = m_i + tl.log(l_i)
    tl.store(out + rows[:, None] * D + vcols[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    tl.store(lse + rows * heads + h, lse_n, mask=rmask)
    if WRITE_ALPHA:  # diagnostics only: the weights, from the logits recomputed (slot by slot, as above)
        NH = N * heads
        _, _, lraw, _ = _source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                                kmask, qt, K, scale, KEY_MODE, KEY_NORM, ACC)
        tl.store(alpha + rows * heads + h, tl.exp(lraw + tl.load(fmeta + PR).to(ACC) - lse_n), mask=rmask)
        for s in range(S_t):
            # (v, not `_`: a name assigned in a loop is loop-carried, and `_` held rstd [BLOCK_N] before it)
            v, lraw = _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
                                    KEY_MODE, KEY_NORM, VDT, KDT, ACC)
            a = tl.exp(lraw + tl.load(fmeta + PR + 1 + s).to(ACC) - lse_n)
            tl.store(alpha + (1 + s) * NH + rows * heads + h, a, mask=rmask)
        if HAS_PARTIAL:
            _, _, lraw, _ = _source(pv, spv, pk, spk, tl.load(fmeta + EP + S - 1).to(ACC), rows, rmask, vcols,
                                    emask, kcols, kmask, qt, K, scale, KEY_MODE, KEY_NORM, ACC)
            a = tl.exp(lraw + tl.load(fmeta + PR + S - 1).to(ACC) - lse_n)
            tl.store(alpha + (S - 1) * NH + rows * heads + h, a, mask=rmask)


@triton.jit
def _bwd_source(vp, sv, kp, sk, dvp, dkp, prior, eps, rows, rmask, vcols, emask, kcols, kmask, K, D, R, qt, g,
                delta, lse_n, scale, dqt, KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, ACC: tl.constexpr):
    """One source's value and key gradients (written), and the query's gradient with its share (returned)."""
    v, x, lraw, rstd = _source(vp, sv, kp, sk, eps, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
                               KEY_MODE, KEY_NORM, ACC)
    a = tl.exp(lraw + prior - lse_n)
    dl = a * (tl.sum(g * v, 1) - delta)  # d loss / d logit
    dv = a[:, None] * g
    c1 = scale * rstd * dl
    dx = c1[:, None] * qt
    if KEY_NORM:  # through rstd: d rstd / dx = -rstd^3 x / k
        dx = dx - (dl * lraw * rstd * rstd / K)[:, None] * x
    if KEY_MODE == 0:  # the key is part of the value: so is its gradient
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        tl.store(dkp + rows[:, None] * R + kcols[None, :], dx.to(dkp.dtype.element_ty),
                 mask=rmask[:, None] & kmask[None, :])
    tl.store(dvp + rows[:, None] * D + vcols[None, :], dv.to(dvp.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    return dqt + c1[:, None] * x


@triton.jit(do_not_specialize=["N", "S_t"])
def read_bwd(ev, sev, ek, sek, pv, spv, pk, spk, meta, fmeta, q, sq, out, lse, gout, dev, dek, dpv, dpk, dq,
             N, D, R, KOFF, heads, S_t, scale,
             HAS_PARTIAL: tl.constexpr, QUERY_PER_TOKEN: tl.constexpr, KEY_MODE: tl.constexpr,
             KEY_NORM: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Gradients of one read: dv (and dk) of every source; dq per token, or per tile (the caller sums tiles)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         BLOCK_K, KEY_MODE)
    S = S_t + 2
    PR = 4 * S_t
    EP = PR + S
    DV = EP + S  # the table's dv pointers, then its dk pointers
    DK = DV + S_t
    omask = rmask[:, None] & emask[None, :]
    g = tl.load(gout + rows[:, None] * D + vcols[None, :], mask=omask, other=0.0).to(ACC)
    o = tl.load(out + rows[:, None] * D + vcols[None, :], mask=omask, other=0.0).to(ACC)
    delta = tl.sum(g * o, 1)  # <g, h> = sum_s alpha_s <g, v_s>
    lse_n = tl.load(lse + rows * heads + h, mask=rmask, other=0.0)
    qmask = rmask[:, None] & kmask[None, :]
    qt = tl.load(q + rows[:, None] * sq + kcols[None, :], mask=qmask, other=0.0).to(ACC)
    dqt = tl.zeros_like(qt)
    dqt = _bwd_source(ev, sev, ek, sek, dev, dek, tl.load(fmeta + PR).to(ACC), tl.load(fmeta + EP).to(ACC), rows,
                      rmask, vcols, emask, kcols, kmask, K, D, R, qt, g, delta, lse_n, scale, dqt,
                      KEY_MODE, KEY_NORM, ACC)
    for s in range(S_t):
        vp = tl.load(meta + s).to(tl.pointer_type(VDT))
        kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
        dvp = tl.load(meta + DV + s).to(tl.pointer_type(VDT))
        dkp = tl.load(meta + DK + s).to(tl.pointer_type(KDT))
        prior = tl.load(fmeta + PR + 1 + s).to(ACC)
        eps = tl.load(fmeta + EP + 1 + s).to(ACC)
        dqt = _bwd_source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), dvp, dkp, prior, eps, rows,
                          rmask, vcols, emask, kcols, kmask, K, D, R, qt, g, delta, lse_n, scale, dqt,
                          KEY_MODE, KEY_NORM, ACC)
    if HAS_PARTIAL:
        prior = tl.load(fmeta + PR + S - 1).to(ACC)
        eps = tl.load(fmeta + EP + S - 1).to(ACC)
        dqt = _bwd_source(pv, spv, pk, spk, dpv, dpk, prior, eps, rows, rmask, vcols, emask, kcols, kmask, K, D, R,
                          qt, g, delta, lse_n, scale, dqt, KEY_MODE, KEY_NORM, ACC)
    if QUERY_PER_TOKEN:
        tl.store(dq + rows[:, None] * R + kcols[None, :], dqt, mask=qmask)
    else:
        tl.store(dq + pid_n * R + kcols, tl.sum(dqt, 0), mask=kmask)


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
def _group_source(vp, sv, kp, sk, eps, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                  KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, ACC: tl.constexpr):
    """_source for the G queries Qt [BLOCK_G, W] at once: value, key, raw logits [BLOCK_N, BLOCK_G], rstd."""
    v, x = _load(vp, sv, kp, sk, rows, rmask, vcols, emask, kcols, kmask, KEY_MODE, ACC)
    rstd = _rstd(x, K, eps, KEY_NORM)
    return v, x, scale * rstd[:, None] * tl.sum(x[:, None, :] * Qt[None, :, :], 2), rstd


@triton.jit
def _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                 KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr,
                 ACC: tl.constexpr):
    """Completed summary `s` of the pointer table against the G queries (_group_source)."""
    EP = 5 * S_t + 2
    vp = tl.load(meta + s).to(tl.pointer_type(VDT))
    kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
    eps = tl.load(fmeta + EP + 1 + s).to(ACC)
    return _group_source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), eps, rows, rmask, vcols,
                         emask, kcols, kmask, Qt, K, scale, KEY_MODE, KEY_NORM, ACC)


@triton.jit
def _group_online(m_i, l_i, acc, logit, v):
    m_new = tl.maximum(m_i, logit)
    corr = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * corr + p, acc * corr[:, :, None] + p[:, :, None] * v[:, None, :]


@triton.jit(do_not_specialize=["N", "S_t", "G"])
def group_fwd(ev, sev, ek, sek, meta, fmeta, q, out, lse, alpha, N, D, R, KOFF, heads, S_t, G, scale,
              WRITE_ALPHA: tl.constexpr, KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, VDT: tl.constexpr,
              KDT: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Phase 1: out [G, N, D] and lse [G, N, heads] of the G sites q [G, R]; alpha [S_t + 1, N, heads, G]."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         BLOCK_K, KEY_MODE)
    PR = 4 * S_t
    EP = PR + S_t + 2
    gs = tl.arange(0, BLOCK_G)
    gmask = gs < G
    Qt = tl.load(q + gs[:, None] * R + kcols[None, :], mask=gmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    m_i = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32).to(ACC)
    l_i = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_E], dtype=tl.float32).to(ACC)
    v, _, lraw, _ = _group_source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                                  kmask, Qt, K, scale, KEY_MODE, KEY_NORM, ACC)
    m_i, l_i, acc = _group_online(m_i, l_i, acc, lraw + tl.load(fmeta + PR).to(ACC), v)
    for s in range(S_t):
        v, _, lraw, _ = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                     KEY_MODE, KEY_NORM, VDT, KDT, ACC)
        m_i, l_i, acc = _group_online(m_i, l_i, acc, lraw + tl.load(fmeta + PR + 1 + s).to(ACC), v)
    lse_ng = m_i + tl.log(l_i)
    ng = rmask[:, None] & gmask[None, :]
    o_ptr = out + gs[None, :, None] * N * D + rows[:, None, None] * D + vcols[None, None, :]
    tl.store(o_ptr, (acc / l_i[:, :, None]).to(out.dtype.element_ty), mask=ng[:, :, None] & emask[None, None, :])
    tl.store(lse + gs[None, :] * N * heads + rows[:, None] * heads + h, lse_ng, mask=ng)
    if WRITE_ALPHA:  # diagnostics only: the weights from the logits recomputed
        NHG = N * heads * G
        a_ptr = alpha + (rows[:, None] * heads + h) * G + gs[None, :]
        _, _, lraw, _ = _group_source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask,
                                      kcols, kmask, Qt, K, scale, KEY_MODE, KEY_NORM, ACC)
        tl.store(a_ptr, tl.exp(lraw + tl.load(fmeta + PR).to(ACC) - lse_ng), mask=ng)
        for s in range(S_t):
            _, _, lraw, _ = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                         KEY_MODE, KEY_NORM, VDT, KDT, ACC)
            a = tl.exp(lraw + tl.load(fmeta + PR + 1 + s).to(ACC) - lse_ng)
            tl.store(a_ptr + (1 + s) * NHG, a, mask=ng)


@triton.jit
def _group_bwd_source(v, x, lraw, rstd, prior, dvp, dkp, rows, rmask, vcols, emask, kcols, kmask, K, D, R, Qt, g3,
                      delta, lse_ng, glse, scale, dQt, KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr):
    """One completed source's value and key gradients over the G sites (written); the queries' share added."""
    a = tl.exp(lraw + prior - lse_ng)  # [BLOCK_N, BLOCK_G]
    dl = a * (tl.sum(g3 * v[:, None, :], 2) - delta + glse)
    dv = tl.sum(a[:, :, None] * g3, 1)
    c1 = scale * rstd[:, None] * dl
    dx = tl.sum(c1[:, :, None] * Qt[None, :, :], 1)
    if KEY_NORM:
        dx = dx - (tl.sum(dl * lraw, 1) * rstd * rstd / K)[:, None] * x
    if KEY_MODE == 0:
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        tl.store(dkp + rows[:, None] * R + kcols[None, :], dx.to(dkp.dtype.element_ty),
                 mask=rmask[:, None] & kmask[None, :])
    tl.store(dvp + rows[:, None] * D + vcols[None, :], dv.to(dvp.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    return dQt + tl.sum(c1[:, :, None] * x[:, None, :], 0)


@triton.jit(do_not_specialize=["N", "S_t", "G"])
def group_bwd(ev, sev, ek, sek, meta, fmeta, q, out, lse, gout, glse, dev, dek, dq, N, D, R, KOFF, heads, S_t, G,
              scale, KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr,
              ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_G: tl.constexpr):
    """Phase 1's gradients: dv (and dk) of every completed source; dq [tiles, G, R] per tile (summed outside)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         BLOCK_K, KEY_MODE)
    PR = 4 * S_t
    EP = PR + S_t + 2
    DV = EP + S_t + 2
    DK = DV + S_t
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
                                     kcols, kmask, Qt, K, scale, KEY_MODE, KEY_NORM, ACC)
    dQt = _group_bwd_source(v, x, lraw, rstd, tl.load(fmeta + PR).to(ACC), dev, dek, rows, rmask, vcols, emask,
                            kcols, kmask, K, D, R, Qt, g3, delta, lse_ng, gl, scale, dQt, KEY_MODE, KEY_NORM)
    for s in range(S_t):
        v, x, lraw, rstd = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                        KEY_MODE, KEY_NORM, VDT, KDT, ACC)
        dvp = tl.load(meta + DV + s).to(tl.pointer_type(VDT))
        dkp = tl.load(meta + DK + s).to(tl.pointer_type(KDT))
        dQt = _group_bwd_source(v, x, lraw, rstd, tl.load(fmeta + PR + 1 + s).to(ACC), dvp, dkp, rows, rmask, vcols,
                                emask, kcols, kmask, K, D, R, Qt, g3, delta, lse_ng, gl, scale, dQt, KEY_MODE,
                                KEY_NORM)
    tl.store(dq + pid_n * G * R + gs[:, None] * R + kcols[None, :], dQt, mask=qmask)


@triton.jit(do_not_specialize=["N"])
def merge_fwd(pv, spv, pk, spk, fmeta, q, outc, lsec, out, w, N, D, R, KOFF, heads, scale,
              KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Phase 2 at one site: h = out_c + w (v_p - out_c), w = sigmoid(l_p - lse_c); w [N, heads] kept."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         BLOCK_K, KEY_MODE)
    qt = tl.load(q + rows[:, None] * 0 + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    v, _, lraw, _ = _source(pv, spv, pk, spk, tl.load(fmeta + 1).to(ACC), rows, rmask, vcols, emask, kcols, kmask,
                            qt, K, scale, KEY_MODE, KEY_NORM, ACC)
    omask = rmask[:, None] & emask[None, :]
    o = tl.load(outc + rows[:, None] * D + vcols[None, :], mask=omask, other=0.0).to(ACC)
    lse_n = tl.load(lsec + rows * heads + h, mask=rmask, other=0.0)
    wp = 1.0 / (1.0 + tl.exp(lse_n - (lraw + tl.load(fmeta).to(ACC))))
    tl.store(out + rows[:, None] * D + vcols[None, :], (o + wp[:, None] * (v - o)).to(out.dtype.element_ty),
             mask=omask)
    tl.store(w + rows * heads + h, wp, mask=rmask)


@triton.jit(do_not_specialize=["N"])
def merge_bwd(pv, spv, pk, spk, fmeta, q, outc, w, gout, doutc, dlsec, dpv, dpk, dq, N, D, R, KOFF, heads, scale,
              KEY_MODE: tl.constexpr, KEY_NORM: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Phase 2's gradients: d out_c, d lse_c, the partial's dv (and dk); dq [tiles, R] per tile."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         BLOCK_K, KEY_MODE)
    qmask = rmask[:, None] & kmask[None, :]
    qt = tl.load(q + rows[:, None] * 0 + kcols[None, :], mask=qmask, other=0.0).to(ACC)
    v, x, lraw, rstd = _source(pv, spv, pk, spk, tl.load(fmeta + 1).to(ACC), rows, rmask, vcols, emask, kcols,
                               kmask, qt, K, scale, KEY_MODE, KEY_NORM, ACC)
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
    if KEY_NORM:
        dx = dx - (dl * lraw * rstd * rstd / K)[:, None] * x
    if KEY_MODE == 0:
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        tl.store(dpk + rows[:, None] * R + kcols[None, :], dx.to(dpk.dtype.element_ty), mask=qmask)
    tl.store(dpv + o_off, dv.to(dpv.dtype.element_ty), mask=omask)
    tl.store(dq + pid_n * R + kcols, tl.sum(c1[:, None] * x, 0), mask=kmask)
